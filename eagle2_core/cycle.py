"""One EAGLE-2 cycle with a batch dimension: draft, verify, commit, over every row's state at once.

B >= 1 sequences (*rows*) decode together: draft a tree per row with the draft head (EAGLE-2
section 4: expansion by path score, then rerank) and, in live mode, the head-free draft sources
(sources.py: recycled target top-k, context matches) merged into the same tree by calibrated
path probability (merge.py), verify every row's tree in one forward of the
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

import torch

from .drafter import Drafter
from .kvcache import KVCache, num_cache_layers  # noqa: F401  (re-exported: engine, tests)
from .merge import Merger
from .policy import Outcome, Plan
from .rowgemm import row_linears
from .rows import Rows, RowState, Slot, bucket  # noqa: F401  (re-exported: engine, measure, tests)
from .sources import DraftSources, tokens_taken
from .target import TargetRunner, capture_layer_inputs
from .tree import chain_choices, static_choices
from .treesettings import TreeSettings
from .verifier import Verifier


def _compile(fn, backend: str):
    """torch.compile a cycle function whole; "cuda-graphs" = inductor replayed as one CUDA graph."""
    if backend == "cuda-graphs":
        return torch.compile(fn, backend="inductor", mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


# -- the cycle -----------------------------------------------------------------------------------

class Cycle:
    """B rows decoding together, composed of its parts: the rows and their caches (rows.py), the
    head drafter (drafter.py), the merger of sources into one tree (merge.py), the verifier
    (verifier.py) and live mode's policy (policy.py). `head` None (or a one-node tree) is plain decoding."""

    def __init__(self, run: TargetRunner, head, tree: TreeSettings, batch: int, capacity: int, *, fixed: bool = False,
                 backend: str | None = None, sources: DraftSources | None = None):
        self.run, self.head, self.tree, self.fixed = run, head, tree, fixed
        k, depth = max(1, tree.top_k), max(1, tree.depth)
        # the merge of draft sources (sources.py) runs on the host: live mode's dynamic trees only
        self.sources = sources if sources is not None and not fixed and tree.shape == "dynamic" else None
        free = self.sources is not None and self.sources.head_free
        if head is None:
            self.n_max = 1
        elif tree.shape == "dynamic":
            self.n_max = min(tree.total_tokens, k + (depth - 1) * k ** 2 + 1)  # the candidate pool bounds it
        else:  # EAGLE-1's static tree or a chain: the same sibling ranks every cycle
            self.n_max = len(chain_choices(depth) if tree.shape == "chain" else static_choices(tree.total_tokens, depth, k)) + 1
        if free:  # head-free nodes fill the tree up to its size, past the head's pool
            self.n_max = max(self.n_max, tree.total_tokens)
        spec = head is not None and self.n_max > 1   # the head drafts (else: sources alone, or plain)
        # accepted path, root first: the absorb and commit width (a copied chain may run deeper than the head)
        self.width = max(depth, self.sources.max_depth if free else 0) + 1 if self.n_max > 1 else 1
        margin = max(self.n_max, depth * k) + self.width + 8  # room past a sequence's end for one tree
        self.rows = Rows(run, batch, capacity, self.width, margin, fixed=fixed, cache_layers=num_cache_layers(run.model.config),
                         head_cache=spec)
        self.merger = Merger(self.sources, self.rows) if self.sources is not None else None
        self.drafter = Drafter(head, tree, self.rows, self.n_max, fixed=fixed, merger=self.merger) if spec else None
        self.verifier = Verifier(run, self.rows, self.sources, self.width)
        self.layers = self.verifier.layers = head.feature_layers if spec else None
        self.speculative = spec
        # live mode on a CPU verifies with its small steps on the host (`Verifier.verify_live`); windowed masks keep the tensor path
        self.host_verify = not fixed and run.device.type == "cpu" and run.window is None and not run.hybrid
        self._policy = None       # live mode's policy.Policy (set by the engine); None: every cycle drafts its whole tree
        self.record_confidence = False
        self.counter = None       # opcount.OpCounter while counting
        # host time after the last cycle's read-back (the sources' and the policy's bookkeeping of
        # what was verified): charged to the next cycle, so every arm's cost is its whole cost
        self.tail_s = 0.0
        self.last: dict = {}
        self._root_alone: dict = {}
        self.backend = backend if fixed else None
        self.capture_failure = None
        self._draft, self._verify = self.draft_fn, self.verify_fn
        if self.backend:
            self._draft, self._verify = _compile(self.draft_fn, self.backend), _compile(self.verify_fn, self.backend)

    # -- the parts' shared settings -------------------------------------------------------------
    @property
    def speculative(self) -> bool:
        """Whether the head drafts (`step_at_size` turns it off for a one-node size)."""
        return self._speculative

    @speculative.setter
    def speculative(self, on: bool) -> None:
        self._speculative = on
        self.verifier.width = self.width if self.drafting else 1

    @property
    def drafting(self) -> bool:
        """Whether trees may have more than the root: a head, or head-free sources."""
        return self._speculative or (self.sources is not None and self.sources.head_free)

    @property
    def policy(self):
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        self._policy = policy
        for part in (self.drafter, self.merger):
            if part is not None:
                part.policy = policy

    @contextmanager
    def session(self):
        """Hooks (EAGLE-3's layer inputs) and the measured product plan, for one run only: outside
        it the model is the user's (`generate` included). A run stopped early (Ctrl-C) ends here too."""
        with ExitStack() as stack:
            if not self.backend:  # captured cycles leave products to the compiler
                stack.enter_context(row_linears(self.run.cpu_linears))
            if self.layers:
                self.verifier.seen = stack.enter_context(capture_layer_inputs(self.run.body, self.layers))
            yield

    # -- rows -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new run: every row free, drafting on again (a skipping head kept nothing across runs)."""
        self.rows.reset()
        self.speculative = self.rows.hcache is not None
        if self.drafter is not None:
            self.drafter.reset()

    @torch.no_grad()
    def admit(self, b: int, ids: list[int], slot: Slot, pick, kept=None, reuse: int = 0) -> int:
        """Prefill one prompt into row b, alone, and return its first token (`pick(logits)`). The
        head absorbs the prompt's pairs (f_t, x_{t+1}) here too, all but the last, which the next
        cycle's draft absorbs with the other rows' new pairs at the fixed width.

        With `kept` (a prefix.Kept whose ids share at least `reuse` + 1 leading ids with `ids`, and
        whose head holds at least `reuse` cells when drafting) the first `reuse` cells of both
        caches are restored from it and only ids[reuse:] run: reuse < len(ids), so the first
        token's logits and every head pair from `reuse` on come from a real forward."""
        dev, n = self.run.device, len(ids)
        r = reuse if kept is not None else 0
        assert 0 <= r < n, (r, n)
        # fixed mode reserves what the row can reach (one bucket while it runs, no capture
        # mid-answer); live mode the prompt, and `step` grows the buffers as rows grow
        self.rows.ensure_capacity(n + (slot.stop.remaining if self.fixed else 0) + 1)
        x = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        c = self.rows.cache
        if r:
            c.put(b, kept.target, r)
            if self.speculative:
                self.drafter.restore(b, kept, r)
        logits, feats = self.verifier.prefill(b, x, pos, r)
        if self.sources is not None:
            self.sources.note_logits(x[-1:], logits)
        root = pick(logits)
        if self.speculative:
            self.drafter.prefill(b, x, feats[0], pos, r, root)
        self.rows.occupy(b, slot, n, root)
        return root

    def kept_row(self, b: int, ids: list[int]):
        """Row b's cells as a kept sequence (prefix.Kept) of `ids`, the row's prompt and emitted
        tokens (rows.Rows.take), a paused head first catching up so that it keeps every head cell."""
        if self.drafter is not None:
            self.drafter.catch_up()
        return self.rows.take(b, ids)

    def release(self, b: int) -> Slot:
        slot = self.rows.release(b)
        if self.drafter is not None and self.rows.batch == 1:  # a skipping head's pairs end with their sequence
            self.drafter.paused = None
        if self.sources is not None:
            self.sources.forget(self.rows.slots)
        return slot

    # -- the parts' captured functions: plain methods, so that each capture is of the cycle's own -
    def draft_fn(self, new_tokens, new_features, head_len, n_new, root, active):
        """drafter.Drafter.draft_fn: absorb, then one tree per row. Captured in fixed mode."""
        return self.drafter.draft_fn(new_tokens, new_features, head_len, n_new, root, active)

    def verify_fn(self, tokens, parents, depth, anc, seq_len, root, n_new, new_features, active):
        """verifier.Verifier.verify_fn: forward, accept, commit. Captured in fixed mode."""
        return self.verifier.verify_fn(tokens, parents, depth, anc, seq_len, root, n_new, new_features, active)

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
        policy = self.policy
        free = None
        self.verifier.noting = self.sources is not None
        if policy is not None and not policy.look():
            self.verifier.noting = False
            return Plan("plain"), None
        if self.sources is not None and self.sources.head_free:
            free = self.merger.grow_rows(None, self.rows.state.root, "free", 0, self.n_max)
        if policy is None:
            arm = "head" if self.speculative else "free" if free is not None else "plain"
            return Plan(arm, max((len(t.tokens) for t in free if t is not None), default=1) if free is not None else 1), free
        policy.batch = self.rows.batch
        return policy.plan(None if free is None else self.merger.tree_probs(free), can_skip_head=self.speculative), free

    def _propose(self, plan: Plan, free):
        """This cycle's trees by the plan's arm: the head's (its pause ended), the head-free
        sources' alone, or the root alone. Returns (tokens, parents, depth, ancestors, scores)."""
        b, dev, st = self.rows.batch, self.run.device, self.rows.state
        if plan.arm == "head" and self.speculative:
            self.drafter.unpause()
            tokens, parents, depth, anc, scores, st.head_len = self._call(
                "draft", self._draft, st.new_tokens, st.new_features, st.head_len, st.n_new, st.root, st.active)
            plan.steps = self.drafter.steps
            return tokens, parents, depth, anc, scores
        if self.speculative:
            self.drafter.skip()
        if plan.arm == "free" and plan.free_n > 1:
            return self.merger.padded(free, plan.free_n, st.root)
        if free is not None:  # a plain cycle still learns what the head-free trees would have given
            self.sources.last = free
        if b not in self._root_alone:  # the root alone: the same parents, depth and ancestry every plain cycle
            self._root_alone[b] = (torch.full((b, 1), -1, dtype=torch.long, device=dev), torch.zeros(b, 1, dtype=torch.long, device=dev),
                                   torch.ones(b, 1, 1, dtype=torch.bool, device=dev))
        return (st.root[:, None],) + self._root_alone[b] + (None,)

    def _verify_commit(self, tokens, parents, depth, anc, scores):
        """Verify every row's tree and commit: on the host in live mode on a CPU, captured in fixed
        mode, when no row needs host-side steps. Returns the accepted paths and the read-back
        values; the rows' state is the next cycle's."""
        st, n, verifier = self.rows.state, tokens.shape[1], self.verifier
        state, values = (st.seq_len, st.root, st.n_new, st.new_features, st.active), None
        # a root alone (a plain cycle) is one product whatever the lm_head plan for trees
        if (n == 1 and not self.backend or verifier.one_product_for(tokens.numel())) and not any(
                s is not None and s.host_side for s in self.rows.slots):
            if self.host_verify:
                path, values = self._call("verify", verifier.verify_live, tokens, parents, depth, anc)
            else:
                path, *new = self._call("verify", self._verify, tokens, parents, depth, anc, *state)
        else:
            def host():
                p, acc, bon, feats = verifier.verify_host(tokens, parents, depth, anc, scores)
                return (p,) + verifier.commit_fn(tokens, depth, p, acc, bon, feats, *state)
            path, *new = self._call("verify", host)
        if values is None:
            if self.backend == "cuda-graphs":  # a replay's outputs are overwritten by the next replay
                path, new = path.clone(), [t.clone() if t is not None else None for t in new]
            st.seq_len, st.root, st.n_new, st.new_tokens, st.new_features, readout = new
            values = self.read_back(readout)
        if self.drafter is not None:
            self.drafter.verified(max(v[0] for v, s in zip(values, self.rows.slots) if s is not None))
        return path, values

    @torch.no_grad()
    def step(self) -> list[tuple[int, list[int], int]]:
        """One cycle for every row: plan, propose, verify (accept, commit), learn. Returns, per busy
        row, (row, tokens it produced, draft tokens accepted), before stop handling."""
        t0 = time.perf_counter()
        if not self.fixed:  # room for the longest row and its tree (doubling, `ensure_capacity`)
            self.rows.ensure_capacity(max(self.rows.host_len) + 1)
        if self.sources is not None:
            self.sources.last = []
        plan, free = self._plan()
        tokens, parents, depth, anc, scores = self._propose(plan, free)
        t1 = time.perf_counter()
        path, values = self._verify_commit(tokens, parents, depth, anc, scores)
        t2 = time.perf_counter()
        n = tokens.shape[1]
        tail, self.tail_s = self.tail_s, 0.0
        self.last = {"tree": n, "arm": plan.arm, "draft_s": t1 - t0 + tail, "verify_s": t2 - t1, "busy": self.rows.busy, "batch": self.rows.batch}
        out = []
        for i, s in enumerate(self.rows.slots):
            if s is None:
                continue
            a, deepest = values[i][0], values[i][1]
            self.rows.host_len[i] += a + 1
            s.summary.record_cycle(a, n, deepest, t1 - t0, t2 - t1)
            out.append((i, values[i][2 : 3 + a], a))
        self._learn(plan, free, values, n, t1 - t0 + tail, t2 - t1)
        if scores is not None and self.record_confidence:
            self.rows.observe(scores, path)
        self.tail_s = time.perf_counter() - t2
        return out

    def _learn(self, plan: Plan, free, values, n: int, draft_s: float, verify_s: float) -> None:
        """What the cycle teaches: every grown node whose fate the emitted tokens decide (the
        acceptance estimate), its costs, and in the head's cycles what the alternative would have
        made (the tokens the target emitted decide every head-free node: sources.tokens_taken)."""
        busy = [i for i, s in enumerate(self.rows.slots) if s is not None]
        emitted = [values[i][2 : 3 + values[i][0]] for i in busy]
        nodes = []
        if self.sources is not None and self.sources.last:
            nodes = self.sources.observe(busy, [self.rows.slots[i].summary for i in busy], n, emitted)
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
        self.n_max, self.speculative = n, n > 1 and self.rows.hcache is not None
        if self.drafter is not None:
            self.drafter.n_max = n
        pending = self.rows.state.new_tokens
        self.step()
        if n == 1:
            self.rows.state.new_tokens = pending
        return self.last
