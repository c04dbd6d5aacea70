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


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token at which the cumulative distribution first exceeds u (of the row's total mass)."""
    c = probs.double().cumsum(-1)
    return int(torch.searchsorted(c, torch.tensor([u * float(c[-1])], dtype=c.dtype), right=True).clamp(max=probs.shape[-1] - 1))


def accept_sampling_keyed(tree: DraftTree, probs: torch.Tensor, uniforms: list[float]) -> tuple[list[int], int]:
    """Lossless sampling acceptance whose outcome does not depend on the tree (batched decoding).

    At each node the target's own token is drawn by inverse CDF from one uniform per output
    position (uniforms[d] for the token after the depth-d node); the walk moves to the child that
    carries that token, and ends with it as the bonus when no child does. Each emitted token is
    therefore a draw from p at its position, exactly as plain sampling makes it, so the law is the
    target's (every token ~ p given the tokens before it). And since the draw depends only on p and
    the position's uniform, a seeded answer is the same whatever tree, tree size or batch-mates a
    cycle had, and the same as plain decoding with those uniforms. For one-hot drafts the chance to
    accept some child is sum of p(child), as under the recursive rule (`accept_sampling`).
    """
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    kids = children_lists(parents)
    node, path = 0, [0]
    for d in range(len(uniforms)):
        tok = inverse_cdf(probs[node].float().cpu(), uniforms[d])
        nxt = next((c for c in kids[node] if tokens[c] == tok), None)
        if nxt is None:
            return path, tok
        path.append(nxt)
        node = nxt
    raise ValueError("fewer uniforms than the tree is deep")


def position_uniforms(seed: int, start: int, count: int) -> list[float]:
    """One uniform per output position start .. start + count - 1, from (seed, position) alone."""
    out = []
    for t in range(start, start + count):
        g = torch.Generator().manual_seed((seed * 1_000_003 + t) % (1 << 63))
        out.append(float(torch.rand((), generator=g, dtype=torch.float64)))
    return out
