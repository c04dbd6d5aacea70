"""Running a comparison: every method on the same prompts in one process after a warm-up, and
the short reference run the chat's speedup estimate is measured against. No terminal code here.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from .events import GenerationSettings, Summary
from .methods import Decoder
from .prompts import PromptItem, apply_overrides
from .stats import Comparison, MethodRun


def split_by_context(runtime, items: list[PromptItem]) -> tuple[list[PromptItem], list[tuple[PromptItem, int]]]:
    """(items whose first turn fits the model's context, [(item, prompt tokens)] of those that don't)."""
    fit, too_long = [], []
    for it in items:
        n = len(runtime.encode(it.messages))
        (fit.append(it) if n < runtime.max_positions else too_long.append((it, n)))
    return fit, too_long


def run_comparison(methods: dict[str, tuple[Decoder, bool]], items: list[PromptItem], encode: Callable[[list[dict]], list[int]],
                   gen: GenerationSettings, baseline: str | None = "vanilla", warmup_tokens: int = 8,
                   on_step: Callable[[str, int, PromptItem | None], None] | None = None, settings: dict | None = None,
                   model=None, tokenizer=None) -> Comparison:
    """Run each method (name -> (decoder, speculative?)) on each item's first turn, after a warm-up.

    Methods alternate per prompt, so slow drifts (thermal, other load) hit them alike.
    `on_step(phase, index, item)` reports progress: phase "warmup" or "prompt", then "explain"
    while greedy differences are measured. `model` (the target): each greedy answer that differs
    from the baseline's gets its logit gap and near-tie verdict (divergence.py).
    """
    encoded = [encode(it.messages) for it in items]
    runs = {name: MethodRun(name, speculative=spec) for name, (_, spec) in methods.items()}
    if encoded and warmup_tokens > 0:
        if on_step:
            on_step("warmup", 0, None)
        wg = dataclasses.replace(gen, max_new_tokens=warmup_tokens)
        for dec, _ in methods.values():
            dec.generate(encoded[0], wg)
    whole = {name for name, (dec, _) in methods.items()  # batched: all prompts at once
             if hasattr(dec, "generate_many") and not getattr(dec, "per_prompt", False)}
    for i, (item, ids) in enumerate(zip(items, encoded)):
        g = apply_overrides(gen, item.overrides)
        for name, (dec, _) in methods.items():
            if name in whole:
                continue
            tokens, summary = dec.generate(ids, g)
            runs[name].outputs.append(tokens)
            runs[name].summaries.append(summary)
        if on_step:
            on_step("prompt", i + 1, item)
    for name in whole:
        dec = methods[name][0]
        for tokens, summary in dec.generate_many(encoded, [apply_overrides(gen, it.overrides) for it in items]):
            runs[name].outputs.append(tokens)
            runs[name].summaries.append(summary)
        runs[name].plan = getattr(dec, "plan", None)
    for name, (dec, _) in methods.items():
        runs[name].backend_used = backend_used(dec)
    if encoded and not gen.temperature:
        for name, (dec, spec) in methods.items():
            runs[name].ops_per_cycle = ops_per_cycle(dec, encoded[0], gen) if spec else None
    comp = Comparison(items, runs, gen, baseline, settings or {})
    if model is not None:
        explain_differences(comp, encoded, model, tokenizer, on_step)
    return comp


def explain_differences(comp: Comparison, encoded: list[list[int]], model, tokenizer=None, on_step=None) -> None:
    """comp.divergences[method][item id]: why each greedy answer that differs from the reference's
    does (divergence.py). The float32 copy of the model is made once, only if something differs,
    and methods that part from the reference at the same token the same way share one measurement."""
    from .divergence import explain, float32_copy

    if not comp.greedy or comp.reference is None or comp.int8:  # in int8 a difference has no rounding to explain it
        return
    base = comp.runs[comp.reference].outputs
    index = {str(item.id): i for i, item in enumerate(comp.items)}
    model32, why, seen = None, None, {}
    for name in comp.runs:
        for item, tok in comp.differences(name):
            i = index[str(item.id)]
            got = comp.runs[name].outputs[i]
            key = (i, tok, got[tok] if tok < len(got) else None)
            if key not in seen:
                if model32 is None and why is None:
                    if on_step:
                        on_step("explain", 0, None)
                    model32, why = float32_copy(model)
                seen[key] = explain(model, encoded[i], base[i], got, tok, apply_overrides(comp.gen, item.overrides),
                                    tokenizer, model32, why)
            comp.divergences.setdefault(name, {})[str(item.id)] = seen[key]


def backend_used(dec) -> str | None:
    """What actually ran a speculative decoder's cycles: its torch.compile backend ("inductor",
    "cuda-graphs"), "eager", or "eager (capture failed: ...)" when the engine fell back; None for
    decoders that are not ours (plain `generate`)."""
    if not hasattr(dec, "capture_failure"):
        return None
    if dec.capture_failure:
        return f"eager (capture failed: {dec.capture_failure})"
    return dec.compile or "eager"


def ops_per_cycle(dec, ids: list[int], gen: GenerationSettings, cycles: int = 4) -> dict | None:
    """Mean aten ops per steady-state cycle, to draft and to verify, and the host reads among them:
    what a GPU would launch and wait for, counted on any machine. Not for captured decoders,
    whose compiled kernels bypass the dispatcher (they run the fixed mode's ops, fused)."""
    from .engine import Engine
    from .opcount import cycle_ops

    if getattr(dec, "compile", None) or not isinstance(dec, Engine):
        return None
    r = cycle_ops(dec, ids, dataclasses.replace(gen, max_new_tokens=max(gen.max_new_tokens, 64)), cycles=cycles)
    if not r:
        return None
    mean = lambda k: round(statistics.fmean(c[k] for c in r), 1)  # noqa: E731
    return {"draft": mean("draft_ops"), "verify": mean("verify_ops"),
            "host_reads": round(statistics.fmean(sum(len(v) for v in c["host_reads"].values()) for c in r), 1), "cycles": len(r)}


BASELINE_MESSAGES = [{"role": "user", "content": "Write a few sentences about the history of the printing press."}]


def measure_baseline(vanilla, eagle, encode: Callable[[list[dict]], list[int]], gen: GenerationSettings, tokens: int = 32) -> Summary:
    """A short vanilla run (after a tiny warm-up) for the chat speedup estimate, then a tiny
    warm-up of the EAGLE-2 decoder for the first answer. The decoder's caches are made after the
    vanilla runs, not before them, so `generate`'s own transients (its cache, each weight rebuilt
    for it) never add to them: that sum was the peak memory of a chat's start-up."""
    ids = encode(BASELINE_MESSAGES)
    warm = dataclasses.replace(gen, max_new_tokens=2)
    vanilla.generate(ids, warm)
    _, summary = vanilla.generate(ids, dataclasses.replace(gen, max_new_tokens=max(1, tokens)))
    if eagle is not None:
        eagle.generate(ids, warm)
    return summary
