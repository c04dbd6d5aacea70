"""Greedy EAGLE-2 decoding is token-for-token identical to `model.generate(do_sample=False)`.

Tiny random-weight targets of four architectures (Llama, Qwen2, Mistral with a 5-token sliding
window, Gemma 3 with hybrid sliding/full layers), vocabulary 12, context limit 40 positions, and a
draft head fitted to each target for a couple of seconds so accepted paths of every depth occur.
Every (architecture, tree shape) pair decodes the same ~24 cases:
  * random prompts of random lengths with random token budgets,
  * prompts whose greedy continuation hits an EOS id (the EOS is picked from the tokens the
    model really produces, so the stop is guaranteed to trigger, sometimes on the first token),
  * prompts that run into the context limit (max_position_embeddings), including a prompt that
    already fills it.
The per-shape acceptance histogram must show cycles accepting >= 2 draft tokens, so KV compaction
of multi-node paths is exercised, and cycles accepting 0 tokens, so rejected branches are too.
"""
from __future__ import annotations

import random

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, Summary, TreeSettings
from eagle2_core.vanilla import VanillaDecoder

from conftest import CORE_ARCHS

MAXPOS = 40
VOCAB = 12
SHAPES = {
    "dynamic": TreeSettings(shape="dynamic", total_tokens=12, depth=4, top_k=3),
    "static": TreeSettings(shape="static", total_tokens=12, depth=4, top_k=3),
    "chain": TreeSettings(shape="chain", total_tokens=5, depth=4),
}


def reference(model, ids: list[int], max_new: int, eos: tuple[int, ...]) -> list[int]:
    n = min(max_new, MAXPOS - len(ids))
    if n <= 0:
        return []
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=list(eos) or None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def build_cases(model, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []

    def rand_prompt(lo, hi):
        return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]

    for _ in range(12):  # free running, random lengths and budgets
        ids, n = rand_prompt(1, 16), rng.randint(1, 30)
        cases.append(dict(kind="random", ids=ids, n=n, eos=(), ref=reference(model, ids, n, ())))
    for i in range(6):  # stop at an EOS the model actually emits (i == 0: the very first token)
        ids = rand_prompt(1, 12)
        free = reference(model, ids, 30, ())
        j = 0 if i == 0 else rng.randrange(len(free))
        eos = (free[j],) if i != 5 else (free[j], (free[j] + 1) % VOCAB)  # one case with two EOS ids
        ref = reference(model, ids, 30, eos)
        assert ref and ref[-1] in eos and len(ref) == free.index(ref[-1]) + 1
        cases.append(dict(kind="eos", ids=ids, n=30, eos=eos, ref=ref))
    for room in (1, 2, 3, 6, 11):  # run into max_position_embeddings
        ids = rand_prompt(MAXPOS - room, MAXPOS - room)
        ref = reference(model, ids, 100, ())
        assert len(ref) == room
        cases.append(dict(kind="context", ids=ids, n=100, eos=(), ref=ref))
    cases.append(dict(kind="context", ids=rand_prompt(MAXPOS, MAXPOS), n=5, eos=(), ref=[]))  # no room at all
    return cases


