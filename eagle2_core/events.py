"""What a generation reports: settings in, per-cycle events and a final summary out.

The CLI's live panel, `generate` output lines and the benchmarks read only these objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONFIDENCE_BINS = 10  # path-probability bins of the calibration table (0-0.1, ..., 0.9-1)


# A temperature below this decodes greedily, as 0 does: logits divided by it can overflow float32
# (inf - inf in the softmax is NaN, and a draw from NaN scores picks the last id every time),
# and at it a draw already takes the argmax unless another logit is within about 1e-5 of it.
GREEDY_BELOW = 1e-6


def samples(temperature: float) -> bool:
    """Whether `temperature` samples (False: greedy, see GREEDY_BELOW)."""
    return temperature >= GREEDY_BELOW


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0        # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0              # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    no_repeat_ngram_size: int = 0   # 0 = off
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's EOS plus chat end-of-turn tokens
    # Also what the model's generation_config sets beyond the fields above (bad_words_ids,
    # suppress_tokens, min_new_tokens, sequence_bias, ...), applied as `generate` applies them
    # (sampling.TargetProcessors); False: only the fields above. The fields above are always
    # these values: sampling.settings_from_model takes their defaults from the model's config.
    use_generation_config: bool = True
    # What the output must match (structured.Constraint: a JSON schema, a regex, a grammar), as
    # one more logits processor on every tree node; None: free text.
    constraint: Any = None
    # Each emitted token's log-probability, with this many of the likeliest tokens beside it
    # (0 to logprobs.MAX_TOP); None: none computed (no cost).
    logprobs: int | None = None


@dataclass
class StepEvent:
    token_ids: list[int]            # tokens emitted this cycle (after stop handling)
    accepted: int                   # draft tokens accepted (the bonus token not counted)
    tree_size: int                  # nodes verified, root included
    draft_s: float
    verify_s: float
    cached_tokens: int = 0          # the prefill's event only: prompt tokens restored from a kept sequence
    logprobs: list | None = None    # one logprobs.TokenLogprob per token of token_ids, when asked for


@dataclass
class Summary:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0        # prefill included
    cycles: int = 0
    accepted_hist: list[int] = field(default_factory=list)   # cycles by number of draft tokens accepted
    tree_tokens: int = 0
    depth_sum: int = 0              # deepest draft path of each cycle's tree, summed
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    finish_reason: str = ""
    cached_tokens: int = 0          # prompt tokens restored from a kept sequence (prefix.py), not prefilled
    # Calibration (EAGLE-2 section 3): drafted nodes binned by path probability, and how many of
    # each bin were on the accepted path: a [3, CONFIDENCE_BINS] tensor (nodes, accepted, confidence
    # sum; policy.bin_counts) on the tree's device, read only when reported.
    confidence_counts: Any = None        # torch is imported only where used
    # Per draft source (sources.py): nodes verified, accepted, and the calibration of its
    # conditionals (children of accepted parents) by bin of the predicted conditional.
    source_counts: dict = field(default_factory=dict)
    # One logprobs.TokenLogprob per emitted token (the new_tokens), when the settings asked for them.
    logprobs: list | None = None

    def record_source(self, source: str, accepted: bool, predicted: float | None) -> None:
        """One verified node a source proposed; `predicted`: its conditional where its parent was accepted."""
        c = self.source_counts.get(source)
        if c is None:
            c = self.source_counts[source] = {"nodes": 0, "accepted": 0, "cal": [[0, 0, 0.0] for _ in range(CONFIDENCE_BINS)]}
        c["nodes"] += 1
        c["accepted"] += int(accepted)
        if predicted is not None:
            cell = c["cal"][min(CONFIDENCE_BINS - 1, max(0, int(predicted * CONFIDENCE_BINS)))]
            cell[0] += 1
            cell[1] += int(accepted)
            cell[2] += predicted

    def source_table(self) -> dict:
        """Per source: nodes verified, accepted, share of the output (a token two sources proposed
        counts for both), and the calibration gap of its conditionals (node-weighted |predicted - accepted|)."""
        out = {}
        for name, c in sorted(self.source_counts.items()):
            n = sum(cell[0] for cell in c["cal"])
            gap = sum(abs(cell[2] - cell[1]) for cell in c["cal"]) / n if n else None
            out[name] = {"nodes": c["nodes"], "accepted": c["accepted"],
                         "share": round(c["accepted"] / self.new_tokens, 4) if self.new_tokens else 0.0,
                         "calibration_gap": None if gap is None else round(gap, 4)}
        return out

    def record_confidence(self, path_probs, on_path) -> None:
        """One cycle's drafted nodes: their path probabilities and which were on the accepted path."""
        from .policy import bin_counts

        if path_probs.numel() == 0:
            return
        counts = bin_counts(path_probs.float(), on_path.float(), CONFIDENCE_BINS)
        self.confidence_counts = counts if self.confidence_counts is None else self.confidence_counts + counts.to(self.confidence_counts.device)

    @property
    def calibration_table(self) -> list[dict]:
        """Bins with nodes: mean path probability (`confidence`), `nodes`, fraction `accepted`."""
        if self.confidence_counts is None:
            return []
        n, a, c = self.confidence_counts.cpu().tolist()
        return [{"bin": [i / CONFIDENCE_BINS, (i + 1) / CONFIDENCE_BINS], "confidence": round(c[i] / n[i], 4), "nodes": int(n[i]),
                 "accepted": round(a[i] / n[i], 4)} for i in range(CONFIDENCE_BINS) if n[i]]

    @property
    def calibration_gap(self) -> float | None:
        """Node-weighted mean |confidence - acceptance| (policy.calibration_gap); None without data."""
        from .policy import calibration_gap

        return None if self.confidence_counts is None else round(calibration_gap(self.confidence_counts), 4)

    def record_cycle(self, accepted: int, tree_size: int, deepest: int, draft_s: float, verify_s: float) -> None:
        """One cycle: draft tokens accepted, nodes verified, the tree's deepest draft depth."""
        self.cycles += 1
        self.target_forwards += 1
        while len(self.accepted_hist) <= accepted:
            self.accepted_hist.append(0)
        self.accepted_hist[accepted] += 1
        self.tree_tokens += tree_size
        self.depth_sum += deepest
        self.draft_s += draft_s
        self.verify_s += verify_s

    def finish(self, stop, wall_s: float) -> None:
        self.new_tokens = stop.count
        self.finish_reason = stop.reason
        self.wall_s = wall_s

    @property
    def tau(self) -> float:
        """Tokens per target forward pass, bonus token included (prefill counted as a forward)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(draft token at depth d accepted | depth d-1 accepted), over all cycles."""
        reach = [sum(self.accepted_hist[d:]) for d in range(len(self.accepted_hist))]
        return [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, len(reach))]

    @property
    def mean_tree_size(self) -> float:
        """Nodes verified per cycle, root included."""
        return self.tree_tokens / self.cycles if self.cycles else 0.0

    @property
    def accepted_per_cycle(self) -> float:
        return sum(i * n for i, n in enumerate(self.accepted_hist)) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over the longest draft path of each tree: 1.0 = every path fully accepted."""
        acc = sum(i * n for i, n in enumerate(self.accepted_hist))
        return acc / self.depth_sum if self.depth_sum else 0.0

    def merge(self, other: "Summary") -> None:
        for name in ("prompt_tokens", "cached_tokens", "new_tokens", "target_forwards", "cycles", "tree_tokens", "depth_sum", "draft_s", "verify_s", "prefill_s", "wall_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, n in enumerate(other.accepted_hist):
            while len(self.accepted_hist) <= i:
                self.accepted_hist.append(0)
            self.accepted_hist[i] += n
        for name, c in other.source_counts.items():
            mine = self.source_counts.setdefault(name, {"nodes": 0, "accepted": 0, "cal": [[0, 0, 0.0] for _ in range(CONFIDENCE_BINS)]})
            mine["nodes"] += c["nodes"]
            mine["accepted"] += c["accepted"]
            for a, b in zip(mine["cal"], c["cal"]):
                for j in range(3):
                    a[j] += b[j]
        if other.confidence_counts is not None:
            self.confidence_counts = other.confidence_counts.clone() if self.confidence_counts is None else self.confidence_counts + other.confidence_counts.to(self.confidence_counts.device)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
            "verify_steps": self.cycles, "tau": round(self.tau, 4), "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_depth],
            "accepted_per_cycle": round(self.accepted_per_cycle, 4), "acceptance_rate": round(self.acceptance_rate, 4), "accepted_hist": self.accepted_hist,
            "mean_tree_size": round(self.mean_tree_size, 2),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4), "prefill_s": round(self.prefill_s, 4),
            "wall_time": round(self.wall_s, 4), "tokens_per_s": round(self.tokens_per_s, 3), "finish_reason": self.finish_reason,
            **({"sources": self.source_table()} if self.source_counts else {}),
        }


def collect(stream) -> tuple[list[int], "Summary"]:
    """Run a decoder's event stream to the end: (all emitted tokens, the summary)."""
    out: list[int] = []
    for ev in stream:
        if isinstance(ev, Summary):
            return out, ev
        out.extend(ev.token_ids)
    raise RuntimeError("decoder stream ended without a summary")


