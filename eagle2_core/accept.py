"""Acceptance rules: which drafted path the target keeps, and the bonus token after it.

Both rules are pure functions of the draft tree and the target's outputs at every tree node, so
they are tested without a model. Each returns the accepted node indices (root first, in path
order) and the bonus token, which the target chose itself and which becomes the next root.
Sampling draws from one uniform per output position, a hash of (seed, position)
(`position_uniforms`), in every decoder.
"""
from __future__ import annotations

import secrets

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


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token at which the cumulative distribution first exceeds u (of the row's total mass)."""
    c = probs.double().cumsum(-1)
    return int(torch.searchsorted(c, torch.tensor([u * float(c[-1])], dtype=c.dtype), right=True).clamp(max=probs.shape[-1] - 1))


def first_token(scores: torch.Tensor, seed: int) -> int:
    """The answer's first token (output position 0) drawn from processed `scores` [V] by the
    keyed rule: what every decoder's prefill samples, so a seeded answer starts alike everywhere."""
    return inverse_cdf(torch.softmax(scores.float(), -1).cpu(), position_uniforms(seed, 0, 1)[0])


def accept_sampling_keyed(tree: DraftTree, probs: torch.Tensor, uniforms: list[float]) -> tuple[list[int], int]:
    """Lossless sampling acceptance whose outcome does not depend on the tree: the one sampling rule.

    `probs[i]` is the target's next-token distribution at node i after its processors (warpers
    included). At each node the target's own token is drawn by inverse CDF from one uniform per
    output position (uniforms[d] for the token after the depth-d node, i.e. `position_uniforms(seed,
    emitted, ...)` where `emitted` counts the answer's tokens so far); the walk moves to the child
    that carries that token, and ends with it as the bonus when no child does. Each emitted token is
    therefore a draw from p at its position, exactly as plain sampling makes it, so the law is the
    target's (every token ~ p given the tokens before it). And since the draw depends only on p and
    the position's uniform, a seeded answer is the same whatever tree, tree size, batch size or
    batch-mates a cycle had, and the same as plain decoding with those uniforms. For one-hot
    drafts the chance to accept some child is the sum of p over the children, as under the
    recursive rejection rule of SpecInfer / EAGLE, which this rule replaced.
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


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser (Stafford's mix 13): a bijection of 64-bit integers that avalanches."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_uniforms(seed: int, start: int, count: int) -> list[float]:
    """The uniforms in [0, 1) of output positions start .. start + count - 1 under `seed`.

    A position is the index of a token within the answer (0 = the first token, drawn at prefill).
    Counter-based, a pure function of (seed, position): the uniform of position t is output
    number t of a SplitMix64 stream whose state starts at mix64(seed mod 2^64), its top 53 bits as
    a double (k / 2^53). So every decoder (batch 1, batched, graph mode; chat and generate) draws
    the same uniform for the same token of a seeded answer, whatever its trees and batch-mates.
    """
    state = _mix64(seed & _MASK64)
    return [(_mix64((state + (t + 1) * _GOLDEN) & _MASK64) >> 11) * (1.0 / (1 << 53)) for t in range(start, start + count)]


def generation_seed(seed: int | None) -> int:
    """The seed of one generation: the user's, or when none is given a fresh one from the OS's
    entropy (so unseeded runs differ from run to run and from process to process)."""
    return seed if seed is not None else secrets.randbits(64)
