"""Choosing each cycle's tree size from the draft's own confidence and the measured cost.

EAGLE-2's central observation (section 3) is that the draft head is well calibrated: a node's
path probability (the product of draft confidences along its path) approximates the chance
that verification accepts it. A tree's expected output is then 1 + the sum of its nodes' path
probabilities (the 1 is the target's bonus token), and the best size for this cycle is the one
that buys the most expected tokens per millisecond of verification plus drafting. Only which
drafted nodes are verified changes, so output stays exactly the target's.

Pure functions on tensors; the costs come from `costs.py`.
"""
from __future__ import annotations

import torch


def expected_tokens(path_probs_desc: torch.Tensor) -> torch.Tensor:
    """[1 + sum of the first i path probabilities] for tree sizes i + 1 = 1 .. len + 1."""
    zero = torch.zeros(1, dtype=path_probs_desc.dtype, device=path_probs_desc.device)
    return 1.0 + torch.cat([zero, torch.cumsum(path_probs_desc, 0)])


def choose_budget(path_probs_desc: torch.Tensor, verify_ms: torch.Tensor, draft_ms: float | torch.Tensor = 0.0) -> int:
    """Tree size n* (root included) maximising expected tokens per ms.

    `path_probs_desc`: the reranked nodes' path probabilities, highest first (a prefix of that
    order is closed under ancestry: a child's path probability never exceeds its parent's).
    `verify_ms[n - 1]`: the measured cost of verifying n rows, for n = 1 .. at least len + 1.
    `draft_ms`: the cycle's drafting cost, paid whatever the size. Ties go to the smaller tree.
    """
    m = path_probs_desc.numel() + 1
    if verify_ms.numel() < m:
        raise ValueError(f"cost table has {verify_ms.numel()} sizes, the tree needs {m}")
    gain = expected_tokens(path_probs_desc.double())
    rate = gain / (verify_ms[:m].double() + float(draft_ms))
    return int(torch.argmax(rate)) + 1  # argmax returns the first maximum: the smallest tree
