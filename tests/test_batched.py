"""Batched decoding (batched.py): B sequences per cycle, continuous batching, exact.

On the tiny targets of the identity tests (Llama, Qwen2, Mistral with a sliding window, Gemma 3
hybrid; vocabulary 12, context 40), with a draft head fitted to each:
  * greedy batched output equals per-prompt `generate` for every case of `build_cases` (mixed
    prompt lengths, EOS at different cycles, sequences running into the context limit, a prompt
    that fills it), with more prompts than slots, so slots are refilled mid-run and the batch
    shrinks at the end; for trees of N nodes, for plain batches (N = 1) and for the tree size
    chosen per cycle by the planner, and with an EAGLE-3 head;
  * batch composition never changes an answer: one prompt alone, with short mates, with long
    mates, and joining mid-run all give the same tokens;
  * sampling: the keyed rule (accept.accept_sampling_keyed), the one rule of every decoder, makes
    a seeded answer independent of the tree, the tree size and the batch-mates (so equal to plain
    sampling with the same uniforms) and the same as the batch-1 decoder's (eager, per-cycle
    budget, graph mode), and its law is the target's (exact check over a grid of uniforms; Monte
    Carlo with batch-mates, with its power stated);
  * the planner chooses by measured cost: plain at large batch where rows are dear, trees where
    rows are nearly free.
"""
from __future__ import annotations

import collections
import random

import pytest
import torch

from eagle2_core.accept import accept_sampling_keyed, inverse_cdf
from eagle2_core.batched import BatchDecoder, BatchPlanner, Request, accept_greedy_batch, plan, prior_expected, rerank_batch
from eagle2_core.costs import BatchCosts
from eagle2_core.events import GenerationSettings
from eagle2_core.sampling import make_warpers, target_probs
from eagle2_core.tree import DraftTree, rerank, tree_from_parents

from conftest import CORE_ARCHS, chisquare_power, distill_tiny_head, pooled_chisquare
from test_decoder_identity import MAXPOS, VOCAB, build_cases, reference


def flat_costs(row_ms: float, base_ms: float = 10.0, draft_ms: float = 3.0) -> BatchCosts:
    """A made-up cost table: base + row_ms per row of B x N."""
    verify = {(b, n): base_ms + row_ms * b * n for b in (1, 2, 4, 8) for n in (1, 2, 3, 4, 6)}
    return BatchCosts(key={}, verify_ms=verify, draft_ms={b: draft_ms * b for b in (1, 2, 4, 8)})


def run_batch(model, head, requests, batch, tree, depth=4, top_k=3, planner=None):
    out = {}
    dec = BatchDecoder(model, head if tree > 1 else None, None, batch, tree, depth, top_k, planner=planner)
    dec.run(collections.deque(requests), lambda k, toks, s: out.__setitem__(k, (toks, s)))
    return out, dec


def case_requests(cases):
    return [Request(i, c["ids"], GenerationSettings(max_new_tokens=c["n"], eos_token_ids=c["eos"])) for i, c in enumerate(cases)]


