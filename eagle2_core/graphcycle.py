"""The decoding cycle in graph mode (fixed shapes on static buffers), and its capture (the GPU path).

At batch size 1 a GPU spends a small model's cycle mostly on the host: launching each of a few
thousand kernels and waiting for values the Python loop reads back. The systems that are fast
there (SGLang; see docs/gpu.md) run a cycle as a few graph replays. This is the same cycle as
`decoder.EagerCycle`, written so it can be captured:

  * fixed shapes: the tree always has `total_tokens` nodes (the candidate pool, top_k +
    (depth-1)·top_k², is larger than any budget, so rerank never comes up short), the newly
    committed pairs are padded to depth + 1 rows, and both caches are static buffers of one
    capacity whose masks always span it;
  * device-side state: the committed length, the root and the new pairs live on the device; the
    cache writes go to slots computed there, and accepted KV is committed by one fixed-size
    gather/scatter of depth + 1 rows (`StaticKVCache.commit`);
  * one host read per greedy cycle: (accepted, deepest depth, accepted tokens + bonus), which
    streaming and the stop checks need. Nothing else in `draft` or `verify` reads the device.

So `torch.compile(fullgraph=True)` captures each of the two functions whole (with
mode="reduce-overhead" on CUDA, as CUDA graphs). Sampling keeps its host-side acceptance walk
(accept.accept_sampling_keyed, the position-keyed rule of every decoder) between the two,
uncaptured; so does greedy verification when the target has logits processors (repetition
penalty, ...: sampling.TargetProcessors, host-side per depth).
"""
from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager

import torch

from .accept import accept_greedy_graph, accept_sampling_keyed, path_tensor
from .drafter import Drafter
from .kvcache import StaticKVCache, num_cache_layers
from .rowgemm import row_linears
from .target import capture_layer_inputs
from .tree import DraftTree

MIN_CAPACITY = 512  # static buffers come in powers of two from here: a new capture (and compile) per doubling only


def _compile(fn, backend: str):
    """torch.compile a cycle function whole. `backend`: "inductor", "aot_eager", or "cuda-graphs"
    (inductor with mode="reduce-overhead": the function replays as one CUDA graph)."""
    if backend == "cuda-graphs":
        return torch.compile(fn, backend="inductor", mode="reduce-overhead", fullgraph=True, dynamic=False)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


