"""Choosing each cycle's tree size from the draft's own confidence and the measured cost.

EAGLE-2's central observation (section 3) is that the draft head is well calibrated: a node's
path probability (the product of draft confidences along its path) approximates the chance
that verification accepts it. A tree's expected output is then 1 + the sum of its nodes' path
probabilities (the 1 is the target's bonus token), and the best size for this cycle is the one
that buys the most expected tokens per millisecond of verification plus drafting. Only which
drafted nodes are verified changes, so output stays exactly the target's.

Pure functions on tensors; the costs come from `costs.py`. `BudgetChooser` holds what one
decoder has measured (cycle costs, calibration) and calls them; `TreePolicy` is what the cycle
asks it while a tree grows (cycle.py), and tells it once the tree is verified.
"""
from __future__ import annotations

import numpy as np
import torch


def host(x) -> np.ndarray:
    """A float64 host array of a tensor or array: the choices below run on the host, several
    times a cycle over a few dozen numbers, where a tensor op's overhead would dominate."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def expected_tokens(path_probs_desc) -> np.ndarray:
    """[1 + sum of the first i path probabilities] for tree sizes i + 1 = 1 .. len + 1."""
    return 1.0 + np.concatenate(([0.0], np.cumsum(host(path_probs_desc))))


def choose_budget(path_probs_desc, verify_ms, draft_ms: float | torch.Tensor = 0.0) -> int:
    """Tree size n* (root included) maximising expected tokens per ms.

    `path_probs_desc`: the reranked nodes' path probabilities, highest first (a prefix of that
    order is closed under ancestry: a child's path probability never exceeds its parent's).
    `verify_ms[n - 1]`: the measured cost of verifying n rows, for n = 1 .. at least len + 1.
    `draft_ms`: the cycle's drafting cost, paid whatever the size. Ties go to the smaller tree.
    """
    p, v = host(path_probs_desc), host(verify_ms)
    m = p.size + 1
    if v.size < m:
        raise ValueError(f"cost table has {v.size} sizes, the tree needs {m}")
    rate = expected_tokens(p) / (v[:m] + float(draft_ms))
    return int(np.argmax(rate)) + 1  # argmax returns the first maximum: the smallest tree


# --- Calibration (section 3) as evidence and as a correction -------------------------------

def bin_counts(path_probs: torch.Tensor, on_path: torch.Tensor, bins: int) -> torch.Tensor:
    """[3, bins]: nodes, nodes on the accepted path, and summed path probability, per bin of
    path probability (bin i holds [i / bins, (i + 1) / bins))."""
    b = (path_probs * bins).long().clamp(0, bins - 1)
    return torch.stack([torch.bincount(b, minlength=bins).to(path_probs.dtype),
                        torch.bincount(b, weights=on_path.to(path_probs.dtype), minlength=bins),
                        torch.bincount(b, weights=path_probs, minlength=bins)])


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


def calibration_ratio(counts, prior_nodes: float) -> np.ndarray:
    """Each bin's correction factor (accepted + w m) / (confidence sum + w m), m the bin's mean
    confidence and w = `prior_nodes` perfectly calibrated pseudo-nodes: `counts` [..., 3, bins]
    (bin_counts, or one such table per depth) -> [..., bins]."""
    c = host(counts)
    bins = c.shape[-1]
    nodes, accepted, conf = c[..., 0, :], c[..., 1, :], c[..., 2, :]
    centre = (np.arange(bins, dtype=np.float64) + 0.5) / bins
    m = np.where(nodes > 0, conf / np.maximum(nodes, 1.0), centre)
    return (accepted + prior_nodes * m) / (conf + prior_nodes * m)


def calibrate(path_probs, counts, prior_nodes: float, ratio: np.ndarray | None = None) -> np.ndarray:
    """Path probabilities corrected by the measured acceptance of their confidence bin.

    Each bin scales its nodes by `calibration_ratio`: with no evidence the draft's own
    confidence stands (the paper's finding), with much evidence the bin's measured acceptance
    rate does. Scaling (rather than replacing by the bin mean) keeps the order of nodes within a
    bin; results are capped at 1. `ratio`: the table already computed from `counts`.
    """
    p = host(path_probs)
    ratio = calibration_ratio(counts, prior_nodes) if ratio is None else ratio
    bins = ratio.shape[-1]
    return np.minimum(p * ratio[np.clip((p * bins).astype(np.int64), 0, bins - 1)], 1.0)


MERGED_DEPTHS = 3  # merged trees' scores are calibrated per depth 1, 2, 3+


def calibrate_by_depth(path_probs, depth, counts, prior_nodes: float, ratio: np.ndarray | None = None) -> np.ndarray:
    """`calibrate` with one table per depth bucket: `counts` [MERGED_DEPTHS, 3, bins], `depth`
    (same shape as `path_probs`) each node's depth (1 = a root child)."""
    p = host(path_probs)
    ratio = calibration_ratio(counts, prior_nodes) if ratio is None else ratio
    bins = ratio.shape[-1]
    bucket = np.clip(host(depth).astype(np.int64), 1, ratio.shape[0]) - 1
    return np.minimum(p * ratio[bucket, np.clip((p * bins).astype(np.int64), 0, bins - 1)], 1.0)


def monotone(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted least-squares fit of `values` that never decreases (pool adjacent violators).

    A verify of n + 1 rows cannot cost less than one of n (the n-row forward could always be padded),
    so where the timed table dips, the dip is noise of the machine; left in, one noisy size decides
    which tree sizes look cheap (a profile with 3 rows 10% dearer than 6 kept trees small). Pooling
    the violating neighbours at their evidence-weighted mean keeps every size's level of evidence."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return torch.tensor([v for v, _, c in blocks for _ in range(c)], dtype=values.dtype)


def head_pays(tokens: float, ms: float, head_tokens: float, head_ms: float) -> bool:
    """Tokens per ms with the head (tokens in ms) at least those without it (its exclusive
    tokens and its draft time taken away): T / C >= (T - m) / (C - d)."""
    if ms <= head_ms:
        return True
    return tokens / ms >= (tokens - head_tokens) / (ms - head_ms)


def mean_row(probs) -> np.ndarray:
    """[rows, m] path probabilities -> [m]: each row sorted highest first, then averaged over rows.
    One tree size serves every row of a batch, so its expected tokens per row are the mean of the
    rows' own prefixes (at batch 1, the row itself)."""
    return -np.sort(-host(probs), axis=-1).mean(0)


def _bin_counts(p: np.ndarray, on: np.ndarray, bins: int, offset: np.ndarray | int = 0, groups: int = 1) -> np.ndarray:
    """`bin_counts` on the host for the chooser's own evidence (`bin_counts` stays on the tree's
    device for the summaries' confidence table, read only when reported), with `offset` (a
    multiple of `bins` per entry) splitting the entries into `groups` tables: [3, groups, bins]."""
    cell = offset + np.clip((p * bins).astype(np.int64), 0, bins - 1)
    size = groups * bins
    out = np.stack([np.bincount(cell, minlength=size).astype(np.float64), np.bincount(cell, weights=on, minlength=size),
                    np.bincount(cell, weights=p, minlength=size)])
    return out.reshape(3, groups, bins)


def new_tally(old: dict | None = None, cycles: int = 0) -> dict:
    """Evidence of what the head adds beside the head-free sources (`head_pays`): cycles, tokens
    and ms of the cycles it drafted, the accepted nodes only it proposed and its draft ms. From
    `old` (a new run, or a try after a stop): its sums at half weight, its cycles at `cycles`, so
    the head drafts `patience - cycles` cycles before it is judged again, on them with the old
    ones behind them (a few cycles alone judge the head by chance; all earlier runs at full
    weight kept a head judged early stopped in every later run after one cycle)."""
    if old is None:
        return {"cycles": 0, "tokens": 0.0, "ms": 0.0, "head_tokens": 0.0, "head_ms": 0.0}
    return {k: cycles if k == "cycles" else 0.5 * v for k, v in old.items()}


def add_to_tally(t: dict, tokens: float, ms: float, head_tokens: float, head_ms: float) -> None:
    """One cycle the head drafted: what it made in how long, what exists because of the head, its draft ms."""
    t["cycles"] += 1
    t["tokens"] += tokens
    t["ms"] += ms
    t["head_tokens"] += head_tokens
    t["head_ms"] += head_ms


def tally_pays(t: dict, patience: int) -> bool:
    """`head_pays` on a tally, once it holds `patience` cycles (before that, the head drafts)."""
    return t["cycles"] < patience or head_pays(t["tokens"], t["ms"], t["head_tokens"], t["head_ms"])


class HeadGate:
    """Whether the head drafts this cycle, judged by what the head-free sources already offer.

    The head's step is paid before its nodes are seen, so the per-cycle budget cannot leave it
    out; but the head-free sources' tree is known first, at no draft cost, and section 3's
    estimate of its worth (1 + the sum of its verified nodes' calibrated probabilities) says how
    much room the head has: where a copied passage already offers three tokens, the head's nodes
    mostly repeat them. So the evidence of `head_pays` is kept per bin of that estimate, and the
    head drafts a cycle where, in its bin (every bin's evidence behind it: `judged`), the cycles it
    drafted gave more tokens per ms than they would have without its steps and its own accepted
    nodes. A bin that does not pay still drafts one cycle in `explore + 1` (its evidence would
    otherwise never change); every bin starts on (`patience` cycles before it is judged), and
    keeps about its last `window` cycles. Only which nodes are drafted changes: the output stays
    the target's."""

    EDGES = (1.3, 1.6, 2.0, 2.6, 3.5)  # expected tokens of the head-free tree: bins of room left for the head

    def __init__(self, patience: int = 8, explore: int = 8, window: int = 32):
        self.patience, self.explore, self.window = patience, explore, window
        self.tallies = [new_tally() for _ in range(len(self.EDGES) + 1)]
        self.skips = [0] * len(self.tallies)

    def bin(self, expected: float) -> int:
        return sum(expected >= e for e in self.EDGES)

    def judged(self, b: int) -> dict:
        """Bin b's evidence with every bin's pooled behind it as `patience` pseudo-cycles at their
        mean (its own cycles still count toward `patience`). A bin's first cycles judge the head
        by chance: measured (SmolLM2, mt16, float32 weights), a bin whose first 8 head cycles
        happened to owe the head nothing was skipped for 39 of its next 48 cycles, where a head
        drafting every cycle made 0.34 tokens a cycle there and paid (82.6 tokens/s with it, 78.2
        without). Where the head truly adds nothing, a window of the bin's own cycles outweighs
        the pooled ones."""
        t = self.tallies[b]
        n = sum(x["cycles"] for x in self.tallies)
        if not n:
            return t
        w = self.patience / n
        return {k: v if k == "cycles" else v + w * sum(x[k] for x in self.tallies) for k, v in t.items()}

    def wants(self, b: int) -> bool:
        if tally_pays(self.judged(b), self.patience):
            self.skips[b] = 0
            return True
        self.skips[b] += 1
        if self.skips[b] > self.explore:
            self.skips[b] = 0
            return True
        return False

    def record(self, b: int, tokens: float, ms: float, head_tokens: float, head_ms: float) -> None:
        t = self.tallies[b]
        add_to_tally(t, tokens, ms, head_tokens, head_ms)
        if t["cycles"] > self.window:  # about the last `window` cycles of the bin: the text drifts
            keep = self.window / t["cycles"]
            for k in t:
                t[k] *= keep

    def new_run(self) -> None:
        """A new run (a chat's next turn, a prompt file's next prompt) keeps the evidence: the bins
        already say what the head adds beside what this text's sources offer."""
        self.skips = [0] * len(self.tallies)


class Backoff:
    """When to try drafting (or the head) again after a run stopped it for not paying: `first`
    cycles later, then twice as long after each further stop in the same run. A stop judges the
    text so far, and the text changes within an answer (prose, then a copied passage or code);
    where drafting never pays, the tries cost a few cycles each, fewer and fewer."""

    def __init__(self, first: int = 16, trial: int = 4):
        self.wait, self.at = first, None
        self.trial = trial  # cycles a retry drafts before it is judged: where nothing pays they are lost

    def stopped(self, cycle: int) -> None:
        self.at = cycle + self.wait
        self.wait *= 2

    def due(self, cycle: int) -> bool:
        """True once when the try is due."""
        if self.at is None or cycle < self.at:
            return False
        self.at = None
        return True


class BudgetChooser:
    """The per-cycle budget of one engine: measured costs and calibration, refined by its cycles.

    Costs are keyed by (B, N): the verify of N tree rows for each of B sequences, and the draft of
    B trees. The cost profile (costs.py) is measured once per machine at a short context; real
    cycles run at longer contexts and add acceptance and cache work, so every timed cycle refines
    the table of its batch size: a size's cost is its observed mean, shrunk toward the profile
    (scaled by how far the observed cycles ran from it) with `prior_cycles` pseudo-cycles, the
    table then held non-decreasing in the tree size (`monotone`). The
    head's measured calibration corrects its confidence per bin (`calibrate`). Plain decoding is
    one of the choices: when drafting has not paid over a run's cycles, the engine stops drafting
    (`drafting_pays`). All this only changes which drafted nodes are verified, so the output stays
    the target's. The state lives as long as the engine, so a chat's later turns choose from what
    its earlier ones measured.
    """

    LIFE_WINDOW = 256  # drafted cycles of earlier runs kept as `drafting_pays`'s prior (scaled down past it)

    def __init__(self, profile, max_tokens: int, step_ms: float, bins: int = 10, prior_cycles: float = 4.0, prior_nodes: float = 50.0,
                 batch_costs=None, step_at=None, patience: int = 8):
        self.profile, self.max_tokens, self.batch_costs = profile, max_tokens, batch_costs
        self.step_prior = float(step_ms)
        self.step_at = step_at    # b -> ms of one draft step over b trees' front (None: the step at b = 1, times b)
        self.batch = 1
        self._by_batch: dict[int, dict] = {}
        self.counts = torch.zeros(3, bins, dtype=torch.float64)  # nodes, accepted, confidence sum (bin_counts)
        # The same for merged trees' scores (sources.py), per depth: each source's conditionals
        # are calibrated given the parent accepted (measured within a few % at depths 1-3), yet
        # the path scores of the nodes a tree verifies ran over their acceptance, the more the
        # deeper (SmolLM2, mt16: 1.1x at depth 1, 1.4x at 2, 2x at 3): a tree verifies the
        # best-scored of many candidates, whose estimates are high by selection, and a product
        # compounds it. The size is chosen on these scores corrected per depth and bin.
        self.merged_counts = torch.zeros(MERGED_DEPTHS, 3, bins, dtype=torch.float64)
        self._ratio_cache = self._floor_cache = None
        # The best child's own confidence (given its parent), averaged over expanded nodes weighted
        # by their path probability: how much of a front node's path probability a deeper level is
        # expected to keep, where the mass is.
        self.keep_sum, self.keep_n = 0.0, 0
        self.prior_cycles, self.prior_nodes = prior_cycles, prior_nodes
        self.learn_costs = True  # False: keep the profile's costs (tests that need a known cost table)
        self.patience = patience
        self.start_run(1)

    def start_run(self, batch: int, trial: int | None = None) -> None:
        """A run's (or a retry's) judgment of drafting starts: after `trial` cycles (`patience`
        unless said) it must pay (`drafting_pays`). The run that ends joins the earlier ones'
        evidence (about their last `LIFE_WINDOW` drafted cycles, per batch size)."""
        if getattr(self, "run_cycles", 0):
            life = self._state()["life"]
            for i, v in enumerate((self.run_tokens, self.run_ms, self.run_cycles)):
                life[i] += v
            if life[2] > self.LIFE_WINDOW:
                life[:] = [v * self.LIFE_WINDOW / life[2] for v in life]
        self.batch = batch
        self.run_cycles, self.run_tokens, self.run_ms = 0, 0.0, 0.0
        self.trial = self.patience if trial is None else trial

    # -- costs by batch size ------------------------------------------------------------------
    def _state(self) -> dict:
        b = self.batch
        if b not in self._by_batch:
            self._by_batch[b] = {"prior": self._prior(b), "sum": torch.zeros(self.max_tokens, dtype=torch.float64),
                                 "n": torch.zeros(self.max_tokens, dtype=torch.float64), "draft_n": 0, "draft": [0.0] * 4,
                                 "table": None, "fit": None, "life": [0.0, 0.0, 0.0]}
        return self._by_batch[b]

    def _prior(self, b: int) -> torch.Tensor:
        """ms of verifying 1 .. max_tokens nodes per row at batch b: the batch grid where measured,
        else the profile at b x N rows."""
        bc = self.batch_costs
        if b > 1 and bc is not None and b in bc.batches:
            return torch.tensor([bc.verify(b, n) for n in range(1, self.max_tokens + 1)], dtype=torch.float64)
        return self.profile.verify_table(b * self.max_tokens)[b - 1 :: b][: self.max_tokens].double()

    @property
    def prior(self) -> torch.Tensor:
        return self._state()["prior"]

    @property
    def obs_sum(self) -> torch.Tensor:
        return self._state()["sum"]

    @property
    def obs_n(self) -> torch.Tensor:
        return self._state()["n"]

    def verify_table(self) -> torch.Tensor:
        st = self._state()
        if st["table"] is None:
            prior, total, n = st["prior"].numpy(), st["sum"].numpy(), st["n"].numpy()
            seen = n > 0
            scale = float(total.sum() / (prior * n).sum()) if seen.any() else 1.0
            w = self.prior_cycles
            st["table"] = monotone(torch.from_numpy((w * scale * prior + total) / (w + n)), torch.from_numpy(w + n))
            st["table_np"] = st["table"].numpy()
        return st["table"]

    def _table(self) -> np.ndarray:
        """`verify_table` as an array (the per-cycle choices read it on the host, many times)."""
        self.verify_table()
        return self._state()["table_np"]

    def plain_ms(self) -> float:
        """ms of a plain step (the root alone) at this batch: the table's first size. The table is
        monotone, so a single noisy size cannot make plain look dear (one row once measured dearer
        than three kept a useless draft going) or cheap (once cheaper, it stopped a good one): a
        dip is pooled with its neighbours."""
        return float(self.verify_table()[0])

    def draft_fit(self) -> tuple[float, float]:
        """(overhead ms per cycle, ms per head step) fitted to this batch size's timed cycles: ridge
        regression of draft ms on steps, the slope shrunk toward the profile's head step with
        `prior_cycles` pseudo-cycles of unit step variance (so with cycles of one depth only, the
        step stays the profile's) and the overhead toward 0 with as many pseudo-cycles. Only the
        step is marginal: charging the whole draft per step would make every level look as dear
        as a whole draft and keep trees at depth 1 (measured)."""
        st = self._state()
        if st["fit"] is None:
            w, n = self.prior_cycles, st["draft_n"]
            s, y, ss, sy = st["draft"]
            sxx, sxy = (ss - s * s / n, sy - s * y / n) if n else (0.0, 0.0)  # centred sums
            prior = self.step_at(self.batch) if self.step_at is not None else self.step_prior * self.batch
            step = max(0.0, (w * prior + sxy) / (w + sxx))
            st["fit"] = (max(0.0, (y - step * s) / (w + n)), step)
        return st["fit"]

    def step_cost(self) -> float:
        """ms of one more draft step (the fitted slope)."""
        return self.draft_fit()[1]

    def draft_cost(self, steps: int) -> float:
        """ms of a cycle's drafting with `steps` head steps: the fitted overhead plus the steps."""
        overhead, step = self.draft_fit()
        return overhead + steps * step

    # -- choices --------------------------------------------------------------------------------
    # -- choices (host arrays: `host`) ---------------------------------------------------------
    def _ratios(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(the head's calibration table, the merged trees' per depth, the largest merged factor),
        computed once per cycle's evidence: tree growth and sizing read them many times."""
        if self._ratio_cache is None:
            merged = calibration_ratio(self.merged_counts, self.prior_nodes)
            self._ratio_cache = (calibration_ratio(self.counts, self.prior_nodes), merged, max(1.0, float(merged.max())))
        return self._ratio_cache

    def _cal(self, probs) -> np.ndarray:
        """The head's path probabilities corrected by its measured calibration (`calibrate`)."""
        return calibrate(probs, self.counts, self.prior_nodes, self._ratios()[0])

    def _rate(self, p: np.ndarray, steps: int) -> float:
        """Best expected tokens per row per ms over prefixes of `p` (one row's calibrated path
        probabilities, highest first)."""
        p = p[: self.max_tokens - 1]
        return float((expected_tokens(p) / (self._table()[: p.size + 1] + self.draft_cost(steps))).max())

    def choose(self, path_probs: torch.Tensor, steps: int, depth: torch.Tensor | None = None) -> int:
        """Tree size (root included) for this cycle: `path_probs` [rows, m] (or [m]) are each busy
        row's best path probabilities, `steps` draft steps spent; `depth` (same shape): a merged
        tree's node depths (sources.py: its scores on the one scale of acceptance estimates,
        corrected per depth), None for the head's raw confidence. `choose_budget` over the
        calibrated rows' mean (`mean_row`)."""
        p = np.atleast_2d(host(path_probs))
        if depth is None:
            p = self._cal(p)
        else:
            p = calibrate_by_depth(p, np.atleast_2d(host(depth)), self.merged_counts, self.prior_nodes, self._ratios()[1])
        return choose_budget(mean_row(p)[: self.max_tokens - 1], self._table(), self.draft_cost(steps))

    def growth_floor(self, steps: int) -> list[float]:
        """floor[k] for a tree of k nodes (root included): with expected tokens E so far, a next
        node of (calibrated) score p can make some larger size m pay only if
        E + (m - k) p > E (V(m) + D) / (V(k) + D) (scores descend, so the m - k nodes score at
        most p each), i.e. p >= E * floor[k], floor[k] = min over m of (V(m) - V(k)) / ((V(k) + D)
        (m - k)). Divided by the largest correction the merged calibration applies (so a raw
        score is never cut where its correction would have kept it)."""
        key = (steps, id(self._state()))
        if self._floor_cache is None or self._floor_cache[0] != key:
            v = self._table()
            d = self.draft_cost(steps)
            n = v.size
            k = np.arange(1, n + 1, dtype=np.float64)
            # [k, j]: (V(j) - V(k)) / ((V(k) + D)(j - k)) for j > k, the least over j per k
            with np.errstate(divide="ignore", invalid="ignore"):
                per = (v[None, :] - v[:, None]) / ((v[:, None] + d) * (k[None, :] - k[:, None]))
            per = np.where(k[None, :] > k[:, None], per, np.inf)
            floor = (per.min(1) / self._ratios()[2]).tolist()
            self._floor_cache = (key, [0.0] + floor[:-1] + [0.0])
        return self._floor_cache[1]

    def worth_expanding(self, pool_logp: torch.Tensor, front_logp: torch.Tensor, steps: int, remaining: int) -> bool:
        """Whether drafting deeper is expected to pay (depth chosen per cycle, like the size).

        Now: the best rate from the pool drafted so far with `steps` steps spent. Deeper: each of
        the next l levels (l = 1 .. `remaining`) adds one child per front node whose path
        probability keeps the measured share of its parent's; it pays if some l beats now. So
        a cycle whose first guesses are weak stops after the absorb step and verifies a small
        tree, where a preset depth would pay for every level (on a CPU where one extra row costs
        nearly a whole forward, often just the root). [rows, m] inputs: per row, then averaged.
        """
        pool = self._cal(np.exp(np.atleast_2d(host(pool_logp))))
        front = np.exp(np.atleast_2d(host(front_logp)))
        now = self._rate(mean_row(pool), steps)
        keep = (self.keep_sum + 0.5 * self.prior_cycles) / (self.keep_n + self.prior_cycles)  # a half before any evidence
        extra = [pool]
        for level in range(1, remaining + 1):
            # the deeper node's path probability is what the measured bins correct, not its factors
            extra.append(self._cal(front * keep ** level))
            if self._rate(mean_row(np.concatenate(extra, -1)), steps + level) > now:
                return True
        return False

    @property
    def drafting_pays(self) -> bool:
        """Plain decoding (N = 1, no draft) is one of the choices: after `patience` cycles of a run,
        drafting must have produced more tokens per ms than verifying the root alone would.

        A few cycles judge by chance: 13 tokens in 10 cycles is tau 1.3 where the same prompt
        gave 1.8 in another pass, and a stop on it decoded the stretch plain where drafting paid
        (SmolLM2, float32 weights, mt16: 99 of 324 cycles plain, 0.96x the best constant tree,
        which never stops). So the earlier runs' drafted cycles stand behind the run's own, as
        `patience` pseudo-cycles at their mean tokens and ms: a stop needs the run to fall
        clearly below plain where drafting has paid before, and comes as soon as ever where it
        has not."""
        if self.run_cycles < self.trial:
            return True
        tokens, ms = self.run_tokens, self.run_ms
        life_tokens, life_ms, life_cycles = self._state()["life"]
        if life_cycles:
            w = self.patience / life_cycles
            tokens, ms = tokens + w * life_tokens, ms + w * life_ms
        return tokens / ms >= self.batch / self.plain_ms()

    def head_pays(self, tally: dict | None) -> bool:
        """Whether the head pays beside the head-free sources (sources.py) over this run: with it,
        T tokens in C ms; without it, about T - m tokens (m: accepted nodes that exist because
        of the head) in C - d ms (d: its draft steps). Its draft step is paid before its nodes are
        seen, so the per-cycle budget cannot drop it; this measured rate does, after `patience`
        cycles (per cycle, by the head-free tree's worth, where `HeadGate` runs). None (no merged
        trees): nothing to compare."""
        return not tally or tally_pays(tally, self.patience)

    # -- evidence -------------------------------------------------------------------------------
    def note_children(self, child_logp: torch.Tensor, parent_logp: torch.Tensor | None = None) -> None:
        """One expansion: [front, k] children's log-probabilities given their parents, and the
        parents' path log-probabilities [front] (None: the root, weight 1 each).

        Weighted by the parent's path probability: the share that matters is the one kept by the
        nodes that carry the tree's expected tokens. Unweighted, the k - 1 unlikely front nodes
        (whose children are unsure) pulled it to about a third on SmolLM2 while the likely node's
        best child kept two thirds (acceptance at depth 2 given depth 1, fixed 6/2/3 trees), and
        the chooser stopped at depth 1."""
        best = child_logp.max(-1).values.exp()
        w = torch.ones_like(best) if parent_logp is None else parent_logp.exp().to(best.dtype)
        self.keep_sum += float((w * best).sum())
        self.keep_n += float(w.sum())

    def observe(self, path_probs: torch.Tensor, on_path: torch.Tensor, draft_ms: float, verify_ms: float, steps: int = 1,
                tokens: float | None = None, head_nodes: torch.Tensor | None = None, merged: tuple | None = None) -> None:
        """One verified cycle: its drafted nodes' path probabilities ([rows, N - 1] or [N - 1]),
        which were accepted, its times, its draft steps, and the tokens it produced. `head_nodes`
        (same shape, bool): in a merged tree, the nodes the head proposed, the only ones its
        calibration learns from (`path_probs` then holds the head's raw path probabilities);
        `merged`: there, (every node's merged score, its depth, whether it was accepted), what the
        size is chosen on (without the third, `on_path`)."""
        path_probs, on_path = torch.atleast_2d(path_probs), torch.atleast_2d(on_path)  # [rows, N - 1]
        n = path_probs.shape[-1] + 1
        st = self._state()
        if self.learn_costs:
            if n <= st["n"].numel():
                st["sum"][n - 1] += verify_ms
                st["n"][n - 1] += 1
            st["draft_n"] += 1
            for i, v in enumerate((steps, draft_ms, steps * steps, steps * draft_ms)):
                st["draft"][i] += v
            st["table"] = st["fit"] = None
        self.run_cycles += 1
        self.run_tokens += float(tokens) if tokens is not None else float(on_path.sum()) + path_probs.shape[0]
        self.run_ms += draft_ms + verify_ms
        self._ratio_cache = self._floor_cache = None
        on = host(on_path).reshape(-1)
        bins = self.counts.shape[1]
        if merged is not None:
            m = host(merged[0]).reshape(-1)
            d = np.clip(host(merged[1]).astype(np.int64).reshape(-1), 1, MERGED_DEPTHS) - 1
            got = host(merged[2]).reshape(-1) if len(merged) > 2 else on
            self.merged_counts += torch.from_numpy(_bin_counts(m, got, bins, d * bins, MERGED_DEPTHS).transpose(1, 0, 2).copy())
        p = host(path_probs).reshape(-1)
        if head_nodes is not None:
            keep = host(head_nodes).reshape(-1) > 0
            p, on = p[keep], on[keep]
        if p.size:
            self.counts += torch.from_numpy(_bin_counts(p, on, bins)[:, 0])

    @property
    def gap(self) -> float:
        return calibration_gap(self.counts)


class TreePolicy:
    """The per-cycle budget's part in one cycle (cycle.py: `Cycle.draft_fn` and its tree growth),
    in live mode only: whether to expand one more depth, how many nodes to verify, and the
    evidence the chooser learns from. It counts the draft's head steps (what a deeper level
    costs is a step) and shows the chooser the busy rows alone (one size serves them all; an
    idle row's tree is junk). Host-side bookkeeping: a captured cycle runs without one."""

    def __init__(self, chooser: BudgetChooser):
        self.chooser = chooser
        self.steps = 1       # head steps of the current draft: the absorb, then one per depth fed
        self._rows = None    # the busy rows' mask [B], None where every row is busy

    def begin(self, active: torch.Tensor, every_row_busy: bool, steps: int = 1) -> None:
        """A new draft over rows `active` [B] (`every_row_busy`: no row needs leaving out);
        `steps`: head steps already spent (the absorb; none where only head-free sources draft)."""
        self.steps = steps
        self._rows = None if every_row_busy else active

    def _busy(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._rows is None else t[self._rows]

    def fed(self) -> None:
        """One more head step: a depth of tree nodes went through the head."""
        self.steps += 1

    def first_level(self, child_logp: torch.Tensor) -> None:
        """The root's children [B, k] (log-probabilities): evidence for `worth_expanding`."""
        self.chooser.note_children(self._busy(child_logp))

    def deeper(self, pool_logp: torch.Tensor, front_logp: torch.Tensor, remaining: int) -> bool:
        """Whether expanding the front [B, k] one more depth is expected to pay, with the pool
        [B, m] drafted so far and `remaining` depths left (the depth, chosen per cycle)."""
        return self.chooser.worth_expanding(self._busy(pool_logp), self._busy(front_logp), self.steps, remaining)

    def expanded(self, child_logp: torch.Tensor, front_logp: torch.Tensor) -> None:
        """One expansion: children [B, k, k] given their parents, the parents' path scores [B, k]."""
        self.chooser.note_children(self._busy(child_logp).flatten(0, 1), self._busy(front_logp).flatten())

    def size(self, pool_logp: torch.Tensor, n_max: int) -> int:
        """Tree size (root included, at most `n_max`) that buys the most expected tokens per ms,
        from the pool's best n_max - 1 path scores per row (section 3: 1 + their probabilities)."""
        best = torch.topk(self._busy(pool_logp), n_max - 1, dim=1).values.exp()
        return self.chooser.choose(best, self.steps)

    def calibrated(self, path_probs: torch.Tensor) -> np.ndarray:
        """The head's path probabilities corrected by its measured calibration (`calibrate`)."""
        return self.chooser._cal(path_probs)

    def rows_ms(self, smaller: int, larger: int) -> float:
        """ms the verify of `larger` nodes per row costs over `smaller` (the measured table)."""
        table = self.chooser._table()
        return max(0.0, float(table[min(larger, table.size) - 1] - table[min(smaller, table.size) - 1]))

    def growth_floor(self) -> list[float]:
        """Per tree size, the least score (per expected token) a next node needs to pay anywhere."""
        return self.chooser.growth_floor(self.steps)

    def size_of(self, path_probs: torch.Tensor, depth: torch.Tensor) -> int:
        """Tree size (root included) for a merged tree: `path_probs` [rows, m] are each busy row's
        calibrated scores in best-first order (sources.py: already on one scale)."""
        return self.chooser.choose(path_probs, self.steps, depth)

    def observe(self, path_probs: torch.Tensor, on_path: torch.Tensor, draft_s: float, verify_s: float, tokens: int,
                head_nodes: torch.Tensor | None = None, merged: tuple | None = None) -> None:
        """The verified cycle, busy rows only: drafted nodes' path probabilities and which were
        accepted ([rows, N - 1]), its times and the tokens it produced."""
        self.chooser.observe(path_probs, on_path, 1000 * draft_s, 1000 * verify_s, self.steps, tokens, head_nodes, merged)
