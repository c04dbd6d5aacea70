"""The few-row product of rowgemm.py: same values as F.linear, taken only where it is meant to
be, and a target model left exactly as it was outside our forwards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle2_core import rowgemm
from eagle2_core.rowgemm import RowLinear, linear_rows, make_row_linears, plain_linears, row_linears, transposed_is_faster


EVERYWHERE = rowgemm.RowPlan(body_one=True, body_max=10**6, wide_one=True, wide_max=10**6)


@pytest.fixture(autouse=True)
def _restore_plan():
    before = rowgemm.PLAN
    yield
    rowgemm.install_plan(before)


@pytest.mark.parametrize("out_features", [48, rowgemm.WIDE])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 65])
def test_linear_rows_matches_linear(out_features, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 40, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(1, rows, 40, generator=g)  # batch dims are kept
    with rowgemm.using_plan(EVERYWHERE):
        assert transposed_is_faster(x, w)
        for bias in (None, b):
            got, want = linear_rows(x, w, bias), F.linear(x, w, bias)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_transposed_form_follows_the_installed_plan():
    w, wide = torch.randn(48, 40), torch.randn(rowgemm.WIDE, 40)
    rows = lambda n, dtype=torch.float32: torch.randn(n, 40, dtype=dtype)  # noqa: E731
    rowgemm.install_plan(rowgemm.RowPlan())  # nothing measured: linear everywhere
    assert not any(transposed_is_faster(rows(n), m) for n in (1, 2, 8) for m in (w, wide))
    rowgemm.install_plan(rowgemm.RowPlan(body_one=False, body_max=5, wide_one=True, wide_max=20))
    assert not transposed_is_faster(rows(1), w) and transposed_is_faster(rows(2), w) and transposed_is_faster(rows(5), w)
    assert not transposed_is_faster(rows(6), w)
    assert transposed_is_faster(rows(1), wide) and transposed_is_faster(rows(20), wide)  # one row too, where measured faster
    assert not transposed_is_faster(rows(21), wide)
    assert not transposed_is_faster(rows(4, torch.bfloat16), w.bfloat16())
    trainable = nn.Parameter(w.clone())
    assert not transposed_is_faster(rows(4), trainable)              # training keeps linear's backward
    with torch.no_grad():
        assert transposed_is_faster(rows(4), trainable)


def test_transposed_form_is_what_runs(monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(rowgemm.torch, "mm", lambda *a: calls.append(a[0].shape) or real_mm(*a))
    w = torch.randn(48, 40)
    with rowgemm.using_plan(rowgemm.RowPlan(body_max=8)):
        linear_rows(torch.randn(3, 40), w)
        linear_rows(torch.randn(1, 40), w)
    assert calls == [w.shape]  # only the three-row product went through W @ x.T


def test_plan_from_measured_pairs():
    from eagle2_core.costs import row_plan

    assert row_plan({}) == rowgemm.RowPlan()
    body = {1: [5.0, 6.0], 2: [9.0, 6.0], 3: [9.0, 7.0], 4: [9.0, 8.0], 6: [9.0, 9.5], 8: [9.0, 8.0]}
    wide = {1: [10.1, 4.4], 2: [20.0, 4.4], 4: [20.0, 6.0], 8: [8.0, 9.0]}
    plan = row_plan({"body": body, "wide": wide})
    # the run of wins from 2 ends at the first loss (6 rows), a later win (8) does not reopen it;
    # one row is its own question: slower transposed for the body, faster for the lm_head (Zen 4)
    assert plan == rowgemm.RowPlan(body_one=False, body_max=4, wide_one=True, wide_max=4)
    assert row_plan({"body": body}) == rowgemm.RowPlan(False, 4, False, 4)  # no vocabulary-sized weight: the body's plan
    assert "2-4 rows" in plan.describe() and "1-4 rows" in plan.describe()
    tie = {1: [33.4, 33.1], 2: [100.0, 40.0]}  # one row within noise of linear: linear stays
    assert row_plan({"body": tie}).body_one is False


def test_the_profile_measures_and_installs_the_plan(tiny_target, monkeypatch, tmp_path):
    from eagle2_core import costs
    from eagle2_core.runtime import random_head

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path))
    head = random_head(tiny_target)
    seen = []
    monkeypatch.setattr(costs, "measure_row_products", lambda run, reps=5: seen.append(run) or
                        {"body": {1: [1.0, 0.5], 2: [2.0, 1.0], 3: [2.0, 3.0]}})
    rowgemm.install_plan(rowgemm.RowPlan())
    prof = costs.load_or_measure(tiny_target.model, head)
    assert len(seen) == 1 and rowgemm.PLAN == rowgemm.RowPlan(True, 2, True, 2)
    assert prof.row_products == {"body": {1: [1.0, 0.5], 2: [2.0, 1.0], 3: [2.0, 3.0]}}
    rowgemm.install_plan(rowgemm.RowPlan())
    again = costs.load_or_measure(tiny_target.model, head)  # from the cache: installed again, not measured
    assert len(seen) == 1 and again.row_products == prof.row_products and rowgemm.PLAN == rowgemm.RowPlan(True, 2, True, 2)


def test_row_products_are_measured_for_body_and_lm_head(tiny_lm):
    from eagle2_core import costs
    from eagle2_core.target import TargetRunner

    rp = costs.measure_row_products(TargetRunner(tiny_lm("llama")), reps=1)
    assert set(rp) == {"body"}  # a small vocabulary is not vocabulary-sized
    assert sorted(rp["body"]) == list(costs.ROW_TRIALS_BODY) and all(a > 0 and b > 0 for a, b in rp["body"].values())
    wide = costs.measure_row_products(TargetRunner(tiny_lm("llama", vocab_size=rowgemm.WIDE, hidden_size=16)), reps=1)
    assert set(wide) == {"body", "wide"} and sorted(wide["wide"]) == list(costs.ROW_TRIALS_WIDE)
    assert costs.measure_row_products(TargetRunner(tiny_lm("llama").to(torch.bfloat16)), reps=1) == {}  # rowgemm never applies


def test_row_linears_is_scoped_and_leaves_hooks_alone():
    model = nn.Sequential(nn.Linear(40, 48), nn.ReLU(), nn.Linear(48, 8))
    hooked = model[2]
    hooked.forward = lambda x: torch.zeros(*x.shape[:-1], 8)  # an accelerate-style instance forward
    x = torch.randn(4, 40)
    want = F.linear(torch.relu(model[0](x)), hooked.weight, hooked.bias)
    linears = [m for m in plain_linears(model) if "forward" not in m.__dict__]
    assert linears == [model[0]]
    with row_linears(linears):
        assert "forward" in model[0].__dict__
        inside = model(x)
    assert "forward" not in model[0].__dict__ and type(model[0]) is nn.Linear  # the model is as it was
    assert torch.equal(inside, torch.zeros(4, 8))  # the hooked layer kept its own forward
    model[2].__dict__.pop("forward")
    torch.testing.assert_close(model(x), want)


def test_make_row_linears_keeps_parameters_and_keys():
    m = nn.Sequential(nn.Linear(40, 48), nn.Linear(48, 8, bias=False))
    keys = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(5, 40)
    want = m(x)
    make_row_linears(m)
    assert all(type(layer) is RowLinear for layer in m)
    assert m.state_dict().keys() == keys.keys() and all(torch.equal(m.state_dict()[k], v) for k, v in keys.items())
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_row_linears_restores_after_an_interrupt():
    layer = nn.Linear(40, 48)
    with pytest.raises(KeyboardInterrupt):
        with row_linears([layer]):
            raise KeyboardInterrupt  # Ctrl-C in the middle of a verify forward
    assert "forward" not in layer.__dict__
