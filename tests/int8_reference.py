"""The int8 products (csrc/int8.cpp) in slow numpy, written from the GGUF block layouts: the
activation quantization, each type's exact integers, and the fixed float32 combination per output.
The kernel must give these bits on every path and at every row count (tests/test_int8.py)."""
from __future__ import annotations

import numpy as np

ROW_I8 = 100
# type -> (values per block, bytes per block); ROW_I8's row is its float32 scale, then int8 values
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210),
          ROW_I8: (32, 32)}
F = np.float32


def quantize(x: np.ndarray, bs: int):
    """x [R, K] float32 -> d [R, K/bs] float32, q [R, K] int8, sums per 16 [R, K/16] int16:
    d = amax / 127, q = rint(x * (1 / d)) (the product rounded to float32, then half to even)."""
    R, K = x.shape
    xb = x.reshape(R, K // bs, bs).astype(F)
    amax = np.abs(xb).max(axis=2)
    d = (amax / F(127)).astype(F)
    inv = np.where(d != 0, F(1) / np.where(d != 0, d, F(1)), F(0)).astype(F)
    v = (xb * inv[..., None]).astype(F)
    q = np.rint(np.clip(v, F(-127), F(127))).astype(np.int8)
    s16 = q.reshape(R, K // 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return d, q.reshape(R, K), s16


def quantized_bytes(x: np.ndarray, bs: int) -> np.ndarray:
    """The activation blocks as int8_quantize lays them out: per block d, q, sums per 16."""
    d, q, s16 = quantize(x, bs)
    R, K = x.shape
    nb = K // bs
    parts = [d.reshape(R, nb, 1).view(np.uint8), q.reshape(R, nb, bs).view(np.uint8), s16.reshape(R, nb, bs // 16).view(np.uint8)]
    return np.concatenate(parts, axis=2).reshape(R, -1)


def _half(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(F)[..., 0]


def decode(w: np.ndarray, qtype: int, K: int):
    """Blocks [N, row bytes] -> dict: v [N, nb, bs] int (the integer multiplying the scale, before
    a K-quant's sub-block scale), dw, dm [N, nb] float32, sc [N, nb, groups], mn [N, nb, 8] ints."""
    bs, nbytes = BLOCKS[qtype]
    N, nb = w.shape[0], K // bs
    out = {}
    if qtype == ROW_I8:
        scale = w[:, :4].copy().view(F)[:, 0]
        out["v"] = w[:, 4:].view(np.int8).astype(np.int64).reshape(N, nb, bs)
        out["dw"] = np.repeat(scale[:, None], nb, axis=1)
        return out
    b = w.reshape(N, nb, nbytes)
    if qtype in (2, 3, 6, 7):
        head = 2 if qtype in (2, 6) else 4
        out["dw"] = _half(b[..., 0:2])
        if qtype in (3, 7):
            out["dm"] = _half(b[..., 2:4])
        qs = b[..., -16:].astype(np.int64)
        v = np.concatenate([qs & 15, qs >> 4], axis=2)
        if qtype in (6, 7):
            qh = b[..., head: head + 4].copy().view("<u4")[..., 0].astype(np.int64)
            v = v | (((qh[..., None] >> np.arange(32)) & 1) << 4)
        out["v"] = v - {2: 8, 3: 0, 6: 16, 7: 0}[qtype]
    elif qtype == 8:
        out["dw"] = _half(b[..., 0:2])
        out["v"] = b[..., 2:].view(np.int8).astype(np.int64)
    elif qtype in (12, 13):
        out["dw"], out["dm"] = _half(b[..., 0:2]), _half(b[..., 2:4])
        s = b[..., 4:16].astype(np.int64)
        sc = np.zeros((N, nb, 8), np.int64)
        mn = np.zeros((N, nb, 8), np.int64)
        sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
        sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
        out["sc"], out["mn"] = sc, mn
        qs = b[..., 16:144] if qtype == 12 else b[..., 48:176]
        qs = qs.astype(np.int64).reshape(N, nb, 4, 32)
        v = np.concatenate([qs & 15, qs >> 4], axis=3)  # [N, nb, 4, 64]: sub-blocks 2p, 2p + 1
        if qtype == 13:
            qh = b[..., 16:48].astype(np.int64)  # bit j of qh[l]: sub-block j's value l
            hb = (qh[..., None, :] >> np.arange(8)[:, None]) & 1  # [N, nb, 8, 32]
            v = v | (hb.reshape(N, nb, 4, 64) << 4)
        out["v"] = v.reshape(N, nb, 256)
    elif qtype == 14:
        out["dw"] = _half(b[..., 208:210])
        out["sc"] = b[..., 192:208].view(np.int8).astype(np.int64)
        ql = b[..., 0:128].astype(np.int64).reshape(N, nb, 2, 64)
        qh = b[..., 128:192].astype(np.int64).reshape(N, nb, 2, 32)
        parts = [(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        out["v"] = np.concatenate(parts, axis=3).reshape(N, nb, 256) - 32
    return out


def linear(x: np.ndarray, w: np.ndarray, qtype: int, bias: np.ndarray | None = None) -> np.ndarray:
    """x [R, K] float32 @ the block weight w [N, row bytes] by the int8 definition -> [R, N] float32."""
    bs, _ = BLOCKS[qtype]
    R, K = x.shape
    nb = K // bs
    dx, q, s16 = quantize(x, bs)
    qb = q.astype(np.int64).reshape(R, nb, bs)
    wd = decode(w, qtype, K)
    v = wd["v"]
    N = v.shape[0]
    if "sc" in wd:  # K-quants: per sub-block sums, scaled
        g = wd["sc"].shape[2]
        part = np.einsum("nbjs,rbjs->rnbj", v.reshape(N, nb, g, bs // g), qb.reshape(R, nb, g, bs // g))
        A = np.einsum("rnbj,nbj->rnb", part, wd["sc"])
    else:
        A = np.einsum("nbs,rbs->rnb", v, qb)
    assert np.abs(A).max(initial=0) < 2**31
    acc = np.zeros((R, N), F)
    for b in range(nb):
        p = (wd["dw"][None, :, b] * dx[:, None, b]).astype(F)
        acc = (acc + (p * A[:, :, b].astype(F)).astype(F)).astype(F)
        if qtype in (12, 13):
            sums32 = s16.astype(np.int64).reshape(R, nb, 8, 2).sum(axis=3)  # [R, nb, 8]
            B = np.einsum("nj,rj->rn", wd["mn"][:, b], sums32[:, b])
            p2 = (wd["dm"][None, :, b] * dx[:, None, b]).astype(F)
            acc = (acc - (p2 * B.astype(F)).astype(F)).astype(F)
        elif qtype in (3, 7):
            S = s16.astype(np.int64).reshape(R, nb, 2).sum(axis=2)[:, b]
            p2 = (wd["dm"][None, :, b] * dx[:, None, b]).astype(F)
            acc = (acc + (p2 * S[:, None].astype(F)).astype(F)).astype(F)
    if bias is not None:
        acc = (acc + bias[None, :].astype(F)).astype(F)
    return acc


def rebuild_row_int8(bw):
    """The float32 weight the kernel reads from ROW_I8 blocks (quantization.row_int8), in torch: scale * q."""
    import torch

    scale = bw.blocks[:, :4].contiguous().view(torch.float32)  # [out, 1]
    q = bw.blocks[:, 4:].contiguous().view(torch.int8).float()
    return scale * q
