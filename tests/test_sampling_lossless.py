"""Sampling is lossless: EAGLE-2 decoding samples exactly from the target's processed distribution.

Target: a 1-layer random Llama with a 5-token vocabulary; draft: a random head (dynamic tree,
8 nodes, depth 3, top-k 3), so drafts are often wrong and all branches of the rule run. The law
tested is the joint law of the first 3 generated tokens (125 cells) of a 4-token generation:
token 1 comes from the prefill, tokens 2-3 from the first cycle's accepted path / bonus at depth
1 and 2, or from a second cycle.

  * exact reference: P(x1, x2, x3) = p(x1) p(x2 | x1) p(x3 | x1 x2), enumerated from full causal
    forwards of the target with the same warpers (`make_warpers` / `target_probs`);
  * analytic check: the same law computed from the *engine's own* trees and verification
    probabilities (captured by forcing each outcome) under the rule, written out exactly;
  * Monte Carlo: N fixed-seed generations, Pearson chi-square (cells with expected < 5 pooled),
    reject at alpha = 0.001;
  * power: the exact laws of two deliberately broken rules (acceptance p(x) not divided by the
    mass left; bonus from p without removing rejected siblings) are computed the same way, and the
    test's power against them follows from the noncentral chi-square with noncentrality
    N * sum((p_broken - p)^2 / p). Required: >= 0.999 against both at temperature 1, against the
    residual rule at T0.8/top-k 3/top-p 0.9 (printed with -s); the same statistic must then
    actually reject the broken rules when they are monkeypatched into
    `eagle2_core.decoder.accept_sampling`.

N is the smallest multiple of 50 whose power meets the requirement (the exact analytic test
above already proves the law; the samples check the engine's random draws against it). Power at
alpha = 0.001 from `chisquare_power` on these laws, by N (it is not monotone in N because the
pooling of small cells changes with N):

    T1, vs no_renorm_accept:      800: 0.9937  850: 0.9969  900: 0.9984  950: 0.9993  1000: 0.9996
    T1, vs no_renorm_residual:    350: 0.9917  400: 0.9975  450: 0.99996
    T0.8-topk3-topp0.9, residual: 300: 0.9778  350: 0.9992  400: 0.99998

so the correct rule is sampled N = 950 times at T1 and 350 times at T0.8; the broken rules 950
(no_renorm_accept) and 450 (no_renorm_residual) times. (These ran at N = 1000 each before.)
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import eagle2_core.decoder as decoder_mod
from eagle2_core import Eagle2Decoder, GenerationSettings, TreeSettings
from eagle2_core.head import DraftHead, HeadSpec
from eagle2_core.sampling import make_warpers, target_probs

from conftest import acceptance_law, broken_accept_sampling, chisquare_power, pooled_chisquare

V = 5
PROMPT = [1, 2, 3, 0]
MAX_NEW = 4        # generate 4 tokens, test the first 3: cycle 1 drafts depth <= 2
N_SAMPLES = {"T1": 950, "T0.8-topk3-topp0.9": 350}             # correct rule, per setting (see above)
N_BROKEN = {"no_renorm_accept": 950, "no_renorm_residual": 450}  # broken rules, at T1
POWER = 0.999
ALPHA = 1e-3
GENS = {
    "T1": dict(temperature=1.0),
    "T0.8-topk3-topp0.9": dict(temperature=0.8, top_k=3, top_p=0.9),
}


@pytest.fixture(scope="module")
def env(tiny_lm):
    model = tiny_lm("llama", vocab_size=V, hidden_size=16, num_layers=1, max_position_embeddings=32,
                    initializer_range=0.3, logit_scale=1.0)
    torch.manual_seed(2)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model)
    dec = Eagle2Decoder(model, head, tree=TreeSettings(shape="dynamic", total_tokens=8, depth=3, top_k=3))
    return dict(model=model, dec=dec, laws={})


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

    def fake_accept(tree, probs, generator=None):
        seen.append((tree, probs.clone()))
        return next(outcomes, ([0], 0))

    with monkeypatch.context() as mp:
        mp.setattr(decoder_mod, "accept_sampling", fake_accept)
        mp.setattr(decoder_mod.Eagle2Decoder, "_pick", lambda self, logits, warpers, rng: [x1])
        dec.generate(PROMPT, GenerationSettings(**{**vars(gen), "max_new_tokens": MAX_NEW, "seed": 0}))
    return seen


def engine_rule_law(dec, gen: GenerationSettings, p0: list[float], rule: str, monkeypatch) -> dict:
    """Exact law of the first 3 tokens under `rule`, on the trees the engine really builds."""
    law: dict = {}
    for a in range(V):
        if p0[a] <= 0:
            continue
        t1, pr1 = capture_trees(dec, gen, a, [], monkeypatch)[0]
        for seq, q in acceptance_law(t1.parents.tolist(), t1.tokens.tolist(), pr1.double(), rule, max_tokens=2).items():
            if len(seq) == 2:
                law[(a,) + seq] = law.get((a,) + seq, 0.0) + p0[a] * q
                continue
            # the first cycle emitted only its bonus: token 3 is the first token of cycle 2
            t2, pr2 = capture_trees(dec, gen, a, [([0], seq[0])], monkeypatch)[1]
            for seq2, q2 in acceptance_law(t2.parents.tolist(), t2.tokens.tolist(), pr2.double(), rule, max_tokens=1).items():
                key = (a, seq[0], seq2[0])
                law[key] = law.get(key, 0.0) + p0[a] * q * q2
    return law


def laws_for(env, name: str, monkeypatch) -> dict:
    if name not in env["laws"]:
        gen = GenerationSettings(**GENS[name])
        exact = exact_target_law(env["model"], gen)
        p0 = [sum(v for k, v in exact.items() if k[0] == a) for a in range(V)]
        env["laws"][name] = {"exact": exact, **{r: engine_rule_law(env["dec"], gen, p0, r, monkeypatch)
                                                for r in ("correct", "no_renorm_accept", "no_renorm_residual")}}
    return env["laws"][name]


def sample_seeds(n: int) -> list[int]:
    """Fixed per-sample seeds, spread over 63 bits by one Python RNG rather than 0..n-1.

    (With seeds 0..999 the correct rule scored p = 1.6e-4, while ten other blocks of 1000 seeds,
    consecutive or spread, scored p = 0.16 .. 0.89 and a block of 6000 p = 0.30; the exact
    analytic test passes to 1e-6. Small consecutive Mersenne-Twister seeds are not independent
    streams in any guaranteed sense, so the samples use spread-out seeds.)
    """
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
    the two broken rules do not."""
    laws = laws_for(env, name, monkeypatch)
    exact, correct = laws["exact"], laws["correct"]
    assert sum(correct.values()) == pytest.approx(1.0, abs=1e-6)  # float32 verification probabilities
    for k in set(exact) | set(correct):
        assert correct.get(k, 0.0) == pytest.approx(exact.get(k, 0.0), abs=1e-6), k
    for rule in ("no_renorm_accept", "no_renorm_residual"):
        assert max(abs(laws[rule].get(k, 0.0) - exact.get(k, 0.0)) for k in set(exact) | set(laws[rule])) > 5e-3


