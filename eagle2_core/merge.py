"""The merge of draft sources into one tree per row (sources.py): the head's candidate pool, when
the head drafts, and the head-free sources' children of any node, grown best-first by the
acceptance estimate's calibrated path probability, sized by the policy (policy.py), and padded
into the verify's tensors. Live mode's dynamic trees only: it runs on the host."""
from __future__ import annotations

import numpy as np

from .policy import Acceptance
from .sources import DraftSources, pad_trees


class Merger:
    """Every busy row's merged tree from the sources; `policy` (set by the engine, None: no
    policy) sizes them and supplies the acceptance estimate, else `acceptance` does."""

    def __init__(self, sources: DraftSources, rows):
        self.sources, self.rows = sources, rows
        self.policy = None
        self.acceptance = Acceptance()  # the estimates where no policy runs

    def acceptance_of(self) -> Acceptance:
        return self.policy.acceptance if self.policy is not None else self.acceptance

    def merge(self, pool_t, pool_p, pool_s, root, n_max: int, steps: int):
        """One tree per row from every source's candidates: the head's pool (None: no head this
        cycle, else after `steps` head steps) and the head-free sources' children of any node,
        then sized by the policy (section 3: expected tokens per measured ms). Returns (tokens,
        parents, depth, ancestors, log scores), [B, N]."""
        head = None if pool_t is None else (pool_t.tolist(), pool_p.tolist(), pool_s.exp().tolist())
        arm, steps = ("head", steps) if head is not None else ("free", 0)
        trees = self.grow_rows(head, root, arm, steps, n_max)
        n = max((len(t.tokens) for t in trees if t is not None), default=1)
        if self.policy is not None and n > 1:
            n = self.policy.size(self.tree_probs(trees), arm, steps)
        return self.padded(trees, n, root)

    def grow_rows(self, head, root, arm: str, steps: int, n_max: int) -> list:
        """Every busy row's merged tree (sources.grow_row)."""
        src, policy = self.sources, self.policy
        roots = root.tolist()
        floor = policy.growth_floor(arm, steps) if policy is not None else None
        return [None if s is None else src.grow_row(s, roots[b], n_max, self.acceptance_of(),
                                                    None if head is None else tuple(h[b] for h in head), floor)
                for b, s in enumerate(self.rows.slots)]

    def padded(self, trees: list, n: int, root):
        """The rows' trees cut to `n` nodes as the verify's tensors (sources.pad_trees)."""
        self.sources.last = trees
        tokens, parents, scores, depth, anc = pad_trees(trees, n, root.device, self.sources.vocab)
        tokens[:, 0] = root
        return tokens, parents, depth, anc, scores

    @staticmethod
    def tree_probs(trees: list) -> np.ndarray:
        """[busy rows, m - 1]: each busy row's node scores after the root, best first, zero-padded."""
        busy = [t for t in trees if t is not None]
        m = max((len(t.tokens) for t in busy), default=1)
        probs = np.zeros((len(busy), m - 1))
        for j, t in enumerate(busy):
            probs[j, : len(t.scores) - 1] = t.scores[1:]
        return probs
