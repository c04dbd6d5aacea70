"""The drafting policy judged by its purpose, in a simulated environment with no model.

Each cycle the head-free source ("match") and the head each propose a chain of tokens below the
root; every node is accepted (given its parent) with its source's true probability, and each
source reports a raw confidence that is off from it (noisy, and biased: the head overconfident, the
matcher always sure). Costs follow a CPU's measured shape (a few rows nearly free, then dearer),
each timing with +-10% noise; a cycle that looks at the other arms pays for growing the head-free
tree even when it then decodes plain (policy.look). The policy must reach, within 64 cycles of the start and of each change
of the environment, at least 0.97x (mean over 20 seeds) the tokens per ms of the best fixed choice
of that stretch: plain decoding, a constant tree of the matcher alone, or of the head and the matcher.
"""
from __future__ import annotations

import numpy as np
import pytest

from eagle2_core.policy import CostCurve, Outcome, Plan, Policy, expected_tokens

N_MAX, HEAD_DEPTH, FREE_DEPTH = 10, 4, 6
VERIFY = np.array([6.0, 6.2, 6.4, 6.6, 7.6, 8.4, 9.0, 9.4, 10.2, 11.0])   # ms of n rows
STEP, OVERHEAD = {"head": 1.8}, {"plain": 0.2, "free": 0.5, "head": 0.7}
GROW = OVERHEAD["free"] - OVERHEAD["plain"]  # growing the head-free trees: what a cycle that looks and then decodes plain pays


class Profile:
    """The machine's cost profile as costs.CostProfile gives it: a verify table, pessimistic by 30%."""

    def verify_table(self, n):
        import torch
        return torch.tensor(np.resize(VERIFY * 1.3, n))


class World:
    """One stretch of text: each source's true acceptance per node, and how its confidence misreports it."""

    def __init__(self, head: float, free: float):
        self.p = {"head": head, "match": free}

    def match(self, rng):
        """The matcher's chain: (raw confidences, whether the target takes each node given its parent)."""
        return np.full(FREE_DEPTH, 0.95), rng.random(FREE_DEPTH) < self.p["match"]

    def head_node(self, rng):
        return float(np.clip(self.p["head"] * 1.25 + rng.normal(0, 0.1), 0.01, 0.99)), bool(rng.random() < self.p["head"])


def noisy(rng, ms):
    return ms * (1 + rng.uniform(-0.1, 0.1))


def run_cycle(rng, world, arm=None, n=1, depth=0, policy=None, arms=None):
    """One cycle of a fixed choice (`arm`, tree size `n`, head depth) or of `policy`; returns (tokens, ms)
    and appends the arm that ran to `arms`, if given."""
    chains = {"match": world.match(rng)}
    acc = policy.acceptance if policy is not None else None
    if policy is not None and not policy.look():  # decodes plain without growing any tree
        o, v = noisy(rng, OVERHEAD["plain"]), noisy(rng, VERIFY[0])
        policy.learn(Outcome(Plan("plain"), 1, 1, 1, 1.0, o, v, []))
        if arms is not None:
            arms.append("plain")
        return 1, o + v

    def scores(src):  # a fixed choice ranks by the true probabilities: the best it could do
        raw = chains[src][0]
        return np.cumprod([acc.conditional(src, d + 1, r) for d, r in enumerate(raw)] if acc is not None else [world.p[src]] * len(raw))

    if policy is not None:
        plan = policy.plan(free_probs=scores("match")[None])
        arm = plan.arm
    if arms is not None:
        arms.append(arm)
    if arm == "head":  # one step per depth; the policy decides after each whether another pays
        raw, ok, cal = [], [], [1.0]
        while len(raw) < (depth if policy is None else HEAD_DEPTH):
            r, o = world.head_node(rng)
            raw.append(r), ok.append(o)
            if policy is not None:
                c = acc.conditional("head", len(raw), r)
                policy.note_children([c], [cal[-1]])
                cal.append(cal[-1] * c)
                pool = np.concatenate([scores("match"), cal[1:]])[None]
                if not policy.deeper(pool, np.array([[cal[-1]]]), len(raw), HEAD_DEPTH - len(raw)):
                    break
        chains["head"] = (np.array(raw), np.array(ok))
    steps = len(chains["head"][0]) if "head" in chains else 0
    nodes = sorted(((sc, src, d + 1) for src in chains for d, sc in enumerate(scores(src))), reverse=True) if arm != "plain" else []
    if policy is not None:
        n = policy.size(np.array([[sc for sc, _, _ in nodes]]), arm, steps) if nodes else 1
    taken = nodes[: n - 1]
    deep = {src: max([d for _, s, d in taken if s == src], default=0) for src in chains}
    tokens = 1 + max(int(np.argmin(np.append(ok[: deep[src]], False))) for src, (_, ok) in chains.items())
    ms = noisy(rng, OVERHEAD[arm]) + steps * noisy(rng, STEP["head"]) + noisy(rng, VERIFY[n - 1])
    ms += noisy(rng, GROW) if policy is not None and arm == "plain" else 0.0
    if policy is not None:
        known = []
        for src, (raw, ok) in chains.items():
            for d in range(min(tokens, raw.size)):  # decided: every ancestor taken and the emitted tokens reach it
                known.append((src, d + 1, float(raw[d]), bool(ok[d])))
                if not ok[d]:
                    break
        free_ok = chains["match"][1]
        alt = 1 + int(np.argmin(np.append(free_ok[: plan.alt[1] - 1], False))) if plan.alt[0] == "free" else 1
        plan.steps = steps
        verify = ms - (ms - VERIFY[n - 1])
        policy.learn(Outcome(plan, n, 1, tokens, alt, ms - verify, verify, known))
    return tokens, ms