@pytest.fixture(scope="module", params=CORE_ARCHS)
def arch_env(request, tiny_lm, fitted_head):
    arch = request.param
    model = tiny_lm(arch, vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    return dict(arch=arch, model=model, head=head, cases=build_cases(model, seed=1000 + CORE_ARCHS.index(arch)))


def check_summary(s: Summary, out: list[int], case: dict) -> None:
    assert s.new_tokens == len(out)
    assert sum(s.accepted_hist) == s.cycles
    assert s.target_forwards == s.cycles + (1 if case["ref"] else 0)  # prefill + one verification per cycle; no room: nothing runs
    expect = "stop" if case["kind"] == "eos" else "length"
    assert s.finish_reason == expect, (s.finish_reason, case)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_identity(arch_env, shape, monkeypatch):
    from eagle2_core.target import TargetRunner

    max_pos = []  # no position at or beyond max_position_embeddings is ever computed (learned
    real_forward = TargetRunner.body_forward  # absolute-position models would index out of range)

    def forward(self, tokens, positions, *args):
        max_pos.append(int(positions.max()))
        return real_forward(self, tokens, positions, *args)

    monkeypatch.setattr(TargetRunner, "body_forward", forward)
    dec = Engine(arch_env["model"], arch_env["head"], tree=SHAPES[shape])
    hist: list[int] = []
    cut_cycles = 0  # cycles whose emitted tokens were cut short by EOS
    mismatches = []
    for case in arch_env["cases"]:
        gen = GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"])
        out: list[int] = []
        summary = None
        for ev in dec.stream(case["ids"], gen):
            if isinstance(ev, Summary):
                summary = ev
            else:
                out.extend(ev.token_ids)
                cut_cycles += ev.accepted > 0 and len(ev.token_ids) < ev.accepted + 1
        if out != case["ref"]:
            mismatches.append((case["kind"], case["ids"], case["n"], case["eos"], out, case["ref"]))
            continue
        check_summary(summary, out, case)
        for d, c in enumerate(summary.accepted_hist):
            hist.extend([0] * (d + 1 - len(hist)))
            hist[d] += c
    kinds = {k: sum(c["kind"] == k for c in arch_env["cases"]) for k in ("random", "eos", "context")}
    print(f"\n[identity] {arch_env['arch']:8s} {shape:8s} {len(arch_env['cases']) - len(mismatches)}/{len(arch_env['cases'])} "
          f"identical {kinds} accepted_hist={hist} eos_cut_cycles={cut_cycles}")
    assert not mismatches, mismatches[:3]
    assert max(max_pos) == MAXPOS - 1  # reached (the full-context prompt), never exceeded
    assert sum(hist[2:]) > 0, f"no cycle accepted >= 2 draft tokens: {hist}"
    assert hist[0] > 0, f"no cycle rejected every draft token: {hist}"


@pytest.mark.parametrize("rows_cheap", [True, False])
def test_greedy_identity_for_both_lm_head_plans(arch_env, rows_cheap):
    """Where extra rows are measured cheap (GPU, float32 CPU via rowgemm, bf16 on AMX) acceptance takes
    every tree row's logits in one product; elsewhere internal rows first and a leaf row only
    when the path ends there. Both are forced here on the float32 tiny models."""
    dec = Engine(arch_env["model"], arch_env["head"], tree=SHAPES["dynamic"])
    dec.one_product = rows_cheap  # what the measured profile would decide
    rows_seen = []
    real_logits = dec.runner.logits
    dec.runner.logits = lambda h: rows_seen.append(h.shape[0]) or real_logits(h)
    for case in arch_env["cases"]:
        out, _ = dec.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
        assert out == case["ref"], case
    if rows_cheap:
        assert max(rows_seen) == SHAPES["dynamic"].total_tokens  # whole trees went through lm_head at once
    else:
        # internal rows only, plus one-row leaf passes beyond the one prefill row per case
        assert max(rows_seen) < SHAPES["dynamic"].total_tokens and rows_seen.count(1) > len(arch_env["cases"])


@pytest.mark.parametrize("kernel", ["transposed", "packed", "stream"])  # linear: every other identity test (the suite pins it)
def test_greedy_identity_with_each_kernel_forced(arch_env, kernel, monkeypatch):
    """Every kernel the product plan may choose (rowgemm.py), forced for every product of the
    target and the head in turn (EAGLE2_KERNEL, which a measured plan cannot override), keeps
    greedy output equal to `generate` (which runs F.linear)."""
    from eagle2_core import rowgemm
    from eagle2_core.costs import product_weights

    if not rowgemm._offered(kernel):
        pytest.skip(f"{kernel} is not offered here (no oneDNN packed linear, or no native build)")
    monkeypatch.setenv("EAGLE2_KERNEL", kernel)
    before = rowgemm.PLAN
    rowgemm.install_plan(rowgemm.ProductPlan())
    weights = product_weights(arch_env["model"], arch_env["head"])
    rowgemm.prepare(weights)
    ran = []
    real = rowgemm.kernel_for
    monkeypatch.setattr(rowgemm, "kernel_for", lambda x, w: ran.append(real(x, w)) or ran[-1])
    try:
        dec = Engine(arch_env["model"], arch_env["head"], tree=SHAPES["dynamic"])
        for case in arch_env["cases"]:
            out, _ = dec.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
            assert out == case["ref"], (kernel, case)
    finally:
        rowgemm.prepare(weights, rowgemm.ProductPlan())
        rowgemm.PLAN = before
    assert set(ran) == {kernel}  # it really ran, for every product


def test_tree_variants_identity(tiny_lm, fitted_head):
    """Ablations and edge sizes stay lossless too: expand by node confidence, no rerank,
    a one-node tree (total_tokens=2), a top-1 dynamic tree, and a tree wider than the vocabulary."""
    model = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    head = fitted_head(model)
    cases = build_cases(model, seed=7)[:10]
    for ts in (TreeSettings(expand_by="node", total_tokens=10, depth=3, top_k=3),
               TreeSettings(rerank=False, total_tokens=10, depth=3, top_k=3),
               TreeSettings(total_tokens=2, depth=3, top_k=3),
               TreeSettings(total_tokens=8, depth=5, top_k=1),
               TreeSettings(total_tokens=30, depth=2, top_k=VOCAB + 4)):
        dec = Engine(model, head, tree=ts)
        for case in cases:
            out, _ = dec.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
            assert out == case["ref"], (ts, case)


def test_vanilla_matches_generate(tiny_lm):
    """The baseline decoder is `generate` itself: same tokens, EOS and context handling."""
    model = tiny_lm("mistral", vocab_size=VOCAB, max_position_embeddings=MAXPOS)
    van = VanillaDecoder(model)
    for case in build_cases(model, seed=11):
        out, s = van.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
        assert out == case["ref"], case
        assert s.new_tokens == len(out)
        assert s.finish_reason == ("stop" if case["kind"] == "eos" else "length")


def test_summary_tau_and_acceptance_by_depth():
    """tau and acceptance-by-depth on a known histogram.

    Cycles by accepted drafts: 4 accepted 0, 3 accepted 1, 2 accepted 2, 1 accepted 3 (10 cycles).
    Emitted tokens = 1 (prefill) + sum(accepted + 1) = 1 + (0+3+4+3) + 10 = 21; forwards = 11.
    Depth d is reached by the cycles that accepted >= d-1 drafts: 10, 6, 3, 1 -> rates 6/10, 3/6, 1/3.
    """
    s = Summary(new_tokens=21, target_forwards=11, cycles=10, accepted_hist=[4, 3, 2, 1], depth_sum=40)
    assert s.tau == pytest.approx(21 / 11)
    assert s.acceptance_by_depth == pytest.approx([0.6, 0.5, 1 / 3])
    assert s.accepted_per_cycle == pytest.approx(10 / 10)  # 0*4 + 1*3 + 2*2 + 3*1 = 10 accepted drafts
    assert s.acceptance_rate == pytest.approx(10 / 40)     # over the deepest draft path of each tree
    assert Summary().tau == 0.0 and Summary().acceptance_by_depth == []
    # record_cycle builds the same histogram (trees of 3 nodes, a depth-2 chain each)
    t = Summary()
    for acc in [0, 0, 0, 0, 1, 1, 1, 2, 2, 3]:
        t.record_cycle(acc, 3, 2, 0.0, 0.0)
    assert t.accepted_hist == [4, 3, 2, 1] and t.cycles == 10 and t.target_forwards == 10 and t.tree_tokens == 30
    assert t.depth_sum == 20 and t.acceptance_rate == pytest.approx(10 / 20)  # every tree is a depth-2 chain
    # a histogram with a gap: nobody accepted 1, so depth 2 has no denominator
    g = Summary(accepted_hist=[5, 0, 0])
    assert g.acceptance_by_depth == [0.0, 0.0]