class GraphCycle:
    """Static buffers for one decoder, reused by every generation that fits their capacity."""

    def __init__(self, dec, cap: int):
        run = dec.runner
        self.dec = dec  # told when capture fails, so the decoder reports what really ran (compare's backend_used)
        self.run, self.head, self.settings = run, dec.head, dec.tree
        self.width = self.settings.depth + 1
        self.capacity = max(MIN_CAPACITY, 1 << (cap - 1).bit_length())
        self.cache = StaticKVCache(num_cache_layers(run.model.config), self.capacity, run.device)
        self.drafter = Drafter(dec.head, self.settings, self.capacity, graph=True)
        self.layers = dec.head.feature_layers
        self.seen: dict = {}  # EAGLE-3: inputs of the fused layers, filled by hooks during our forwards
        self.backend = dec.compile
        self._draft, self._verify = self.draft_fn, self.verify_fn
        if self.backend:
            self._draft, self._verify = _compile(self.draft_fn, self.backend), _compile(self.verify_fn, self.backend)
        self.last_path = None

    def fits(self, cap: int) -> bool:
        return cap <= self.capacity

    @contextmanager
    def session(self):
        """Hooks and few-row products for one generation (not inside the captured functions)."""
        with ExitStack() as stack:
            self.seen = stack.enter_context(capture_layer_inputs(self.run.body, self.layers))
            if not self.backend:  # eager on a CPU: rowgemm's few-row products, as EagerCycle
                stack.enter_context(row_linears(self.run.cpu_linears))
            yield

    # -- the two captured functions: plain tensors in, plain tensors out --------------------
    def draft_fn(self, new_tokens, new_features, start_pos, n_new, root):
        t = self.drafter.draft_graph(new_tokens, new_features, start_pos, n_new, root)
        return t.tokens, t.parents, t.depth, t.ancestors, t.scores

    def _forward(self, tree: DraftTree, seq_len):
        # Nodes past the context limit are verified but never emitted (StopChecker); clamping
        # keeps their position ids in range for models with learned absolute positions.
        positions = (seq_len + tree.depth).clamp(max=self.run.max_positions - 1)
        self.cache.slots = seq_len + torch.arange(tree.size, device=positions.device)
        mask = self.run.static_tree_mask(tree, seq_len, self.capacity)
        return self.run.run_body(tree.tokens, positions, mask, self.cache, self.seen, self.layers)

    def commit_fn(self, tree: DraftTree, features, seq_len, path, accepted, bonus):
        """Accepted KV into place, and the next cycle's state; fixed sizes throughout."""
        w = self.width
        self.cache.commit(seq_len + path, seq_len + torch.arange(w, device=path.device))
        drafted = tree.tokens[path[1:]]                              # path tokens after the root
        slot = torch.arange(w, device=path.device)
        new_tokens = torch.where(slot == accepted, bonus, torch.cat([drafted, bonus.view(1)]))
        new_features = features.index_select(0, path)
        readout = torch.cat([accepted.view(1), tree.depth[-1:], new_tokens])  # the one host read
        return new_tokens, new_features, seq_len + accepted + 1, accepted + 1, readout

    def verify_fn(self, tokens, parents, depth, ancestors, seq_len):
        tree = DraftTree(tokens, parents, depth, ancestors)
        hidden, features = self._forward(tree, seq_len)
        argmax = self.run.logits(hidden).argmax(-1)  # all rows: on a GPU more rows are nearly free
        path, accepted, bonus = accept_greedy_graph(tree, argmax, self.width)
        return (path, bonus) + self.commit_fn(tree, features, seq_len, path, accepted, bonus)

    # -- what the decoder's loop calls -----------------------------------------------------
    def prefill(self, ids, pick) -> int:
        dev, n = ids.device, ids.numel()
        positions = torch.arange(n, device=dev)
        self.cache.slots = positions
        hidden, features = self.run.run_body(ids, positions, self.run.static_causal_mask(positions, self.capacity), self.cache,
                                             self.seen, self.layers)
        root = pick(self.run.logits(hidden[-1:]))
        # The prompt's pairs (f_t, x_{t+1}) go to the head in the first draft, one absorb of the
        # prompt's width (uncaptured); every later cycle absorbs the fixed depth + 1 rows.
        self.root = torch.tensor(root, device=dev)
        self.seq_len = torch.tensor(n, device=dev)
        self.start_pos, self.n_new = torch.tensor(0, device=dev), torch.tensor(n, device=dev)
        self.new_tokens = torch.cat([ids[1:], self.root.view(1)])
        self.new_features = features
        return root

    def draft(self, max_depth: int) -> DraftTree:
        # max_depth is not needed: tokens past the budget or the context limit are verified but
        # never emitted (StopChecker), and the buffers have room for one more tree.
        fn = self._draft if self.new_tokens.shape[0] == self.width else self.draft_fn  # the prompt's absorb is not captured
        out = self._run(fn, self.new_tokens, self.new_features, self.start_pos, self.n_new, self.root)
        return DraftTree(*out)

    def verify_greedy(self, tree: DraftTree, score=None):
        if score is None:
            out = self._run(self._verify, tree.tokens, tree.parents, tree.depth, tree.ancestors, self.seq_len)
        else:  # the target's processors run on the host: the same steps, uncaptured (the draft stays captured)
            out = self._verify_scored(tree, score)
        path, bonus, new_tokens, new_features, seq_len, n_new, readout = out
        values = self.read_back(readout)  # the one host synchronisation of a greedy cycle
        accepted, deepest = values[0], values[1]
        self._advance(path, bonus, new_tokens, new_features, seq_len, n_new)
        return accepted, deepest, values[2 : 3 + accepted]

    def _verify_scored(self, tree: DraftTree, score):
        """`verify_fn` with the target's processors (`score(logits)`, sampling.TargetProcessors) before the argmax."""
        hidden, features = self._forward(tree, self.seq_len)
        argmax = score(self.run.logits(hidden)).argmax(-1)
        path, accepted, bonus = accept_greedy_graph(tree, argmax, self.width)
        return (path, bonus) + self.commit_fn(tree, features, self.seq_len, path, accepted, bonus)

    def verify_sampling(self, tree: DraftTree, score, uniforms: list[float]):
        """`uniforms[d]`: the uniform of the token after the depth-d node (accept.accept_sampling_keyed)."""
        hidden, features = self._forward(tree, self.seq_len)
        path_l, bonus_i = accept_sampling_keyed(tree, torch.softmax(score(self.run.logits(hidden)).float(), dim=-1), uniforms)
        dev = tree.tokens.device
        path, bonus = path_tensor(path_l, self.width, dev), torch.tensor(bonus_i, device=dev)
        new_tokens, new_features, seq_len, n_new, readout = self.commit_fn(tree, features, self.seq_len, path,
                                                                          torch.tensor(len(path_l) - 1, device=dev), bonus)
        values = self.read_back(readout)
        self._advance(path, bonus, new_tokens, new_features, seq_len, n_new)
        return values[0], values[1], values[2 : 2 + len(path_l)]

    @staticmethod
    def read_back(readout: torch.Tensor) -> list[int]:
        """(accepted, deepest depth, tokens...) to the host: the cycle's one designated read."""
        return readout.tolist()

    def _advance(self, path, bonus, new_tokens, new_features, seq_len, n_new):
        self.start_pos, self.seq_len, self.n_new, self.root = self.seq_len, seq_len, n_new, bonus
        self.new_tokens, self.new_features, self.last_path = new_tokens, new_features, path
        if self.backend == "cuda-graphs":
            # A CUDA-graph replay's outputs are overwritten by its next replay: keep copies of
            # what the next cycle reads.
            for name in ("start_pos", "seq_len", "n_new", "root", "new_tokens", "new_features", "last_path"):
                setattr(self, name, getattr(self, name).clone())

    def _run(self, fn, *args):
        if not self.backend or (fn is not self._draft and fn is not self._verify):  # uncaptured
            return fn(*args)
        if self.backend == "cuda-graphs":
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a capture failure falls back to the same functions uncaptured
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
            # Said once: capture is off for good, for this cycle and every later one of the decoder
            # (a larger one built when the prompt outgrows these buffers would only fail again).
            warnings.warn(f"capture failed ({reason}); running the cycle uncaptured", stacklevel=2)
            eager = self.verify_fn if fn is self._verify else self.draft_fn
            self.backend = None
            self.dec.compile, self.dec.capture_failure = None, reason
            self._draft, self._verify = self.draft_fn, self.verify_fn
            return eager(*args)
