"""The methods a comparison runs (`eagle2 compare --against`): vanilla `generate`, EAGLE-2 with the
runtime's settings, and the baselines, each built from a `Runtime` as a decoder.
"""
from __future__ import annotations

import dataclasses
import re

Decoder = object  # anything with .generate(prompt_ids, GenerationSettings) -> (tokens, Summary)
BASELINES = ("pld", "sps", "static", "chain", "auto", "graph", "compiled", "generate-compiled",
             "plain-float32")  # plus tree:N/D/K, auto:N/D/K, batch:B[xN]
RENAMED = {"fixed": "graph"}  # old method names, still accepted with a notice
PLD_TOKENS = 10


def parse_tree_spec(name: str) -> tuple[int, int, int] | None:
    """`tree:6/3/2` or `auto:16/3/4` -> (total_tokens, depth, top_k); None if not a tree spec.
    `auto:` trees choose their size every cycle, up to the first number (policy.py)."""
    m = re.fullmatch(r"(?:tree|auto):(\d+)/(\d+)/(\d+)", name)
    return tuple(int(g) for g in m.groups()) if m else None


from .stats import PLAIN  # eagle2's own plain decoding: the engine with a one-node tree, same kernels, no draft


def build_methods(runtime, against=(), vanilla: bool = True, assistant_model=None, batch_size: int | None = None,
                  plain: bool | None = None) -> dict[str, tuple[Decoder, bool]]:
    """name -> (decoder, speculative?) for a comparison: vanilla HF generate, EAGLE-2, and extra baselines:
    pld (HF prompt lookup, 10 tokens), sps (HF assisted generation with `assistant_model`), static/chain
    (our EAGLE-1 tree and chain draft shapes with the same head), tree:N/D/K (the dynamic tree with another
    budget: total tokens / depth / top-k), so tree sizes can be swept against one shared baseline; graph and
    compiled (EAGLE-2 in fixed mode, uncaptured and captured: cycle.py), generate-compiled (HF generate
    with a static cache and torch.compile, the strongest plain decoding transformers offers).
    `plain` (None: on where the target runs on a CPU): eagle2's own plain decoding, so a speedup
    splits into kernels alone (plain over generate) and speculation alone (eagle2 over plain)."""
    methods: dict[str, tuple[Decoder, bool]] = {}
    if vanilla:
        methods["vanilla"] = (runtime.vanilla(), False)
    if plain is None:
        plain = runtime.model.get_output_embeddings().weight.device.type == "cpu"
    if plain:
        methods[PLAIN] = (BatchedEagle(runtime, 1, 1), False)
    # --batch-size N: the eagle2 row is the batched decoder at N sequences (the tree chosen by cost)
    methods["eagle2"] = (BatchedEagle(runtime, batch_size) if batch_size else runtime.eagle(record_confidence=True), True)
    constant_tree = runtime.constant_tree or runtime.tree
    for name in against:
        if name == "pld":
            methods["pld"] = (runtime.vanilla(prompt_lookup_num_tokens=PLD_TOKENS), False)
        elif name == "sps":
            if assistant_model is None:
                raise ValueError("sps needs an assistant model")
            methods["sps"] = (runtime.vanilla(assistant_model=assistant_model), False)
        elif name == "graph":  # the GPU path's graph mode (fixed shapes, static buffers), uncaptured
            methods[name] = (runtime.eagle(constant_tree, record_confidence=True, compile=False, graph=True), True)
        elif name == "compiled":  # the same, captured (CUDA graphs on a GPU, inductor on a CPU)
            methods[name] = (runtime.eagle(constant_tree, record_confidence=True, compile=True), True)
        elif name == "generate-compiled":  # HF generate with a static cache and torch.compile
            methods[name] = (runtime.vanilla(compiled=True), False)
        elif name == "plain-float32":  # eagle2's plain decoding over float32 weights beside the blocks
            methods[name] = (FloatWeights(BatchedEagle(runtime, 1, 1)), False)
        elif name in ("static", "chain"):
            methods[name] = (runtime.eagle(dataclasses.replace(constant_tree, shape=name), record_confidence=True), True)
        elif name == "auto":  # the drafting policy as `--total-tokens auto` sets it up
            methods[name] = (runtime.eagle(runtime.auto_tree, record_confidence=True), True)
        elif (spec := parse_tree_spec(name)) is not None:
            tree = dataclasses.replace(constant_tree, shape="dynamic", total_tokens=spec[0], depth=spec[1], top_k=spec[2],
                                       budget="auto" if name.startswith("auto:") else "constant")
            tree.validate()
            methods[name] = (runtime.eagle(tree, record_confidence=True), True)
        elif name.startswith("sources:"):  # the same engine drafting from other sources (sources.py): sources:head, sources:recycle+match
            from .sources import parse_sources

            methods[name] = (runtime.eagle(record_confidence=True, sources=parse_sources(name[8:].replace("+", ","),
                                                                                         runtime.head is not None)), True)
        elif (bspec := parse_batch_spec(name)) is not None:  # eagle2 batched: batch:auto, batch:B, batch:BxN (N = 1: plain)
            methods[name] = (BatchedEagle(runtime, *bspec), True)
        else:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}, tree:N/D/K, auto:N/D/K, batch:B[xN] "
                             "or sources:A+B")
    return methods


