"""Acceptance rules: which drafted path the target keeps, and the bonus token after it.

Both rules are pure functions of the draft tree and the target's outputs at every tree node, so
they are tested without a model. Each returns the accepted node indices (root first, in path
order) and the bonus token, which the target chose itself and which becomes the next root.
"""
from __future__ import annotations

import torch

from .tree import DraftTree


def _deepest_match(tree: DraftTree, target_argmax: torch.Tensor) -> torch.Tensor:
    """Index of the deepest node whose whole path matches the target's argmax (0-d tensor).

    A node matches when its token is the argmax at its parent; a path survives when all its
    nodes match. Siblings carry distinct tokens, so at most one node per depth survives and
    the deepest surviving node identifies the path.
    """
    # the root (parent -1) was chosen by the target itself; tensor ops only, no setitem from Python
    match = (tree.tokens == target_argmax[tree.parents.clamp(min=0)]) | (tree.parents < 0)
    survives = ~(tree.ancestors & ~match[None, :]).any(dim=1)
    return torch.argmax(torch.where(survives, tree.depth, -1))


def accept_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Temperature 0: the longest path on which every token equals the target's argmax.

    Vectorised over nodes; one host sync.
    """
    best = _deepest_match(tree, target_argmax)
    path = torch.nonzero(tree.ancestors[best]).flatten()  # ascending index = root-to-leaf order
    bonus = target_argmax[best]
    values = torch.cat([path, bonus.view(1)]).tolist()  # the one host sync of a greedy cycle
    return values[:-1], values[-1]


def accept_greedy_graph(tree: DraftTree, target_argmax: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_greedy` in graph mode: fixed shapes and no host read (the GPU path).

    Returns `path` [width] (node index at each depth of the accepted path, root first; entries
    past the path repeat the root and are never used), `accepted` (0-d: draft tokens accepted)
    and `bonus` (0-d). width = the tree's depth + 1.
    """
    best = _deepest_match(tree, target_argmax).view(1)  # index_select, not t[best]: no host read of `best`
    on_path = tree.ancestors.index_select(0, best)[0]
    # Scatter each path node to the slot of its depth; off-path nodes go to a spare slot.
    slot = torch.where(on_path, tree.depth, width)
    path = torch.zeros(width + 1, dtype=torch.long, device=tree.tokens.device)
    path.scatter_(0, slot, torch.arange(tree.size, device=tree.tokens.device) * on_path)
    return path[:width], tree.depth.index_select(0, best)[0], target_argmax.index_select(0, best)[0]


def path_tensor(path: list[int], width: int, device) -> torch.Tensor:
    """A host-side accepted path as `accept_greedy_graph` returns it (padded with the root)."""
    return torch.tensor(path + [0] * (width - len(path)), dtype=torch.long, device=device)


def children_lists(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    return kids


def accept_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless acceptance for deterministic (one-hot) drafts, many candidates per node.

    `probs[i]` is the target's next-token distribution at node i after temperature/top-k/top-p.
    At a node with distribution p, its children x1, x2, ... (in draft-rank order) are tried in
    turn: x is accepted with probability p(x) / (1 - mass already rejected), which is p(x) under
    the residual distribution after zeroing the rejected siblings. If all are rejected, the bonus
    token is drawn from that residual. For drafts with q = one-hot this is the recursive
    rejection rule of SpecInfer / EAGLE (issue discussions call it "q(x) = 1"), and the emitted
    token at every step has exactly the distribution p: by induction, P(emit x) =
    p(x) + (1 - p(x1) - ...)·p(x)/(1 - ...) telescopes to p(x).

    One device-to-host transfer of the children's probabilities; the bonus row is fetched once.
    Uniforms come from `generator` (a CPU generator) so runs are reproducible under a seed.
    """
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    child_p = probs[tree.parents[1:].clamp(min=0), tree.tokens[1:]].float().cpu().tolist()
    kids = children_lists(parents)

    node, path = 0, [0]
    while True:
        rejected: list[int] = []
        rejected_mass = 0.0
        accepted = None
        for c in kids[node]:
            tok = tokens[c]
            if tok in rejected:
                continue
            pc = child_p[c - 1]
            left = 1.0 - rejected_mass
            if left > 0 and torch.rand((), generator=generator).item() * left < pc:
                accepted = c
                break
            rejected.append(tok)
            rejected_mass += pc
        if accepted is None:
            row = probs[node].float().cpu().clone()  # a copy: float32 CPU input would be a view
            if rejected:
                row[rejected] = 0.0
            if not torch.isfinite(row).all() or row.sum() <= 0:
                row = probs[node].float().cpu()
            bonus = int(torch.multinomial(row / row.sum(), 1, generator=generator))
            return path, bonus
        path.append(accepted)
        node = accepted
