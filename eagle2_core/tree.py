"""Draft trees as plain tensors, and the pure functions that build them.

A tree has N nodes. Node 0 is the *root*: the token the target itself chose at the end of the
previous cycle, which is not yet in the target's KV cache. Every other node is a drafted token.
Parents always come before children (index order is a topological order), which is what lets
acceptance and mask construction run without recursion.

EAGLE-2 (Li et al., 2024, section 4) builds the tree in two phases:
  * expansion: at each depth, the top-k nodes by *path score* (product of draft confidences along
    the path, a sum of log-probs here) are fed to the draft head again, so the tree grows where the
    draft is confident;
  * rerank: among every node drafted in the expansion phase, keep the `budget` with the highest
    path score. A child's path score never exceeds its parent's, so the kept set is a tree.
The functions below are those two steps plus the mask/position bookkeeping; the loop that calls
the draft head is `drafter.Drafter.draft_fn` (its tree growth: `Drafter._grow_dynamic` and
`Drafter._grow_static`). Every function takes a batch of trees, one per sequence.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor      # [N] long, node 0 is the root
    parents: torch.Tensor     # [N] long, parents[0] == -1
    depth: torch.Tensor       # [N] long, root at depth 0
    ancestors: torch.Tensor   # [N, N] bool, [i, j] is True when j is i or an ancestor of i
    scores: torch.Tensor | None = None  # [N] path log-prob of each node under the draft (root 0), dynamic trees only

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device) -> "DraftTree":
        return DraftTree(*(None if t is None else t.to(device)
                           for t in (self.tokens, self.parents, self.depth, self.ancestors, self.scores)))


def batch_trees(parents: torch.Tensor, depth_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths [B, N] and ancestor masks [B, N, N] of B trees from their parent vectors [B, N]
    (parents before children, -1 for the root). Each pass pushes ancestry down one level, so
    `depth_max` passes (the drafter knows the depth) settle a tree with no host read."""
    b, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    depth = torch.zeros(b, n, dtype=torch.long, device=parents.device)
    has_parent = parents >= 0
    p = parents.clamp(min=0)
    for _ in range(depth_max if n > 1 else 0):
        anc = anc | (anc.gather(1, p[:, :, None].expand(b, n, n)) & has_parent[:, :, None])
        depth = torch.where(has_parent, depth.gather(1, p) + 1, 0)
    return depth, anc


