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
the draft head lives in `drafter.py`.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

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


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, max_depth: int | None = None) -> DraftTree:
    """Depths and the ancestor mask from a parent vector (parents before children).

    Each pass pushes ancestry down one level, so a tree of depth D needs D passes: a loop over
    depth levels, never over nodes. Given `max_depth` (the drafter knows it) the passes run
    without checking for convergence, i.e. without a host sync.
    """
    n = tokens.shape[0]
    device = tokens.device
    ancestors = torch.eye(n, dtype=torch.bool, device=device)
    depth = torch.zeros(n, dtype=torch.long, device=device)
    if n > 1:
        # Whole-tensor updates (no slice assignment): every non-root row ORs in its parent's row.
        has_parent = (parents >= 0)
        p = parents.clamp(min=0)
        for _ in range(max_depth if max_depth is not None else n - 1):
            new_anc = ancestors | (ancestors[p] & has_parent[:, None])
            new_depth = torch.where(has_parent, depth[p] + 1, 0)
            if max_depth is None and torch.equal(new_anc, ancestors) and torch.equal(new_depth, depth):
                break
            ancestors, depth = new_anc, new_depth
    return DraftTree(tokens=tokens, parents=parents, depth=depth, ancestors=ancestors)


def select_expansion(path_scores: torch.Tensor, k: int) -> torch.Tensor:
    """EAGLE-2 expansion (section 4.1): indices of the k candidates with the highest path score.

    `path_scores` is flat over all candidates of this depth (k parents x k children). Passing the
    node's own log-prob instead of the path score gives the paper's "expand by confidence" ablation.
    """
    k = min(k, path_scores.numel())
    return torch.topk(path_scores, k, sorted=True).indices


def rerank(
    pool_tokens: torch.Tensor,
    pool_parents: torch.Tensor,
    pool_scores: torch.Tensor,
    root_token: torch.Tensor,
    budget: int,
    max_depth: int | None = None,
) -> DraftTree:
    """EAGLE-2 rerank (section 4.2): keep the `budget` drafted nodes with the highest path scores.

    Pool entries are drafted nodes in the order they were drafted (depth by depth), so every
    parent precedes its children; `pool_parents` indexes the pool, -1 meaning the root.
    Ties are broken towards the earlier (shallower) node, so a parent always wins over a child
    with the same score and the kept set stays closed under ancestry.
    """
    budget = max(0, min(budget, pool_tokens.shape[0]))
    order = torch.sort(pool_scores, descending=True, stable=True).indices[:budget]
    keep = torch.sort(order).values  # pool order = parents before children
    # Map pool index -> tree index (root is tree index 0, kept nodes 1..budget).
    remap = torch.full((pool_tokens.shape[0] + 1,), -1, dtype=torch.long, device=pool_tokens.device)
    remap.index_copy_(0, keep + 1, torch.arange(1, budget + 1, device=pool_tokens.device))
    remap[:1].zero_()  # pool parent -1 (+1 -> 0) is the root
    parents = remap[pool_parents[keep] + 1]
    tokens = torch.cat([root_token.view(1), pool_tokens[keep]])
    parents = torch.cat([torch.full((1,), -1, dtype=parents.dtype, device=parents.device), parents])  # no host->device copy
    tree = tree_from_parents(tokens, parents, max_depth)
    # Path scores travel with the tree: the paper's calibration check (section 3) compares them
    # with what verification accepts.
    tree.scores = torch.cat([torch.zeros(1, dtype=pool_scores.dtype, device=pool_scores.device), pool_scores[keep]])
    return tree


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


def tree_attention_bias(tree: DraftTree, past_len: int, dtype: torch.dtype, sliding_window: int | None = None) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, past_len + N] for verifying the tree on top of a cache.

    Every node sees the whole committed context plus its own ancestors (paper section 3: tree
    attention). With a sliding window, a node at absolute position q sees keys at positions > q - w.
    An additive float mask works with every attention backend (eager, sdpa, flex via conversion).
    """
    device = tree.tokens.device
    allowed = appended_visible(tree.ancestors, past_len)
    if sliding_window is not None:
        q_pos = past_len + tree.depth  # absolute position of each node
        k_pos = torch.cat([torch.arange(past_len, device=device), past_len + tree.depth])
        allowed &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
    return additive(allowed, dtype)


def causal_attention_bias(q_len: int, past_len: int, dtype: torch.dtype, device, sliding_window: int | None = None) -> torch.Tensor:
    """Ordinary causal additive mask [1, 1, q_len, past_len + q_len] (prefill and plain appends)."""
    q_pos = past_len + torch.arange(q_len, device=device)
    k_pos = torch.arange(past_len + q_len, device=device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
    return additive(allowed, dtype)


def appended_visible(visible: torch.Tensor, past_len: int) -> torch.Tensor:
    """[n, past_len + m] bool over a growable cache: every row sees the past_len context keys, plus
    the m rows appended after them that `visible` [n, m] marks (its ancestors and itself)."""
    ctx = torch.ones(visible.shape[0], past_len, dtype=torch.bool, device=visible.device)
    return torch.cat([ctx, visible], dim=1)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [q, k] (or [batch, q, k]) as the additive [1 or batch, 1, q, k] float mask every
    attention backend takes: 0 where a key is seen, the dtype's lowest value where it is not."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None] if allowed.dim() == 2 else bias[:, None]


# -- the same masks over a static cache (graph mode, issue 16) --------------------------------
# A static cache has `capacity` slots whatever the length, and the length lives on the device,
# so these masks always have capacity columns and take the length as a tensor. Context slot c
# holds position c; the tree's rows sit in the slots right after the context.

def static_causal_bias(positions: torch.Tensor, capacity: int, dtype: torch.dtype, sliding_window: int | None = None) -> torch.Tensor:
    """[1, 1, n, capacity]: row i (at position positions[i], written to slot positions[i]) sees slots <= its own."""
    k_pos = torch.arange(capacity, device=positions.device)
    allowed = k_pos[None, :] <= positions[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > (positions[:, None] - sliding_window)
    return additive(allowed, dtype)


def static_visible(visible: torch.Tensor, past_len: torch.Tensor, capacity: int) -> torch.Tensor:
    """[n, capacity] bool: every row sees the context slots < past_len, plus the m tree rows in
    slots past_len .. past_len + m - 1 that `visible` [n, m] marks (its ancestors and itself)."""
    n, m, device = visible.shape[0], visible.shape[1], visible.device
    allowed = (torch.arange(capacity, device=device) < past_len)[None].expand(n, capacity).clone()
    allowed.scatter_(1, (past_len + torch.arange(m, device=device))[None].expand(n, -1), visible)
    return allowed


def static_tree_bias(tree: DraftTree, past_len: torch.Tensor, capacity: int, dtype: torch.dtype, sliding_window: int | None = None) -> torch.Tensor:
    """`tree_attention_bias` over a static cache: [1, 1, N, capacity], the tree in slots past_len + i."""
    n, device = tree.size, tree.tokens.device
    slots = past_len + torch.arange(n, device=device)
    allowed = static_visible(tree.ancestors, past_len, capacity)
    if sliding_window is not None:
        q_pos = past_len + tree.depth
        k_pos = torch.arange(capacity, device=device).scatter(0, slots, q_pos)
        allowed &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
    return additive(allowed, dtype)
