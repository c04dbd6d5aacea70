"""The few-row product of rowgemm.py: same values as F.linear, taken only where it is meant to
be, and a target model left exactly as it was outside our forwards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle2_core import rowgemm
from eagle2_core.rowgemm import RowLinear, linear_rows, make_row_linears, plain_linears, row_linears, transposed_is_faster


@pytest.mark.parametrize("out_features", [48, rowgemm.WIDE])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 65])
def test_linear_rows_matches_linear(out_features, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 40, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(1, rows, 40, generator=g)  # batch dims are kept
    for bias in (None, b):
        got, want = linear_rows(x, w, bias), F.linear(x, w, bias)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_transposed_form_only_where_measured_faster():
    w, wide = torch.randn(48, 40), torch.randn(rowgemm.WIDE, 40)
    rows = lambda n, dtype=torch.float32: torch.randn(n, 40, dtype=dtype)  # noqa: E731
    assert not transposed_is_faster(rows(1), w)                      # one row: MKL's own GEMV
    assert transposed_is_faster(rows(2), w) and transposed_is_faster(rows(rowgemm.MAX_ROWS), w)
    assert not transposed_is_faster(rows(rowgemm.MAX_ROWS + 1), w)
    assert transposed_is_faster(rows(rowgemm.MAX_ROWS_WIDE), wide)   # lm_head-sized weights go further
    assert not transposed_is_faster(rows(rowgemm.MAX_ROWS_WIDE + 1), wide)
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
    linear_rows(torch.randn(3, 40), w)
    linear_rows(torch.randn(1, 40), w)
    assert calls == [w.shape]  # only the three-row product went through W @ x.T


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
