"""The EAGLE-2 decoding loop: draft a tree, verify it in one target forward, accept, repeat.

Everything here runs the stock transformers forward of the target: the tree goes in as a 4D
additive attention mask plus `position_ids` (depth), on a preallocated cache we hand the model
as its own `Cache`. No modeling file is patched, so any decoder-only architecture works.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .accept import accept_greedy, accept_sampling
from .drafter import Drafter, TreeSettings
from .events import GenerationSettings, StepEvent, StopChecker, Summary, collect
from .kvcache import TreeKVCache, num_cache_layers
from .sampling import make_warpers, target_probs
from .target import TargetRunner


class Eagle2Decoder:
    def __init__(self, model, head, tokenizer=None, tree: TreeSettings | None = None, costs=None, calibration: bool = False):
        self.runner = TargetRunner(model)
        self.head = head
        self.tokenizer = tokenizer
        self.tree = tree or TreeSettings.for_device(self.runner.device, self.runner.dtype)
        if self.tree.budget == "auto" and costs is None:
            from .costs import load_or_measure

            costs = load_or_measure(model, head)  # cached per machine, model, dtype and threads
        self.costs = costs
        self.calibration = calibration  # bin nodes by confidence vs acceptance (compare asks; chat and generate need not)

    @torch.no_grad()
    def stream(self, prompt_ids, gen: GenerationSettings | None = None) -> Iterator[StepEvent | Summary]:
        gen = gen or GenerationSettings()
        run, dev = self.runner, self.runner.device
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).view(-1)
        stop = StopChecker(gen, self.tokenizer, run.eos_ids(gen, self.tokenizer), run.max_positions, ids.numel())
        warpers = make_warpers(gen)
        rng = torch.Generator().manual_seed(gen.seed) if gen.seed is not None else None
        cap = min(run.max_positions, ids.numel() + gen.max_new_tokens + self.tree.total_tokens + 8)
        cache = TreeKVCache(num_cache_layers(run.model.config), cap)
        drafter = Drafter(self.head, self.tree, cap, self.costs)
        summary = Summary(prompt_tokens=ids.numel())
        t0 = time.perf_counter()

        # Prefill: the target reads the prompt and picks the first token itself (the first root).
        layers = self.head.feature_layers  # what the head reads: last hidden state, or EAGLE-3's fused layers
        hidden, features = run.forward_features(ids, torch.arange(ids.numel(), device=dev), None, cache, layers)
        root = self._pick(run.logits(hidden[-1:]), warpers, rng)[0]
        summary.target_forwards, summary.prefill_s = 1, time.perf_counter() - t0
        emitted = stop.push([root])
        yield StepEvent(emitted, accepted=0, tree_size=1, draft_s=0.0, verify_s=summary.prefill_s)
        new_tokens = torch.cat([ids[1:], torch.tensor([root], device=dev)])  # pairs (f_t, x_{t+1})
        new_features, start_pos = features, 0

        while not stop.done:
            t1 = time.perf_counter()
            past = cache.length  # committed tokens; the root sits at position `past`
            # remaining counts both max_new_tokens and the context limit; the bonus token needs one.
            tree = drafter.draft(new_tokens, new_features, start_pos, torch.tensor(root, device=dev),
                                 budget=self.tree.total_tokens, max_depth=stop.remaining - 1)
            t2 = time.perf_counter()
            # Verify (paper section 3): all tree nodes in one forward; node i at position past + depth(i).
            hidden, features = run.forward_features(tree.tokens, past + tree.depth, run.tree_mask(tree, past), cache, layers)
            if gen.temperature > 0:
                path, bonus = accept_sampling(tree, target_probs(run.logits(hidden), warpers), rng)
            else:
                path, bonus = self._accept_greedy(tree, hidden)
            path_t = torch.tensor(path, device=dev)
            cache.keep(past, path_t)  # accepted nodes' KV move into place; the rest is dropped
            t3 = time.perf_counter()
            summary.record_cycle(len(path) - 1, tree, t2 - t1, t3 - t2)
            if self.calibration:
                summary.record_calibration(tree, path_t)
            new_tokens = torch.cat([tree.tokens[path_t[1:]], torch.tensor([bonus], device=dev)])
            emitted = stop.push(new_tokens.tolist())
            yield StepEvent(emitted, accepted=len(path) - 1, tree_size=tree.size, draft_s=t2 - t1, verify_s=t3 - t2)
            new_features, start_pos, root = features[path_t], past, bonus

        summary.finish(stop, time.perf_counter() - t0)
        yield summary

    def _accept_greedy(self, tree, hidden) -> tuple[list[int], int]:
        """Greedy acceptance with lm_head applied only where an argmax is needed.

        Children are checked against their parent's argmax, so only nodes with children need
        logits up front; a leaf needs them only when the accepted path ends there (one more row).
        On a small model lm_head is a large share of the verify cost, and about half the nodes
        of a tree are leaves. Where extra rows are nearly free (GPU, float32 CPU through
        rowgemm's transposed product, bf16 on AMX) that second pass over lm_head's weights would
        cost more than it saves, so all rows go in one product. The two-row-set plan remains for
        half precision on CPUs without AMX, where a product costs in proportion to its rows.
        """
        if self.runner.rows_cheap:
            return accept_greedy(tree, self.runner.logits(hidden).argmax(-1))
        internal = torch.zeros(tree.size, dtype=torch.bool, device=tree.tokens.device)
        internal[tree.parents[1:]] = True
        rows = torch.nonzero(internal).flatten()
        argmax = torch.full((tree.size,), -1, dtype=torch.long, device=tree.tokens.device)
        argmax[rows] = self.runner.logits(hidden[rows]).argmax(-1)
        path, bonus = accept_greedy(tree, argmax)
        if bonus < 0:  # the path ends at a leaf
            bonus = int(self.runner.logits(hidden[path[-1] : path[-1] + 1]).argmax(-1))
        return path, bonus

    def _pick(self, logits, warpers, rng) -> list[int]:
        if warpers is None:
            return logits.argmax(-1).tolist()
        probs = target_probs(logits, warpers)
        return torch.multinomial(probs.float().cpu(), 1, generator=rng).flatten().tolist()

    def generate(self, prompt_ids, gen: GenerationSettings | None = None) -> tuple[list[int], Summary]:
        return collect(self.stream(prompt_ids, gen))