@pytest.mark.parametrize("name", list(GENS))
def test_sampling_matches_target_law(env, name, monkeypatch):
    laws = laws_for(env, name, monkeypatch)
    exact, n = laws["exact"], N_SAMPLES[name]
    counts = sample_counts(env["dec"], GENS[name], n)
    stat, dof, pval, bins = pooled_chisquare(counts, exact, n)
    power = {r: chisquare_power(exact, laws[r], bins, n, ALPHA) for r in ("no_renorm_accept", "no_renorm_residual")}
    print(f"\n[lossless] {name}: correct rule, N={n}: chi2={stat:.1f} df={dof} p={pval:.3f}; "
          f"power at alpha={ALPHA} vs no_renorm_accept={power['no_renorm_accept']:.4f}, "
          f"vs no_renorm_residual={power['no_renorm_residual']:.4f}")
    assert pval > ALPHA
    assert power["no_renorm_residual"] >= POWER
    if name == "T1":
        assert power["no_renorm_accept"] >= POWER


@pytest.mark.parametrize("rule", ["no_renorm_accept", "no_renorm_residual"])
def test_broken_rule_is_rejected(env, rule, monkeypatch):
    """The same statistic, same seeds, with a deliberately broken acceptance rule: must reject,
    at an N where the test's power against that rule is >= 0.999 (module docstring)."""
    laws = laws_for(env, "T1", monkeypatch)
    n = N_BROKEN[rule]
    with monkeypatch.context() as mp:
        mp.setattr(decoder_mod, "accept_sampling", broken_accept_sampling(rule))
        counts = sample_counts(env["dec"], GENS["T1"], n)
    stat, dof, pval, bins = pooled_chisquare(counts, laws["exact"], n)
    print(f"\n[lossless] T1: BROKEN rule {rule}, N={n}: chi2={stat:.1f} df={dof} p={pval:.2e}")
    assert chisquare_power(laws["exact"], laws[rule], bins, n, ALPHA) >= POWER
    assert pval < ALPHA
    # and the broken run is consistent with the broken rule's own exact law (the harness is sound)
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
    """The exact law above is built with the engine's own warpers, so check those separately."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 50, generator=g) * 3
    gen = GenerationSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    got = target_probs(logits, make_warpers(gen))
    torch.testing.assert_close(got.double(), manual_processed_probs(logits, temperature, top_k, top_p), rtol=1e-5, atol=1e-6)
    assert make_warpers(GenerationSettings(temperature=0.0)) is None