@pytest.fixture(scope="module", params=CORE_ARCHS)
def env(request, tiny_lm, fitted_head):
    arch = request.param
    model = tiny_lm(arch, vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    return dict(arch=arch, model=model, head=fitted_head(model), cases=build_cases(model, seed=5000 + CORE_ARCHS.index(arch)))


@pytest.mark.parametrize("batch,tree", [(3, 6), (4, 1), (5, "auto")])
def test_batched_greedy_identity(env, batch, tree):
    cases = env["cases"]
    planner = BatchPlanner(flat_costs(0.5), batch, 6, [1.0, 1.6, 1.9, 2.1, 2.2, 2.3]) if tree == "auto" else None
    out, dec = run_batch(env["model"], env["head"], case_requests(cases), batch, 6 if tree == "auto" else tree, planner=planner)
    bad = [(c["kind"], c["ids"], out[i][0], c["ref"]) for i, c in enumerate(cases) if out[i][0] != c["ref"]]
    hist = collections.Counter(a for i in out for a, n in enumerate(out[i][1].accepted_hist) for _ in range(n))
    print(f"\n[batched] {env['arch']} B={batch} N={tree}: {len(cases) - len(bad)}/{len(cases)} identical, accepted {dict(hist)}, "
          f"tree sizes {dec.stats['tree_sizes']}")
    assert not bad, bad[:2]
    assert len(out) == len(cases)
    if tree not in (1, "auto"):
        assert max(hist) >= 2 and hist[0] > 0  # multi-token commits and full rejections both happened
    if tree == "auto":
        assert len(dec.stats["tree_sizes"]) > 1  # the size was chosen per cycle, not fixed


def test_batch_composition_never_changes_an_answer(tiny_lm):
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = distill_tiny_head(model)
    rng = random.Random(7)
    probe = [rng.randrange(VOCAB) for _ in range(6)]
    ref = reference(model, probe, 20, ())
    short = [[rng.randrange(VOCAB) for _ in range(2)] for _ in range(5)]
    long = [[rng.randrange(VOCAB) for _ in range(25)] for _ in range(5)]
    g = GenerationSettings(max_new_tokens=20, eos_token_ids=())
    layouts = {
        "alone": [probe],
        "short mates": short[:2] + [probe] + short[2:],
        "long mates": long[:3] + [probe],
        "joins mid-run": long + short + [probe],  # queued behind ten prompts: takes a freed slot
    }
    for name, prompts in layouts.items():
        reqs = [Request(i, p, GenerationSettings(max_new_tokens=3 if p is not probe else 20, eos_token_ids=())) if p is not probe
                else Request(i, p, g) for i, p in enumerate(prompts)]
        out, _ = run_batch(model, head, reqs, 3, 6)
        assert out[prompts.index(probe)][0] == ref, name


def test_batched_eagle3_head_identity(tiny_lm):
    model = tiny_lm("qwen2", vocab_size=VOCAB, max_position_embeddings=MAXPOS, num_layers=7)
    head = distill_tiny_head(model, arch="eagle3")
    cases = build_cases(model, seed=77)[:14]
    out, _ = run_batch(model, head, case_requests(cases), 4, 6)
    assert [out[i][0] for i in range(len(cases))] == [c["ref"] for c in cases]


# -- batched pure functions agree with the batch-1 ones ------------------------------------------

def test_batched_rerank_and_accept_match_the_single_tree_functions():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b, p = 3, 14
        parents = [-1, -1, -1] + [random.Random(i).randrange(0, i) for i in range(3, p)]
        pool_p = torch.tensor([parents] * b)
        pool_t = torch.randint(0, 9, (b, p), generator=g)
        # path scores that never rise from parent to child, as the drafter makes them
        own = -torch.rand(b, p, generator=g)
        scores = own.clone()
        for i in range(p):
            if parents[i] >= 0:
                scores[:, i] += scores[:, parents[i]]
        roots = torch.randint(0, 9, (b,), generator=g)
        bt, bp, bd, ba, _ = rerank_batch(pool_t, pool_p, scores, roots, 7, depth_max=p)
        argmax = torch.randint(0, 9, (b, bt.shape[1]), generator=g)
        path, acc, bonus = accept_greedy_batch(bt, bp, bd, ba, argmax, width=8)
        for r in range(b):
            one = rerank(pool_t[r], pool_p[r], scores[r], roots[r], 7, max_depth=p)
            assert torch.equal(one.tokens, bt[r]) and torch.equal(one.parents, bp[r])
            assert torch.equal(one.depth, bd[r]) and torch.equal(one.ancestors, ba[r])
            from eagle2_core.accept import accept_greedy
            p1, b1 = accept_greedy(one, argmax[r])
            assert path[r, : len(p1)].tolist() == p1 and int(acc[r]) == len(p1) - 1 and int(bonus[r]) == b1


# -- sampling --------------------------------------------------------------------------------

def test_keyed_rule_emits_the_target_distribution_exactly():
    """Over a fine grid of the position's uniform, the first emitted token has law p exactly (up to
    the grid), whatever children the tree offers; deeper tokens follow p at their node."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.5, 0.0, 0.25, 0.25, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    tree = tree_from_parents(torch.tensor([4, 3, 1]), torch.tensor([-1, 0, 0]))  # children 3 (p .4) and 1 (p .2)
    grid = 20000
    first = collections.Counter()
    second_after_3 = collections.Counter()
    for j in range(grid):
        u = (j + 0.5) / grid
        path, bonus = accept_sampling_keyed(tree, probs, [u, 0.3, 0.9])
        tok = tree.tokens[path[1]].item() if len(path) > 1 else bonus
        first[tok] += 1
        if len(path) > 1 and path[1] == 1:
            second_after_3[bonus] += 1
    for t in range(5):
        assert first[t] / grid == pytest.approx(float(probs[0, t]), abs=1e-3)
    # the node holding token 3 has no children: its bonus is the draw of uniform 0.3 under probs[1]
    assert set(second_after_3) == {inverse_cdf(probs[1], 0.3)}
    assert inverse_cdf(torch.tensor([0.0, 1.0, 0.0]), 0.0) == 1  # a zero-mass token is never drawn


def tiny_sampling_model(tiny_lm):
    return tiny_lm("llama", vocab_size=5, hidden_size=16, num_layers=1, max_position_embeddings=32, initializer_range=0.3, logit_scale=1.0)


def test_seeded_sample_is_independent_of_tree_and_mates(tiny_lm):
    model = tiny_sampling_model(tiny_lm)
    head = distill_tiny_head(model, steps=60)
    prompt = [1, 2, 3, 0]
    mates = [[4, 4], [0, 1, 2, 3, 4, 0, 1], [2]]
    for seed in range(12):
        g = GenerationSettings(max_new_tokens=8, temperature=1.0, seed=seed, eos_token_ids=())
        alone_plain, _ = run_batch(model, None, [Request(0, prompt, g)], 1, 1)
        for batch, tree in ((3, 4), (2, 6), (4, 1)):
            others = [Request(i + 1, m, GenerationSettings(max_new_tokens=5, temperature=0.7, seed=100 + i, eos_token_ids=()))
                      for i, m in enumerate(mates)]
            out, _ = run_batch(model, head, others[:1] + [Request(0, prompt, g)] + others[1:], batch, tree)
            assert out[0][0] == alone_plain[0][0], (seed, batch, tree)


def exact_law(model, temperature: float, prompt: list[int]) -> dict:
    warpers = make_warpers(GenerationSettings(temperature=temperature))
    law = {}
    with torch.no_grad():
        for a in range(5):
            for b in range(5):
                p = target_probs(model(torch.tensor([prompt + [a, b]])).logits[0, -3:], warpers).double()
                for c in range(5):
                    law[(a, b, c)] = float(p[0, a] * p[1, b] * p[2, c])
    return law


def test_batched_sampling_follows_the_target_law(tiny_lm):
    """Monte Carlo, N = 1200 seeded answers decoded 6 at a time with trees of 4 nodes, against
    the exact law of the first three tokens (Pearson chi-square, cells with expected < 5 pooled,
    alpha = 0.001). Power: against the law at temperature 1.3 instead of 1 (a mis-applied
    warper), computed from the noncentral chi-square, must be >= 0.99."""
    model = tiny_sampling_model(tiny_lm)
    head = distill_tiny_head(model, steps=60)
    prompt, n = [1, 2, 3, 0], 1200
    law, wrong = exact_law(model, 1.0, prompt), exact_law(model, 1.3, prompt)
    rng = random.Random(1)
    seeds = [rng.getrandbits(62) for _ in range(n)]
    reqs = [Request(i, prompt, GenerationSettings(max_new_tokens=4, temperature=1.0, seed=s, eos_token_ids=())) for i, s in enumerate(seeds)]
    out, _ = run_batch(model, head, reqs, 6, 4)
    counts = collections.Counter(tuple(out[i][0][:3]) for i in range(n))
    stat, dof, pval, bins = pooled_chisquare(counts, law, n)
    power = chisquare_power(law, wrong, bins, n, 1e-3)
    print(f"\n[batched sampling] chi2={stat:.1f} df={dof} p={pval:.3f}; power vs T=1.3: {power:.4f}")
    assert power >= 0.99
    assert pval > 1e-3


def test_seeded_answer_is_the_same_in_every_decoder(tiny_lm):
    """One sampling rule, one uniform per output position: a seeded answer (temperature 0.8) is
    the same from the batch-1 decoder (Eagle2Decoder: trees of 4 and 8 nodes, the per-cycle
    budget, graph mode) and from the batched decoder at B = 1 and B = 3 with batch-mates, trees
    and plain; seeds past 2^63 and negative ones included. Different seeds give different answers."""
    from eagle2_core import Eagle2Decoder, TreeSettings

    model = tiny_sampling_model(tiny_lm)
    head = distill_tiny_head(model, steps=60)
    prompt = [1, 2, 3, 0]
    tree = lambda n, **kw: TreeSettings(shape="dynamic", total_tokens=n, depth=3, top_k=3, **kw)  # noqa: E731
    eager = {"eager N=4": Eagle2Decoder(model, head, tree=tree(4)), "eager N=8": Eagle2Decoder(model, head, tree=tree(8)),
             "eager auto budget": Eagle2Decoder(model, head, tree=tree(8, budget="auto")),
             "graph N=8": Eagle2Decoder(model, head, tree=tree(8), graph=True)}
    seen = set()
    for seed in (7, 2**63 + 5, -3):
        g = GenerationSettings(max_new_tokens=12, temperature=0.8, seed=seed, eos_token_ids=())
        answers = {name: dec.generate(prompt, g)[0] for name, dec in eager.items()}
        for batch, n in ((1, 4), (1, 1), (3, 6), (3, 1)):
            mates = [Request(i, [4, 4, i], GenerationSettings(max_new_tokens=4 + 5 * i, temperature=1.0, seed=100 + i, eos_token_ids=()))
                     for i in range(1, batch)]
            out, _ = run_batch(model, head, [Request(0, prompt, g)] + mates, batch, n, depth=3)
            answers[f"batched B={batch} N={n}"] = out[0][0]
        assert len({tuple(a) for a in answers.values()}) == 1, (seed, answers)
        assert len(answers["eager N=4"]) == 12
        seen.add(tuple(answers["eager N=4"]))
    assert len(seen) == 3


# -- choosing by measured cost ------------------------------------------------------------------

def test_plan_follows_the_measured_costs():
    prior = [1.0, 1.6, 1.9, 2.1, 2.2, 2.3]
    b, n, table = plan(flat_costs(row_ms=8.0, base_ms=2.0), 32, prior)  # every row costs: plain, widest batch
    assert (b, n) == (8, 1), table
    b, n, _ = plan(flat_costs(row_ms=0.01, base_ms=50.0, draft_ms=0.1), 32, prior)  # rows nearly free: trees
    assert n >= 4 and b == 8
    b, n, _ = plan(flat_costs(row_ms=8.0), 3, prior)  # never more slots than prompts
    assert b <= 3
    assert plan(flat_costs(1.0), 32, prior, batch=4, tree=3)[:2] == (4, 3)


def test_planner_grows_the_tree_with_the_drafts_confidence():
    pl = BatchPlanner(flat_costs(row_ms=2.0, base_ms=20.0, draft_ms=0.5), 4, 6, [1.0] * 6)
    sure = torch.tensor([[0.95, 0.9, 0.85, 0.8, 0.75]] * 4)
    unsure = torch.tensor([[0.05, 0.03, 0.02, 0.01, 0.01]] * 4)
    assert pl.choose_n(sure) > pl.choose_n(unsure) == 1
    for _ in range(pl.patience):
        pl.choose_n(unsure)
    assert pl.go_plain  # drafting has not paid for `patience` cycles: plain batches from here


def test_prior_from_the_heads_metadata():
    class H:
        metadata = {"eval": {"acceptance_by_depth": [0.6, 0.5]}}
    assert prior_expected(H(), 4)[:3] == pytest.approx([1.0, 1.6, 1.9])
    class R:
        metadata = {"random": True}
    assert prior_expected(R(), 4) == [1.0] * 4


def test_batched_applies_the_models_generation_config(tiny_lm):
    """A model whose generation_config sets a repetition penalty and no-repeat n-grams: batched
    greedy (trees and plain) equals the model's own generate() with that config."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = distill_tiny_head(model)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 3
    try:
        rng = random.Random(11)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))] for _ in range(7)]
        refs = []
        for p in prompts:
            x = torch.tensor([p])
            refs.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=15, do_sample=False, pad_token_id=0)[0, len(p):].tolist())
        for batch, tree in ((3, 6), (4, 1)):
            # the settings Runtime resolves from that config (sampling.settings_from_model, tested in test_processors)
            g = GenerationSettings(max_new_tokens=15, eos_token_ids=(), repetition_penalty=1.3, no_repeat_ngram_size=3)
            reqs = [Request(i, p, g) for i, p in enumerate(prompts)]
            out, _ = run_batch(model, head, reqs, batch, tree)
            assert [out[i][0] for i in range(len(prompts))] == refs, (batch, tree)
        # and the processors did change the answers
        model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size = 1.0, 0
        bare = [reference(model, p, 15, ()) for p in prompts]
        assert bare != refs
    finally:
        model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size = 1.0, 0
