"""The methods a comparison runs (`eagle2 compare --against`): vanilla `generate`, EAGLE-2 with the
runtime's settings, and the baselines, each built from a `Runtime` as a decoder.
"""
from __future__ import annotations

import dataclasses
import re

Decoder = object  # anything with .generate(prompt_ids, GenerationSettings) -> (tokens, Summary)
BASELINES = ("pld", "sps", "static", "chain", "auto", "graph", "compiled", "generate-compiled")  # plus tree:N/D/K and auto:N/D/K
RENAMED = {"fixed": "graph"}  # old method names, still accepted with a notice
PLD_TOKENS = 10


def parse_tree_spec(name: str) -> tuple[int, int, int] | None:
    """`tree:6/3/2` or `auto:16/3/4` -> (total_tokens, depth, top_k); None if not a tree spec.
    `auto:` trees choose their size every cycle, up to the first number (budget.py)."""
    m = re.fullmatch(r"(?:tree|auto):(\d+)/(\d+)/(\d+)", name)
    return tuple(int(g) for g in m.groups()) if m else None


def build_methods(runtime, against=(), vanilla: bool = True, assistant_model=None) -> dict[str, tuple[Decoder, bool]]:
    """name -> (decoder, speculative?) for a comparison: vanilla HF generate, EAGLE-2, and extra baselines:
    pld (HF prompt lookup, 10 tokens), sps (HF assisted generation with `assistant_model`), static/chain
    (our EAGLE-1 tree and chain draft shapes with the same head), tree:N/D/K (the dynamic tree with another
    budget: total tokens / depth / top-k), so tree sizes can be swept against one shared baseline; graph and
    compiled (EAGLE-2 in graph mode, uncaptured and captured: graphcycle.py), generate-compiled (HF generate
    with a static cache and torch.compile, the strongest plain decoding transformers offers)."""
    methods: dict[str, tuple[Decoder, bool]] = {}
    if vanilla:
        methods["vanilla"] = (runtime.vanilla(), False)
    methods["eagle2"] = (runtime.eagle(record_confidence=True), True)
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
        elif name in ("static", "chain"):
            methods[name] = (runtime.eagle(dataclasses.replace(constant_tree, shape=name), record_confidence=True), True)
        elif name == "auto":  # the per-cycle budget as `--total-tokens auto` sets it up
            methods[name] = (runtime.eagle(runtime.auto_tree, record_confidence=True), True)
        elif (spec := parse_tree_spec(name)) is not None:
            tree = dataclasses.replace(constant_tree, shape="dynamic", total_tokens=spec[0], depth=spec[1], top_k=spec[2],
                                       budget="auto" if name.startswith("auto:") else "constant")
            tree.validate()
            methods[name] = (runtime.eagle(tree, record_confidence=True), True)
        else:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}, tree:N/D/K or auto:N/D/K")
    return methods
