"""Benchmarks: prompt sets, per-generation metrics, vanilla-vs-EAGLE-2 comparisons, plots.

`run_comparison` runs every method on the same prompts in one process after a warm-up, and a
`Comparison` holds the statistics the CLI table and `--json` show. No terminal code here.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from .events import GenerationSettings, Summary
from .prompts import PromptItem, apply_overrides

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
DATASETS = ("mt-bench", "humaneval")

BUILTIN_PROMPTS = [
    "Give three tips for staying healthy.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what speculative decoding is in two sentences.",
    "List the first ten prime numbers.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "Summarise the plot of Romeo and Juliet in a short paragraph.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
]


# -- prompt sets ----------------------------------------------------------------------------
def builtin_items() -> list[PromptItem]:
    return [PromptItem("id", i, [{"role": "user", "content": p}]) for i, p in enumerate(BUILTIN_PROMPTS)]


def dataset_items(name: str) -> list[PromptItem]:
    """A vendored benchmark as single-turn items: MT-bench first turns (with category), HumanEval prompts."""
    if name == "mt-bench":
        items = []
        with open(os.path.join(DATA_DIR, "mt_bench", "question.jsonl"), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    q = json.loads(line)
                    items.append(PromptItem("question_id", q["question_id"], [{"role": "user", "content": q["turns"][0]}], category=q.get("category")))
        return items
    if name == "humaneval":
        with gzip.open(os.path.join(DATA_DIR, "humaneval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
            return [PromptItem("task_id", p["task_id"], [{"role": "user", "content": p["prompt"]}]) for p in map(json.loads, f) if p]
    raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")


# -- metrics --------------------------------------------------------------------------------
def acceptance_rate(summary: Summary, depth: int) -> float:
    """Share of the drafted depth accepted: the Summary's own rate, or accepted per cycle / depth
    for summaries that did not record tree depths."""
    if summary.depth_sum:
        return summary.acceptance_rate
    if not summary.cycles or depth <= 0:
        return 0.0
    return summary.accepted_per_cycle / depth


def summary_metrics(summary: Summary, depth: int) -> dict:
    """The `metrics` object of a `generate` output line."""
    d = summary.to_dict()
    return {
        "tau": d["tau"], "acceptance_rate": round(acceptance_rate(summary, depth), 4), "verify_steps": d["verify_steps"],
        "new_tokens": d["new_tokens"], "wall_time": d["wall_time"], "tokens_per_s": d["tokens_per_s"],
        "accepted_per_cycle": d["accepted_per_cycle"], "acceptance_by_depth": d["acceptance_by_depth"],
        "mean_tree_size": d["mean_tree_size"],
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when identical (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- comparisons ----------------------------------------------------------------------------
@dataclass
class MethodRun:
    name: str
    summaries: list[Summary] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    speculative: bool = True      # False for plain HF generate (no tau/acceptance)
    ops_per_cycle: dict | None = None  # aten ops dispatched per steady-state cycle (opcount.py)

    @property
    def total(self) -> Summary:
        s = Summary()
        for x in self.summaries:
            s.merge(x)
        return s

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.summaries)

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.summaries)

    @property
    def tokens_per_s(self) -> float:
        w = self.wall_s
        return self.new_tokens / w if w > 0 else 0.0

    def step_ms(self) -> dict:
        """Where the time goes: ms per draft-and-verify cycle for a speculative method (prefill
        apart), ms per new token for `generate` (its prefill included, as `generate` reports none)."""
        tot = self.total

        def per(seconds: float, n: int) -> float | None:
            return round(1000 * seconds / n, 2) if n else None

        if not self.speculative:
            return {"ms_per_token": per(tot.wall_s, tot.new_tokens)}
        return {"draft_ms_per_cycle": per(tot.draft_s, tot.cycles), "verify_ms_per_cycle": per(tot.verify_s, tot.cycles),
                "prefill_s": round(tot.prefill_s, 4)}


@dataclass
class Comparison:
    items: list[PromptItem]
    runs: dict[str, MethodRun]       # insertion order: baseline first
    gen: GenerationSettings
    baseline: str | None = "vanilla"
    settings: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.gen.temperature <= 0 and all(it.overrides.get("temperature", 0) <= 0 for it in self.items)

    def speedup(self, name: str) -> float | None:
        """Total tokens / total time of `name` over the baseline's."""
        if not self.baseline or self.baseline not in self.runs:
            return None
        b = self.runs[self.baseline].tokens_per_s
        return self.runs[name].tokens_per_s / b if b > 0 else None

    def per_prompt_speedups(self, name: str) -> list[float]:
        if not self.baseline or self.baseline not in self.runs:
            return []
        out = []
        for s, b in zip(self.runs[name].summaries, self.runs[self.baseline].summaries):
            if s.tokens_per_s > 0 and b.tokens_per_s > 0:
                out.append(s.tokens_per_s / b.tokens_per_s)
        return out

    def mean_speedup(self, name: str) -> float | None:
        r = self.per_prompt_speedups(name)
        return statistics.fmean(r) if r else None

    def differences(self, name: str) -> list[tuple[PromptItem, int]]:
        """(item, first differing token index) for outputs that differ from the baseline's."""
        if not self.baseline or self.baseline not in self.runs:
            return []
        out = []
        for item, a, b in zip(self.items, self.runs[name].outputs, self.runs[self.baseline].outputs):
            i = first_difference(a, b)
            if i is not None:
                out.append((item, i))
        return out

    def identical(self, name: str) -> int | None:
        """How many outputs equal the baseline's; None when sampling (not expected to match) or no baseline."""
        if not self.greedy or not self.baseline or self.baseline not in self.runs:
            return None
        return len(self.items) - len(self.differences(name))

    def per_category(self, name: str) -> dict[str, dict]:
        cats: dict[str, list[int]] = {}
        for i, item in enumerate(self.items):
            if item.category:
                cats.setdefault(item.category, []).append(i)
        out = {}
        for cat, idx in sorted(cats.items()):
            s = Summary()
            for i in idx:
                s.merge(self.runs[name].summaries[i])
            entry = {"prompts": len(idx), "tau": round(s.tau, 4), "tokens_per_s": round(s.tokens_per_s, 3)}
            if self.baseline in self.runs and name != self.baseline:
                b = Summary()
                for i in idx:
                    b.merge(self.runs[self.baseline].summaries[i])
                entry["speedup"] = round(s.tokens_per_s / b.tokens_per_s, 4) if b.tokens_per_s > 0 else None
            out[cat] = entry
        return out

    def method_dict(self, name: str) -> dict:
        run = self.runs[name]
        tot = run.total
        d = {"tokens_per_s": round(run.tokens_per_s, 3), "new_tokens": run.new_tokens, "wall_time": round(run.wall_s, 4), **run.step_ms()}
        if run.speculative:
            d.update(tau=round(tot.tau, 4), acceptance_by_depth=[round(a, 4) for a in tot.acceptance_by_depth],
                     accepted_hist=tot.accepted_hist, verify_steps=tot.cycles,
                     mean_tree_size=round(tot.mean_tree_size, 2))
            if tot.calibration:  # EAGLE-2 section 3: draft confidence against measured acceptance
                d["calibration"] = tot.calibration
                d["calibration_gap"] = tot.calibration_gap
            if run.ops_per_cycle:
                d["ops_per_cycle"] = run.ops_per_cycle
        if name != self.baseline:
            sp, mean = self.speedup(name), self.mean_speedup(name)
            d.update(speedup=None if sp is None else round(sp, 4), speedup_mean_ratio=None if mean is None else round(mean, 4),
                     identical=self.identical(name))
            diffs = self.differences(name) if self.greedy else []
            if diffs:
                d["first_difference"] = {str(item.id): i for item, i in diffs}
        cats = self.per_category(name)
        if cats:
            d["per_category"] = cats
        return d

    def to_json(self) -> dict:
        main = "eagle2" if "eagle2" in self.runs else next(iter(self.runs))
        out = {
            "prompts": len(self.items),
            "identical": self.identical(main) if main != self.baseline else None,
            "speedup": None if self.speedup(main) is None else round(self.speedup(main), 4),
            "speedup_mean_ratio": None if self.mean_speedup(main) is None else round(self.mean_speedup(main), 4),
            "greedy": self.greedy,
            "settings": self.settings,
        }
        for name in self.runs:
            out[name] = self.method_dict(name)
        cats = self.per_category(main)
        if cats:
            out["per_category"] = cats
        calib = self.runs[main].total.calibration if self.runs[main].speculative else []
        if calib:
            out["calibration"] = calib
            out["calibration_gap"] = self.runs[main].total.calibration_gap
        out["per_prompt"] = [
            {item.key: item.id, **({"category": item.category} if item.category else {}),
             **{name: {"new_tokens": r.summaries[i].new_tokens, "tokens_per_s": round(r.summaries[i].tokens_per_s, 3),
                       **({"tau": round(r.summaries[i].tau, 4)} if r.speculative else {})} for name, r in self.runs.items()}}
            for i, item in enumerate(self.items)
        ]
        return out


