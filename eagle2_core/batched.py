"""Batched decoding: B sequences per cycle, each with its own draft tree, one target forward of B x N rows.

The cycle is the one `graphcycle.py` runs at batch 1, with a batch dimension in front of every tensor:

  * every sequence (a *slot*) gets a dynamic tree of exactly N nodes (EAGLE-2 section 4: expansion
    by path score, then rerank); N = 1 is plain decoding (the tree is the root alone, no draft), so
    plain and speculative batches are the same cycle;
  * one static KV cache [B, kv_heads, capacity, head_dim] for the target and one for the draft
    head, slot = position in every row; per-row lengths live on the device, and the additive mask
    [B, 1, N, view] lets each row see only its own context and its own tree's ancestors;
  * acceptance and the KV commit are per-row gathers and scatters of fixed width (depth + 1);
  * one host read per cycle, for the whole batch: (accepted, deepest depth, new tokens) per row,
    which the per-row stop checks (EOS, stop strings, max tokens, context limit) need.

A slot whose sequence ends takes the next prompt (`admit`: its prefill alone, into that row), so
long and short answers do not hold each other up (continuous batching); when no prompt is left
and half the rows are idle, the batch shrinks (`compact`), since an idle row costs a full row of
every product. Which B and N pay on this machine is measured (`BatchCosts`, `plan`), not assumed.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .accept import accept_sampling_keyed, first_token, generation_seed, position_uniforms
from .kvcache import num_cache_layers
from .rowgemm import row_linears
from .target import TargetRunner, capture_layer_inputs, fuse
from .tree import DraftTree, additive


# -- the batched static cache ------------------------------------------------------------------

class BatchKVLayer(CacheLayerMixin):
    """K/V buffers [B, heads, capacity, dim]; rows are written at the owner's `slots` [B, n]
    (or, for one row's prefill, `row` and `slots` [n]) and attention reads the first `view` slots."""
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "BatchKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states) -> None:
        o = self.owner
        self.device = key_states.device
        self.keys = torch.zeros(o.batch, key_states.shape[1], o.capacity, key_states.shape[3], dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(o.batch, value_states.shape[1], o.capacity, value_states.shape[3], dtype=value_states.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if o.row is not None:  # one sequence's prefill into its own row
            self.keys[o.row].index_copy_(1, o.slots, key_states[0])
            self.values[o.row].index_copy_(1, o.slots, value_states[0])
            return self.keys[o.row : o.row + 1, :, : o.view], self.values[o.row : o.row + 1, :, : o.view]
        rows = torch.arange(o.batch, device=self.device)[:, None]
        # advanced indices around a slice put their dims first: [B, n, heads, dim]
        self.keys[rows, :, o.slots] = key_states.transpose(1, 2)
        self.values[rows, :, o.slots] = value_states.transpose(1, 2)
        return self.keys[:, :, : o.view], self.values[:, :, : o.view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.view, 0

    def get_seq_length(self) -> int:
        raise RuntimeError("a batched cache keeps its lengths per row; pass position_ids")

    def get_max_length(self) -> int:
        return self.owner.capacity


class BatchKVCache(Cache):
    def __init__(self, num_layers: int, batch: int, capacity: int):
        self.batch, self.capacity = batch, capacity
        self.slots, self.row, self.view = None, None, capacity
        super().__init__(layers=[BatchKVLayer(self) for _ in range(num_layers)])

    def _each(self, fn) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def commit(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row b, move slots src[b] to dst[b] (the accepted path into place), all layers."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for layer in self.layers:
            if layer.is_initialized:
                for buf in (layer.keys, layer.values):
                    buf[rows, :, dst] = buf[rows, :, src]  # the right side is gathered (copied) first

    def grow(self, capacity: int) -> None:
        def bigger(t):
            new = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
            new[:, :, : t.shape[2]] = t
            return new
        self._each(bigger)
        self.capacity = capacity

    def compact(self, rows: torch.Tensor) -> None:
        """Keep only these rows (in this order): a smaller batch once slots go idle."""
        self._each(lambda t: t.index_select(0, rows))
        self.batch = int(rows.numel())


# -- masks and trees with a batch dimension ------------------------------------------------------

def context_and_tree(past: torch.Tensor, visible: torch.Tensor, view: int) -> torch.Tensor:
    """[B, n, view] bool: row b's n queries see its context slots < past[b], plus the m tree rows
    at slots past[b] .. past[b] + m - 1 that `visible` [B, n, m] marks."""
    b, n, m = visible.shape
    k = torch.arange(view, device=visible.device)
    allowed = (k[None, None, :] < past[:, None, None]).expand(b, n, view).clone()
    cols = (past[:, None] + torch.arange(m, device=visible.device))[:, None, :].expand(b, n, m)
    return allowed.scatter_(2, cols, visible)


def causal_rows(positions: torch.Tensor, view: int) -> torch.Tensor:
    """[B, n, view] bool: a query at position p sees slots <= p (slot = position)."""
    return torch.arange(view, device=positions.device)[None, None, :] <= positions[:, :, None]


def windowed(allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Sliding-window attention (Mistral, Gemma 3's local layers): keys within `window` positions."""
    if window is None:
        return allowed
    return allowed & (k_pos[:, None, :] > q_pos[:, :, None] - window)


def batch_trees(tokens: torch.Tensor, parents: torch.Tensor, depth_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree.tree_from_parents` for B trees at once: (depth [B, N], ancestors [B, N, N]); depth_max
    passes push ancestry down one level each, with no host read."""
    b, n = tokens.shape
    anc = torch.eye(n, dtype=torch.bool, device=tokens.device).expand(b, n, n).clone()
    depth = torch.zeros(b, n, dtype=torch.long, device=tokens.device)
    has_parent = parents >= 0
    p = parents.clamp(min=0)
    for _ in range(depth_max if n > 1 else 0):
        anc = anc | (anc.gather(1, p[:, :, None].expand(b, n, n)) & has_parent[:, :, None])
        depth = torch.where(has_parent, depth.gather(1, p) + 1, 0)
    return depth, anc


def rerank_batch(pool_tokens, pool_parents, pool_scores, roots, budget: int, depth_max: int):
    """EAGLE-2 rerank (section 4.2) per row: the `budget` pool nodes with the highest path scores,
    in pool order (parents first; ties go to the earlier, shallower node, so the kept set is a tree)."""
    b, p = pool_scores.shape
    budget = max(0, min(budget, p))
    order = torch.sort(pool_scores, dim=1, descending=True, stable=True).indices[:, :budget]
    keep = torch.sort(order, dim=1).values
    remap = torch.full((b, p + 1), -1, dtype=torch.long, device=roots.device)
    remap.scatter_(1, keep + 1, torch.arange(1, budget + 1, device=roots.device).expand(b, budget))
    remap[:, 0] = 0  # pool parent -1 is the root
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=roots.device), remap.gather(1, pool_parents.gather(1, keep) + 1)], 1)
    tokens = torch.cat([roots[:, None], pool_tokens.gather(1, keep)], 1)
    scores = torch.cat([torch.zeros(b, 1, dtype=pool_scores.dtype, device=roots.device), pool_scores.gather(1, keep)], 1)
    depth, anc = batch_trees(tokens, parents, depth_max)
    return tokens, parents, depth, anc, scores


def accept_greedy_batch(tokens, parents, depth, anc, argmax, width: int):
    """`accept.accept_greedy_fixed` per row: (path [B, width] root first, padded with the root;
    accepted [B]; bonus [B]). A node matches when its token is its parent's argmax; the deepest
    node whose whole path matches ends the accepted path."""
    match = (tokens == argmax.gather(1, parents.clamp(min=0))) | (parents < 0)
    survives = ~(anc & ~match[:, None, :]).any(dim=2)
    best = torch.argmax(torch.where(survives, depth, -1), dim=1)
    b, n = tokens.shape
    rows = torch.arange(b, device=tokens.device)
    on_path = anc[rows, best]
    slot = torch.where(on_path, depth, width)
    path = torch.zeros(b, width + 1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, torch.arange(n, device=tokens.device).expand(b, n) * on_path)
    return path[:, :width], depth[rows, best], argmax[rows, best]


# -- per-sequence state ----------------------------------------------------------------------

@dataclass
class Slot:
    """One sequence in the batch, on the host: its stop checks, sampling, statistics."""
    key: object
    stop: object
    procs: object = None     # sampling.TargetProcessors: the model's generation_config processors, warpers included
    prompt: list = field(default_factory=list)
    seed: int = 0            # sampling: one uniform per output position from (seed, position) (accept_sampling_keyed)
    tokens: list = field(default_factory=list)   # emitted tokens (what the record gets)
    summary: object = None
    started: float = 0.0


class BatchCycle:
    """B slots decoding together; `tree_tokens` N = 1 is plain batched decoding (no draft head use).

    `depth` and `top_k` shape the expansion (candidate pool top_k + (depth-1) top_k^2); the tree
    verified each cycle has `tree_tokens` nodes, or fewer where `choose_n` says so (per cycle)."""

    def __init__(self, model, head, tokenizer, batch: int, tree_tokens: int, depth: int = 3, top_k: int = 2,
                 capacity: int = 512, choose_n=None):
        self.run = TargetRunner(model)
        self.head, self.tokenizer = head, tokenizer
        self.batch, self.n_max = batch, max(1, tree_tokens)
        self.depth, self.top_k = max(1, depth), max(1, top_k)
        pool = self.top_k + (self.depth - 1) * self.top_k ** 2
        if self.n_max > 1 and head is None:
            raise ValueError("a tree of more than one node needs a draft head")
        self.n_max = min(self.n_max, pool + 1)
        self.width = self.depth + 1
        self.choose_n = choose_n
        self.layers = head.feature_layers if head is not None and self.n_max > 1 else None
        self.margin = self.n_max + self.width + 8  # room past a sequence's end for one more tree
        self.capacity = capacity + self.margin
        self.cache = BatchKVCache(num_cache_layers(model.config), batch, self.capacity)
        self.hcache = BatchKVCache(1, batch, self.capacity) if self.n_max > 1 else None
        dev = self.run.device
        z = torch.zeros(batch, dtype=torch.long, device=dev)
        self.seq_len, self.root, self.head_len, self.n_new = z.clone(), z.clone(), z.clone(), z.clone()
        self.active = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.new_tokens = torch.zeros(batch, self.width, dtype=torch.long, device=dev)
        self.new_features = None  # [B, width, F], allocated at the first admission
        self.slots: list[Slot | None] = [None] * batch
        self.host_len = [0] * batch  # mirrors of seq_len, from the cycle's read-back
        self.speculative = self.n_max > 1
        self.last = {}  # the last cycle's figures (tree size, ms), for the planner and reports
        self.seen: dict = {}
        self._stack = ExitStack()
        self._stack.enter_context(row_linears(self.run.cpu_linears))
        if self.layers:
            self.seen = self._stack.enter_context(capture_layer_inputs(self.run.body, self.layers))

    def close(self) -> None:
        self._stack.close()

    # -- masks ------------------------------------------------------------------------------
    def _masks(self, allowed_fn, dtype):
        r = self.run
        if r.hybrid:
            return {"full_attention": additive(allowed_fn(None), dtype), "sliding_attention": additive(allowed_fn(r.window), dtype)}
        return additive(allowed_fn(r.window), dtype)

    # -- admission --------------------------------------------------------------------------
    @property
    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.slots)

    def ensure_capacity(self, need: int) -> None:
        need = min(need, self.run.max_positions) + self.margin
        if need > self.capacity:
            cap = max(need, 2 * self.capacity)
            self.cache.grow(cap)
            if self.hcache is not None:
                self.hcache.grow(cap)
            self.capacity = cap

    @torch.no_grad()
    def admit(self, b: int, ids: list[int], slot: Slot, pick) -> int:
        """Prefill one prompt into row b (alone) and return its first token, chosen by `pick(logits)`.
        The head absorbs the prompt's pairs here too, all but the last, which the next cycle's
        draft absorbs with the other rows' new pairs at the fixed width."""
        dev, n = self.run.device, len(ids)
        self.ensure_capacity(n + slot.stop.remaining + 1)
        x = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        c = self.cache
        c.row, c.slots, c.view = b, pos, n
        mask = self._masks(lambda w: windowed(causal_rows(pos[None], n), pos[None], pos[None], w), self.run.dtype)
        out = self.run.body(input_ids=x[None], position_ids=pos[None], attention_mask=mask, cache=c, use_cache=True)
        c.row = None
        hidden = out.last_hidden_state[0]
        root = pick(self.run.logits(hidden[-1:]))
        if self.hcache is not None and self.speculative:
            feats = hidden if self.layers is None else fuse(self.seen, self.layers)[0]
            if self.new_features is None:
                self.new_features = torch.zeros(self.batch, self.width, feats.shape[-1], dtype=feats.dtype, device=dev)
            if n > 1:  # pairs (f_t, x_{t+1}) for t < n - 1, at positions t
                h = self.hcache
                h.row, h.slots, h.view = b, pos[: n - 1], n - 1
                bias = additive(causal_rows(pos[None, : n - 1], n - 1), self.head.fc.weight.dtype)
                self.head(x[None, 1:], self.head.project(feats[None, : n - 1]), pos[None, : n - 1], attention_mask=bias, cache=h)
                h.row = None
            self.new_tokens[b, 0] = root
            self.new_features[b, 0] = feats[-1]
            self.head_len[b], self.n_new[b] = n - 1, 1
        self.seq_len[b], self.root[b], self.active[b] = n, root, True
        self.host_len[b] = n
        self.slots[b] = slot
        return root

    def release(self, b: int) -> Slot:
        slot, self.slots[b] = self.slots[b], None
        self.active[b] = False
        return slot

    def compact(self) -> None:
        """Drop idle rows (no prompt is waiting for them): every row costs a row of every product."""
        keep = [i for i, s in enumerate(self.slots) if s is not None]
        rows = torch.tensor(keep, dtype=torch.long, device=self.run.device)
        self.cache.compact(rows)
        if self.hcache is not None:
            self.hcache.compact(rows)
        for name in ("seq_len", "root", "head_len", "n_new", "active", "new_tokens"):
            setattr(self, name, getattr(self, name).index_select(0, rows))
        if self.new_features is not None:
            self.new_features = self.new_features.index_select(0, rows)
        self.slots = [self.slots[i] for i in keep]
        self.host_len = [self.host_len[i] for i in keep]
        self.batch = len(keep)

    # -- one cycle --------------------------------------------------------------------------
    def _view(self, extra: int) -> int:
        # attention reads only the slots some row can see: the longest context plus this cycle's rows
        return min(self.capacity, (max(self.host_len) + extra + 31) // 32 * 32)

    @torch.no_grad()
    def draft(self):
        """Absorb every row's new pairs, then expand and rerank one dynamic tree per row."""
        head, h, dev = self.head, self.hcache, self.run.device
        b, w, k = self.batch, self.width, self.top_k
        dtype = head.fc.weight.dtype
        positions = self.head_len[:, None] + torch.arange(w, device=dev)
        view = self._view(w + self.depth * k)
        h.slots, h.view = positions, view
        bias = additive(causal_rows(positions, view), dtype)
        out = head(self.new_tokens, head.project(self.new_features), positions, attention_mask=bias, cache=h)
        rows = torch.arange(b, device=dev)
        hid = out[rows, self.n_new - 1]                    # [B, H]: each row's root state
        ctx = self.head_len + self.n_new                   # head context after the absorb = root position
        self.head_len = torch.where(self.active, ctx, self.head_len)
        logp = torch.log_softmax(head.draft_logits(hid).float(), dim=-1)
        k = min(k, logp.shape[-1])
        scores, ids = torch.topk(logp, k, dim=-1)          # [B, k]
        tokens = head.to_target_ids(ids)
        pool_t, pool_p, pool_s = [tokens], [torch.full((b, k), -1, dtype=torch.long, device=dev)], [scores]
        front_idx, front_s = torch.arange(k, device=dev).expand(b, k), scores
        front_h = hid[:, None].expand(b, k, hid.shape[-1])
        visible = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        eye, size = visible, k
        for d in range(1, self.depth):
            m = visible.shape[2]
            h.slots = ctx[:, None] + torch.arange(m - k, m, device=dev)
            pos = (ctx + d - 1)[:, None].expand(b, k)
            bias = additive(context_and_tree(ctx, visible, view), dtype)
            out_h = head(tokens, front_h, pos, attention_mask=bias, cache=h)
            out_lp = torch.log_softmax(head.draft_logits(out_h).float(), dim=-1)
            child_lp, child_ids = torch.topk(out_lp, k, dim=-1)            # [B, k, k]
            path = (front_s[:, :, None] + child_lp).flatten(1)            # path score = product of confidences
            sel = torch.topk(path, k, dim=1).indices                       # EAGLE-2 expansion (section 4.1)
            parent_slot = sel // k
            pool_t.append(head.to_target_ids(child_ids).flatten(1))
            pool_p.append(front_idx.repeat_interleave(k, dim=1))
            pool_s.append(path)
            tokens, front_idx, front_s = pool_t[-1].gather(1, sel), size + sel, path.gather(1, sel)
            front_h = out_h.gather(1, parent_slot[:, :, None].expand(-1, -1, out_h.shape[-1]))
            visible = torch.cat([visible.gather(1, parent_slot[:, :, None].expand(-1, -1, m)), eye], 2)
            size += k * k
        pool_t, pool_p, pool_s = torch.cat(pool_t, 1), torch.cat(pool_p, 1), torch.cat(pool_s, 1)
        n = self.n_max
        if self.choose_n is not None:
            # per cycle: the tree size the measured costs and the draft's confidence pick (batch_plan)
            best = torch.topk(pool_s, min(self.n_max - 1, pool_s.shape[1]), dim=1).values.exp()
            n = self.choose_n(best[self.active])
        return rerank_batch(pool_t, pool_p, pool_s, self.root, n - 1, self.depth)

    @torch.no_grad()
    def step(self) -> list[tuple[int, list[int]]]:
        """One cycle for every row: draft (if speculative), verify, accept, commit. Returns, per busy
        row, (row, tokens it produced this cycle), before stop handling."""
        t0 = time.perf_counter()
        dev, b = self.run.device, self.batch
        if self.speculative:
            tokens, parents, depth, anc, scores = self.draft()
        else:
            tokens = self.root[:, None]
            parents = torch.full((b, 1), -1, dtype=torch.long, device=dev)
            depth = torch.zeros(b, 1, dtype=torch.long, device=dev)
            anc = torch.ones(b, 1, 1, dtype=torch.bool, device=dev)
            scores = None
        t1 = time.perf_counter()
        n = tokens.shape[1]
        w = self.width if self.speculative else 1
        q_pos = self.seq_len[:, None] + depth
        positions = q_pos.clamp(max=self.run.max_positions - 1)  # past the context limit: verified, never emitted
        view = self._view(n)
        c = self.cache
        c.slots, c.view = self.seq_len[:, None] + torch.arange(n, device=dev), view
        k_pos = torch.arange(view, device=dev).expand(b, view).scatter(1, c.slots, q_pos)
        mask = self._masks(lambda win: windowed(context_and_tree(self.seq_len, anc, view), q_pos, k_pos, win), self.run.dtype)
        out = self.run.body(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=c, use_cache=True)
        hidden = out.last_hidden_state                                   # [B, N, H]
        logits = self.run.logits(hidden.reshape(b * n, -1)).view(b, n, -1)
        # every processor generate() would apply, to each node with its own history (context plus
        # its ancestors: sampling.TargetProcessors.tree_scores); rows without processors keep their logits
        processed = [i for i, s in enumerate(self.slots) if s is not None and s.procs is not None and s.procs.active]
        if processed:
            logits = logits.clone()
            for i in processed:
                s = self.slots[i]
                hist = torch.tensor(s.prompt + s.tokens[:-1], dtype=torch.long, device=dev)
                logits[i] = s.procs.tree_scores(logits[i], hist, DraftTree(tokens[i], parents[i], depth[i], anc[i]))
        sampled = [i for i, s in enumerate(self.slots) if s is not None and s.procs is not None and s.procs.sampling]
        argmax = logits.argmax(-1)
        path, accepted, bonus = accept_greedy_batch(tokens, parents, depth, anc, argmax, w)
        if sampled:  # lossless sampling acceptance, row by row on the host (accept.accept_sampling_keyed)
            path, accepted, bonus = path.clone(), accepted.clone(), bonus.clone()
            for i in sampled:
                s = self.slots[i]
                tree = DraftTree(tokens[i], parents[i], depth[i], anc[i])
                u = position_uniforms(s.seed, len(s.tokens), w)  # the next output positions of this sequence
                p_list, bonus_i = accept_sampling_keyed(tree, torch.softmax(logits[i].float(), -1), u)
                path[i] = torch.tensor(p_list + [0] * (w - len(p_list)), device=dev)
                accepted[i], bonus[i] = len(p_list) - 1, bonus_i
        # commit: accepted KV into place, per row; idle rows stay where they are
        if w > 1:
            c.commit(self.seq_len[:, None] + path, self.seq_len[:, None] + torch.arange(w, device=dev))
            drafted = tokens.gather(1, path[:, 1:])
            slot = torch.arange(w, device=dev)[None]
            new_tokens = torch.where(slot == accepted[:, None], bonus[:, None], torch.cat([drafted, bonus[:, None]], 1))
            feats = hidden if self.layers is None else fuse(self.seen, self.layers)
            self.new_features = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1])).to(self.new_features.dtype)
            self.new_tokens = new_tokens
            self.n_new = torch.where(self.active, accepted + 1, self.n_new)
        else:
            new_tokens = bonus[:, None]
        self.seq_len = torch.where(self.active, self.seq_len + accepted + 1, self.seq_len)
        self.root = torch.where(self.active, bonus, self.root)
        readout = torch.cat([accepted[:, None], depth[:, -1:], new_tokens], 1).tolist()  # the cycle's one host read
        t2 = time.perf_counter()
        self.last = {"tree": n, "draft_s": t1 - t0, "verify_s": t2 - t1, "busy": self.busy, "batch": b}
        if scores is not None:
            self.last["scores"] = scores
        out_rows = []
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            a, deepest = readout[i][0], readout[i][1]
            self.host_len[i] += a + 1
            s.summary.record_cycle(a, n, deepest, t1 - t0, t2 - t1)
            out_rows.append((i, readout[i][2 : 3 + a]))
        return out_rows


def pick_fn(slot: Slot):
    """The first token after a prompt: argmax of the processed scores, or the draw of output position 0."""
    def pick(logits):
        if slot.procs is not None and slot.procs.active:
            logits = slot.procs.scores(logits, torch.tensor([slot.prompt], dtype=torch.long, device=logits.device))
        if slot.procs is None or not slot.procs.sampling:
            return int(logits.argmax(-1)[0])
        return first_token(logits[0], slot.seed)
    return pick


def new_slot(key, gen, stop, summary, model=None, prompt=(), eos=()) -> Slot:
    from .sampling import TargetProcessors

    # unseeded: a fresh seed per sequence (still one stream per sequence, independent of its mates)
    seed = generation_seed(gen.seed)
    procs = TargetProcessors(gen, getattr(model, "generation_config", None), list(prompt) or [0], sorted(eos), gen.max_new_tokens)
    return Slot(key=key, stop=stop, procs=procs, prompt=list(prompt), seed=seed, summary=summary, started=time.perf_counter())


def expected_tokens(probs: torch.Tensor, calibration: float) -> torch.Tensor:
    """[n_max] expected tokens per row for trees of 1 .. n_max nodes: 1 + the sum of the best
    n - 1 path probabilities (EAGLE-2 section 3: the draft's confidence approximates acceptance),
    scaled by the measured ratio of accepted to predicted; probs [B, n_max - 1] sorted per row."""
    per = torch.cat([torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device), probs.cumsum(1)], 1).mean(0)
    return 1 + calibration * per.double().cpu()


# -- continuous batching over a queue of requests ----------------------------------------------

@dataclass
class Request:
    key: object            # the caller's handle (returned with the result)
    ids: list[int]         # the prompt, encoded
    gen: object            # GenerationSettings


class BatchPlanner:
    """Chooses the tree size per cycle from measured costs and the draft's confidence, and says
    when plain decoding would pay more than drafting at all (EAGLE-2 section 3: the draft is well
    calibrated, so 1 + the sum of the kept nodes' path probabilities is the expected output)."""

    def __init__(self, costs: "BatchCosts", batch: int, n_max: int, prior: list[float], patience: int = 8):
        self.costs, self.batch, self.n_max = costs, batch, n_max
        self.prior = prior            # expected tokens per row for 1 .. n_max nodes, before any cycle
        self.predicted = self.accepted = 0.0
        self.patience, self.plain_votes = patience, 0
        self.chosen: list[int] = []   # tree size of each speculative cycle
        self._pending = None          # (predicted accepted tokens, n) of the cycle being verified

    @property
    def calibration(self) -> float:
        # measured accepted over predicted accepted, shrunk toward 1 by 20 pseudo-tokens
        return (self.accepted + 20.0) / (self.predicted + 20.0)

    def choose_n(self, best: torch.Tensor) -> int:
        """Tree size (1 .. n_max) for this cycle; `best` [busy rows, n_max - 1]: each busy row's
        best path probabilities, sorted. The draft is paid already: only verify costs decide."""
        if best.shape[0] == 0:
            return 1
        exp = expected_tokens(best, self.calibration)
        b = self.batch
        verify = torch.tensor([self.costs.verify(b, n) for n in range(1, len(exp) + 1)], dtype=torch.float64)
        n = int(torch.argmax(exp / verify)) + 1
        self._pending = (float(exp[n - 1] - 1) / self.calibration * best.shape[0], n)
        # would plain batches have paid more than drafting plus this verify?
        plain = 1.0 / self.costs.verify(b, 1)
        spec = float(exp[n - 1]) / (self.costs.verify(b, n) + self.costs.draft(b))
        self.plain_votes = self.plain_votes + 1 if plain > spec else 0
        self.chosen.append(n)
        return n

    def observe(self, accepted_tokens: int) -> None:
        if self._pending is not None:
            self.predicted += self._pending[0]
            self.accepted += accepted_tokens
            self._pending = None

    @property
    def go_plain(self) -> bool:
        return self.plain_votes >= self.patience


def prior_expected(head, n_max: int) -> list[float]:
    """Expected tokens per cycle for trees of 1 .. n_max nodes before any cycle is seen: a chain
    from the head's own evaluation (metadata `eval.acceptance_by_depth`), 1 for a random head,
    and a cautious guess otherwise. Only the first plan uses it; cycles replace it."""
    meta = getattr(head, "metadata", None) or {}
    if head is None or meta.get("random"):
        return [1.0] * n_max
    rates = (meta.get("eval") or {}).get("acceptance_by_depth") or [0.5, 0.3, 0.2]
    out, reach = [1.0], 1.0
    for n in range(2, n_max + 1):
        d = n - 1
        if d <= len(rates):
            reach *= rates[d - 1]
            out.append(out[-1] + reach)
        else:
            out.append(out[-1] + 0.02)  # extra siblings: little, but not nothing
    return out


def plan(costs: "BatchCosts", n_prompts: int, prior: list[float], batch: int | None = None, tree: int | None = None):
    """(batch size, tree size, estimated tok/s table {(B, N): tok/s}) maximising tokens per second.

    B runs over the measured batch sizes up to the number of prompts (`batch` pins it), N over
    1 (plain) .. len(prior) (`tree` pins it). tok/s = B x E(N) / (verify(B, N) + draft(B) if N > 1)."""
    sizes = [b for b in costs.batches if b <= max(1, n_prompts)] or [1]
    if batch is not None:
        sizes = [batch]
    trees = [tree] if tree is not None else list(range(1, len(prior) + 1))
    table = {}
    for b in sizes:
        for n in trees:
            ms = costs.verify(b, n) + (costs.draft(b) if n > 1 else 0.0)
            table[(b, n)] = 1000.0 * b * prior[min(n, len(prior)) - 1] / ms
    best = max(table, key=table.get)
    return best[0], best[1], table


class BatchDecoder:
    """Continuous batching: `run(queue, on_done)` decodes every request of `queue` (a deque the
    caller may extend from `on_done`, e.g. with a conversation's next turn) with `batch` slots;
    `on_done(key, tokens, summary)` is called as each request finishes."""

    def __init__(self, model, head, tokenizer, batch: int, tree_tokens: int, depth: int = 3, top_k: int = 2,
                 planner: BatchPlanner | None = None, eos_ids=None):
        self.model, self.head, self.tokenizer = model, head, tokenizer
        self.batch, self.tree_tokens, self.depth, self.top_k = batch, tree_tokens, depth, top_k
        self.planner = planner
        self.eos_ids = eos_ids
        self.stats = {"cycles": 0, "plain_from_cycle": None, "tree_sizes": {}}

    @torch.no_grad()
    def run(self, queue, on_done) -> None:
        from .events import StopChecker, Summary
        from .target import model_eos_ids

        run_max = TargetRunner(self.model).max_positions
        default_eos = self.eos_ids or model_eos_ids(self.model, self.tokenizer)  # once: the tokenizer's vocabulary is slow to read
        longest = max((len(r.ids) + r.gen.max_new_tokens for r in queue), default=64)
        cycle = BatchCycle(self.model, self.head, self.tokenizer, self.batch, self.tree_tokens, self.depth, self.top_k,
                           capacity=min(run_max, longest), choose_n=self.planner.choose_n if self.planner and self.tree_tokens > 1 else None)

        def finish(b: int) -> None:
            s = cycle.release(b)
            s.summary.finish(s.stop, time.perf_counter() - s.started)
            on_done(s.key, s.tokens, s.summary)

        try:
            while queue or cycle.busy:
                for b in cycle.free:
                    if not queue:
                        break
                    req = queue.popleft()
                    eos = set(req.gen.eos_token_ids) if req.gen.eos_token_ids is not None else default_eos
                    stop = StopChecker(req.gen, self.tokenizer, eos, run_max, len(req.ids))
                    summary = Summary(prompt_tokens=len(req.ids))
                    slot = new_slot(req.key, req.gen, stop, summary, self.model, req.ids, eos)
                    if stop.done:  # no room at all: nothing to generate
                        summary.finish(stop, 0.0)
                        on_done(req.key, [], summary)
                        continue
                    t0 = time.perf_counter()
                    root = cycle.admit(b, req.ids, slot, pick_fn(slot))
                    summary.target_forwards, summary.prefill_s = 1, time.perf_counter() - t0
                    slot.tokens.extend(stop.push([root]))
                    if stop.done:
                        finish(b)
                if not cycle.busy:
                    continue
                if not queue and cycle.batch > 1 and cycle.busy <= cycle.batch // 2:
                    cycle.compact()
                    if self.planner is not None:
                        self.planner.batch = cycle.batch
                rows = cycle.step()
                self.stats["cycles"] += 1
                n = cycle.last["tree"]
                self.stats["tree_sizes"][n] = self.stats["tree_sizes"].get(n, 0) + 1
                if self.planner is not None and cycle.speculative:
                    self.planner.observe(sum(len(t) - 1 for _, t in rows))
                    if self.planner.go_plain and self.tree_tokens > 1:
                        cycle.speculative = False  # measured: drafting does not pay at this batch on this machine
                        self.stats["plain_from_cycle"] = self.stats["cycles"]
                for b, toks in rows:
                    s = cycle.slots[b]
                    s.tokens.extend(s.stop.push(toks))
                    if s.stop.done:
                        finish(b)
        finally:
            cycle.close()
