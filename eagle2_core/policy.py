"""The drafting policy: one acceptance model, one cost curve, one choice per cycle.

EAGLE-2's finding (section 3): a drafted node's confidence approximates the chance that
verification accepts it, so a tree's expected output is 1 + the sum of its nodes' path
probabilities, and the size worth verifying is the one that buys the most expected tokens per
millisecond. Every choice of a live cycle is that one rule:

  * `Acceptance`: each node's chance of acceptance given its parent's, keyed by which sources
    proposed it, its depth and the bin of its raw confidence; the prior is the raw confidence
    itself, and the outcomes of every node whose fate the emitted tokens decide correct it.
  * `CostCurve`: ms of a cycle = its arm's host overhead + head steps x one step's ms + the
    verify of n rows per sequence (the machine's cost profile, refined by the cycles' own timings).
  * `Policy.plan`: before drafting, plain decoding, the head-free sources' tree (known before any
    draft step, so its worth is computed) or the head with them. The head's worth is known only
    after its step is paid, so it is judged by its record: the tokens per ms of the cycles it
    drafted against what the alternative chosen without it would have made in those same cycles
    (known after the fact: the target's emitted tokens decide every head-free node), per bin of
    what the head-free tree offered. Plain and the head-free tree need no exploring; the head
    drafts one cycle in `explore` where its record says no.
  * `Policy.size`: the tree size n (1 = the root alone) maximising expected tokens per ms.

Only which tokens are verified changes, so the output stays the target's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BINS, DEPTHS = 10, 3          # acceptance cells: raw-confidence bins x depth 1, 2, 3+
PRIOR = 2.0                   # pseudo-acceptances behind every ratio: a cell moves once it holds about this much evidence
MEMORY = 30.0                 # predicted acceptances a source's cells keep, the older scaled down: the text drifts
PRIOR_CYCLES = 4.0            # pseudo-cycles behind the cost profile's figures
PATIENCE = 8                  # head cycles pooled behind each bin's own record (a few cycles judge by chance)
WINDOW = 64                   # cycles: the head's record (its own cycles) and each arm's overhead keep about this many (the text drifts)
FADE = 256                    # cycles over which a record the head no longer renews fades, so it is tried again
LOOK = 4                      # in a stretch of plain cycles, the other arms are looked at (their trees grown) one cycle in this many
LOOK_MAX = 8                  # ... and at least one in this many: a new stretch of copying is missed for at most this many tokens
EDGES = (1.3, 1.6, 2.0, 2.6, 3.5)  # expected tokens of the head-free tree: bins of the room left for the head
ARMS = ("plain", "free", "head")


def expected_tokens(probs_desc) -> np.ndarray:
    """[1 + sum of the first i path probabilities] for tree sizes i + 1 = 1 .. len + 1."""
    return 1.0 + np.concatenate(([0.0], np.cumsum(np.asarray(probs_desc, dtype=np.float64))))


def best_size(probs_desc, verify_ms: np.ndarray, fixed_ms: float, least: int = 1) -> tuple[int, float]:
    """(size n >= `least`, root included, and its expected tokens per ms): the argmax of
    E(n) / (fixed_ms + verify_ms[n - 1]); ties go to the smaller tree."""
    e = expected_tokens(probs_desc)[: verify_ms.size]
    rate = e / (fixed_ms + verify_ms[: e.size])
    rate[: least - 1] = -1.0
    n = int(np.argmax(rate))
    return n + 1, float(rate[n])


def mean_row(probs) -> np.ndarray:
    """[rows, m] scores -> [m]: each row sorted highest first, then averaged: one tree size
    serves every row of a batch."""
    p = np.atleast_2d(np.asarray(probs, dtype=np.float64))
    return -np.sort(-p, axis=-1).mean(0) if p.size else np.zeros(0)


def monotone(values, weights) -> np.ndarray:
    """The weighted least-squares non-decreasing fit (pool adjacent violators): a verify of n + 1
    rows cannot cost less than one of n, so a dip in the timed table is the machine's noise."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for v, w in zip(np.asarray(values, dtype=np.float64).tolist(), np.asarray(weights, dtype=np.float64).tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.array([v for v, _, c in blocks for _ in range(c)])


