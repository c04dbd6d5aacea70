"""One EAGLE-2 cycle with a batch dimension: draft, verify, commit, over every row's state at once.

B >= 1 sequences (*rows*) decode together: draft a tree per row with the draft head (EAGLE-2
section 4: expansion by path score, then rerank) and, in live mode, the head-free draft sources
(sources.py: recycled target top-k, context matches) merged into the same tree by calibrated
path probability (`Cycle.merge`), verify every row's tree in one forward of the
target (the trees go in as an additive mask and positions; no modeling file is patched: the
stock transformers body, or on CPUs the Llama family's lean body, leanbody.py), accept per row,
commit the accepted KV in place (kvcache.py). N = 1 (the root alone) is plain decoding through
the same cycle. Which sequence a row holds, and when, is the engine's (engine.py).

Two modes of the one cycle:
  * live (the CPU default): the drafting policy (policy.py) chooses each cycle's arm (plain,
    the head-free sources' tree, or the head with them), the head's depth and the tree's size
    from the draft's confidence and the measured costs;
    attention spans the longest live row; lm_head runs on internal rows first where the measured
    costs say it pays; host reads allowed.
  * fixed (the CUDA default): fixed tree size and absorb width, state on the device, capacity in
    power-of-two buckets (attention spans the bucket), one host read per cycle; `draft_fn` and
    `verify_fn` are captured by torch.compile, once per (batch, tree size, capacity) shape, as
    SGLang captures a graph per batch size. Logits processors and sampling run their host-side
    steps between the two, uncaptured.
"""
from __future__ import annotations

import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from .accept import accept_greedy_batch, accept_sampling_keyed, position_uniforms
from .kvcache import KVCache, num_cache_layers
from .logprobs import token_logprobs
from .policy import Acceptance, Outcome, Plan
from .rowgemm import row_linears
from .sources import DraftSources, pad_trees, tokens_taken
from .target import TargetRunner, capture_layer_inputs
from .tree import (additive, batch_trees, causal_rows, chain_choices, choices_to_levels, context_and_tree, rerank_batch, row_tree,
                   static_choices, windowed)
from .treesettings import TreeSettings


def bucket(n: int, least: int = 64) -> int:
    """The power of two >= n (and >= least): fixed mode's capacity and batch buckets."""
    return max(least, 1 << (max(1, n) - 1).bit_length())


# -- one sequence, and every row's state -----------------------------------------------------------

@dataclass
class Slot:
    """One sequence in a row of the batch, on the host: its stop checks, processors, sampling, statistics."""
    key: object
    stop: object
    procs: object = None     # sampling.TargetProcessors: generation_config's processors, warpers included
    prompt: list = field(default_factory=list)
    seed: int = 0            # sampling: one uniform per output position from (seed, position)
    tokens: list = field(default_factory=list)   # emitted tokens (the root of the next cycle is the last)
    summary: object = None
    started: float = 0.0
    logprobs: int | None = None  # top alternatives per token when each token's log-probability is asked for (None: not)
    new_logprobs: list | None = None  # the last prefill's or cycle's tokens' logprobs.TokenLogprob, for the engine to take

    @property
    def host_side(self) -> bool:
        """Whether verifying this row needs host-side steps (processors, sampling, logprobs): never captured."""
        return self.logprobs is not None or (self.procs is not None and (self.procs.active or self.procs.sampling))