def rate(rng, world, cycles, **choice):
    t = ms = 0.0
    for _ in range(cycles):
        a, b = run_cycle(rng, world, **choice)
        t, ms = t + a, ms + b
    return t / ms


def fixed_rate(world, arm, n, depth=0):
    """A fixed choice's long-run tokens per ms, exactly: its tree takes the n - 1 nodes of best
    true path probability, and E[tokens] = 1 + sum over k of P(some chain holds k accepted nodes)."""
    chains = {"match": FREE_DEPTH, **({"head": depth} if arm == "head" else {})}
    nodes = sorted(((world.p[s] ** (d + 1), s) for s, m in chains.items() for d in range(m)), reverse=True)[: n - 1]
    length = {s: sum(1 for _, x in nodes if x == s) for s in chains}
    tokens = 1 + sum(1 - np.prod([1 - (world.p[s] ** k if k <= length[s] else 0.0) for s in chains]) for k in range(1, N_MAX + 1))
    return tokens / (OVERHEAD[arm] + (depth if arm == "head" else 0) * STEP["head"] + VERIFY[n - 1])


FIXED = [dict(arm="plain", n=1)] + [dict(arm="free", n=n) for n in range(2, N_MAX + 1)] + \
        [dict(arm="head", n=n, depth=d) for n in range(2, N_MAX + 1) for d in range(1, HEAD_DEPTH + 1)]
STRETCHES = [World(head=0.75, free=0.15),   # prose: the head's guesses are taken, the context's rarely
             World(head=0.75, free=0.92),   # a copied passage
             World(head=0.08, free=0.10),   # a head that stops agreeing: plain pays
             World(head=0.08, free=0.92)]   # then a copied passage again, after a long stretch of plain


def test_the_policy_reaches_the_best_fixed_choice_of_every_stretch():
    ratios = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        policy = Policy(CostCurve(Profile(), N_MAX, lambda b: STEP["head"] * 1.2), N_MAX, head=True, sources=True)
        for world in STRETCHES:
            rate(rng, world, 64, policy=policy)  # the 64 cycles it may spend learning
            got = rate(rng, world, 200, policy=policy)
            best = max(fixed_rate(world, **c) for c in FIXED)
            ratios.append(got / best)
    r = np.array(ratios).reshape(20, len(STRETCHES))
    assert r.mean(0).min() >= 0.97, r.mean(0)


def test_expected_tokens_counts_the_bonus_token():
    assert expected_tokens([0.5, 0.25]).tolist() == [1.0, 1.5, 1.75]


@pytest.mark.parametrize("seed", range(3))
def test_plain_wins_where_nothing_is_accepted(seed):
    """Where neither source is ever right, the policy decodes plain almost always (the head's
    exploration is the only cost)."""
    rng = np.random.default_rng(seed)
    policy = Policy(CostCurve(Profile(), N_MAX, lambda b: STEP["head"]), N_MAX, head=True, sources=True)
    world = World(head=0.0, free=0.0)
    rate(rng, world, 64, policy=policy)
    arms = []
    rate(rng, world, 64, policy=policy, arms=arms)
    assert arms.count("plain") >= 56, arms


def test_a_long_plain_stretch_costs_little_and_copying_after_it_is_taken_up():
    """Where nothing is accepted for a long stretch the policy looks at the other arms ever more
    rarely (growing their trees costs host time), and still takes up a copied passage after it
    within a few looks."""
    plain, copy = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        policy = Policy(CostCurve(Profile(), N_MAX, lambda b: STEP["head"] * 1.2), N_MAX, head=True, sources=True)
        for world, cycles, out in ((World(head=0.0, free=0.0), 1000, plain), (World(head=0.08, free=0.92), 64, copy)):
            out.append(rate(rng, world, cycles, policy=policy) / max(fixed_rate(world, **c) for c in FIXED))
    assert np.mean(plain) >= 0.97 and np.mean(copy) >= 0.75, (np.mean(plain), np.mean(copy))
