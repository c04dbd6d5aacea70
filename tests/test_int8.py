"""int8 products over GGUF block weights (csrc/int8.cpp): 8-bit activations, exact integer dot
products, one fixed float32 combination per output. Bitwise the slow numpy reference
(tests/int8_reference.py) for every type, on every SIMD path built here, at every row count."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle2_core import native

import int8_reference as ref

pytestmark = pytest.mark.skipif(native.module() is None, reason="eagle2's native code is not built here")

TYPES = [2, 3, 6, 7, 8, 12, 13, 14, ref.ROW_I8]
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", ref.ROW_I8: "ROW_I8"}


def random_weight(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8: random blocks (every bit pattern of the values, scales and minimums)
    with finite fp16 scales of a real file's sizes; one all-zero block (scale 0) too."""
    if qtype == ref.ROW_I8:
        w = np.empty((n, k + 4), np.uint8)
        w[:, :4] = (np.abs(rng.standard_normal((n, 1))) * 1e-2).astype(np.float32).view(np.uint8)
        w[:, 4:] = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w[0, 4:36] = 0
        return w
    bs, nbytes = ref.BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // bs, nbytes), dtype=np.uint8)
    scale = (rng.standard_normal((n, k // bs)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
    smin = (np.abs(rng.standard_normal((n, k // bs))) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
    if qtype == 14:
        raw[..., 208:210] = scale
    else:
        raw[..., 0:2] = scale
        if qtype in (3, 7, 12, 13):
            raw[..., 2:4] = smin
    raw[0, 0] = 0  # a block of zeros: scale 0 and values 0
    return raw.reshape(n, -1)


def activations(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0                   # a zero block: d = 0, q = 0
    x[-1, 5] = 40.0                   # an outlier that takes its block's scale
    # a block with d = 1 exactly (amax 127): x * (1 / d) = x, so 2.5 and 3.5 are ties, to even
    x[-1, 64:96] = np.float32(0.25)
    x[-1, 64:68] = [127.0, 2.5, 3.5, -2.5]
    return x


def shape_of(qtype: int) -> tuple[int, int]:
    """(N, K): several blocks a row (an odd count of 32-value blocks), N not a multiple of a tile"""
    return (37, 3 * 32 * 3) if ref.BLOCKS[qtype][0] == 32 else (37, 3 * 256)


def bits(t) -> np.ndarray:
    return np.asarray(t, dtype=np.float32).view(np.int32)


@pytest.fixture(scope="module")
def mod():
    return native.module()


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_int8_product_is_bitwise_the_reference_on_every_path_and_row_count(mod, qtype):
    rng = np.random.default_rng(qtype)
    n, k = shape_of(qtype)
    w = random_weight(qtype, n, k, rng)
    wt = torch.from_numpy(w)
    bias = rng.standard_normal(n).astype(np.float32)
    paths = mod.int8_paths()
    assert 1 in paths
    for rows in (1, 2, 3, 5, 16, 17, 40):
        x = activations(rows, k, rng)
        want = ref.linear(x, w, qtype)
        want_b = ref.linear(x, w, qtype, bias)
        for path in paths:
            got = mod.int8_linear(torch.from_numpy(x), wt, qtype, None, path).numpy()
            assert np.array_equal(bits(got), bits(want)), (NAMES[qtype], rows, path, np.abs(got - want).max())
        got_b = mod.int8_linear(torch.from_numpy(x), wt, qtype, torch.from_numpy(bias)).numpy()
        assert np.array_equal(bits(got_b), bits(want_b)), (NAMES[qtype], rows)


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_every_path_gives_the_same_bits(mod, qtype):
    """Each built path against the generic one on a wider weight (several tiles of every path)."""
    rng = np.random.default_rng(100 + qtype)
    bs = ref.BLOCKS[qtype][0]
    n, k = 53, (10 * bs if bs == 32 else 4 * bs)
    wt = torch.from_numpy(random_weight(qtype, n, k, rng))
    x = torch.from_numpy(activations(6, k, rng))
    base = mod.int8_linear(x, wt, qtype, None, 1)
    for path in mod.int8_paths():
        assert torch.equal(mod.int8_linear(x, wt, qtype, None, path), base), (NAMES[qtype], path)


@pytest.mark.parametrize("qtype", [8, 12, 14], ids=["Q8_0", "Q4_K", "Q6_K"])
def test_a_row_gets_the_same_bits_alone_among_16_and_in_chunks(mod, qtype):
    rng = np.random.default_rng(7 + qtype)
    n, k = shape_of(qtype)
    wt = torch.from_numpy(random_weight(qtype, n, k, rng))
    x = torch.from_numpy(activations(16, k, rng))
    for path in mod.int8_paths():
        together = mod.int8_linear(x, wt, qtype, None, path)
        alone = torch.cat([mod.int8_linear(x[i: i + 1], wt, qtype, None, path) for i in range(16)])
        chunks = torch.cat([mod.int8_linear(x[i: i + 5], wt, qtype, None, path) for i in range(0, 16, 5)])
        assert torch.equal(together, alone) and torch.equal(together, chunks), path
        # a row's result does not change with the rows beside it
        other = x.clone()
        other[1:] = torch.randn(15, k) * 3
        assert torch.equal(mod.int8_linear(other, wt, qtype, None, path)[0], together[0])


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != ref.ROW_I8], ids=[NAMES[t] for t in TYPES if t != ref.ROW_I8])
def test_int8_product_is_close_to_the_float32_block_product(mod, qtype):
    """Against the exact float32 kernel over the same blocks: within what 8-bit activations cost."""
    rng = np.random.default_rng(200 + qtype)
    bs = ref.BLOCKS[qtype][0]
    n, k = 64, (8 * bs if bs == 32 else 2 * bs)
    wt = torch.from_numpy(random_weight(qtype, n, k, rng))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(qtype))
    exact = mod.block_linear(x, wt, qtype, None)
    got = mod.int8_linear(x, wt, qtype)
    err = ((got - exact).norm() / exact.norm()).item()
    assert err < 2e-2, (NAMES[qtype], err)
    assert err > 0  # the activations really were rounded


def test_row_i8_is_close_to_its_float_rebuild(mod):
    from eagle2_core.quantization import row_int8

    w = torch.randn(40, 96)
    bw = row_int8(w)
    x = torch.randn(3, 96)
    exact = mod.block_linear(x, bw.blocks, ref.ROW_I8, None)
    got = mod.int8_linear(x, bw.blocks, ref.ROW_I8)
    assert ((got - exact).norm() / exact.norm()).item() < 2e-2


@pytest.mark.parametrize("qtype", [2, 12], ids=["32 values", "256 values"])
def test_int8_quantize_is_the_reference_bytes(mod, qtype):
    rng = np.random.default_rng(3)
    bs = ref.BLOCKS[qtype][0]
    x = activations(5, 4 * bs, rng)
    got = mod.int8_quantize(torch.from_numpy(x), qtype).numpy()
    want = ref.quantized_bytes(x, bs)
    assert got.shape == want.shape and np.array_equal(got, want)
    d, q, _ = ref.quantize(x, bs)
    assert not q[0, :32].any() and (bs > 32 or d[0, 0] == 0)  # zero values; a zero block has d = 0
    assert np.abs(q).max() == 127
    if bs == 32:
        assert d[-1, 2] == 1 and list(q[-1, 64:68]) == [127, 2, 4, -2]  # rint: half to even


def test_wrong_shapes_and_types_are_refused(mod):
    assert mod.int8_type_known(12) and mod.int8_type_known(ref.ROW_I8) and not mod.int8_type_known(1)
    w = torch.zeros(4, 144, dtype=torch.uint8)  # Q4_K: one block a row
    with pytest.raises(RuntimeError, match="multiple of the block"):
        mod.int8_linear(torch.randn(2, 128), w, 12)
    with pytest.raises(RuntimeError, match="uint8 weight"):
        mod.int8_linear(torch.randn(2, 512), w, 12)
    with pytest.raises(RuntimeError, match="unknown type"):
        mod.int8_linear(torch.randn(2, 256), w, 1)
    with pytest.raises(RuntimeError, match="not built"):
        mod.int8_linear(torch.randn(2, 256), w, 12, None, 9)


TILED_TYPES = [t for t in TYPES if native.module() is not None and native.module().int8_interleaves(t)]


@pytest.mark.skipif(not TILED_TYPES, reason="no interleaved int8 kernel is built here (AVX-512 VNNI)")
@pytest.mark.parametrize("qtype", TILED_TYPES, ids=[NAMES[t] for t in TILED_TYPES])
def test_interleaved_weights_give_the_reference_bits_on_every_path(mod, qtype):
    """The layout interleaved at load (16 rows' blocks as one tile) is read back to the very bits of
    the file's layout, at every row count (the fused few-row steps and the stored ones) and path."""
    rng = np.random.default_rng(200 + qtype)
    n, k = 48, (3 * 256 if ref.BLOCKS[qtype][0] == 256 else 5 * 32)  # an odd count of 32-value blocks
    w = random_weight(qtype, n, k, rng)
    wt = torch.from_numpy(w)
    tiled = mod.int8_interleave(wt, qtype)
    assert tiled.shape == wt.shape and not torch.equal(tiled, wt)
    assert torch.equal(mod.int8_interleave(tiled, qtype, False), wt)  # and back
    for rows in (1, 2, 3, 4, 5, 8, 17):
        x = activations(rows, k, rng)
        want = ref.linear(x, w, qtype)
        for path in mod.int8_paths():
            got = mod.int8_linear(torch.from_numpy(x), tiled, qtype | 256, None, path).numpy()
            assert np.array_equal(bits(got), bits(want)), (NAMES[qtype], rows, path)


def test_interleaving_refuses_what_it_cannot_lay_out(mod):
    if TILED_TYPES:
        with pytest.raises(RuntimeError, match="multiple of 16 rows"):
            mod.int8_linear(torch.randn(1, 256), torch.zeros(8, 144, dtype=torch.uint8), 12 | 256)
    with pytest.raises(RuntimeError, match="not interleaved"):
        mod.int8_interleave(torch.zeros(16, 36, dtype=torch.uint8), ref.ROW_I8)  # its row scale leads each row
