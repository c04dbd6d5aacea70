"""Choosing each cycle's tree size from the draft's own confidence and the measured cost.

EAGLE-2's central observation (section 3) is that the draft head is well calibrated: a node's
path probability (the product of draft confidences along its path) approximates the chance
that verification accepts it. A tree's expected output is then 1 + the sum of its nodes' path
probabilities (the 1 is the target's bonus token), and the best size for this cycle is the one
that buys the most expected tokens per millisecond of verification plus drafting. Only which
drafted nodes are verified changes, so output stays exactly the target's.

Pure functions on tensors; the costs come from `costs.py`. `BudgetChooser` holds what one
decoder has measured (cycle costs, calibration) and calls them.
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


# --- Calibration (section 3) as evidence and as a correction -------------------------------

def bin_counts(path_probs: torch.Tensor, on_path: torch.Tensor, bins: int) -> torch.Tensor:
    """[3, bins]: nodes, nodes on the accepted path, and summed path probability, per bin of
    path probability (bin i holds [i / bins, (i + 1) / bins))."""
    b = (path_probs * bins).long().clamp(0, bins - 1)
    return torch.stack([torch.bincount(b, minlength=bins).to(path_probs.dtype),
                        torch.bincount(b, weights=on_path.to(path_probs.dtype), minlength=bins),
                        torch.bincount(b, weights=path_probs, minlength=bins)])


def on_accepted_path(tree, path: torch.Tensor) -> torch.Tensor:
    """[tree.size - 1] 1.0 for the drafted nodes (root excluded) on the accepted `path` (node indices)."""
    on = torch.zeros(tree.size, dtype=torch.float, device=tree.tokens.device)
    return on.index_fill_(0, path, 1.0)[1:]


def calibration_gap(counts: torch.Tensor) -> float:
    """Expected calibration error: the node-weighted mean |confidence - acceptance| over bins.
    The paper's claim (section 3, figure 4) is that this is small for an EAGLE head."""
    nodes, accepted, conf = counts.double()
    total = float(nodes.sum())
    return float((conf - accepted).abs().sum()) / total if total else 0.0


# A head whose node-weighted gap exceeds this is called badly calibrated (`compare` says so).
# The correction below is always applied, shrunk toward the draft's confidence, so on a head
# within this gap it changes little; beyond it, it changes which sizes pay.
BADLY_CALIBRATED = 0.03


def calibrate(path_probs: torch.Tensor, counts: torch.Tensor, prior_nodes: float) -> torch.Tensor:
    """Path probabilities corrected by the measured acceptance of their confidence bin.

    Each bin scales its nodes by (accepted + w m) / (confidence sum + w m), where m is the bin's
    mean confidence and w = `prior_nodes` pseudo-nodes that are perfectly calibrated: with no
    evidence the draft's own confidence stands (the paper's finding), with much evidence the
    bin's measured acceptance rate does. Scaling (rather than replacing by the bin mean) keeps
    the order of nodes within a bin; results are capped at 1.
    """
    bins = counts.shape[1]
    nodes, accepted, conf = counts.to(path_probs.dtype)
    centre = (torch.arange(bins, dtype=path_probs.dtype, device=path_probs.device) + 0.5) / bins
    m = torch.where(nodes > 0, conf / nodes.clamp(min=1), centre)
    ratio = (accepted + prior_nodes * m) / (conf + prior_nodes * m)
    b = (path_probs * bins).long().clamp(0, bins - 1)
    return (path_probs * ratio[b]).clamp(max=1.0)