def conf_bin(p: float) -> int:
    return min(BINS - 1, max(0, int(p * BINS)))


class Acceptance:
    """P(a node is accepted | its parent is), per (proposers, depth, bin of raw confidence): the
    raw confidence scaled by the cell's accepted / predicted ratio, each level of (proposers),
    (proposers, depth), (proposers, depth, bin) shrunk toward the one above it by `PRIOR`
    pseudo-acceptances (the top toward 1: the paper's finding, with no evidence)."""

    def __init__(self):
        self.cells: dict[str, np.ndarray] = {}   # key -> [accepted, predicted] x [DEPTHS, BINS]
        self._ratios: dict[str, list] = {}

    def ratio(self, key: str) -> list:
        r = self._ratios.get(key)
        if r is None:
            a, p = self.cells[key] if key in self.cells else np.zeros((2, DEPTHS, BINS))
            top = (a.sum() + PRIOR) / (p.sum() + PRIOR)
            depth = (a.sum(1) + PRIOR * top) / (p.sum(1) + PRIOR)
            r = self._ratios[key] = ((a + PRIOR * depth[:, None]) / (p + PRIOR)).tolist()
        return r

    def conditional(self, key: str, depth: int, raw: float) -> float:
        return min(1.0, raw * self.ratio(key)[min(depth, DEPTHS) - 1][conf_bin(raw)])

    def conditionals(self, key: str, depth: int, raw: np.ndarray) -> np.ndarray:
        """`conditional` over an array of raw confidences at one depth."""
        r = np.asarray(self.ratio(key)[min(depth, DEPTHS) - 1])
        return np.minimum(1.0, raw * r[np.clip((raw * BINS).astype(np.int64), 0, BINS - 1)])

    def add(self, key: str, depth: int, raw: float, accepted: bool) -> None:
        self.add_all([(key, depth, raw, accepted)])

    def add_all(self, nodes) -> None:
        """Outcomes (proposers, depth, raw confidence, accepted), one array update per key."""
        by_key: dict[str, list] = {}
        for key, depth, raw, got in nodes:
            by_key.setdefault(key, []).append((min(depth, DEPTHS) - 1, raw, got))
        for key, rows in by_key.items():
            c = self.cells.get(key)
            if c is None:
                c = self.cells[key] = np.zeros((2, DEPTHS, BINS))
            d, raw, got = (np.array(x) for x in zip(*rows))
            b = np.clip((raw * BINS).astype(np.int64), 0, BINS - 1)
            np.add.at(c[0], (d, b), got.astype(np.float64))
            np.add.at(c[1], (d, b), raw)
            total = c[1].sum()
            if total > MEMORY:
                c *= MEMORY / total
            self._ratios.pop(key, None)


