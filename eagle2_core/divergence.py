"""Why two greedy answers differ: the target's logit gap at the first differing token.

Speculative decoding is exact in exact arithmetic, but a tree row goes through a multi-row
product where plain decoding uses a one-row one, and floating point rounds the two differently
in the last bits. Two greedy decoders of the same target can therefore part only where its two
best candidates are within that rounding of each other: a near-tie. Anywhere else a difference
is a bug. `explain` tells which, for the first differing token of two answers to one prompt.

The gap is measured as plain greedy decoding computes it (prefill, then one row per token, the
model's processors applied with the sequence so far), again with the whole prefix in one forward
(the multi-row product a tree verify uses), again so with eagle2's measured kernels (rowgemm.py:
oneDNN's packed product rounds differently from `F.linear`), and, for a 16-bit run, with a
float32 copy of the model. How far the first moves from each of the others is the rounding measured at this very
position; the other decoder's own rounding is of the same size, so the two can flip the choice
when the gap is within twice the larger of them. That is the tolerance, never under four units in
the last place of the run's dtype at these logits (two roundings of up to two units each).
Measured on SmolLM2 in bfloat16, 12 MT-bench questions, five trees: all 48 differences lie
within the tolerance, the largest at three quarters of it; with two units and the whole-prefix
term alone, one of 84 was called a bug: a gap of 0.19 that the float32 copy puts at 0.08.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch

from .sampling import TargetProcessors
from .target import model_eos_ids


@dataclass
class Divergence:
    token: int                    # index of the first differing new token
    expected: int | None          # the baseline's token there (None: the baseline's answer ended)
    got: int | None               # the other answer's token there (None: it ended)
    dtype: str
    gap: float | None = None      # score(expected) - score(got), plain decoding in the run's dtype
    gap_float32: float | None = None  # the same with a float32 copy of the model (None: not measured)
    tolerance: float | None = None    # what rounding can move the gap by here (see the module docstring)
    near_tie: bool = False
    note: str = ""                # why something was not measured, or what makes it not a near-tie

    @property
    def verdict(self) -> str:
        return "near-tie" if self.near_tie else "NOT a near-tie"

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("gap", "gap_float32", "tolerance"):
            if d[k] is not None:
                d[k] = float(f"{d[k]:.6g}")
        return {**d, "verdict": self.verdict}


def ulp(dtype: torch.dtype, x: float) -> float:
    """One unit in the last place of `dtype` at magnitude `x`."""
    eps = torch.finfo(dtype).eps
    return eps * 2.0 ** math.floor(math.log2(abs(x))) if x else torch.finfo(dtype).tiny


def _device(model) -> torch.device:
    return model.get_output_embeddings().weight.device


@torch.no_grad()
def stepwise_logits(model, ids: list[int], start: int) -> torch.Tensor:
    """Next-token logits [V] after `ids`, as greedy `generate` computes them: a prefill of the first
    `start` tokens, then one row per token."""
    dev = _device(model)
    x = torch.as_tensor(ids, dtype=torch.long, device=dev)[None]
    out = model(x[:, :start], use_cache=True, logits_to_keep=1)
    cache = out.cache
    for j in range(start, x.shape[1]):
        out = model(x[:, j:j + 1], cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
    return out.logits[0, -1]


@torch.no_grad()
def whole_logits(model, ids: list[int], our_kernels: bool = False) -> torch.Tensor:
    """Next-token logits [V] after `ids` from one forward over all of them (a multi-row product);
    `our_kernels`: every CPU linear through the product plan eagle2's own forwards take
    (rowgemm.py), whose kernels round differently from `F.linear`."""
    from .rowgemm import eligible, plain_linears, row_linears

    x = torch.as_tensor(ids, dtype=torch.long, device=_device(model))[None]
    linears = [m for m in plain_linears(model) if eligible(m.weight) and "forward" not in m.__dict__] if our_kernels else []
    with row_linears(linears):
        return model(x, use_cache=False, logits_to_keep=1).logits[0, -1]


def float32_copy(model):
    """(float32 copy of `model`, None) or (None, why not). Costs the model's float32 size in memory."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        return model, None
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None:
        return None, "quantized weights have no float32 copy"
    try:
        return copy.deepcopy(model).float(), None
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        return None, f"no float32 copy ({type(e).__name__})"


def explain(model, prompt: list[int], expected: list[int], got: list[int], token: int, gen, tokenizer=None,
            model32=None, why_no_32: str | None = None) -> Divergence:
    """The divergence of answer `got` from the baseline's `expected` (both greedy, same `prompt`
    and settings `gen`) at their first differing new token `token`. `model32`: a float32 copy
    (float32_copy), or None with `why_no_32`."""
    dtype = next(model.parameters()).dtype
    a = expected[token] if token < len(expected) else None
    b = got[token] if token < len(got) else None
    d = Divergence(token, a, b, str(dtype).replace("torch.", ""))
    if a is None or b is None:
        d.note = "one answer ends here and the other goes on: no logit can explain that"
        return d
    ids = list(prompt) + list(expected[:token])
    eos = gen.eos_token_ids if gen.eos_token_ids is not None else model_eos_ids(model, tokenizer)
    procs = TargetProcessors(gen, getattr(model, "generation_config", None), prompt, sorted(eos), gen.max_new_tokens, _device(model),
                             tokenizer=tokenizer, vocab_size=model.get_output_embeddings().weight.shape[0])
    history = torch.as_tensor(ids, dtype=torch.long, device=_device(model))[None]

    def gap_of(logits: torch.Tensor) -> tuple[float, float]:
        s = procs.scores(logits[None], history)[0].float()
        return float(s[a] - s[b]), max(abs(float(logits[a])), abs(float(logits[b])))

    gap, scale = gap_of(stepwise_logits(model, ids, len(prompt)))
    gap_whole, _ = gap_of(whole_logits(model, ids))
    gap_ours, _ = gap_of(whole_logits(model, ids, our_kernels=True))  # the kernels eagle2's verify ran
    d.gap = gap
    d.tolerance = max(4 * ulp(dtype, scale), 2 * abs(gap - gap_whole), 2 * abs(gap - gap_ours))
    if dtype == torch.float32:
        d.gap_float32 = gap
    elif model32 is not None:
        d.gap_float32 = gap_of(whole_logits(model32, ids))[0]
        # how far the run's dtype put this gap from the float32 one: the rounding along the whole
        # context, which the other decoder's rounding (its cache filled by tree verifies) matches in size
        d.tolerance = max(d.tolerance, 2 * abs(gap - d.gap_float32))
    elif why_no_32:
        d.note = f"float32 gap not measured: {why_no_32}"
    d.near_tie = abs(gap) <= d.tolerance
    if gap < -d.tolerance:  # the baseline's own computation, redone, would not pick its token
        d.note = "; ".join(filter(None, [d.note, "plain greedy decoding here picks the other answer's token: the baseline is not plain greedy decoding"]))
    return d