class StopChecker:
    """Applies EOS ids, stop strings, max_new_tokens and the context limit to emitted tokens."""

    def __init__(self, gen: GenerationSettings, tokenizer, eos_ids: set[int], max_positions: int, prompt_len: int):
        self.max_new = gen.max_new_tokens
        self.stop_strings = tuple(s for s in gen.stop_strings if s)
        self.tokenizer = tokenizer
        self.eos = eos_ids
        self.limit = max_positions - prompt_len  # never emit past the model's context
        self.tokens: list[int] = []
        self.reason = ""
        if self.limit <= 0:
            self.reason = "length"
        elif self.max_new <= 0:
            self.reason = "length"

    @property
    def count(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return bool(self.reason)

    @property
    def remaining(self) -> int:
        return min(self.max_new, self.limit) - len(self.tokens)

    def push(self, new: list[int]) -> list[int]:
        """Append what may be emitted of `new`; returns it (possibly cut)."""
        out: list[int] = []
        for t in new:
            if self.done:
                break
            out.append(t)
            self.tokens.append(t)
            if t in self.eos:
                self.reason = "stop"
            elif self._hit_stop_string():
                self.reason = "stop"
            elif len(self.tokens) >= min(self.max_new, self.limit):
                self.reason = "length"
        return out

    def _hit_stop_string(self) -> bool:
        # Checked token by token: a cycle may emit several, and we cut right after the one
        # that completes a stop string, as `generate(stop_strings=...)` does.
        if not self.stop_strings or self.tokenizer is None:
            return False
        tail = self.tokenizer.decode(self.tokens[-32:], skip_special_tokens=False)
        return any(tail.endswith(s) or s in tail[-(len(s) + 16):] for s in self.stop_strings)
