"""Sampling is lossless: EAGLE-2 decoding samples exactly from the target's processed distribution.

The rule is the position-keyed one of every decoder (accept.accept_sampling_keyed: each token is
drawn by inverse CDF from the uniform of its output position, `position_uniforms(seed,
position)`). Target: a 1-layer random Llama with a 5-token vocabulary; draft: a random head
(dynamic tree, 8 nodes, depth 3, top-k 3), so drafts are often wrong and every branch of the
walk runs. The law tested is the joint law of the first 3 generated tokens (125 cells) of a
4-token generation: token 1 comes from the prefill, tokens 2-3 from the first cycle's accepted
path / bonus at depth 1 and 2, or from a second cycle.

  * exact reference: P(x1, x2, x3) = p(x1) p(x2 | x1) p(x3 | x1 x2), enumerated from full causal
    forwards of the target with transformers' own warpers (`make_warpers` / `target_probs` below);
  * analytic check: the same law computed from the *engine's own* trees and verification
    probabilities (captured by forcing each outcome) under the rule, written out exactly;
  * Monte Carlo: N fixed-seed generations, Pearson chi-square (cells with expected < 5 pooled),
    reject at alpha = 0.001;
  * power against WRONG LAWS, each the law of a plausible bug, computed exactly and turned into
    the test's power by the noncentral chi-square (noncentrality N * sum((p_wrong - p)^2 / p)):
      - unprocessed: the walk draws from the target's raw softmax, its warpers (temperature,
        top-k, top-p) not applied; its law is the T1 target law (tree-independent, since every
        keyed draw is a draw from the row it is given);
      - stale_uniform: the position is not advanced within a cycle, so one uniform draws every
        depth of it (law from the engine's own trees, integrated exactly over the uniform);
      - no_temperature (reported only): the warpers without the temperature;
    required: >= 0.999 against stale_uniform at T1, against stale_uniform and unprocessed at
    T0.8/top-k 3/top-p 0.9 (printed with -s); the same statistic must then actually reject each
    bug when it is monkeypatched into the engine (`eagle2_core.verifier.accept_sampling_keyed`,
    and the processors of `sampling.TargetProcessors`), and accept the bug's own law.

N is the smallest multiple of 50 meeting the requirement (the exact analytic test above already
proves the law; the samples check the engine's draws against it). Power at alpha = 0.001 from
`chisquare_power` on these laws, by N (not monotone in N: the pooling of small cells changes):

    T1, vs stale_uniform:              350: 0.98695  400: 0.99830  450: 1.00000
    T0.8-topk3-topp0.9, stale_uniform: 300: 0.66809  350: 0.99809  400: 1.00000
    T0.8-topk3-topp0.9, unprocessed:   1.00000 from N = 100 (its law puts mass on outcomes top-k
                                       and top-p remove, which the test rejects outright)
    T0.8-topk3-topp0.9, no_temperature (reported, not required): 400: 0.95236  800: 0.99810

so the correct rule is sampled N = 450 times at T1 and 400 times at T0.8 (950 and 350 under the
recursive rule this replaced); the bugs 450 (stale_uniform) and 100 (unprocessed) times.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import eagle2_core.verifier as verifier_mod
import eagle2_core.engine as engine_mod
from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.head import DraftHead, HeadSpec
from eagle2_core.events import samples
from eagle2_core.sampling import TargetProcessors

from conftest import broken_keyed_rule, chisquare_power, keyed_law, pooled_chisquare

V = 5
PROMPT = [1, 2, 3, 0]
MAX_NEW = 4        # generate 4 tokens, test the first 3: cycle 1 drafts depth <= 2
N_SAMPLES = {"T1": 450, "T0.8-topk3-topp0.9": 400}         # correct rule, per setting (see above)
N_BROKEN = {"stale_uniform": 450, "unprocessed": 100}      # the bugs, at T1 and at T0.8 (see above)
BROKEN_SETTING = {"stale_uniform": "T1", "unprocessed": "T0.8-topk3-topp0.9"}
POWER = 0.999
ALPHA = 1e-3
GENS = {
    "T1": dict(temperature=1.0),
    "T0.8-topk3-topp0.9": dict(temperature=0.8, top_k=3, top_p=0.9),
}
WRONG = {"T1": ("stale_uniform",), "T0.8-topk3-topp0.9": ("stale_uniform", "unprocessed", "no_temperature")}
REQUIRED = {"T1": ("stale_uniform",), "T0.8-topk3-topp0.9": ("stale_uniform", "unprocessed")}  # >= POWER at N_SAMPLES


@pytest.fixture(scope="module")
def env(tiny_lm):
    model = tiny_lm("llama", vocab_size=V, hidden_size=16, num_layers=1, max_position_embeddings=32,
                    initializer_range=0.3, logit_scale=1.0)
    torch.manual_seed(2)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model)
    dec = Engine(model, head, tree=TreeSettings(shape="dynamic", total_tokens=8, depth=3, top_k=3))
    return dict(model=model, dec=dec, laws={})


def make_warpers(gen) -> LogitsProcessorList | None:
    """None at temperature 0 (greedy); otherwise transformers' warpers for gen's temperature/top-k/top-p."""
    if not samples(gen.temperature):
        return None
    procs = LogitsProcessorList()
    if gen.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(gen.temperature))
    if gen.top_k:
        procs.append(TopKLogitsWarper(top_k=gen.top_k))
    if gen.top_p is not None and gen.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=gen.top_p))
    return procs


def target_probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """Row-wise processed distributions [N, V] (float32) for the N rows of `logits`."""
    return torch.softmax(warpers(None, logits.float()), dim=-1)


def exact_target_law(model, gen: GenerationSettings) -> dict:
    warpers = make_warpers(gen)
    law = {}
    with torch.no_grad():
        for a in range(V):
            for b in range(V):
                logits = model(torch.tensor([PROMPT + [a, b]])).logits[0, -3:]
                p = target_probs(logits, warpers).double()
                for c in range(V):
                    q = float(p[0, a] * p[1, b] * p[2, c])
                    if q > 0:
                        law[(a, b, c)] = q
    return law


def capture_trees(dec, gen: GenerationSettings, x1: int, forced: list, monkeypatch) -> list:
    """Run the engine with its prefill token forced to x1 and its acceptance outcomes forced;
    returns the (tree, probs) it passed to the acceptance rule at each cycle."""
    seen = []
    outcomes = iter(forced)

    def fake_accept(tree, probs, uniforms):
        seen.append((tree, probs.clone()))
        return next(outcomes, ([0], 0))

    with monkeypatch.context() as mp:
        mp.setattr(verifier_mod, "accept_sampling_keyed", fake_accept)
        mp.setattr(engine_mod, "first_token", lambda scores, seed: x1)  # the prefill's draw
        dec.generate(PROMPT, GenerationSettings(**{**vars(gen), "max_new_tokens": MAX_NEW, "seed": 0}))
    return seen


def engine_rule_law(dec, gen: GenerationSettings, p0: list[float], rule: str, monkeypatch) -> dict:
    """Exact law of the first 3 tokens under `rule` (conftest.keyed_law), on the trees the engine
    really builds; token 1 (the prefill's draw, one position of its own) has law p0."""
    law: dict = {}
    for a in range(V):
        if p0[a] <= 0:
            continue
        t1, pr1 = capture_trees(dec, gen, a, [], monkeypatch)[0]
        for seq, q in keyed_law(t1.parents.tolist(), t1.tokens.tolist(), pr1.double(), rule, max_tokens=2).items():
            if len(seq) == 2:
                law[(a,) + seq] = law.get((a,) + seq, 0.0) + p0[a] * q
                continue
            # the first cycle emitted only its bonus: token 3 is the first token of cycle 2
            t2, pr2 = capture_trees(dec, gen, a, [([0], seq[0])], monkeypatch)[1]
            for seq2, q2 in keyed_law(t2.parents.tolist(), t2.tokens.tolist(), pr2.double(), rule, max_tokens=1).items():
                key = (a, seq[0], seq2[0])
                law[key] = law.get(key, 0.0) + p0[a] * q * q2
    return law


def laws_for(env, name: str, monkeypatch) -> dict:
    if name not in env["laws"]:
        gen = GenerationSettings(**GENS[name])
        exact = exact_target_law(env["model"], gen)
        p0 = [sum(v for k, v in exact.items() if k[0] == a) for a in range(V)]
        env["laws"][name] = {"exact": exact, **{r: engine_rule_law(env["dec"], gen, p0, r, monkeypatch) for r in ("keyed", "stale_uniform")},
                             "unprocessed": exact_target_law(env["model"], GenerationSettings(temperature=1.0)),
                             "no_temperature": exact_target_law(env["model"], GenerationSettings(**{**GENS[name], "temperature": 1.0}))}
    return env["laws"][name]


def sample_seeds(n: int) -> list[int]:
    """Fixed per-sample seeds, spread over 63 bits by one Python RNG rather than 0..n-1 (the
    uniforms are a hash of (seed, position), so any seeds would do; spread ones also keep the
    samples apart from the small seeds other tests use)."""
    rng = random.Random(0)
    return [rng.getrandbits(63) for _ in range(n)]


def sample_counts(dec, gen_kw: dict, n: int) -> Counter:
    counts = Counter()
    for seed in sample_seeds(n):
        out, _ = dec.generate(PROMPT, GenerationSettings(**gen_kw, max_new_tokens=MAX_NEW, seed=seed, eos_token_ids=()))
        assert len(out) == MAX_NEW
        counts[tuple(out[:3])] += 1
    return counts


@pytest.mark.parametrize("name", list(GENS))
def test_engine_trees_give_exact_target_law(env, name, monkeypatch):
    """Analytic: the rule applied to the engine's own trees and verification probabilities yields
    exactly the target's law (so tree attention, positions and the rule are all right), while
    the wrong laws are far from it."""
    laws = laws_for(env, name, monkeypatch)
    exact, correct = laws["exact"], laws["keyed"]
    assert sum(correct.values()) == pytest.approx(1.0, abs=1e-6)  # float32 verification probabilities
    for k in set(exact) | set(correct):
        assert correct.get(k, 0.0) == pytest.approx(exact.get(k, 0.0), abs=1e-6), k
    for rule in WRONG[name]:
        assert max(abs(laws[rule].get(k, 0.0) - exact.get(k, 0.0)) for k in set(exact) | set(laws[rule])) > 5e-3, rule


@pytest.mark.parametrize("name", list(GENS))
def test_sampling_matches_target_law(env, name, monkeypatch):
    laws = laws_for(env, name, monkeypatch)
    exact, n = laws["exact"], N_SAMPLES[name]
    counts = sample_counts(env["dec"], GENS[name], n)
    stat, dof, pval, bins = pooled_chisquare(counts, exact, n)
    power = {r: chisquare_power(exact, laws[r], bins, n, ALPHA) for r in WRONG[name]}
    print(f"\n[lossless] {name}: keyed rule, N={n}: chi2={stat:.1f} df={dof} p={pval:.3f}; power at alpha={ALPHA} vs "
          + ", ".join(f"{r}={v:.4f}" for r, v in power.items()))
    assert pval > ALPHA
    for r in REQUIRED[name]:
        assert power[r] >= POWER, (r, power[r])


def unprocessed(mp) -> None:
    """The bug: the target's processors (warpers included) are skipped, so the walk draws from the raw softmax."""
    mp.setattr(TargetProcessors, "scores", lambda self, logits, ids: logits)
    mp.setattr(TargetProcessors, "tree_scores", lambda self, logits, history, tree, nodes=None: logits)


@pytest.mark.parametrize("rule", list(N_BROKEN))
def test_broken_rule_is_rejected(env, rule, monkeypatch):
    """The same statistic, same seeds, with a deliberate bug in the decoder: must reject, at an N
    where the test's power against that bug's law is >= 0.999 (module docstring)."""
    name = BROKEN_SETTING[rule]
    laws = laws_for(env, name, monkeypatch)
    n = N_BROKEN[rule]
    with monkeypatch.context() as mp:
        if rule == "unprocessed":
            unprocessed(mp)
        else:
            mp.setattr(verifier_mod, "accept_sampling_keyed", broken_keyed_rule(rule))
        counts = sample_counts(env["dec"], GENS[name], n)
    outside = sum(c for k, c in counts.items() if laws["exact"].get(k, 0.0) <= 0)  # outcomes the target's law cannot give
    if outside:  # rejected outright (pooled_chisquare refuses such counts)
        _, _, _, bins = pooled_chisquare({}, laws["exact"], n)
        pval = 0.0
        print(f"\n[lossless] {name}: BROKEN {rule}, N={n}: {outside} outcomes of probability zero under the target's law")
    else:
        stat, dof, pval, bins = pooled_chisquare(counts, laws["exact"], n)
        print(f"\n[lossless] {name}: BROKEN {rule}, N={n}: chi2={stat:.1f} df={dof} p={pval:.2e}")
    assert chisquare_power(laws["exact"], laws[rule], bins, n, ALPHA) >= POWER
    assert pval < ALPHA
    # and the broken run is consistent with the bug's own exact law (the harness is sound)
    stat_b, dof_b, pval_b, _ = pooled_chisquare(counts, laws[rule], n)
    assert pval_b > ALPHA, (stat_b, dof_b, pval_b)


def manual_processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent reference for generate's sampling distribution: temperature, then top-k, then
    top-p (keep a token while the mass of strictly more probable kept tokens is < top_p)."""
    x = logits.double() / temperature
    if top_k:
        kth = torch.topk(x, min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, -1)
    if top_p < 1.0:
        sp, idx = torch.sort(p, descending=True, dim=-1)
        before = torch.cumsum(sp, -1) - sp
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8),
                                                     (0.8, 3, 0.9), (0.5, 10, 0.5), (2.0, 1, 1.0), (1.0, 60, 0.95)])
def test_target_distribution_matches_independent_reference(temperature, top_k, top_p):
    """The exact law above is built with `make_warpers` here, so check it against an independent reference."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 50, generator=g) * 3
    gen = GenerationSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    got = target_probs(logits, make_warpers(gen))
    torch.testing.assert_close(got.double(), manual_processed_probs(logits, temperature, top_k, top_p), rtol=1e-5, atol=1e-6)
    assert make_warpers(GenerationSettings(temperature=0.0)) is None