class BudgetChooser:
    """The per-cycle budget of one decoder: measured costs and calibration, refined by its cycles.

    The cost profile (costs.py) is measured once per machine at a short context; real cycles
    run at longer contexts and add acceptance and cache work, so every timed cycle refines the
    table: a size's cost is its observed mean, shrunk toward the profile (scaled by how far the
    observed cycles ran from it) with `prior_cycles` pseudo-cycles. Likewise the head's measured
    calibration corrects its confidence (`calibrate`). Both only change which drafted nodes are
    verified, so the output stays the target's. The state lives as long as the decoder, so a
    chat's later turns choose from what its earlier ones measured.
    """

    def __init__(self, profile, max_tokens: int, step_ms: float, bins: int = 10, prior_cycles: float = 4.0, prior_nodes: float = 50.0):
        self.prior = profile.verify_table(max_tokens)            # [max_tokens] ms by rows, float64, CPU
        self.obs_sum = torch.zeros(max_tokens, dtype=torch.float64)
        self.obs_n = torch.zeros(max_tokens, dtype=torch.float64)
        # Drafting costs a per-cycle overhead (top-k, pool bookkeeping, rerank, these choices)
        # plus one head step per level (the absorb of the new pairs, then one per depth). Only the
        # step is marginal: charging the whole cycle per step would make every level look as dear
        # as a whole draft and keep trees at depth 1 (measured: issue 23). Both are fitted to the
        # timed cycles (`draft_cost`), the step starting from the profile's measured head step.
        self.step_prior = float(step_ms)
        self.draft_n, self.draft_sums = 0, [0.0, 0.0, 0.0, 0.0]  # cycles; sums of steps, ms, steps^2, steps * ms
        self.counts = torch.zeros(3, bins, dtype=torch.float64)  # nodes, accepted, confidence sum (bin_counts)
        # The best child's own confidence (given its parent), averaged over expansions: how much
        # of a front node's path probability a deeper level is expected to keep.
        self.keep_sum, self.keep_n = 0.0, 0
        self.prior_cycles, self.prior_nodes = prior_cycles, prior_nodes
        self.learn_costs = True  # False: keep the profile's costs (tests that need a known cost table)
        self._table = None       # verify_table(), kept until the next observed cycle
        self._fit = None         # draft_fit(), likewise

    def verify_table(self) -> torch.Tensor:
        if self._table is None:
            self._table = self._blend()
        return self._table

    def _blend(self) -> torch.Tensor:
        seen = self.obs_n > 0
        scale = float(self.obs_sum.sum() / (self.prior * self.obs_n).sum()) if seen.any() else 1.0
        w = self.prior_cycles
        return (w * scale * self.prior + self.obs_sum) / (w + self.obs_n)

    def draft_fit(self) -> tuple[float, float]:
        """(overhead ms per cycle, ms per head step) fitted to the timed cycles: ridge regression of
        draft ms on steps, the slope shrunk toward the profile's head step with `prior_cycles`
        pseudo-cycles of unit step variance (so with cycles of one depth only, the step stays the
        profile's) and the overhead toward 0 with as many pseudo-cycles."""
        if self._fit is None:
            w, n = self.prior_cycles, self.draft_n
            s, y, ss, sy = self.draft_sums
            sxx, sxy = (ss - s * s / n, sy - s * y / n) if n else (0.0, 0.0)  # centred sums
            step = max(0.0, (w * self.step_prior + sxy) / (w + sxx))
            self._fit = (max(0.0, (y - step * s) / (w + n)), step)
        return self._fit

    def step_cost(self) -> float:
        """ms of one more draft step (the fitted slope)."""
        return self.draft_fit()[1]

    def draft_cost(self, steps: int) -> float:
        """ms of a cycle's drafting with `steps` head steps: the fitted overhead plus the steps."""
        overhead, step = self.draft_fit()
        return overhead + steps * step

    def _rate(self, p: torch.Tensor, steps: int) -> float:
        """Best expected tokens per ms over prefixes of `p` (calibrated, highest first)."""
        p = p[: self.prior.numel() - 1]
        gain = expected_tokens(p)
        return float((gain / (self.verify_table()[: p.numel() + 1] + self.draft_cost(steps))).max())

    def choose(self, path_probs_desc: torch.Tensor, steps: int) -> int:
        """Tree size (root included) for this cycle's reranked path probabilities, `steps` draft steps spent."""
        p = calibrate(path_probs_desc.double().cpu(), self.counts, self.prior_nodes)
        return choose_budget(p[: self.prior.numel() - 1], self.verify_table(), self.draft_cost(steps))

    def worth_expanding(self, pool_logp: torch.Tensor, front_logp: torch.Tensor, steps: int, remaining: int) -> bool:
        """Whether drafting deeper is expected to pay (depth chosen per cycle, like the size).

        Now: the best rate from the pool drafted so far with `steps` steps spent. Deeper: each of
        the next l levels (l = 1 .. `remaining`) adds one child per front node whose path
        probability keeps the measured share of its parent's; it pays if some l beats now. So
        a cycle whose first guesses are weak stops after the absorb step and verifies a small
        tree, where a preset depth would pay for every level (on a CPU where one extra row costs
        nearly a whole forward, often just the root).
        """
        cal = lambda lp: calibrate(lp.double().exp().cpu(), self.counts, self.prior_nodes)  # noqa: E731
        pool = cal(pool_logp)
        now = self._rate(torch.sort(pool, descending=True).values, steps)
        keep = (self.keep_sum + 0.5 * self.prior_cycles) / (self.keep_n + self.prior_cycles)  # a half before any evidence
        front = cal(front_logp)
        extra = []
        for level in range(1, remaining + 1):
            extra.append(front * keep ** level)
            p = torch.sort(torch.cat([pool, *extra]), descending=True).values
            if self._rate(p, steps + level) > now:
                return True
        return False

    def note_children(self, child_logp: torch.Tensor) -> None:
        """One expansion: [front, k] children's log-probabilities given their parents."""
        self.keep_sum += float(child_logp.max(-1).values.exp().sum())
        self.keep_n += child_logp.shape[0]

    def observe(self, path_probs: torch.Tensor, on_path: torch.Tensor, draft_ms: float, verify_ms: float, steps: int = 1) -> None:
        """One verified cycle: its drafted nodes' path probabilities, which were accepted, its
        times, and how many draft steps it took."""
        n = path_probs.numel() + 1
        if self.learn_costs:
            if n <= self.obs_n.numel():
                self.obs_sum[n - 1] += verify_ms
                self.obs_n[n - 1] += 1
            self.draft_n += 1
            for i, v in enumerate((steps, draft_ms, steps * steps, steps * draft_ms)):
                self.draft_sums[i] += v
            self._table = self._fit = None
        if path_probs.numel():
            self.counts += bin_counts(path_probs.double().cpu(), on_path.cpu(), self.counts.shape[1])

    @property
    def gap(self) -> float:
        return calibration_gap(self.counts)
