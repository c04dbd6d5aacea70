"""Target-side sampling: the same logits warpers Hugging Face `generate` applies, in its order.

Losslessness with sampling means the emitted tokens follow the target's *processed*
distribution (temperature, then top-k, then top-p), exactly what `generate(do_sample=True)`
samples from; so we build that distribution with transformers' own warpers.
"""
from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def make_warpers(gen) -> LogitsProcessorList | None:
    """None at temperature 0 (greedy); otherwise the warpers for gen's temperature/top-k/top-p."""
    if gen.temperature <= 0:
        return None
    procs = LogitsProcessorList()
    if gen.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(gen.temperature))
    if gen.top_k:
        procs.append(TopKLogitsWarper(top_k=gen.top_k))
    if gen.top_p is not None and gen.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=gen.top_p))
    return procs


def target_probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """Row-wise processed distributions [N, V] (float32) for the N rows of `logits`."""
    scores = warpers(None, logits.float())
    return torch.softmax(scores, dim=-1)