@dataclass
class RowState:
    """Every row's decoding state on the device, row b's at index b of each field: what a draft,
    a verify and a commit read and write. A row's sequence on the host is its `Slot`; this is
    the part the captured functions see, so it stays tensors. Pending pairs (f_t, x_{t+1}) are
    the accepted path's tokens and target features that the head has not absorbed yet."""
    seq_len: torch.Tensor        # [B] tokens in the target's cache
    root: torch.Tensor           # [B] the next tree's root: the target's last token, not yet in its cache
    head_len: torch.Tensor       # [B] pairs in the head's cache (its length)
    n_new: torch.Tensor          # [B] pending pairs (accepted + 1); >= 1 even idle: a draft gathers at n_new - 1
    active: torch.Tensor         # [B] bool: the row holds a sequence
    new_tokens: torch.Tensor     # [B, width] the pending pairs' tokens
    new_features: torch.Tensor | None = None  # [B, width, F] their features, made at the first admission

    @classmethod
    def empty(cls, batch: int, width: int, device) -> "RowState":
        z = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(seq_len=z.clone(), root=z.clone(), head_len=z.clone(), n_new=z + 1,
                   active=torch.zeros(batch, dtype=torch.bool, device=device),
                   new_tokens=torch.zeros(batch, width, dtype=torch.long, device=device))

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows, in this order (`Cycle.compact`)."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                setattr(self, f.name, t.index_select(0, rows))

    def widen(self, extra: int) -> None:
        """`extra` idle rows appended (`Cycle.widen`)."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                fill = (t.new_ones if f.name == "n_new" else t.new_zeros)(extra, *t.shape[1:])
                setattr(self, f.name, torch.cat([t, fill]))


def _compile(fn, backend: str):
    """torch.compile a cycle function whole; "cuda-graphs" = inductor replayed as one CUDA graph."""
    if backend == "cuda-graphs":
        return torch.compile(fn, backend="inductor", mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


# -- the cycle -----------------------------------------------------------------------------------

class Cycle:
    """B rows decoding together: the target's and the head's caches, every row's state on the
    device (`state`), and one host read per cycle. `head` None (or a one-node tree) is plain decoding."""

    def __init__(self, run: TargetRunner, head, tree: TreeSettings, batch: int, capacity: int, *, fixed: bool = False,
                 backend: str | None = None, sources: DraftSources | None = None):
        self.run, self.head, self.tree, self.batch, self.fixed = run, head, tree, batch, fixed
        self.k, self.depth = max(1, tree.top_k), max(1, tree.depth)
        # the merge of draft sources (sources.py) runs on the host: live mode's dynamic trees only
        self.sources = sources if sources is not None and not fixed and tree.shape == "dynamic" else None
        free = self.sources is not None and self.sources.head_free
        if head is None:
            self.n_max = 1
        elif tree.shape == "dynamic":
            self.n_max = min(tree.total_tokens, self.k + (self.depth - 1) * self.k ** 2 + 1)  # the candidate pool bounds it
        else:  # EAGLE-1's static tree or a chain: the same sibling ranks every cycle
            choices = chain_choices(self.depth) if tree.shape == "chain" else static_choices(tree.total_tokens, self.depth, self.k)
            self.levels = choices_to_levels(choices)
            self.n_max = len(choices) + 1
        if free:  # head-free nodes fill the tree up to its size, past the head's pool
            self.n_max = max(self.n_max, tree.total_tokens)
        self.speculative = head is not None and self.n_max > 1   # the head drafts (else: sources alone, or plain)
        # accepted path, root first: the absorb and commit width (a copied chain may run deeper than the head)
        self.width = max(self.depth, self.sources.max_depth if free else 0) + 1 if self.n_max > 1 else 1
        self.margin = max(self.n_max, self.depth * self.k) + self.width + 8  # room past a sequence's end for one tree
        self.capacity = self._capacity(capacity)
        self.cache = KVCache(num_cache_layers(run.model.config), batch, self.capacity, static=fixed)
        self.hcache = KVCache(1, batch, self.capacity, static=fixed) if self.speculative else None
        self.layers = head.feature_layers if self.speculative else None
        self.state = RowState.empty(batch, self.width, run.device)
        self.slots: list[Slot | None] = [None] * batch
        self.host_len = [0] * batch  # mirrors of seq_len from the read-back, for the live view
        self.policy = None        # live mode's policy.Policy (set by the engine); None: every cycle drafts its whole tree
        self.acceptance = Acceptance()  # the merge's estimates where no policy runs
        self.one_product = True   # lm_head over every tree row at once (else internal rows first)
        self.record_confidence = False
        self.counter = None       # opcount.OpCounter while counting
        self.absorb = 1           # live mode: the widest row of new pairs (accepted + 1, from the read-back)
        # host time after the last cycle's read-back (the sources' and the policy's bookkeeping of
        # what was verified): charged to the next cycle, so every arm's cost is its whole cost
        self.tail_s = 0.0
        self.steps = 0            # head steps of the current draft: the absorb, then one per depth fed
        # while the head skips cycles at batch 1: the pairs (f_t, x_{t+1}) it has not absorbed, one
        # ([1, k] tokens, [1, k, F] features) per cycle, so that its next draft catches up in one
        # forward over them (a prefill of the head) rather than absorbing every cycle it does not
        # draft. None: nothing kept. (At batch > 1 a skipping head absorbs each cycle: `_skip_head`.)
        self.paused: list | None = None
        # whether this cycle's verified rows feed the recycling table: not in the plain cycles
        # that do not look at the head-free trees (policy.Policy.look), which would not read it
        self.noting = self.sources is not None
        self.last: dict = {}
        self.seen: dict = {}
        self.backend = backend if fixed else None
        self.capture_failure = None
        self._draft, self._verify = self.draft_fn, self.verify_fn
        if self.backend:
            self._draft, self._verify = _compile(self.draft_fn, self.backend), _compile(self.verify_fn, self.backend)

    def _capacity(self, need: int) -> int:
        need = need + self.margin
        return bucket(need) if self.fixed else need

    @contextmanager
    def session(self):
        """Hooks (EAGLE-3's layer inputs) and the measured product plan, for one run only: outside
        it the model is the user's (`generate` included). A run stopped early (Ctrl-C) ends here too."""
        with ExitStack() as stack:
            if not self.backend:  # captured cycles leave products to the compiler
                stack.enter_context(row_linears(self.run.cpu_linears))
            if self.layers:
                self.seen = stack.enter_context(capture_layer_inputs(self.run.body, self.layers))
            yield

    # -- rows ---------------------------------------------------------------------------------
    @property
    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.slots)

    def reset(self) -> None:
        """A new run: every row free, drafting on again (a skipping head kept nothing across runs)."""
        st = self.state
        self.slots = [None] * self.batch
        st.active.zero_()
        st.seq_len.zero_()
        self.host_len = [0] * self.batch  # idle rows keep their lengths (their cells stay inside the view)
        self.speculative = self.hcache is not None
        self.paused = None
        self.absorb = 1  # a head resumed at the last cycle of a run had as many pairs to absorb as it missed
        if st.new_tokens.shape[1] != self.width:  # a run that went plain left one-token rows
            st.new_tokens = torch.zeros(self.batch, self.width, dtype=torch.long, device=self.run.device)

    @property
    def drafting(self) -> bool:
        """Whether trees may have more than the root: a head, or head-free sources."""
        return self.speculative or (self.sources is not None and self.sources.head_free)

    def _skip_head(self) -> None:
        """The head does not draft this cycle. At batch 1 its pending pairs wait in `paused` (the
        next draft absorbs every cycle's at once); at batch > 1, where rows come and go, it absorbs
        them now, which its arm's measured overhead then includes."""
        if not self.speculative or self.state.new_features is None:
            return
        st = self.state
        if self.batch == 1:
            if self.paused is None:
                n = int(st.n_new[0])  # this cycle's pending pairs: the first the skipping head owes
                self.paused = [(st.new_tokens[:, :n].clone(), st.new_features[:, :n].clone())]
            return
        w = self.absorb
        self._absorb(st.new_tokens[:, :w], st.new_features[:, :w], st.head_len, 0)
        st.head_len = torch.where(st.active, st.head_len + st.n_new, st.head_len)  # the commit sets the next pending pairs

    def _unpause(self) -> None:
        """A head that skipped cycles drafts again: its next draft first absorbs every pair of
        the cycles it missed, in one forward."""
        if self.paused is None:
            return
        st = self.state
        st.new_tokens = torch.cat([t for t, _ in self.paused], 1)
        st.new_features = torch.cat([f for _, f in self.paused], 1)
        st.n_new = torch.full_like(st.n_new, st.new_tokens.shape[1])
        self.absorb = st.new_tokens.shape[1]
        self.paused = None

    def catch_up_head(self) -> None:
        """A paused head absorbs the pairs it missed, all but the last (which stays pending, as
        after any cycle), so a kept sequence (prefix.Kept) holds every head cell: a chat's next
        turn then reuses them instead of prefilling the answer again."""
        if self.paused is None:
            return
        self._unpause()
        st = self.state
        w = st.new_tokens.shape[1]
        if w > 1:
            self._absorb(st.new_tokens[:, : w - 1], st.new_features[:, : w - 1], st.head_len, 1)
            st.head_len = torch.where(st.active, st.head_len + w - 1, st.head_len)
        st.new_tokens, st.new_features = st.new_tokens[:, w - 1 :].contiguous(), st.new_features[:, w - 1 :].contiguous()
        st.n_new = torch.ones_like(st.n_new)
        self.absorb = 1

    def ensure_capacity(self, need: int) -> None:
        """Room for `need` cells per row and one tree past them. Live mode doubles: growing by
        what each cycle adds would copy every buffer every cycle."""
        cap = self._capacity(min(need, self.run.max_positions))
        if cap > self.capacity:
            cap = cap if self.fixed else max(cap, 2 * self.capacity)
            self._resize(cap)

    def _resize(self, cap: int) -> None:
        for c in (self.cache, self.hcache):
            if c is not None:
                c.resize(cap)
        self.capacity = cap

    def fit(self) -> None:
        """Live mode: shrink the buffers once the busy rows need a quarter of them or less (a long
        sequence left, or the run ended), to twice what they need, so that one long request does
        not make every later cycle copy, widen and hold its cells. Fixed mode keeps its bucket:
        captured cycles read these buffers in place."""
        if self.fixed:
            return
        want = self._capacity(min(max((self.host_len[i] + 1 for i, s in enumerate(self.slots) if s is not None), default=0),
                                  self.run.max_positions))
        if self.capacity > 4 * want:
            st = self.state
            for i, s in enumerate(self.slots):
                if s is None:  # an idle row still runs in every forward, at its own cells: from cell 0 it needs no room
                    st.seq_len[i], st.head_len[i], st.n_new[i], self.host_len[i] = 0, 0, 1, 0
            self._resize(2 * want)

    @torch.no_grad()
    def admit(self, b: int, ids: list[int], slot: Slot, pick, kept=None, reuse: int = 0) -> int:
        """Prefill one prompt into row b, alone, and return its first token (`pick(logits)`). The
        head absorbs the prompt's pairs (f_t, x_{t+1}) here too, all but the last, which the next
        cycle's draft absorbs with the other rows' new pairs at the fixed width.

        With `kept` (a prefix.Kept whose ids share at least `reuse` + 1 leading ids with `ids`, and
        whose head holds at least `reuse` cells when drafting) the first `reuse` cells of both
        caches are restored from it and only ids[reuse:] run: reuse < len(ids), so the first
        token's logits and every head pair from `reuse` on come from a real forward."""
        dev, n, st = self.run.device, len(ids), self.state
        r = reuse if kept is not None else 0
        assert 0 <= r < n, (r, n)
        # fixed mode reserves what the row can reach (one bucket while it runs, no capture
        # mid-answer); live mode the prompt, and `step` grows the buffers as rows grow
        self.ensure_capacity(n + (slot.stop.remaining if self.fixed else 0) + 1)
        x = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        c = self.cache
        if r:
            self._restore(b, kept, r)
        c.row, c.cells, c.view = b, pos[r:], n
        mask = self.run.masks(lambda w: windowed(causal_rows(pos[None, r:], n), pos[None, r:], pos[None], w))
        try:
            hidden, feats = self.run.body_forward(x[None, r:], pos[None, r:], mask, c, self.seen, self.layers)
        finally:
            c.row = None
        logits = self.run.logits(hidden[0, -1:])
        if self.sources is not None:
            self.sources.note_logits(x[-1:], logits)
        root = pick(logits)
        if self.speculative:
            self._head_cache_ready()
            feats = feats[0]  # features of positions r .. n - 1
            if st.new_features is None:
                st.new_features = torch.zeros(self.batch, self.width, feats.shape[-1], dtype=feats.dtype, device=dev)
            if n - 1 > r:  # pairs (f_t, x_{t+1}) sit at position t (the EAGLE convention); those before r were restored
                h = self.hcache
                h.row, h.cells, h.view = b, pos[r : n - 1], n - 1
                try:
                    bias = additive(causal_rows(pos[None, r : n - 1], n - 1), self.head.fc.weight.dtype)
                    self.head(x[None, r + 1 :], self.head.project(feats[None, : n - 1 - r]), pos[None, r : n - 1], attention_mask=bias,
                              cache=h)
                finally:
                    h.row = None
            st.new_tokens[b, 0] = root
            st.new_features[b, 0] = feats[-1]
            st.head_len[b], st.n_new[b] = n - 1, 1
            if self.batch == 1:
                self.absorb, self.paused = 1, None  # the row's only pair (what a skipping head kept was the last sequence's)
        st.seq_len[b], st.root[b], st.active[b] = n, root, True
        self.host_len[b] = n
        self.slots[b] = slot
        return root

    def _restore(self, b: int, kept, length: int) -> None:
        """Row b's first `length` cells of the target's cache, and of the head's when drafting, from a kept sequence."""
        self.cache.put(b, kept.target, length)
        if self.speculative:
            if kept.head is None or kept.head_len < length:
                raise ValueError(f"the kept sequence has {kept.head_len} head cells, {length} asked for")
            self._head_cache_ready()
            self.hcache.put(b, kept.head, length)

    def kept_row(self, b: int, ids: list[int]):
        """Row b's cells as a kept sequence (prefix.Kept) of `ids`, the row's prompt and emitted
        tokens: as many as the target's cache holds (the last emitted token is the next root, not
        yet in it; tokens cut by a stop were computed but are not kept). The head's cell t holds
        (f_t, x_{t+1}), so it keeps at most len - 1 cells, and after drafting stopped only those it
        had absorbed by then (admit zeroes a row's head length when it does not absorb)."""
        from .prefix import Kept

        self.catch_up_head()
        length = min(self.host_len[b], len(ids))
        head, head_len = None, 0
        if self.hcache is not None and self.hcache.layers[0].is_initialized:
            head_len = max(0, min(int(self.state.head_len[b]), length - 1))
            head = self.hcache.take(b, head_len)
        return Kept(tuple(ids[:length]), self.cache.take(b, length), head, head_len)

    def _head_cache_ready(self) -> None:
        """Allocate the head's cache at admission, never inside a capture: a one-token prompt has no
        pair to absorb here, and its first draft would otherwise allocate it (and run uncaptured)."""
        layer = self.hcache.layers[0]
        if not layer.is_initialized:
            attn = next(m for m in self.head.modules() if hasattr(m, "head_dim") and hasattr(m, "k_proj"))
            z = torch.zeros(1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim, dtype=self.head.fc.weight.dtype,
                            device=self.run.device)
            layer.lazy_initialization(z, z)

    def release(self, b: int) -> Slot:
        slot, self.slots[b] = self.slots[b], None
        self.state.active[b] = False
        if self.batch == 1:  # a skipping head's pairs end with their sequence
            self.paused = None
        if self.sources is not None:
            self.sources.forget(self.slots)
        return slot

    def compact(self, keep: list[int]) -> None:
        """Keep only rows `keep` (busy ones, and in fixed mode idle ones up to the batch bucket)."""
        rows = torch.tensor(keep, dtype=torch.long, device=self.run.device)
        for c in (self.cache, self.hcache):
            if c is not None:
                c.compact(rows)
        self.state.keep(rows)
        self.slots = [self.slots[i] for i in keep]
        self.host_len = [self.host_len[i] for i in keep]
        self.batch = len(keep)

    def widen(self, batch: int) -> None:
        """Back to `batch` rows for a new run (after `compact`): the shapes captured before stay valid."""
        extra = batch - self.batch
        for c in (self.cache, self.hcache):
            if c is not None:
                c.widen(batch)
        self.state.widen(extra)
        self.slots += [None] * extra
        self.host_len += [0] * extra
        self.batch = batch

    def span(self, extra: int) -> int:
        """Cells attention reads when `extra` rows follow each row's context: the whole bucket in
        fixed mode (one shape), else the longest live row plus those rows."""
        return self.capacity if self.fixed else min(self.capacity, max(self.host_len) + extra)

    # -- draft (section 4): capturable when no policy runs ---------------------------------------
    def draft_fn(self, new_tokens, new_features, head_len, n_new, root, active):
        """Absorb every row's new pairs, then grow one tree per row. Returns the trees
        (tokens, parents, depth, ancestors, path scores), each [B, N], and the head's new length."""
        head = self.head
        if not self.fixed:  # live: the width actually accepted (the last read-back says), not depth + 1
            new_tokens, new_features = new_tokens[:, : self.absorb], new_features[:, : self.absorb]
        b, w = new_tokens.shape
        out, view = self._absorb(new_tokens, new_features, head_len, self.depth * self.k)
        last = (n_new - 1).clamp(max=w - 1)  # an idle row may hold a wider stale count
        hid = out.gather(1, last[:, None, None].expand(b, 1, out.shape[-1]))[:, 0]  # each row's root state
        ctx = head_len + n_new                  # the head's context after the absorb = the root's position
        head_len = torch.where(active, ctx, head_len)
        logp = torch.log_softmax(head.draft_logits(hid).float(), dim=-1)
        if self.policy is not None:  # host bookkeeping: live mode only, never inside a capture
            self.steps = 1
        grow = self._grow_dynamic if self.tree.shape == "dynamic" else self._grow_static
        return grow(hid, logp, ctx, view, root) + (head_len,)

    def _absorb(self, new_tokens, new_features, head_len, extra: int):
        """The head takes pairs [B, w] (f_t, x_{t+1}) into its cache cells head_len .. + w - 1;
        `extra` rows may follow in the view (a tree's). Returns its outputs [B, w, H] and the view."""
        head, h = self.head, self.hcache
        positions = head_len[:, None] + torch.arange(new_tokens.shape[1], device=new_tokens.device)
        view = self.span(new_tokens.shape[1] + extra)
        h.cells, h.view = positions, view
        bias = additive(causal_rows(positions, view), head.fc.weight.dtype)
        return head(new_tokens, head.project(new_features), positions, attention_mask=bias, cache=h), view

    def head_step(self, tokens, front_h, ctx, d: int, visible, view):
        """Feed one depth of tree nodes [B, m] (depth d + 1, all at position ctx + d); `visible`
        [B, m, fed] marks which of the tree rows fed so far each sees. Their rows go to head-cache
        cells after the context, which the next absorb overwrites: tree tokens are not context.
        Returns the nodes' hidden states and their children's log-probabilities."""
        b, m = tokens.shape
        fed = visible.shape[2]
        self.hcache.cells, self.hcache.view = ctx[:, None] + torch.arange(fed - m, fed, device=tokens.device), view
        bias = additive(context_and_tree(ctx, visible, view), self.head.fc.weight.dtype)
        out = self.head(tokens, front_h, (ctx + d)[:, None].expand(b, m), attention_mask=bias, cache=self.hcache)
        if self.policy is not None:
            self.steps += 1
        return out, torch.log_softmax(self.head.draft_logits(out).float(), dim=-1)

    def _grow_dynamic(self, hid, logp, ctx, view, root):
        """EAGLE-2's dynamic tree: expand the top-k nodes by path score at each depth (section 4.1),
        then rerank every drafted node by path score and keep the best N - 1 (section 4.2). In
        live mode the policy chooses the depth (whether another step pays) and the size."""
        head, dev, policy = self.head, hid.device, self.policy
        b = hid.shape[0]
        k = min(self.k, logp.shape[-1])  # top_k may exceed a tiny (or pruned draft) vocabulary
        scores, ids = torch.topk(logp, k, dim=-1)          # [B, k]
        tokens = head.to_target_ids(ids)
        pool_t, pool_p, pool_s = [tokens], [torch.full((b, k), -1, dtype=torch.long, device=dev)], [scores]
        expanded = [torch.ones(b, k, dtype=torch.bool, device=dev)]
        front_idx, front_s = torch.arange(k, device=dev).expand(b, k), scores
        front_h = hid[:, None].expand(b, k, hid.shape[-1])
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        visible, size = eye, k
        if policy is not None:  # the busy rows' calibrated path probabilities, on the host
            busy = [i for i, s in enumerate(self.slots) if s is not None]
            front_c = self.acceptance_of().conditionals("head", 1, scores[busy].exp().double().cpu().numpy())
            policy.note_children(front_c.max(-1), np.ones(len(busy)))
            pool_c = [front_c]
        for d in range(1, self.depth):
            if policy is not None and not policy.deeper(np.concatenate(pool_c, 1), front_c, self.steps, self.depth - d):
                break
            m = visible.shape[2]
            out_h, out_lp = self.head_step(tokens, front_h, ctx, d - 1, visible, view)
            child_lp, child_ids = torch.topk(out_lp, k, dim=-1)            # [B, k, k]
            path = (front_s[:, :, None] + child_lp).flatten(1)            # path score = product of confidences
            key = path if self.tree.expand_by == "path" else child_lp.flatten(1)  # "node": the paper's ablation
            sel = torch.topk(key, k, dim=1).indices
            if policy is not None:
                cond = self.acceptance_of().conditionals("head", d + 1, child_lp[busy].exp().double().cpu().numpy())
                policy.note_children(cond.max(-1), front_c)
                path_c = (front_c[:, :, None] * cond).reshape(len(busy), -1)
                pool_c.append(path_c)
                front_c = np.take_along_axis(path_c, sel[busy].cpu().numpy(), 1)
            parent = sel // k
            pool_t.append(head.to_target_ids(child_ids).flatten(1))
            pool_p.append(front_idx.repeat_interleave(k, dim=1))
            pool_s.append(path)
            if not self.tree.rerank:
                expanded.append(torch.zeros(b, k * k, dtype=torch.bool, device=dev).scatter_(1, sel, True))
            tokens, front_idx, front_s = pool_t[-1].gather(1, sel), size + sel, path.gather(1, sel)
            front_h = out_h.gather(1, parent[:, :, None].expand(-1, -1, out_h.shape[-1]))
            visible = torch.cat([visible.gather(1, parent[:, :, None].expand(-1, -1, m)), eye], 2)
            size += k * k
        pool_t, pool_p, pool_s = torch.cat(pool_t, 1), torch.cat(pool_p, 1), torch.cat(pool_s, 1)
        if self.sources is not None:
            return self.merge(pool_t, pool_p, pool_s, root)
        n = min(self.n_max, size + 1)
        if not self.tree.rerank:  # ablation: the expanded nodes themselves, shallowest first
            pick = torch.cat(expanded, 1)
            pool_s = torch.where(pick, -torch.arange(size, device=dev, dtype=pool_s.dtype), float("-inf"))
            n = min(n, int(pick[0].sum()) + 1)
        return rerank_batch(pool_t, pool_p, pool_s, root, n - 1, self.depth)

    def acceptance_of(self) -> Acceptance:
        return self.policy.acceptance if self.policy is not None else self.acceptance

    def merge(self, pool_t, pool_p, pool_s, root):
        """One tree per row from every source's candidates (sources.py): the head's pool (None:
        no head this cycle) and the head-free sources' children of any node, grown best-first by
        the acceptance estimate's path probability, then sized by the policy (section 3: expected
        tokens per measured ms). Returns (tokens, parents, depth, ancestors, log scores), [B, N]."""
        head = None if pool_t is None else (pool_t.tolist(), pool_p.tolist(), pool_s.exp().tolist())
        trees = self._grow_rows(head, root, "head" if head is not None else "free", self.steps if head is not None else 0)
        n = max((len(t.tokens) for t in trees if t is not None), default=1)
        if self.policy is not None and n > 1:
            n = self.policy.size(self.tree_probs(trees), "head" if head is not None else "free", self.steps if head is not None else 0)
        return self._padded(trees, n, root)

    def _grow_rows(self, head, root, arm: str, steps: int) -> list:
        """Every busy row's merged tree (sources.grow_row)."""
        src, policy = self.sources, self.policy
        roots = root.tolist()
        floor = policy.growth_floor(arm, steps) if policy is not None else None
        return [None if s is None else src.grow_row(s, roots[b], self.n_max, self.acceptance_of(),
                                                    None if head is None else tuple(h[b] for h in head), floor)
                for b, s in enumerate(self.slots)]

    def _padded(self, trees: list, n: int, root):
        """The rows' trees cut to `n` nodes as the verify's tensors (sources.pad_trees)."""
        self.sources.last = trees
        tokens, parents, scores, depth, anc = pad_trees(trees, n, root.device, self.sources.vocab)
        tokens[:, 0] = root
        return tokens, parents, depth, anc, scores

    @staticmethod
    def tree_probs(trees: list) -> np.ndarray:
        """[busy rows, m - 1]: each busy row's node scores after the root, best first, zero-padded."""
        busy = [t for t in trees if t is not None]
        m = max((len(t.tokens) for t in busy), default=1)
        probs = np.zeros((len(busy), m - 1))
        for j, t in enumerate(busy):
            probs[j, : len(t.scores) - 1] = t.scores[1:]
        return probs

    def _grow_static(self, hid, logp, ctx, view, root):
        """EAGLE-1's static tree, or a chain: the same sibling ranks below every root."""
        head, dev = self.head, hid.device
        b = hid.shape[0]
        toks, parents = [root[:, None]], [-1]
        front_h, front_lp, visible = hid[:, None], logp[:, None], None
        prev_first, first = 0, 1  # tree index of the first node of the previous level and of this one
        for d, level in enumerate(self.levels[: self.depth]):
            # choices are ordered by depth, so path index p is tree node p + 1 (-1: the root)
            par = torch.tensor([p + 1 - prev_first for p, _ in level], device=dev)  # parent within the fed level
            ranks = torch.tensor([r for _, r in level], device=dev)
            top = torch.topk(front_lp, int(ranks.max()) + 1, dim=-1).indices     # [B, fed, r]
            toks.append(head.to_target_ids(top[:, par, ranks]))
            parents += [p + 1 for p, _ in level]
            prev_first, first = first, first + len(level)
            if d + 1 >= min(self.depth, len(self.levels)):
                break
            eye = torch.eye(len(level), dtype=torch.bool, device=dev)
            visible = eye if visible is None else torch.cat([visible[par], eye], 1)
            front_h, front_lp = self.head_step(toks[-1], front_h[:, par], ctx, d, visible.expand(b, -1, -1), view)
        tokens = torch.cat(toks, 1)
        par_t = torch.tensor(parents, dtype=torch.long, device=dev).expand(b, -1)
        depth, anc = batch_trees(par_t, self.depth)
        return tokens, par_t, depth, anc, None

    # -- verify (section 3) --------------------------------------------------------------------
    def forward_tree(self, tokens, depth, anc, seq_len):
        """Every row's tree in one target forward: node i at cell seq_len + i, position seq_len +
        depth (nodes past the context limit are verified, never emitted: clamped). Nothing is
        committed: the next forward writes the same cells. Returns (hidden states, features)."""
        b, n = tokens.shape
        dev = tokens.device
        q_pos = seq_len[:, None] + depth
        view = self.span(n)
        c = self.cache
        c.cells, c.view = seq_len[:, None] + torch.arange(n, device=dev), view
        c.start = self.host_len[0] if b == 1 and not self.fixed else None
        k_pos = torch.arange(view, device=dev).expand(b, view).scatter(1, c.cells, q_pos)
        mask = self.run.masks(lambda win: windowed(context_and_tree(seq_len, anc, view), q_pos, k_pos, win))
        return self.run.body_forward(tokens, q_pos.clamp(max=self.run.max_positions - 1), mask, c, self.seen, self.layers)

    def tree_argmax(self, tokens, depth, anc, seq_len):
        """`forward_tree`, then lm_head over every node and its argmax: what greedy acceptance
        checks (one product for all rows). Returns (argmax [B, N], features)."""
        hidden, feats = self.forward_tree(tokens, depth, anc, seq_len)
        b, n = tokens.shape
        logits = self.run.logits(hidden.reshape(b * n, -1))
        if self.noting:  # live mode only (never captured): the recycling table learns every busy row
            busy = self.state.active[:, None].expand(b, n).reshape(-1)
            return self.sources.argmax_noted(tokens, logits, busy).view(b, n), feats
        return logits.argmax(-1).view(b, n), feats

    def commit_fn(self, tokens, depth, path, accepted, bonus, feats, seq_len, root, n_new, new_features, active):
        """The accepted KV into place, per row, and each row's next state; idle rows stay where
        they are. Returns (seq_len, root, n_new, new_tokens, new_features, readout)."""
        w = path.shape[1]
        if w > 1:
            self.cache.commit(seq_len[:, None] + path, seq_len[:, None] + torch.arange(w, device=path.device))
            col = torch.arange(w, device=path.device)[None]
            new_tokens = torch.where(col == accepted[:, None], bonus[:, None], torch.cat([tokens.gather(1, path[:, 1:]), bonus[:, None]], 1))
            if new_features is not None and feats is not None:  # the head's pending pairs (none without a head)
                new_features = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1])).to(new_features.dtype)
            n_new = torch.where(active, accepted + 1, n_new)
        else:
            new_tokens = bonus[:, None]
            if new_features is not None and feats is not None:  # the root's pair, for a skipping head (`_skip_head`)
                new_features = feats[:, :1].to(new_features.dtype)
                n_new = torch.where(active, 1, n_new)
        seq_len = torch.where(active, seq_len + accepted + 1, seq_len)
        root = torch.where(active, bonus, root)
        readout = torch.cat([accepted[:, None], depth[:, -1:], new_tokens], 1)  # nodes are in depth order
        return seq_len, root, n_new, new_tokens, new_features, readout

    def verify_fn(self, tokens, parents, depth, anc, seq_len, root, n_new, new_features, active):
        """Greedy verification with no host step: all rows through lm_head, accept, commit. Captured in fixed mode."""
        argmax, feats = self.tree_argmax(tokens, depth, anc, seq_len)
        path, accepted, bonus = accept_greedy_batch(tokens, parents, depth, anc, argmax, self.width if self.drafting else 1)
        return (path,) + self.commit_fn(tokens, depth, path, accepted, bonus, feats, seq_len, root, n_new, new_features, active)

    def _verify_host(self, tokens, parents, depth, anc, scores):
        """Verification with host-side steps: the target's processors on each node with its own
        history (sampling.TargetProcessors.tree_scores), lossless sampling (the keyed rule), and
        greedy acceptance's two-pass lm_head: children are checked against their parent's argmax,
        so only internal nodes need logits up front, and a leaf only when the path ends there. On a
        small model lm_head is a large share of a verify, and about half a tree's nodes are leaves;
        where extra rows are nearly free (measured: `one_product`) all rows go in one product."""
        hidden, feats = self.forward_tree(tokens, depth, anc, self.state.seq_len)
        b, n = tokens.shape
        dev, w = tokens.device, (self.width if self.drafting else 1)
        two_pass = not self.one_product and n > 1
        internal = torch.zeros(b, n, dtype=torch.bool, device=dev)
        if n > 1:
            internal.scatter_(1, parents[:, 1:], True)
        plain = torch.tensor([s is not None and not s.host_side for s in self.slots], device=dev)
        need = (internal if two_pass else torch.ones_like(internal)) & plain[:, None]
        argmax = torch.full((b, n), -1, dtype=torch.long, device=dev)
        idx = need.flatten().nonzero().flatten()
        if idx.numel():
            logits = self.run.logits(hidden.reshape(b * n, -1)[idx])
            argmax.view(-1)[idx] = (self.sources.argmax_noted(tokens.reshape(-1)[idx], logits) if self.noting
                                    else logits.argmax(-1))
        sampled, kept = {}, {}
        for i, s in enumerate(self.slots):
            if s is None or not s.host_side:
                continue
            tree = row_tree(tokens, parents, depth, anc, scores, i)
            sampling = s.procs is not None and s.procs.sampling
            # a row whose logprobs are asked for scores every node: its accepted path's rows are read below
            nodes = internal[i].nonzero().flatten() if two_pass and not sampling and s.logprobs is None else None
            logits = self._scored(s, hidden[i] if nodes is None else hidden[i, nodes], tree, nodes)
            if s.logprobs is not None:
                kept[i] = logits
            if sampling:
                u = position_uniforms(s.seed, len(s.tokens), w)  # the uniforms of this sequence's next output positions
                sampled[i] = accept_sampling_keyed(tree, torch.softmax(logits.float(), -1), u)
            elif nodes is None:
                argmax[i] = logits.argmax(-1)
            else:
                argmax[i, nodes] = logits.argmax(-1)
        path, accepted, bonus = accept_greedy_batch(tokens, parents, depth, anc, argmax, w)
        if two_pass:  # paths that end at a leaf: one more lm_head row each
            leaf = [i for i, v in enumerate(bonus.tolist()) if v < 0 and self.slots[i] is not None and i not in sampled]
            if leaf:
                rows = torch.tensor(leaf, device=dev)
                last = path[rows, accepted[rows]]
                for j, i in enumerate(leaf):
                    s = self.slots[i]
                    tree = row_tree(tokens, parents, depth, anc, scores, i) if s.host_side else None
                    bonus[i] = self._scored(s, hidden[i, last[j : j + 1]], tree, last[j : j + 1]).argmax(-1)[0]
        for i, (p, tok) in sampled.items():
            path[i] = torch.tensor(p + [0] * (w - len(p)), device=dev)
            accepted[i], bonus[i] = len(p) - 1, tok
        for i, rows in kept.items():  # each emitted token's logprobs from the node whose scores decided it
            on = path[i, : int(accepted[i]) + 1]
            emitted = tokens[i, on[1:]].tolist() + [int(bonus[i])]
            self.slots[i].new_logprobs = token_logprobs(rows[on], emitted, self.slots[i].logprobs)
        bonus.clamp_(min=0)  # idle rows (no slot) got no logits: keep their next root a valid id (never emitted)
        return path, accepted, bonus, feats

    def _scored(self, slot: Slot, hidden, tree, nodes):
        logits = self.run.logits(hidden)
        if self.noting and tree is not None:
            self.sources.note_logits(tree.tokens if nodes is None else tree.tokens[nodes], logits)
        if slot.procs is not None and slot.procs.active:
            hist = torch.tensor(slot.prompt + slot.tokens[:-1], dtype=torch.long, device=hidden.device)  # every token before the root
            logits = slot.procs.tree_scores(logits, hist, tree, nodes)
        return logits

    # -- one cycle ---------------------------------------------------------------------------------
    def _call(self, stage: str, fn, *args):
        """Run a stage of the cycle: counted (opcount) if asked, captured ones falling back to
        themselves uncaptured if capture fails (said once, recorded for compare)."""
        try:
            if self.counter is not None:
                return self.counter.staged(stage, fn, *args)
            if self.backend == "cuda-graphs":
                torch.compiler.cudagraph_mark_step_begin()
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            if not self.backend or fn not in (self._draft, self._verify):
                raise
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            self.capture_failure = f"{type(e).__name__}: {first}" if first else type(e).__name__
            warnings.warn(f"capture failed ({self.capture_failure}); running the cycle uncaptured", stacklevel=2)
            eager = self.draft_fn if fn is self._draft else self.verify_fn
            self.backend, self._draft, self._verify = None, self.draft_fn, self.verify_fn
            return eager(*args)

    def read_back(self, readout: torch.Tensor) -> list[list[int]]:
        """(accepted, deepest depth, new tokens...) per row: the cycle's one designated host read."""
        if self.counter is not None:
            return self.counter.exempt(readout.tolist)
        return readout.tolist()

    def _plan(self) -> tuple[Plan, list | None]:
        """This cycle's arm (policy.Policy.plan) and the busy rows' head-free trees, grown first:
        they cost no draft step, and their worth says how much room the head has."""
        st, policy = self.state, self.policy
        free = None
        self.noting = self.sources is not None
        if policy is not None and not policy.look():
            self.noting = False
            return Plan("plain"), None
        if self.sources is not None and self.sources.head_free:
            free = self._grow_rows(None, st.root, "free", 0)
        if policy is None:
            arm = "head" if self.speculative else "free" if free is not None else "plain"
            return Plan(arm, max((len(t.tokens) for t in free if t is not None), default=1) if free is not None else 1), free
        policy.batch = self.batch
        return policy.plan(None if free is None else self.tree_probs(free), can_skip_head=self.speculative), free

    @torch.no_grad()
    def step(self) -> list[tuple[int, list[int], int]]:
        """One cycle for every row: plan, propose, verify (accept, commit), learn. Returns, per busy
        row, (row, tokens it produced, draft tokens accepted), before stop handling."""
        t0 = time.perf_counter()
        b, dev, st = self.batch, self.run.device, self.state
        if not self.fixed:  # room for the longest row and its tree (doubling, `ensure_capacity`)
            self.ensure_capacity(max(self.host_len) + 1)
        if self.sources is not None:
            self.sources.last = []
        plan, free = self._plan()
        if plan.arm == "head" and self.speculative:
            self._unpause()
            tokens, parents, depth, anc, scores, st.head_len = self._call(
                "draft", self._draft, st.new_tokens, st.new_features, st.head_len, st.n_new, st.root, st.active)
            plan.steps = self.steps
        else:
            self._skip_head()
            if plan.arm == "free" and plan.free_n > 1:
                tokens, parents, depth, anc, scores = self._padded(free, plan.free_n, st.root)
            else:
                if free is not None:  # a plain cycle still learns what the head-free trees would have given
                    self.sources.last = free
                tokens, scores = st.root[:, None], None
                parents = torch.full((b, 1), -1, dtype=torch.long, device=dev)
                depth = torch.zeros(b, 1, dtype=torch.long, device=dev)
                anc = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)
        t1 = time.perf_counter()
        n = tokens.shape[1]
        state = (st.seq_len, st.root, st.n_new, st.new_features, st.active)
        # a root alone (a plain cycle) is one product whatever the lm_head plan for trees
        if (self.one_product or (n == 1 and not self.backend)) and not any(s is not None and s.host_side for s in self.slots):
            path, *new = self._call("verify", self._verify, tokens, parents, depth, anc, *state)
        else:
            def host():
                p, acc, bon, feats = self._verify_host(tokens, parents, depth, anc, scores)
                return (p,) + self.commit_fn(tokens, depth, p, acc, bon, feats, *state)
            path, *new = self._call("verify", host)
        if self.backend == "cuda-graphs":  # a replay's outputs are overwritten by the next replay
            path, new = path.clone(), [t.clone() if t is not None else None for t in new]
        st.seq_len, st.root, st.n_new, st.new_tokens, st.new_features, readout = new
        values = self.read_back(readout)
        self.absorb = 1 + max(v[0] for v, s in zip(values, self.slots) if s is not None)
        if self.paused is not None:
            self.paused.append((st.new_tokens[:, : self.absorb].clone(), st.new_features[:, : self.absorb].clone()))
        t2 = time.perf_counter()
        tail, self.tail_s = self.tail_s, 0.0
        self.last = {"tree": n, "arm": plan.arm, "draft_s": t1 - t0 + tail, "verify_s": t2 - t1, "busy": self.busy, "batch": b}
        out = []
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            a, deepest = values[i][0], values[i][1]
            self.host_len[i] += a + 1
            s.summary.record_cycle(a, n, deepest, t1 - t0, t2 - t1)
            out.append((i, values[i][2 : 3 + a], a))
        self._learn(plan, free, values, n, t1 - t0 + tail, t2 - t1)
        if scores is not None and self.record_confidence:
            self._observe(scores, path)
        self.tail_s = time.perf_counter() - t2
        return out

    def _learn(self, plan: Plan, free, values, n: int, draft_s: float, verify_s: float) -> None:
        """What the cycle teaches: every grown node whose fate the emitted tokens decide (the
        acceptance estimate), its costs, and in the head's cycles what the alternative would have
        made (the tokens the target emitted decide every head-free node: sources.tokens_taken)."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        emitted = [values[i][2 : 3 + values[i][0]] for i in busy]
        nodes = []
        if self.sources is not None and self.sources.last:
            nodes = self.sources.observe(busy, [self.slots[i].summary for i in busy], n, emitted)
        if self.policy is None:
            return
        made = sum(len(e) for e in emitted)
        alt = plan.alt
        alt_tokens = sum(tokens_taken(free[i], alt[1], e) for i, e in zip(busy, emitted)) if alt[0] == "free" else len(busy)
        self.policy.learn(Outcome(plan, n, len(busy), made, alt_tokens, 1000 * draft_s, 1000 * verify_s, nodes))

    def step_at_size(self, n: int) -> dict:
        """One cycle verifying trees of `n` nodes (1: the root alone, no draft), for timing each
        size on the same rows (measure.measure_batch_costs). A plain cycle leaves one-token rows
        of pending pairs; they are put back, so the next size drafts at a decoding run's shapes.
        Returns its times (`last`)."""
        self.n_max, self.speculative = n, n > 1 and self.hcache is not None
        pending = self.state.new_tokens
        self.step()
        if n == 1:
            self.state.new_tokens = pending
        return self.last

    def _observe(self, scores, path) -> None:
        """Calibration evidence for compare's table (section 3): each drafted node's path
        probability and whether it was accepted."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        # paths are padded with the root (column 0, dropped below), so one scatter marks each row's path
        on = torch.zeros(len(busy), scores.shape[1], dtype=torch.float, device=scores.device).scatter_(1, path[busy], 1.0)
        probs = scores[busy, 1:].exp()
        for j, i in enumerate(busy):
            self.slots[i].summary.record_confidence(probs[j], on[j, 1:])