class CostCurve:
    """ms of a cycle at each batch size b: `overhead(b, arm)` (host work: growing trees, merging,
    acceptance, bookkeeping) + steps x `step(b)` (one head step) + `verify(b)[n - 1]` (the target's
    forward over n rows per sequence). Priors from the machine's cost profile (costs.py); each
    timed cycle refines them, so long contexts and this machine's load enter."""

    def __init__(self, profile, n_max: int, step_at, batch_costs=None):
        self.profile, self.n_max, self.step_at, self.batch_costs = profile, n_max, step_at, batch_costs
        self._by_batch: dict[int, dict] = {}
        self.frozen = False  # True: keep the profile's costs (tests that need a known cost table)

    def _state(self, b: int) -> dict:
        st = self._by_batch.get(b)
        if st is None:
            bc = self.batch_costs
            if b > 1 and bc is not None and b in bc.batches:
                prior = np.array([bc.verify(b, n) for n in range(1, self.n_max + 1)])
            else:
                prior = self.profile.verify_table(b * self.n_max)[b - 1 :: b][: self.n_max].double().numpy()
            prior = monotone(prior, np.ones_like(prior))  # a probe timed once on a busy machine may dip: no size is cheaper than a smaller one
            st = self._by_batch[b] = {"prior": prior, "sum": np.zeros(self.n_max), "n": np.zeros(self.n_max), "table": None,
                                      "steps": np.zeros(4), "cycles": 0, "step": None, "over": {a: [0.0, 0.0] for a in ARMS}}
        return st

    def verify(self, b: int) -> np.ndarray:
        st = self._state(b)
        if st["table"] is None:
            seen = st["n"] > 0
            # the profile runs at a short context: scale it by how far the timed cycles ran from it
            scale = st["sum"][seen].sum() / (st["prior"][seen] * st["n"][seen]).sum() if seen.any() else 1.0
            w = PRIOR_CYCLES
            st["table"] = monotone((w * scale * st["prior"] + st["sum"]) / (w + st["n"]), w + st["n"])
        return st["table"]

    def step(self, b: int) -> float:
        """ms of one head step: ridge regression of head-cycle draft ms on steps, the slope shrunk
        toward the profile's step (only the step is marginal: the intercept is the overhead)."""
        st = self._state(b)
        if st["step"] is None:
            n = st["cycles"]
            s, y, ss, sy = st["steps"]
            sxx, sxy = (ss - s * s / n, sy - s * y / n) if n else (0.0, 0.0)
            st["step"] = max(0.0, (PRIOR_CYCLES * self.step_at(b) + sxy) / (PRIOR_CYCLES + sxx))
        return st["step"]

    def overhead(self, b: int, arm: str) -> float:
        total, n = self._state(b)["over"][arm]
        return total / n if n else 0.0

    def cycle(self, b: int, arm: str, n: int, steps: int) -> float:
        return self.overhead(b, arm) + steps * self.step(b) + float(self.verify(b)[n - 1])

    def learn(self, b: int, arm: str, n: int, steps: int, draft_ms: float, verify_ms: float) -> None:
        if self.frozen:
            return
        st = self._state(b)
        if n <= self.n_max:
            st["sum"][n - 1] += verify_ms
            st["n"][n - 1] += 1
        if arm == "head":
            st["steps"] += (steps, draft_ms, steps * steps, steps * draft_ms)
            st["cycles"] += 1
        over = st["over"][arm]
        over[0] += max(0.0, draft_ms - steps * self.step(b))
        over[1] += 1
        if over[1] > WINDOW:  # about the last WINDOW cycles of the arm: what the host does drifts with the text
            over[0], over[1] = over[0] * WINDOW / over[1], WINDOW
        st["table"] = st["step"] = None


@dataclass
class Plan:
    """One cycle's choice: the arm, and where the head-free tree exists, its size and the
    alternative to the head (arm, size, modelled ms) that the head's record is judged against."""
    arm: str
    free_n: int = 1
    bin: int = 0
    alt: tuple = ("plain", 1, 0.0, 1.0)  # (arm, size, modelled ms, expected tokens per row)
    steps: int = 0


@dataclass
class Outcome:
    """What a verified cycle did: its plan, tree size, busy rows, tokens (and the alternative's,
    known after the fact: the emitted tokens decide every head-free node), times, and every node
    whose conditional outcome the emitted tokens decide: (proposers, depth, raw confidence, accepted)."""
    plan: Plan
    n: int
    rows: int
    tokens: int          # what the busy rows made
    alt_tokens: float    # what the plan's alternative would have made in this cycle (the head's cycles)
    draft_ms: float
    verify_ms: float
    nodes: list


