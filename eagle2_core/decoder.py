"""The EAGLE-2 decoding loop: draft a tree, verify it in one target forward, accept, repeat.

Everything here runs the stock transformers forward of the target: the tree goes in as a 4D
additive attention mask plus `position_ids` (depth), on a preallocated cache we hand the model
as its own `Cache`. No modeling file is patched, so any decoder-only architecture works.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .accept import accept_greedy, accept_sampling_keyed, first_token, generation_seed, position_uniforms
from .budget import BudgetChooser, on_accepted_path
from .drafter import Drafter
from .events import GenerationSettings, StepEvent, StopChecker, Summary, collect
from .kvcache import TreeKVCache, num_cache_layers
from .sampling import TargetProcessors
from .target import TargetRunner
from .treesettings import TreeSettings


class Eagle2Decoder:
    """`graph=True` runs each cycle in graph mode: fixed shapes on static buffers (`graphcycle.py`, the
    GPU path); `compile` captures those cycle functions (torch.compile; `graphcycle.py`). The loop is the same."""

    def __init__(self, model, head, tokenizer=None, tree: TreeSettings | None = None, costs=None, record_confidence: bool = False,
                 graph: bool = False, compile: str | None = None):
        self.runner = TargetRunner(model)
        self.head = head
        self.tokenizer = tokenizer
        self.tree = tree or TreeSettings.for_device(self.runner.device, self.runner.dtype)
        if self.tree.budget == "auto" and costs is None:
            from .costs import load_or_measure

            costs = load_or_measure(model, head)  # cached per machine, model, dtype and threads
        self.costs = costs
        self.record_confidence = record_confidence  # bin nodes by confidence vs acceptance (compare asks; chat and generate need not)
        self.graph = graph or compile is not None
        self.compile = compile          # None, or a torch.compile backend ("inductor", "cudagraphs", "aot_eager")
        self.capture_failure = None     # why capture was turned off (graphcycle.py), which also sets compile to None
        self._graph = None              # the GraphCycle (static buffers, captured functions), reused while it fits
        # Greedy acceptance's lm_head plan, from this machine's measured costs (once, here, not in a
        # cycle): all tree rows in one product where that costs no more than the two-pass plan (a
        # GPU; rowgemm's float32 products; bf16 with AMX or AVX512-BF16), else internal rows first.
        if self.runner.device.type == "cpu" and self.costs is None:
            from .costs import load_or_measure

            self.costs = load_or_measure(model, head)
        self._one_product = self.runner.device.type != "cpu" or self.costs.rows_are_cheap(self.tree.total_tokens)
        self.chooser = None  # the per-cycle budget's state, kept across generations (budget.BudgetChooser)
        if self.tree.budget == "auto" and self.tree.shape == "dynamic":
            self.chooser = BudgetChooser(self.costs, self.tree.total_tokens, self.costs.draft_step_ms(self.tree.top_k))

    @property
    def lm_head_in_one_product(self) -> bool:
        return self._one_product

    def _cycle(self, cap: int):
        if not self.graph:
            return EagerCycle(self, cap)
        if self._graph is None or not self._graph.fits(cap):
            from .graphcycle import GraphCycle

            self._graph = GraphCycle(self, cap)
        return self._graph

    @torch.no_grad()
    def stream(self, prompt_ids, gen: GenerationSettings | None = None) -> Iterator[StepEvent | Summary]:
        gen = gen or GenerationSettings()
        run, dev = self.runner, self.runner.device
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).view(-1)
        eos = run.eos_ids(gen, self.tokenizer)
        stop = StopChecker(gen, self.tokenizer, eos, run.max_positions, ids.numel())
        # what generate() applies to the target's logits, in its order; nothing at all by default
        procs = TargetProcessors(gen, getattr(run.model, "generation_config", None), ids, eos,
                                 max(0, min(gen.max_new_tokens, run.max_positions - ids.numel())), dev)
        # sampling: one uniform per output position from (seed, position), as batched.py draws them,
        # so a seeded answer is the same at every batch size and tree size (accept.accept_sampling_keyed)
        seed = generation_seed(gen.seed) if procs.sampling else None
        cap = min(run.max_positions, ids.numel() + gen.max_new_tokens) + self.tree.total_tokens + self.tree.depth + 8
        cycle = self._cycle(cap)
        summary = Summary(prompt_tokens=ids.numel())
        t0 = time.perf_counter()

        # Prefill: the target reads the prompt and picks the first token itself (the first root).
        with cycle.session():
            root = cycle.prefill(ids, lambda logits: self._pick(procs.scores(logits, ids[None]), seed))
            history = ids  # every token before the root: what tree_scores extends along each path
            summary.target_forwards, summary.prefill_s = 1, time.perf_counter() - t0
            emitted = stop.push([root])
            yield StepEvent(emitted, accepted=0, tree_size=1, draft_s=0.0, verify_s=summary.prefill_s)

            while not stop.done:
                t1 = time.perf_counter()
                # remaining counts both max_new_tokens and the context limit; the bonus token needs one.
                tree = cycle.draft(stop.remaining - 1)
                t2 = time.perf_counter()
                # Verify (paper section 3): all tree nodes in one forward, then accept and commit.
                # each node's scores with its own history (sampling.TargetProcessors.tree_scores)
                score = (lambda logits, nodes=None, _t=tree, _h=history: procs.tree_scores(logits, _h, _t, nodes)) if procs.active else None
                if procs.sampling:
                    # uniforms of the positions after the root's (stop.count tokens emitted so far), one per depth
                    uniforms = position_uniforms(seed, stop.count, int(tree.depth[-1]) + 1)  # nodes are in depth order
                    accepted, deepest, new_tokens = cycle.verify_sampling(tree, score or (lambda logits, nodes=None: logits), uniforms)
                elif score is not None:
                    accepted, deepest, new_tokens = cycle.verify_greedy(tree, score)
                else:
                    accepted, deepest, new_tokens = cycle.verify_greedy(tree)
                if procs.reads_history:
                    history = torch.cat([history, torch.tensor([root] + new_tokens[:-1], dtype=torch.long, device=dev)])
                root = new_tokens[-1]
                t3 = time.perf_counter()
                summary.record_cycle(accepted, tree.size, deepest, t2 - t1, t3 - t2)
                if self.record_confidence:
                    summary.record_confidence(tree, cycle.last_path[: accepted + 1])
                if self.chooser is not None and tree.scores is not None:
                    self.chooser.observe(tree.scores[1:].exp(), on_accepted_path(tree, cycle.last_path[: accepted + 1]),
                                         1000 * (t2 - t1), 1000 * (t3 - t2), cycle.drafter.steps)
                emitted = stop.push(new_tokens)
                yield StepEvent(emitted, accepted=accepted, tree_size=tree.size, draft_s=t2 - t1, verify_s=t3 - t2)

        summary.finish(stop, time.perf_counter() - t0)
        yield summary

    @staticmethod
    def _pick(scores, seed: int | None) -> int:
        """The answer's first token: the argmax of the processed scores, or (seed given: sampling)
        the draw of output position 0, as every decoder does (accept.first_token)."""
        if seed is None:
            return int(scores.argmax(-1)[0])
        return first_token(scores[0], seed)

    def generate(self, prompt_ids, gen: GenerationSettings | None = None) -> tuple[list[int], Summary]:
        return collect(self.stream(prompt_ids, gen))


class EagerCycle:
    """One generation's cycles on growable caches addressed by host-side lengths.

    Shapes follow the tree and the accepted path, and lm_head work is spent only where an
    argmax is needed; the cost is a few host reads per cycle, which a CPU does not notice.
    """

    def __init__(self, dec: Eagle2Decoder, cap: int):
        self.dec, self.run, self.head = dec, dec.runner, dec.head
        self.cache = TreeKVCache(num_cache_layers(self.run.model.config), cap)
        self.drafter = Drafter(dec.head, dec.tree, cap, dec.chooser)
        self.layers = dec.head.feature_layers  # what the head reads: last hidden state, or EAGLE-3's fused layers
        self.last_path = None

    @contextmanager
    def session(self):
        yield

    def prefill(self, ids, pick) -> int:
        dev = ids.device
        hidden, features = self.run.forward_features(ids, torch.arange(ids.numel(), device=dev), None, self.cache, self.layers)
        self.root = pick(self.run.logits(hidden[-1:]))
        self.new_tokens = torch.cat([ids[1:], torch.tensor([self.root], device=dev)])  # pairs (f_t, x_{t+1})
        self.new_features, self.start_pos = features, 0
        return self.root

    def draft(self, max_depth: int):
        return self.drafter.draft(self.new_tokens, self.new_features, self.start_pos, torch.tensor(self.root, device=self.run.device),
                                  budget=self.dec.tree.total_tokens, max_depth=max_depth)

    def _forward(self, tree):
        self.past = self.cache.length  # committed tokens; the root sits at position `past`
        return self.run.forward_features(tree.tokens, self.past + tree.depth, self.run.tree_mask(tree, self.past), self.cache, self.layers)

    def verify_greedy(self, tree, score=None):
        """`score(logits, nodes)`: the target's processors for those tree nodes (None: none apply)."""
        hidden, features = self._forward(tree)
        path, bonus = self._accept_greedy(tree, hidden, score)
        return self._commit(tree, features, path, bonus)

    def verify_sampling(self, tree, score, uniforms: list[float]):
        """`uniforms[d]`: the uniform of the token after the depth-d node (accept.accept_sampling_keyed)."""
        hidden, features = self._forward(tree)
        path, bonus = accept_sampling_keyed(tree, torch.softmax(score(self.run.logits(hidden)).float(), dim=-1), uniforms)
        return self._commit(tree, features, path, bonus)

    def _commit(self, tree, features, path: list[int], bonus: int):
        dev = self.run.device
        path_t = torch.tensor(path, device=dev)
        self.cache.keep(self.past, path_t)  # accepted nodes' KV move into place; the rest is dropped
        self.new_tokens = torch.cat([tree.tokens[path_t[1:]], torch.tensor([bonus], device=dev)])
        self.new_features, self.start_pos, self.root, self.last_path = features[path_t], self.past, bonus, path_t
        deepest = int(tree.depth[-1]) if tree.size > 1 else 0  # nodes are in depth order
        return len(path) - 1, deepest, self.new_tokens.tolist()

    def _argmax(self, hidden, score=None, nodes=None):
        logits = self.run.logits(hidden)
        return (logits if score is None else score(logits, nodes)).argmax(-1)

    def _accept_greedy(self, tree, hidden, score=None) -> tuple[list[int], int]:
        """Greedy acceptance with lm_head applied only where an argmax is needed.

        Children are checked against their parent's argmax, so only nodes with children need
        logits up front; a leaf needs them only when the accepted path ends there (one more row).
        On a small model lm_head is a large share of the verify cost, and about half the nodes
        of a tree are leaves. Where extra rows are nearly free that second pass over lm_head's
        weights would cost more than it saves, so all rows go in one product; which case holds is
        measured (`Eagle2Decoder.lm_head_in_one_product`). With processors (`score`), the rows
        computed are processed with their own nodes' histories, the same plan either way.
        """
        if self.dec.lm_head_in_one_product:
            return accept_greedy(tree, self._argmax(hidden, score))
        internal = torch.zeros(tree.size, dtype=torch.bool, device=tree.tokens.device)
        internal[tree.parents[1:]] = True
        rows = torch.nonzero(internal).flatten()
        argmax = torch.full((tree.size,), -1, dtype=torch.long, device=tree.tokens.device)
        argmax[rows] = self._argmax(hidden[rows], score, rows)
        path, bonus = accept_greedy(tree, argmax)
        if bonus < 0:  # the path ends at a leaf
            bonus = int(self._argmax(hidden[path[-1] : path[-1] + 1], score, torch.tensor([path[-1]], device=hidden.device)))
        return path, bonus