Decoder = object  # anything with .generate(prompt_ids, GenerationSettings) -> (tokens, Summary)
BASELINES = ("pld", "sps", "static", "chain", "auto", "fixed", "compiled", "generate-compiled")  # plus tree:N/D/K and auto:N/D/K
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
    budget: total tokens / depth / top-k), so tree sizes can be swept against one shared baseline; fixed and
    compiled (EAGLE-2 on fixed shapes, uncaptured and captured: fixed.py), generate-compiled (HF generate
    with a static cache and torch.compile, the strongest plain decoding transformers offers)."""
    methods: dict[str, tuple[Decoder, bool]] = {}
    if vanilla:
        methods["vanilla"] = (runtime.vanilla(), False)
    methods["eagle2"] = (runtime.eagle(calibration=True), True)
    fixed_tree = runtime.fixed_tree or runtime.tree
    for name in against:
        if name == "pld":
            methods["pld"] = (runtime.vanilla(prompt_lookup_num_tokens=PLD_TOKENS), False)
        elif name == "sps":
            if assistant_model is None:
                raise ValueError("sps needs an assistant model")
            methods["sps"] = (runtime.vanilla(assistant_model=assistant_model), False)
        elif name == "fixed":  # the GPU path's fixed shapes and static buffers, uncaptured
            methods[name] = (runtime.eagle(fixed_tree, calibration=True, compile=False, fixed=True), True)
        elif name == "compiled":  # the same, captured (CUDA graphs on a GPU, inductor on a CPU)
            methods[name] = (runtime.eagle(fixed_tree, calibration=True, compile=True), True)
        elif name == "generate-compiled":  # HF generate with a static cache and torch.compile
            methods[name] = (runtime.vanilla(compiled=True), False)
        elif name in ("static", "chain"):
            methods[name] = (runtime.eagle(dataclasses.replace(fixed_tree, shape=name), calibration=True), True)
        elif name == "auto":  # the per-cycle budget as `--total-tokens auto` sets it up
            methods[name] = (runtime.eagle(runtime.auto_tree, calibration=True), True)
        elif (spec := parse_tree_spec(name)) is not None:
            tree = dataclasses.replace(fixed_tree, shape="dynamic", total_tokens=spec[0], depth=spec[1], top_k=spec[2],
                                       budget="auto" if name.startswith("auto:") else "fixed")
            tree.validate()
            methods[name] = (runtime.eagle(tree, calibration=True), True)
        else:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}, tree:N/D/K or auto:N/D/K")
    return methods


def split_by_context(runtime, items: list[PromptItem]) -> tuple[list[PromptItem], list[tuple[PromptItem, int]]]:
    """(items whose first turn fits the model's context, [(item, prompt tokens)] of those that don't)."""
    fit, too_long = [], []
    for it in items:
        n = len(runtime.encode(it.messages))
        (fit.append(it) if n < runtime.max_positions else too_long.append((it, n)))
    return fit, too_long


def run_comparison(methods: dict[str, tuple[Decoder, bool]], items: list[PromptItem], encode: Callable[[list[dict]], list[int]],
                   gen: GenerationSettings, baseline: str | None = "vanilla", warmup_tokens: int = 8,
                   on_step: Callable[[str, int, PromptItem | None], None] | None = None, settings: dict | None = None) -> Comparison:
    """Run each method (name -> (decoder, speculative?)) on each item's first turn, after a warm-up.

    Methods alternate per prompt, so slow drifts (thermal, other load) hit them alike.
    `on_step(phase, index, item)` reports progress: phase "warmup" or "prompt".
    """
    encoded = [encode(it.messages) for it in items]
    runs = {name: MethodRun(name, speculative=spec) for name, (_, spec) in methods.items()}
    if encoded and warmup_tokens > 0:
        if on_step:
            on_step("warmup", 0, None)
        wg = dataclasses.replace(gen, max_new_tokens=warmup_tokens)
        for dec, _ in methods.values():
            dec.generate(encoded[0], wg)
    for i, (item, ids) in enumerate(zip(items, encoded)):
        g = apply_overrides(gen, item.overrides)
        for name, (dec, _) in methods.items():
            tokens, summary = dec.generate(ids, g)
            runs[name].outputs.append(tokens)
            runs[name].summaries.append(summary)
        if on_step:
            on_step("prompt", i + 1, item)
    if encoded and not gen.temperature:
        for name, (dec, spec) in methods.items():
            runs[name].ops_per_cycle = ops_per_cycle(dec, encoded[0], gen) if spec else None
    return Comparison(items, runs, gen, baseline, settings or {})


def ops_per_cycle(dec, ids: list[int], gen: GenerationSettings, cycles: int = 4) -> dict | None:
    """Mean aten ops per steady-state cycle, to draft and to verify, and the host reads among them:
    what a GPU would launch and wait for, counted on any machine. Not for captured decoders,
    whose compiled kernels bypass the dispatcher (they run the fixed cycle's ops, fused)."""
    from .opcount import cycle_ops

    if getattr(dec, "compile", None) or not hasattr(dec, "_cycle"):
        return None
    r = cycle_ops(dec, ids, dataclasses.replace(gen, max_new_tokens=max(gen.max_new_tokens, 64)), cycles=cycles)
    if not r:
        return None
    mean = lambda k: round(statistics.fmean(c[k] for c in r), 1)  # noqa: E731
    return {"draft": mean("draft_ops"), "verify": mean("verify_ops"),
            "host_reads": round(statistics.fmean(sum(len(v) for v in c["host_reads"].values()) for c in r), 1), "cycles": len(r)}


def plot_comparison(comp: Comparison, path: str, name: str = "eagle2") -> None:
    """Acceptance-length histogram, per-prompt speedup and the calibration figure (EAGLE-2
    section 3: draft path confidence against the measured acceptance rate), to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'eagle2[plot]'") from None
    run = comp.runs[name]
    hist = run.total.accepted_hist
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4))
    a1.bar([i + 1 for i in range(len(hist))], hist, color="tab:blue")
    a1.set_xlabel("tokens per verify step (accepted draft + 1)")
    a1.set_ylabel("verify steps")
    a1.set_title(f"{name}: acceptance length (tau {run.total.tau:.2f})")
    ratios = [s.tokens_per_s / b.tokens_per_s if b.tokens_per_s > 0 else 0.0
              for s, b in zip(run.summaries, comp.runs[comp.baseline].summaries)] if comp.baseline in comp.runs else []
    a2.bar(range(len(ratios)), ratios, color="tab:green")
    a2.axhline(1.0, color="grey", lw=1, ls="--")
    a2.set_xlabel("prompt")
    a2.set_ylabel(f"speedup over {comp.baseline}")
    sp = comp.speedup(name)
    a2.set_title(f"per-prompt speedup (total {sp:.2f}x)" if sp else "per-prompt speedup")
    calib = run.total.calibration
    a3.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
    if calib:
        a3.plot([b["confidence"] for b in calib], [b["accepted"] for b in calib], "o-", color="tab:orange")
    a3.set_xlim(0, 1)
    a3.set_ylim(0, 1)
    a3.set_xlabel("draft path confidence (bin mean)")
    a3.set_ylabel("accepted (fraction of nodes)")
    a3.set_title("calibration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- calibration (chat) ---------------------------------------------------------------------
CALIBRATION_MESSAGES = [{"role": "user", "content": "Write a few sentences about the history of the printing press."}]


def calibrate_vanilla(vanilla, eagle, encode: Callable[[list[dict]], list[int]], gen: GenerationSettings, tokens: int = 32) -> Summary:
    """A short vanilla run (after a tiny warm-up of both decoders) for the chat speedup estimate."""
    ids = encode(CALIBRATION_MESSAGES)
    warm = dataclasses.replace(gen, max_new_tokens=2)
    vanilla.generate(ids, warm)
    if eagle is not None:
        eagle.generate(ids, warm)
    _, summary = vanilla.generate(ids, dataclasses.replace(gen, max_new_tokens=max(1, tokens)))
    return summary
