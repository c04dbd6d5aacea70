"""The statistics generations report: one generation's metrics, and a comparison of methods
(speedups against the baseline, identical outputs, per category). Pure: nothing runs here.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .events import GenerationSettings, Summary, samples
from .prompts import PromptItem

PLAIN = "plain"  # methods.PLAIN: eagle2's own plain decoding, the reference for speculation alone


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


@dataclass
class MethodRun:
    name: str
    summaries: list[Summary] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    speculative: bool = True      # False for plain HF generate (no tau/acceptance)
    ops_per_cycle: dict | None = None  # aten ops dispatched per steady-state cycle (opcount.py)
    plan: dict | None = None      # a batched method's batch size and tree size, and the estimates they came from
    backend_used: str | None = None    # what ran the cycles (compare.backend_used()); None for plain generate

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
    divergences: dict = field(default_factory=dict)  # method -> item id -> divergence.Divergence (greedy differences)

    @property
    def greedy(self) -> bool:
        return not samples(self.gen.temperature) and not any(samples(it.overrides.get("temperature", 0)) for it in self.items)

    def speedup(self, name: str) -> float | None:
        """Total tokens / total time of `name` over the baseline's."""
        if not self.baseline or self.baseline not in self.runs:
            return None
        b = self.runs[self.baseline].tokens_per_s
        return self.runs[name].tokens_per_s / b if b > 0 else None

    def speedup_over(self, name: str, reference: str) -> float | None:
        """`name`'s tokens/s over `reference`'s (None where either is missing or empty)."""
        if name not in self.runs or reference not in self.runs or name == reference:
            return None
        r = self.runs[reference].tokens_per_s
        return self.runs[name].tokens_per_s / r if r > 0 else None

    def over_plain(self, name: str) -> float | None:
        """Speculation alone: `name` over eagle2's own plain decoding (same kernels, no draft)."""
        return self.speedup_over(name, PLAIN) if self.runs[name].speculative else None

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

    @property
    def int8(self) -> bool:
        """Whether the target multiplied in int8 (rowgemm.ARITHMETICS): every product row-invariant, so
        eagle2's methods must equal its plain decoding to the bit and `generate` (float32) is another model."""
        return self.settings.get("arithmetic") == "int8"

    @property
    def reference(self) -> str | None:
        """What outputs are checked against. Greedy: the baseline (`generate`), or where none ran,
        eagle2's own plain decoding (`compare --no-vanilla`: a sweep still checks that speculation
        changed no answer). Sampling with a seed: eagle2's plain decoding, since every eagle2
        decoder draws a token from one uniform per output position (accept.accept_sampling_keyed),
        so a seeded answer is the same whatever the trees; `generate` draws differently. Unseeded
        sampling: nothing (each answer draws its own seed). In int8 always eagle2's plain decoding,
        the same arithmetic as every eagle2 method; `generate` runs the float32 model."""
        if self.int8:
            return PLAIN if PLAIN in self.runs and (self.greedy or self.gen.seed is not None) else None
        if self.greedy:
            if self.baseline and self.baseline in self.runs:
                return self.baseline
            return PLAIN if PLAIN in self.runs else None
        return PLAIN if PLAIN in self.runs and self.gen.seed is not None else None

    def checked(self, name: str) -> bool:
        """Whether `name`'s outputs are expected to equal the reference's: greedy, every method;
        seeded sampling, eagle2's own decoders (not `generate` or HF's assisted decoding)."""
        if not self.reference or name == self.reference:
            return False
        return (self.greedy and not self.int8) or self.runs[name].backend_used is not None

    def identical_to_generate(self, name: str) -> int | None:
        """In int8, how many greedy outputs equal `generate`'s (the float32 model): said, never checked."""
        if not (self.int8 and self.greedy and self.baseline in self.runs) or name == self.baseline:
            return None
        base = self.runs[self.baseline].outputs
        return sum(first_difference(a, b) is None for a, b in zip(self.runs[name].outputs, base))

    def bugs(self, name: str) -> int:
        """Differences from the reference that rounding cannot explain: in int8 every one (each row's
        result is the same whatever the other rows, so no near-tie exists), else the explained ones
        that are not near-ties."""
        return len(self.differences(name)) if self.int8 else self.tie_counts(name)[1]

    def differences(self, name: str) -> list[tuple[PromptItem, int]]:
        """(item, first differing token index) for outputs that differ from the reference's."""
        ref = self.reference
        if not self.checked(name):
            return []
        out = []
        for item, a, b in zip(self.items, self.runs[name].outputs, self.runs[ref].outputs):
            i = first_difference(a, b)
            if i is not None:
                out.append((item, i))
        return out

    def identical(self, name: str) -> int | None:
        """How many outputs equal the reference's; None where they are not expected to (`checked`):
        the reference itself, unseeded sampling, `generate` under sampling, nothing to check against."""
        if not self.checked(name):
            return None
        return len(self.items) - len(self.differences(name))

    def tie_counts(self, name: str) -> tuple[int, int]:
        """(near-ties, others) among `name`'s explained differences."""
        ds = list(self.divergences.get(name, {}).values())
        ties = sum(d.near_tie for d in ds)
        return ties, len(ds) - ties

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
            if tot.calibration_table:  # EAGLE-2 section 3: draft confidence against measured acceptance
                d["calibration"] = tot.calibration_table
                d["calibration_gap"] = tot.calibration_gap
            if tot.source_counts:  # per draft source (sources.py): nodes, accepted, share of the output, calibration gap
                d["sources"] = tot.source_table()
            if run.ops_per_cycle:
                d["ops_per_cycle"] = run.ops_per_cycle
            if run.backend_used:
                d["backend_used"] = run.backend_used
        if run.plan:
            d["batch_plan"] = run.plan
        if name != self.baseline:
            sp, mean = self.speedup(name), self.mean_speedup(name)
            d.update(speedup=None if sp is None else round(sp, 4), speedup_mean_ratio=None if mean is None else round(mean, 4),
                     identical=self.identical(name))
            if (g := self.identical_to_generate(name)) is not None:
                d["identical_to_generate"] = g
            if (op := self.over_plain(name)) is not None:
                d["speedup_over_plain"] = round(op, 4)
            diffs = self.differences(name)
            if diffs:
                d["first_difference"] = {str(item.id): i for item, i in diffs}
            if self.divergences.get(name):  # each difference's logit gap and near-tie verdict
                d["divergences"] = {k: v.to_json() for k, v in self.divergences[name].items()}
                d["not_near_ties"] = self.tie_counts(name)[1]
        cats = self.per_category(name)
        if cats:
            d["per_category"] = cats
        return d

    def to_json(self) -> dict:
        main = "eagle2" if "eagle2" in self.runs else next(iter(self.runs))
        out = {
            "prompts": len(self.items),
            "identical": self.identical(main),
            "identical_to": self.reference,
            **({"identical_to_generate": self.identical_to_generate(main)} if self.identical_to_generate(main) is not None else {}),
            "speedup": None if self.speedup(main) is None else round(self.speedup(main), 4),
            "speedup_mean_ratio": None if self.mean_speedup(main) is None else round(self.mean_speedup(main), 4),
            "greedy": self.greedy,
            "settings": self.settings,
        }
        if PLAIN in self.runs:  # the speedup split: kernels alone and speculation alone
            kern, spec = self.speedup(PLAIN), self.over_plain(main) if main in self.runs else None
            out["plain_over_generate"] = None if kern is None else round(kern, 4)
            out["speedup_over_plain"] = None if spec is None else round(spec, 4)
        for name in self.runs:
            out[name] = self.method_dict(name)
        cats = self.per_category(main)
        if cats:
            out["per_category"] = cats
        calib = self.runs[main].total.calibration_table if self.runs[main].speculative else []
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