def host_ancestry(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`batch_trees` on the host for trees grown there (sources.py), parents [B, N] with -1 at
    the root and parents before children: (depths [B, N], ancestor masks [B, N, N]), one pass
    over the nodes instead of a gather per depth on small tensors."""
    b, n = parents.shape
    depth = np.zeros((b, n), dtype=np.int64)
    anc = np.zeros((b, n, n), dtype=bool)
    anc[:, 0, 0] = True
    rows = np.arange(b)
    for i in range(1, n):
        p = parents[:, i]
        depth[:, i] = depth[rows, p] + 1
        anc[:, i] = anc[rows, p]
        anc[:, i, i] = True
    return depth, anc


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, max_depth: int | None = None) -> DraftTree:
    """One tree (`batch_trees` at B = 1): depths and the ancestor mask from a parent vector."""
    depth, anc = batch_trees(parents[None], max_depth if max_depth is not None else tokens.shape[0] - 1)
    return DraftTree(tokens=tokens, parents=parents, depth=depth[0], ancestors=anc[0])


def rerank_batch(pool_tokens, pool_parents, pool_scores, roots, budget: int, depth_max: int):
    """EAGLE-2 rerank (section 4.2) per row: keep the `budget` drafted nodes with the highest path
    scores, in pool order. Pool entries are drafted depth by depth, so parents precede children
    (`pool_parents` indexes the pool, -1 = the root); ties go to the earlier, shallower node, so a
    parent always beats a child of equal score and the kept set stays a tree.
    Returns (tokens, parents, depth, ancestors, scores), each [B, budget + 1], root first."""
    b, p = pool_scores.shape
    dev = roots.device
    budget = max(0, min(budget, p))
    order = torch.sort(pool_scores, dim=1, descending=True, stable=True).indices[:, :budget]
    keep = torch.sort(order, dim=1).values
    remap = torch.full((b, p + 1), -1, dtype=torch.long, device=dev)
    remap.scatter_(1, keep + 1, torch.arange(1, budget + 1, device=dev).expand(b, budget))
    remap[:, :1].zero_()  # pool parent -1 is the root (zero_: no tensor from host data)
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=dev), remap.gather(1, pool_parents.gather(1, keep) + 1)], 1)
    tokens = torch.cat([roots[:, None], pool_tokens.gather(1, keep)], 1)
    # path scores travel with the tree: the calibration check (section 3) compares them with acceptance
    scores = torch.cat([torch.zeros(b, 1, dtype=pool_scores.dtype, device=dev), pool_scores.gather(1, keep)], 1)
    depth, anc = batch_trees(parents, depth_max)
    return tokens, parents, depth, anc, scores


def rerank(pool_tokens, pool_parents, pool_scores, root_token, budget: int, max_depth: int | None = None) -> DraftTree:
    """`rerank_batch` for one tree."""
    t, p, d, a, s = rerank_batch(pool_tokens[None], pool_parents[None], pool_scores[None], root_token.view(1), budget,
                                 max_depth if max_depth is not None else max(1, pool_tokens.shape[0]))
    return DraftTree(t[0], p[0], d[0], a[0], s[0])


def row_tree(tokens, parents, depth, anc, scores, b: int) -> DraftTree:
    """Row b of a batch of trees as one `DraftTree` (processors, sampling and reports work per sequence)."""
    return DraftTree(tokens[b], parents[b], depth[b], anc[b], None if scores is None else scores[b])


def static_choices(total_tokens: int, depth: int, top_k: int, decay: float = 0.45) -> list[tuple[int, ...]]:
    """An EAGLE-1 style static tree: the same shape every cycle, whatever the context.

    Each path is a tuple of sibling ranks, e.g. (0, 1) = second-ranked child of the top-ranked
    first token. The shape is the `total_tokens - 1` paths with the highest prior score, where the
    prior acceptance of rank r at any depth is decay**r times a per-depth discount: a fixed stand-in
    for the offline acceptance statistics EAGLE-1 used to hand-pick its tree.
    """
    budget = total_tokens - 1
    rank_logp = [math.log(1 - decay) + r * math.log(decay) for r in range(top_k)]
    depth_logp = math.log(0.7)  # deeper tokens are accepted less often, whatever their rank
    heap = [(-rank_logp[r], (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    chosen: list[tuple[float, tuple[int, ...]]] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append((neg, path))
        if len(path) < depth:
            for r in range(top_k):
                heapq.heappush(heap, (neg - depth_logp - rank_logp[r], path + (r,)))
    return sorted((p for _, p in chosen), key=lambda p: (len(p), p))


def chain_choices(depth: int) -> list[tuple[int, ...]]:
    """A plain chain: the draft's top-1 token at each depth."""
    return [(0,) * d for d in range(1, depth + 1)]


def choices_to_levels(choices: list[tuple[int, ...]]) -> list[list[tuple[int, int]]]:
    """Group static-tree paths by depth as (parent path index or -1, rank) pairs.

    Path indices refer to positions in `choices` (sorted by length then rank), so the drafter
    can expand a static tree depth by depth with tensor gathers instead of walking nodes.
    """
    index = {p: i for i, p in enumerate(choices)}
    levels: list[list[tuple[int, int]]] = []
    for p in choices:
        while len(levels) < len(p):
            levels.append([])
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"static tree path {p} has no parent path {p[:-1]}")
        parent = index[p[:-1]] if len(p) > 1 else -1
        levels[len(p) - 1].append((parent, p[-1]))
    return levels


# -- attention masks, batched: a cache cell has one index in every row (kvcache.KVCache) --------

def context_and_tree(past: torch.Tensor, visible: torch.Tensor, view: int) -> torch.Tensor:
    """[B, n, view] bool: row b's n queries see its context cells < past[b], plus the m tree rows
    at cells past[b] .. past[b] + m - 1 that `visible` [B, n, m] marks (tree attention, section 3)."""
    b, n, m = visible.shape
    k = torch.arange(view, device=visible.device)
    allowed = (k[None, None, :] < past[:, None, None]).expand(b, n, view).clone()
    cols = (past[:, None] + torch.arange(m, device=visible.device))[:, None, :].expand(b, n, m)
    return allowed.scatter_(2, cols, visible)


def causal_rows(positions: torch.Tensor, view: int) -> torch.Tensor:
    """[B, n, view] bool: a query at position p sees cells <= p (prefill and the draft's absorb)."""
    return torch.arange(view, device=positions.device)[None, None, :] <= positions[:, :, None]


def windowed(allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Sliding-window attention (Mistral, Gemma 3's local layers): keys within `window` positions."""
    if window is None:
        return allowed
    return allowed & (k_pos[:, None, :] > q_pos[:, :, None] - window)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [q, k] (or [batch, q, k]) as the additive [1 or batch, 1, q, k] float mask every
    attention backend takes: 0 where a key is seen, the dtype's lowest value where it is not."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None] if allowed.dim() == 2 else bias[:, None]
