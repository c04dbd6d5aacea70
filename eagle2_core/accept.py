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


def accept_greedy_batch(tokens, parents, depth, anc, argmax, width: int):
    """Temperature 0, per row: the longest path on which every token equals the target's argmax.

    A node matches when its token is its parent's argmax (the root, chosen by the target itself,
    always does); a path survives when all its nodes match. Siblings carry distinct tokens, so at
    most one node per depth survives and the deepest survivor names the path. Fixed shapes, no
    host read (capturable). Returns (path [B, width]: node index at each depth, root first,
    padded with the root; accepted [B]: draft tokens on the path; bonus [B]: the target's token
    after it, -1 where the path ends at a node whose argmax was not computed)."""
    match = (tokens == argmax.gather(1, parents.clamp(min=0))) | (parents < 0)
    survives = ~(anc & ~match[:, None, :]).any(dim=2)
    best = torch.argmax(torch.where(survives, depth, -1), dim=1)
    b, n = tokens.shape
    rows = torch.arange(b, device=tokens.device)
    on_path = anc[rows, best]
    slot = torch.where(on_path, depth, width)  # off-path nodes go to a spare column
    path = torch.zeros(b, width + 1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, torch.arange(n, device=tokens.device).expand(b, n) * on_path)
    return path[:, :width], depth[rows, best], argmax[rows, best]


def accept_greedy_row(tokens: list[int], parents: list[int], depth: list[int], argmax: list[int], width: int):
    """`accept_greedy_batch` for one row on host lists (a few nodes: a tensor op each would cost
    more than the loop): (path, width node indices root first, padded with the root; accepted
    draft tokens; bonus token)."""
    ok, best = [True] * len(tokens), 0  # a node survives where it and every ancestor is its parent's argmax
    for i in range(1, len(tokens)):
        ok[i] = ok[parents[i]] and tokens[i] == argmax[parents[i]]
        if ok[i] and depth[i] > depth[best]:
            best = i
    path, i = [0] * width, best
    while i > 0:
        path[depth[i]], i = i, parents[i]
    return path, depth[best], argmax[best]


def children_lists(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    return kids


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token at which the cumulative distribution first exceeds u (of the row's total mass)."""
    c = probs.double().cumsum(-1)
    total = float(c[-1])
    if not total > 0 or total == float("inf"):  # NaN scores would draw the last id every time
        raise FloatingPointError("the next-token distribution is not a number (NaN or infinite scores): nothing to sample from")
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