class FloatWeights:
    """A decoder run with the target's float32 weights back where it holds blocks only, on the
    float32 stream kernel (rowgemm.float32_weights); the rebuilding is outside its timing."""

    def __init__(self, decoder):
        self.decoder = decoder

    def generate(self, prompt_ids, gen):
        from .rowgemm import float32_weights

        with float32_weights():
            return self.decoder.generate(prompt_ids, gen)


def share_wall(summaries: list, wall: float) -> None:
    """Batched methods answer all prompts in one run: each summary gets the run's wall time in
    proportion to its tokens, so a method's tokens/s is its total tokens over the run's time."""
    total = sum(s.new_tokens for s in summaries)
    for s in summaries:  # no tokens at all: an even split
        s.wall_s = wall * (s.new_tokens / total if total else 1 / len(summaries))


class BatchedEagle:
    """eagle2's batched decoder as a comparison method (`compare --batch-size N`, `--against batch:...`):
    the whole prompt list through `Runtime.batch_decoder`, continuous batching included.
    `batch`/`tree` None: chosen from this machine's measured costs."""

    speculative = True

    def __init__(self, runtime, batch: int | None = None, tree: int | None = None):
        self.runtime, self.batch, self.tree_tokens = runtime, batch, tree
        self.plan: dict = {}
        self.stats: dict = {}
        # What ran (compare's backend_used): batched rows run live (uncaptured); at batch 1 the
        # runtime's own engine, with its backend and capture failure.
        self.compile, self.capture_failure = None, None
        self._single = None

    @property
    def per_prompt(self) -> bool:
        """One sequence, no tree (`plain`): compare runs it prompt by prompt, interleaved with the
        other methods like `generate`, each answer timed on its own."""
        return self.batch == 1 and self.tree_tokens == 1

    def generate(self, ids, gen):
        if not self.per_prompt:
            return self.generate_many([ids], [gen])[0]
        import collections

        from .engine import Request

        if self._single is None:  # built once: its end-of-turn ids are read from the tokenizer once
            from .target import model_eos_ids

            self._single, self.plan = self.runtime.batch_decoder(1, 1, 1)
            self._single.eos_ids = model_eos_ids(self.runtime.model, self.runtime.tokenizer)
        out = {}
        self._single.run(collections.deque([Request(0, ids, gen)]), lambda k, toks, s: out.__setitem__(k, (toks, s)))
        return out[0]

    def generate_many(self, ids_list: list[list[int]], gens: list) -> list:
        import collections
        import time

        from .engine import Request

        dec, self.plan = self.runtime.batch_decoder(len(ids_list), self.batch, self.tree_tokens, record_confidence=True)
        out = {}
        t0 = time.perf_counter()
        if dec is None:  # batch 1 with a tree: the per-prompt decoder
            d = self.runtime.eagle(record_confidence=True)
            for i, (ids, g) in enumerate(zip(ids_list, gens)):
                out[i] = d.generate(ids, g)
            self.compile, self.capture_failure = d.compile, d.capture_failure
        else:
            dec.run(collections.deque(Request(i, ids, g) for i, (ids, g) in enumerate(zip(ids_list, gens))),
                    lambda k, toks, s: out.__setitem__(k, (toks, s)))
            self.stats = dec.stats
        wall = time.perf_counter() - t0
        res = [out[i] for i in range(len(ids_list))]
        share_wall([s for _, s in res], wall)
        return res


def parse_batch_spec(name: str) -> tuple[int | None, int | None] | None:
    """`batch:auto` -> (None, None); `batch:8` -> (8, None); `batch:8x1` -> (8, 1); None if not a batch spec."""
    m = re.fullmatch(r"batch:(auto|\d+)(?:x(\d+))?", name)
    if not m:
        return None
    return (None if m.group(1) == "auto" else int(m.group(1))), (int(m.group(2)) if m.group(2) else None)