class Policy:
    """The drafting policy of one engine, kept across runs (a chat's later turns start from what
    the earlier ones learned)."""

    def __init__(self, costs: CostCurve, n_max: int, head: bool, sources: bool):
        self.costs, self.n_max, self.has_head, self.has_sources = costs, n_max, head, sources
        self.acceptance = Acceptance()
        self.batch = 1
        # per bin of the head-free tree's worth: head cycles, the sum and sum of squares of what each
        # gained in tokens per ms over the alternative chosen without the head, and the sum of 1 /
        # the alternative's ms; every cycle discounts it, so a record the head no longer renews fades
        self.record = np.zeros((len(EDGES) + 1, 4))
        self.rng = np.random.default_rng(0)  # the head's draws (the output never depends on them)
        self.expected = 1.0  # the last sized tree's expected tokens per row
        self.plain_run = 0   # plans in a row that chose plain
        # how much of a front node's path probability its best child keeps, weighted by that path
        # probability (the mass that carries a tree's expected tokens): what a deeper level adds
        self.keep = [PRIOR * 0.5, PRIOR]

    # -- the choice ----------------------------------------------------------------------------
    def _rate(self, arm: str, probs, steps: int, least: int = 1) -> tuple[int, float, float]:
        """(size, expected tokens per ms, modelled ms) of the best tree of `arm` over `probs` [rows, m]."""
        b = self.batch
        v = self.costs.verify(b)[: self.n_max]
        fixed = self.costs.overhead(b, arm) + steps * self.costs.step(b)
        p = mean_row(probs)[: self.n_max - 1] if probs is not None else np.zeros(0)
        n, r = best_size(p, v[: p.size + 1], fixed, least)
        return n, r, fixed + float(v[n - 1])

    def head_drafts(self, b: int) -> bool:
        """Whether the head drafts this cycle: a draw from what its record in bin b (with every
        bin's pooled behind it as up to PATIENCE pseudo-cycles) says of its mean gain on the
        alternative (Thompson sampling, normal: its mean shrunk toward no gain by PRIOR_CYCLES,
        its standard error), so a head drafts about as often as it may pay: a few unlucky cycles
        cannot lock out a head that pays, a clear loss drafts rarely, and a record the head no
        longer renews fades (`learn`), so it is tried again where the text may have changed."""
        total = self.record.sum(0)
        if total[0] <= 0.0:
            return True
        n, s, ss, a = self.record[b] + min(PATIENCE, total[0]) * total / total[0]
        # a cycle's tokens vary by a third of a token at least: its gain's spread is at least that over the alternative's ms
        var = max(ss / n - (s / n) ** 2, (0.35 * a / n) ** 2)
        return s / (n + PRIOR_CYCLES) + (var / (n + PRIOR_CYCLES)) ** 0.5 * self.rng.standard_normal() >= 0.0

    def plan(self, free_probs=None, can_skip_head: bool = True) -> Plan:
        """This cycle's arm. `free_probs` [rows, m]: the busy rows' head-free trees' node scores
        (calibrated path probabilities, best first), None where no head-free source runs."""
        n_plain, r_plain, ms_plain = self._rate("plain", None, 0)
        alt = ("plain", 1, ms_plain, 1.0)
        free_n, expected = 1, 1.0
        if free_probs is not None:
            free_n, r_free, ms_free = self._rate("free", free_probs, 0, least=2)
            expected = float(expected_tokens(mean_row(free_probs))[free_n - 1])
            if r_free > r_plain:
                alt = ("free", free_n, ms_free, expected)
        if not self.has_head:
            # a head-free target looks every cycle: its recycling table, most of what it drafts, learns only in cycles that look
            return Plan(alt[0], free_n, alt=alt)
        b = sum(expected >= e for e in EDGES)
        plan = Plan("head", free_n, b, alt)
        if can_skip_head and not self.head_drafts(b):
            plan.arm = alt[0]
        self.plain_run = self.plain_run + 1 if plan.arm == "plain" else 0
        return plan

    def look(self) -> bool:
        """Whether this cycle plans at all: in a stretch of plain cycles the head-free trees (and
        the head's draw) are looked at one cycle in LOOK, then in LOOK_MAX, since growing them costs
        host time a plain cycle would not spend; a cycle that does not look decodes plain."""
        # the longer plain has won, the less likely the next look pays: the gap doubles with the stretch, up to LOOK_MAX
        gap = min(LOOK_MAX, max(LOOK, (1 << max(0, self.plain_run.bit_length() - 1)) // LOOK))
        if self.plain_run < 2 or self.plain_run % gap == 0:
            return True
        self.plain_run += 1
        return False

    def size(self, probs, arm: str, steps: int) -> int:
        """The tree size (root included, 1 = plain) for the drafted scores [rows, m], best first."""
        n = self._rate(arm, probs, steps)[0]
        self.expected = float(expected_tokens(mean_row(probs))[n - 1]) if probs is not None else 1.0
        return n

    def deeper(self, pool, front, steps: int, remaining: int) -> bool:
        """Whether one more head step is expected to pay: the best rate over the tree so far
        (`pool` [rows, m], calibrated path probabilities) against it plus, for l = 1 ..
        `remaining` more levels, one child per front node (`front` [rows, k]) keeping the measured
        share of its parent's path probability."""
        pool, front = np.atleast_2d(pool), np.atleast_2d(front)
        now = self._rate("head", pool, steps)[1]
        keep = self.keep[0] / self.keep[1]
        extra = [pool]
        for level in range(1, remaining + 1):
            extra.append(front * keep ** level)
            if self._rate("head", np.concatenate(extra, -1), steps + level)[1] > now:
                return True
        return False

    def growth_floor(self, arm: str, steps: int) -> list[float]:
        """floor[k] for a tree of k nodes: a next node scoring below E x floor[k] (E: the tree's
        expected tokens so far) cannot make any larger size pay, since scores only descend."""
        v = self.costs.verify(self.batch)[: self.n_max]
        d = self.costs.overhead(self.batch, arm) + steps * self.costs.step(self.batch)
        k = np.arange(v.size)
        per = np.divide(v[None, :] - v[:, None], (v[:, None] + d) * (k[None, :] - k[:, None]), out=np.full((v.size, v.size), np.inf),
                        where=k[None, :] > k[:, None])
        return [0.0] + per.min(1).tolist()[:-1] + [0.0]

    # -- evidence ------------------------------------------------------------------------------
    def note_children(self, best, parents) -> None:
        """One head expansion: each front node's best child's calibrated conditional, and the
        front nodes' calibrated path probabilities (the weights)."""
        best, parents = np.asarray(best, dtype=np.float64), np.asarray(parents, dtype=np.float64)
        self.keep[0] += float((parents * best).sum())
        self.keep[1] += float(parents.sum())

    def learn(self, o: Outcome) -> None:
        # both sides at the cost curve's figures (refined by this cycle's timing just below): the
        # alternative's cycle never ran, and one cycle's timing is noisier than the curve
        head = o.plan.arm == "head" and self.has_head
        head_ms = self.costs.cycle(self.batch, "head", o.n, o.plan.steps) if head else 0.0
        self.costs.learn(self.batch, o.plan.arm, o.n, o.plan.steps, o.draft_ms, o.verify_ms)
        self.acceptance.add_all(o.nodes)
        self.record *= 1.0 - 1.0 / FADE
        if head:
            self.record *= 1.0 - 1.0 / WINDOW
            gain = o.tokens / head_ms - o.alt_tokens / o.plan.alt[2]
            self.record[o.plan.bin] += (1, gain, gain * gain, 1.0 / o.plan.alt[2])


# -- reports (compare's calibration table) ---------------------------------------------------------

def bin_counts(path_probs: torch.Tensor, on_path: torch.Tensor, bins: int) -> torch.Tensor:
    """[3, bins]: nodes, nodes on the accepted path, and summed path probability, per bin of path probability."""
    b = (path_probs * bins).long().clamp(0, bins - 1)
    return torch.stack([torch.bincount(b, minlength=bins).to(path_probs.dtype),
                        torch.bincount(b, weights=on_path.to(path_probs.dtype), minlength=bins),
                        torch.bincount(b, weights=path_probs, minlength=bins)])


def calibration_gap(counts: torch.Tensor) -> float:
    """Expected calibration error: the node-weighted mean |confidence - acceptance| over bins
    (section 3, figure 4: small for an EAGLE head)."""
    nodes, accepted, conf = counts.double()
    total = float(nodes.sum())
    return float((conf - accepted).abs().sum()) / total if total else 0.0


BADLY_CALIBRATED = 0.03  # a head whose gap exceeds this is called badly calibrated (compare says so)
