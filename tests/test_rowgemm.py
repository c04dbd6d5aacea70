"""The product plan of rowgemm.py: every kernel gives F.linear's values, each is taken only where
the plan says and a packing exists, the plan comes from measurements (never from the CPU's
name), a torch without the private packed ops is offered none, and a target model is left
exactly as it was outside our forwards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle2_core import rowgemm
from eagle2_core.rowgemm import ProductPlan, RowLinear, kernel_for, linear_rows, make_row_linears, plain_linears, row_linears

needs_packed = pytest.mark.skipif(not rowgemm.HAVE_PACKED, reason="this torch build has no oneDNN packed linear")
needs_stream = pytest.mark.skipif(not rowgemm.have_stream(), reason="eagle2's native code is not built here")
AVAILABLE = [k for k in rowgemm.KERNELS if rowgemm._offered(k)]


@pytest.fixture(autouse=True)
def _restore_plan(monkeypatch):
    monkeypatch.delenv("EAGLE2_KERNEL", raising=False)  # the suite pins linear (conftest); these tests are about the plan
    before = rowgemm.PLAN
    yield
    rowgemm.PLAN = before


def plan_for(weight, by_rows: dict[int, str], hint: int = 16) -> ProductPlan:
    return ProductPlan({rowgemm.shape_key(weight): {b: by_rows.get(b, "linear") for b in rowgemm.ROW_BUCKETS}},
                       {rowgemm.shape_key(weight): hint})


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 64, 65])
def test_every_kernel_matches_linear(kernel, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(50, 64, generator=g).to(dtype)  # 50: the streaming kernel's last block of weight rows is partial
    b = torch.randn(50, generator=g).to(dtype)
    x = torch.randn(1, rows, 64, generator=g).to(dtype)  # batch dims are kept
    plan = rowgemm.forced(kernel)
    rowgemm.prepare([w], plan)
    with rowgemm.using_plan(plan):
        # `block` needs a weight's GGUF blocks (tests/test_blocks.py); a weight without them streams its floats
        assert kernel_for(x, w) == ("stream" if kernel == "block" else kernel)
        for bias in (None, b):
            got, want = linear_rows(x, w, bias), F.linear(x, w, bias)
            assert got.shape == want.shape and got.is_contiguous() and got.dtype == want.dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_plan_is_followed_by_rows_and_shape():
    w, other = torch.randn(48, 40), torch.randn(24, 40)
    rows = lambda n, dtype=torch.float32: torch.randn(n, 40, dtype=dtype)  # noqa: E731
    rowgemm.install_plan(ProductPlan())  # nothing measured: linear everywhere
    assert {kernel_for(rows(n), m) for n in (1, 2, 8) for m in (w, other)} == {"linear"}
    plan = plan_for(w, {1: "linear", 2: "transposed", 3: "transposed", 4: "transposed", 6: "linear"})
    rowgemm.install_plan(plan)
    assert [kernel_for(rows(n), w) for n in (1, 2, 3, 4, 5, 6, 7)] == ["linear", "transposed", "transposed", "transposed",
                                                                       "linear", "linear", "linear"]  # 5 follows bucket 6
    assert kernel_for(rows(4), other) == "linear"                      # a shape the plan does not know
    assert kernel_for(rows(4, torch.bfloat16), w.bfloat16()) == "linear"  # the key carries the dtype
    assert kernel_for(rows(4, torch.float16), w.half()) == "linear"    # float16 is not offered
    trainable = nn.Parameter(w.clone())
    rowgemm.install_plan(plan_for(trainable, {4: "transposed"}))
    assert kernel_for(rows(4), trainable) == "linear"                   # training keeps linear's backward
    with torch.no_grad():
        assert kernel_for(rows(4), trainable) == "transposed"


@needs_packed
def test_packed_runs_only_with_a_packing_made_at_prepare(monkeypatch):
    w = torch.randn(48, 40)
    plan = plan_for(w, {b: "packed" for b in rowgemm.ROW_BUCKETS})
    rowgemm.install_plan(plan)
    x = torch.randn(3, 40)
    assert kernel_for(x, w) == "linear"          # no packing yet: never packed on the fly
    assert kernel_for(x, w.clone()) == "linear"  # a temporary copy (a dtype cast) is not packed either
    packs = []
    real = rowgemm.pack
    monkeypatch.setattr(rowgemm, "pack", lambda weight, hint=16: packs.append(hint) or real(weight, hint))
    assert rowgemm.prepare([w, w]) == w.numel() * 4  # the bytes of the one packing
    assert rowgemm.prepare([w]) == w.numel() * 4 and packs == [16]  # made once
    assert kernel_for(x, w) == "packed"
    torch.testing.assert_close(linear_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        w.mul_(2.0)                              # changed in place (a training step): the packing is stale
    assert kernel_for(x, w) == "linear"
    torch.testing.assert_close(linear_rows(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    rowgemm.prepare([w])                         # made again for the new values
    assert kernel_for(x, w) == "packed" and packs == [16, 16]
    rowgemm.prepare([w], ProductPlan())          # a plan without packing drops it
    assert kernel_for(x, w) == "linear" and rowgemm.packed_bytes([w]) == 0


def test_plan_from_measured_kernels():
    from eagle2_core.costs import PRODUCT_ROWS, packing_spread, product_plan

    def row(lin, tr, p1, p16):
        return {"linear": lin, "transposed": tr, "packed@1": p1, "packed@16": p16}

    body = {1: row(5.0, 5.1, 4.0, 3.0), 2: row(9.0, 4.0, 6.0, 5.0), 3: row(9.0, 7.0, 6.0, 5.0),
            4: row(9.0, 8.0, 6.0, 8.9), 6: row(9.0, 9.5, 9.2, 9.3), 8: row(9.0, 8.0, 7.0, 5.0)}
    plan = product_plan({"48x40 float32": body})
    k = plan.kernels["48x40 float32"]
    # one packing for the shape: packed@16 is nearer the best over all rows (sum of ratios)
    assert plan.pack_hint == {"48x40 float32": 16}
    assert k[1] == "packed" and k[2] == "transposed" and k[3] == "packed"
    assert k[4] == "transposed"   # the chosen packing (16) is not the fastest here; transposed is
    assert k[6] == "linear"       # nothing beats linear by ROW_WIN
    assert k[8] == "packed" and k[12] == "packed" and k[64] == "packed"  # past the last timed count: its choice
    assert packing_spread({"48x40 float32": body}, plan)["48x40 float32"] == pytest.approx(8.9 / 6.0)
    tie = {1: row(33.4, 33.1, 40.0, 40.0)}   # within noise of linear: linear stays
    assert product_plan({"k": tie}).kernels["k"][1] == "linear"
    assert product_plan({"k": tie}).pack_hint == {}  # no row count runs packed: no packing to make
    near = {r: row(10.0, 10.0, 8.0, 8.0) for r in (1, 8, 64)}  # packed 20% faster: not worth a second copy (PACK_WIN)
    assert set(product_plan({"k": near}).kernels["k"].values()) == {"linear"} and product_plan({"k": near}).pack_hint == {}
    assert set(PRODUCT_ROWS) <= set(rowgemm.ROW_BUCKETS)


def test_without_the_private_ops_no_packed_kernel_is_offered(monkeypatch, tiny_lm):
    """A torch build without (or with broken) oneDNN packed linear: measurement, plan, a stored
    plan and EAGLE2_KERNEL all leave packing out, and every product still runs."""
    from eagle2_core import costs, measure

    monkeypatch.setattr(rowgemm, "HAVE_PACKED", False)
    model = tiny_lm("llama")
    weights = costs.product_weights(model, None)
    products = measure.measure_products(weights, rows=(1, 4), reps=1)
    assert products and all(not any(k.startswith("packed") for k in t) for by in products.values() for t in by.values())
    assert "packed" not in {k for by in costs.product_plan(products).kernels.values() for k in by.values()}
    stored = ProductPlan.from_json({"kernels": {"48x40 float32": {"1": "packed", "2": "transposed"}}})
    assert stored.kernels["48x40 float32"] == {1: "linear", 2: "transposed"}
    with pytest.raises(ValueError, match="no oneDNN packed"):
        rowgemm.forced("packed")
    rowgemm.install_plan(ProductPlan(everywhere="packed"))
    assert rowgemm.prepare(weights) == 0  # nothing packed
    x = torch.randn(2, weights[0].shape[1])
    torch.testing.assert_close(linear_rows(x, weights[0]), F.linear(x, weights[0]))


@needs_stream
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_gives_each_row_the_same_bits_whatever_rows_share_it(dtype):
    """The streaming kernel sums each output in one fixed order whatever its tile (6 or 4 weight
    rows x 1-4 input rows, a partial last block): a row's result does not depend on the other rows, so a token
    verified inside a tree gets the bits it gets alone. (F.linear does not promise this.)"""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 96, generator=g).to(dtype)
    x = torch.randn(23, 96, generator=g).to(dtype)
    stream = rowgemm.native.module().stream_linear
    alone = torch.cat([stream(x[i : i + 1], w) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 7, 8, 16, 23):
        assert torch.equal(stream(x[:rows], w), alone[:rows]), rows
    assert stream(x[:0], w).shape == (0, 70)  # no rows: an empty product, nothing read


@needs_stream
def test_stream_steps_aside_for_weights_it_does_not_take():
    plan = rowgemm.forced("stream")
    fits, odd, wide = torch.randn(48, 64), torch.randn(48, 40), torch.randn(64, 48)
    x = torch.randn(3, 64)
    with rowgemm.using_plan(plan):
        assert kernel_for(x, fits) == "stream"
        assert kernel_for(torch.randn(3, 40), odd) == "linear"        # rows not a multiple of 16 values
        assert kernel_for(x, wide.t()) == "linear"                     # not contiguous
        assert kernel_for(x.bfloat16(), torch.randn(48, 48).bfloat16()) == "linear"  # bfloat16 wants 32s
        assert kernel_for(x.half(), fits.half()) == "linear"
        torch.testing.assert_close(linear_rows(x, wide.t()), F.linear(x, wide.t()))


def test_without_the_native_build_no_stream_kernel_is_offered(monkeypatch, tiny_lm):
    from eagle2_core import costs, measure, native

    monkeypatch.setitem(native._STATE, "error", "no compiler (test)")
    monkeypatch.delitem(native._STATE, "module", raising=False)
    assert not rowgemm.have_stream() and "no compiler (test)" in native.status()
    weights = costs.product_weights(tiny_lm("llama"), None)
    products = measure.measure_products(weights, rows=(1, 4), reps=1)
    assert products and not any("stream" in t for by in products.values() for t in by.values())
    assert ProductPlan.from_json({"kernels": {"k": {"1": "stream"}}}).kernels["k"] == {1: "linear"}
    with pytest.raises(ValueError, match="EAGLE2_KERNEL=stream: eagle2's native code is not built: no compiler"):
        rowgemm.forced("stream")
    with rowgemm.using_plan(ProductPlan(everywhere="stream")):
        x = torch.randn(2, weights[0].shape[1])
        assert kernel_for(x, weights[0]) == "linear"
        torch.testing.assert_close(linear_rows(x, weights[0]), F.linear(x, weights[0]))


def test_the_probe_says_no_when_the_op_is_missing(monkeypatch):
    class NoOps:
        pass

    monkeypatch.setattr(rowgemm.torch.ops, "mkldnn", NoOps(), raising=False)
    assert rowgemm._probe_packed() is False


def test_env_forces_one_kernel(monkeypatch):
    monkeypatch.setenv("EAGLE2_KERNEL", "transposed")
    rowgemm.install_plan(ProductPlan())
    assert rowgemm.PLAN.everywhere == "transposed" and "forced" in rowgemm.PLAN.describe()
    monkeypatch.setenv("EAGLE2_KERNEL", "measured")
    rowgemm.install_plan(ProductPlan())
    assert rowgemm.PLAN.everywhere is None
    monkeypatch.setenv("EAGLE2_KERNEL", "fastest")
    with pytest.raises(ValueError, match="unknown kernel"):
        rowgemm.install_plan(ProductPlan())


def test_the_profile_measures_installs_and_packs(tiny_target, monkeypatch, tmp_path):
    from eagle2_core import costs, measure
    from eagle2_core.runtime import random_head

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path))
    monkeypatch.delenv("EAGLE2_KERNEL", raising=False)
    head = random_head(tiny_target)
    weights = costs.product_weights(tiny_target.model, head)
    keys = {rowgemm.shape_key(w) for w in weights}
    seen = []
    measured = {k: {1: {"linear": 2.0, "transposed": 1.0, "packed@16": 3.0}, 4: {"linear": 2.0, "transposed": 3.0, "packed@16": 1.0}}
                for k in keys}
    monkeypatch.setattr(measure, "measure_products", lambda ws, reps=5: seen.append(len(ws)) or measured)
    rowgemm.install_plan(ProductPlan())
    prof = measure.load_or_measure(tiny_target.model, head)
    assert len(seen) == 1 and seen[0] == len(weights)
    assert prof.stream_floor_ms > 0 and prof.weight_bytes == sum(p.numel() * 4 for p in tiny_target.model.parameters())
    w = weights[0]
    assert kernel_for(torch.randn(1, w.shape[1]), w) == "transposed"
    expect_packed = "packed" if rowgemm.HAVE_PACKED else "linear"
    assert kernel_for(torch.randn(3, w.shape[1]), w) == expect_packed  # 3 rows follow the 4-row measurement
    rowgemm.install_plan(ProductPlan())
    rowgemm.release()
    again = measure.load_or_measure(tiny_target.model, head)  # from the cache: installed and packed again, not measured
    assert len(seen) == 1 and again.products == prof.products and again.stream_floor_ms == prof.stream_floor_ms
    assert kernel_for(torch.randn(3, w.shape[1]), w) == expect_packed


def test_products_are_measured_per_shape_for_target_and_head(tiny_lm):
    from eagle2_core import costs, measure
    from eagle2_core.head import DraftHead, HeadSpec

    model = tiny_lm("llama")
    head = DraftHead(HeadSpec.for_target(model.config)).eval()
    weights = costs.product_weights(model, head)
    assert model.lm_head.weight in [w for w in weights if w is model.lm_head.weight]
    assert any(w is head.fc.weight for w in weights) and len({id(w) for w in weights}) == len(weights)
    products = measure.measure_products(weights, rows=(1, 2), reps=1)
    assert set(products) == {rowgemm.shape_key(w) for w in weights}
    kinds = {"linear", "transposed"} | ({f"packed@{h}" for h in costs.PACK_HINTS} if rowgemm.HAVE_PACKED else set())
    streams = {"stream"} if rowgemm.have_stream() else set()
    for key, by in products.items():
        fits = rowgemm.stream_fits(next(w for w in weights if rowgemm.shape_key(w) == key))
        assert all(set(t) == kinds | (streams if fits else set()) and all(v > 0 for v in t.values()) for t in by.values())
    assert streams <= {k for by in products.values() for t in by.values() for k in t}  # the tiny model has shapes it takes
    assert measure.measure_products([w.half() for w in weights], reps=1) == {}  # float16: no candidate but linear


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


def test_a_bad_kernel_name_is_one_line(monkeypatch, tiny_model_dir):
    from click.testing import CliRunner

    from eagle2_cli.main import cli

    monkeypatch.setenv("EAGLE2_KERNEL", "fastest")
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "-n", "2", "--no-baseline", "--model", tiny_model_dir, "--device", "cpu"])
    assert r.exit_code == 2 and "EAGLE2_KERNEL: unknown kernel 'fastest'" in r.stderr and "Traceback" not in r.stderr


def test_a_finished_build_is_found_without_building(monkeypatch, tmp_path):
    """`native.is_built()` tells a first run (about to spend a minute building) from a later one,
    by torch's extensions folder alone: nothing is built to answer it."""
    from eagle2_core import native

    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not native.is_built() and native._STATE == {}
    name = f"eagle2_native_{native.cpu_digest()}_1"
    native.build_dir(name).mkdir(parents=True)
    assert not native.is_built()  # a folder without the library: a build that did not finish
    (native.build_dir(name) / f"{name}.so").write_bytes(b"")
    assert native.is_built()
    monkeypatch.setattr(native, "_STATE", {"error": "no compiler"})
    assert not native.is_built()
