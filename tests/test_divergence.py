"""Why greedy answers differ (divergence.py): a near-tie within rounding or a bug, on tiny models."""
from __future__ import annotations

import torch

from conftest import make_tiny_lm, model_digest
from eagle2_core.compare import run_comparison
from eagle2_core.divergence import explain, float32_copy, ulp
from eagle2_core.events import GenerationSettings
from eagle2_core.prompts import PromptItem
from eagle2_core.vanilla import VanillaDecoder

PROMPT = [1, 5, 3, 7, 2]


def greedy(model, n=8, gen=None):
    return VanillaDecoder(model).generate(PROMPT, gen or GenerationSettings(max_new_tokens=n))[0]


def ranked(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.sort(logits, descending=True)


def test_ulp():
    assert ulp(torch.bfloat16, 20.0) == 0.125 and ulp(torch.bfloat16, -31.9) == 0.125 and ulp(torch.bfloat16, 32.0) == 0.25
    assert ulp(torch.float32, 1.0) == 2.0 ** -23 and ulp(torch.float16, 1.5) == 2.0 ** -10


def test_a_real_preference_is_not_a_near_tie():
    model = make_tiny_lm("llama", vocab_size=32)
    expected = greedy(model)
    t = 3
    order = ranked(model, PROMPT + expected[:t])
    assert int(order.indices[0]) == expected[t]  # the reference reproduces plain greedy decoding
    second = int(order.indices[1])
    got = expected[:t] + [second] + expected[t + 1:]
    d = explain(model, PROMPT, expected, got, t, GenerationSettings(max_new_tokens=8))
    assert abs(d.gap - float(order.values[0] - order.values[1])) < 1e-4
    assert d.gap > d.tolerance > 0 and not d.near_tie and d.verdict == "NOT a near-tie"
    assert d.gap_float32 == d.gap  # float32 run: the model is its own float32 copy
    # An answer that simply stops early is never explained by a near-tie.
    short = explain(model, PROMPT, expected, expected[:t], t, GenerationSettings(max_new_tokens=8))
    assert short.gap is None and not short.near_tie and "ends here" in short.note


def test_an_exact_tie_is_a_near_tie():
    model = make_tiny_lm("qwen2", vocab_size=32)
    expected = greedy(model)
    t = 2
    a = expected[t]
    b = next(x for x in range(a + 1, 32) if x not in PROMPT + expected)  # after a (ties go to the first index), unseen
    with torch.no_grad():  # give b the same output row as a: equal logits everywhere
        model.lm_head.weight[b] = model.lm_head.weight[a]
    assert greedy(model) == expected
    got = expected[:t] + [b] + expected[t + 1:]
    d = explain(model, PROMPT, expected, got, t, GenerationSettings(max_new_tokens=8))
    assert abs(d.gap) <= 2 * ulp(torch.float32, 10.0) and d.near_tie and d.verdict == "near-tie"


def test_processors_shape_the_gap():
    # With a repetition penalty the gap is between processed scores, as greedy generate sees them.
    model = make_tiny_lm("llama", vocab_size=32)
    gen = GenerationSettings(max_new_tokens=8, repetition_penalty=1.5)
    expected = greedy(model, gen=gen)
    t = 4
    second = next(int(i) for i in ranked(model, PROMPT + expected[:t]).indices if int(i) != expected[t])
    got = expected[:t] + [second]
    plain = explain(model, PROMPT, expected, got, t, GenerationSettings(max_new_tokens=8))
    penal = explain(model, PROMPT, expected, got, t, gen)
    assert penal.gap >= -penal.tolerance and abs(penal.gap - plain.gap) > 1e-4


def test_half_precision_gap_has_a_float32_reading_and_leaves_the_model_alone():
    model = make_tiny_lm("mistral", vocab_size=32).to(torch.bfloat16)
    digest = model_digest(model)
    expected = greedy(model)
    t = 1
    second = next(int(i) for i in ranked(model, PROMPT + expected[:t]).indices if int(i) != expected[t])
    m32, why = float32_copy(model)
    assert why is None and next(m32.parameters()).dtype == torch.float32
    d = explain(model, PROMPT, expected, expected[:t] + [second], t, GenerationSettings(max_new_tokens=8), model32=m32)
    assert d.dtype == "bfloat16" and d.gap_float32 is not None and d.tolerance > 0
    assert model_digest(model) == digest and next(model.parameters()).dtype == torch.bfloat16


class FlipOne:
    """A decoder with a bug: plain greedy, except token `t` is the target's second choice."""

    def __init__(self, model, t):
        self.model, self.t = model, t

    def generate(self, ids, gen):
        tokens, s = VanillaDecoder(self.model).generate(ids, gen)
        if len(tokens) > self.t:
            second = int(ranked(self.model, list(ids) + tokens[: self.t]).indices[1])
            tokens = tokens[: self.t] + [second]
        return tokens, s


def test_comparison_reports_each_difference_and_calls_a_real_one_a_bug():
    model = make_tiny_lm("llama", vocab_size=32)
    items = [PromptItem("id", 1, [{"role": "user", "content": "x"}]), PromptItem("id", 2, [{"role": "user", "content": "y"}])]
    prompts = {"x": PROMPT, "y": PROMPT[::-1]}
    methods = {"vanilla": (VanillaDecoder(model), False), "same": (VanillaDecoder(model), True), "broken": (FlipOne(model, 2), True)}
    comp = run_comparison(methods, items, lambda m: prompts[m[0]["content"]], GenerationSettings(max_new_tokens=6),
                          warmup_tokens=0, model=model)
    assert comp.identical("same") == 2 and "same" not in comp.divergences
    assert comp.identical("broken") == 0 and comp.tie_counts("broken") == (0, 2)
    j = comp.to_json()["broken"]
    assert j["not_near_ties"] == 2 and set(j["divergences"]) == {"1", "2"}
    one = j["divergences"]["1"]
    assert one["token"] == 2 == j["first_difference"]["1"] and one["verdict"] == "NOT a near-tie" and one["gap"] > one["tolerance"]


def test_cli_lines_say_near_tie_or_bug():
    from eagle2_cli.compare_cmd import divergence_text
    from eagle2_core.divergence import Divergence

    tie = Divergence(5, 10, 11, "bfloat16", gap=0.125, gap_float32=0.01, tolerance=0.25, near_tie=True)
    bug = Divergence(5, 10, 11, "float32", gap=3.0, gap_float32=3.0, tolerance=1e-5, near_tie=False)
    decode = lambda ts: f"<{ts[0]}>"  # noqa: E731
    assert "'<10>' (vanilla) and '<11>' differ by 0.125 in bfloat16, 0.01 in float32" in divergence_text(tie, decode)
    assert divergence_text(tie, decode).endswith("a near-tie, rounding decides it")
    assert "NOT a near-tie, a bug" in divergence_text(bug, decode) and "in float32;" in divergence_text(bug, decode)
    assert "'<10>' (plain) and" in divergence_text(tie, decode, "plain")  # compare --no-vanilla checks against plain


def test_the_tolerance_reads_eagle2s_own_kernels(monkeypatch):
    """The rounding eagle2's verify really had: one reading goes through the product plan's
    kernel (here `transposed`, forced), and the model is left as it was after it."""
    from eagle2_core import rowgemm
    from eagle2_core.divergence import whole_logits

    model = make_tiny_lm("llama", vocab_size=32)
    ids = PROMPT + greedy(model)[:3]
    ran = []
    real = rowgemm.kernel_for
    monkeypatch.setattr(rowgemm, "kernel_for", lambda x, w: ran.append(real(x, w)) or ran[-1])
    with rowgemm.using_plan(rowgemm.forced("transposed")):
        plain = whole_logits(model, ids)
        assert ran == []  # the plain reading is `generate`'s own F.linear
        ours = whole_logits(model, ids, our_kernels=True)
    assert ran and set(ran) == {"transposed"}
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)
