"""int8 products (csrc/int8.cpp) against the float32 block kernel over the same GGUF blocks, by rows.

Shapes of SmolLM2-1.7B Q4_K_M (hidden 2048, intermediate 8192, vocabulary 49152) and of
Llama-3-8B (hidden 4096, kv 1024, intermediate 14336; vocabulary 49152 as our synthetic files
have it), weights as random blocks with sane fp16 scales (not quantized matrices: the speed does
not depend on the values). Median ms of `int8_linear` and `block_linear` at 1, 2, 4, 8, 16 rows,
and each one's k-rows / one-row ratio. Name the CPU and the thread count with the figures.

    python3 benchmarks/int8_rows_bench.py [--threads 2] [--rows 1,2,4,8,16] [--repeat 15] [--only 1.7b|8b]

--cold: weights from DRAM, as a forward streams them: distinct matrices of the 1.7B shapes (q, k,
v, o, gate, up, down per layer; --layers 24, ~0.9 GB) run in turn, one "pass" timed whole; GB/s =
weight bytes / pass time for int8 at each row count, in the file's layout and interleaved (as a
GGUF target holds its K-quants where the AVX-512 kernel runs), beside a plain read of the same
bytes (a torch sum over an int64 view of each matrix) as the machine's bandwidth reference.

    python3 benchmarks/int8_rows_bench.py --cold [--layers 24] [--rows 1,2,4,8] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle2_core import native  # noqa: E402

BLOCK = {12: (256, 144, "Q4_K"), 14: (256, 210, "Q6_K")}
SHAPES = {  # (out, in, type)
    "1.7b": [(2048, 2048, 12), (8192, 2048, 12), (2048, 8192, 14), (2048, 8192, 12), (49152, 2048, 14)],
    "8b": [(4096, 4096, 12), (1024, 4096, 12), (1024, 4096, 14), (14336, 4096, 12), (4096, 14336, 12),
           (4096, 14336, 14), (49152, 4096, 14)],
}


def random_blocks(n: int, k: int, qtype: int, rng: np.random.Generator) -> torch.Tensor:
    bs, nbytes, _ = BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n, k // bs, nbytes), dtype=np.uint8)
    scale = (rng.standard_normal((n, k // bs)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
    if qtype == 14:
        raw[..., 208:210] = scale
    else:
        raw[..., 0:2] = scale
        raw[..., 2:4] = (np.abs(rng.standard_normal((n, k // bs))) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def interleaved_ms(fns, repeat: int) -> list[tuple[float, float]]:
    """(median, min) ms of each function, timed in turns (a load that comes and goes on a shared
    machine falls on all of them alike)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


COLD_LAYER = [(2048, 2048, 12)] * 4 + [(8192, 2048, 12)] * 2 + [(2048, 8192, 14)]  # q k v o gate up down


def cold(args, mod) -> None:
    rng = np.random.default_rng(0)
    proto = {s: random_blocks(*s, rng) for s in set(COLD_LAYER)}  # random bytes once, copied per layer
    mats = [(proto[s].clone(), s[1], s[2]) for _ in range(args.layers) for s in COLD_LAYER]
    total = sum(w.numel() for w, _, _ in mats)
    views = [w.view(torch.int64) for w, _, _ in mats]  # int64: int32 sums widen and run compute-bound
    rows = [int(r) for r in args.rows.split(",")]
    xs = {(r, k): torch.randn(r, k) for r in rows for k in (2048, 8192)}

    def read():
        for v in views:
            v.sum()

    tiled = []
    if hasattr(mod, "int8_interleaves") and all(mod.int8_interleaves(t) for _, _, t in mats):
        tiled = [(mod.int8_interleave(w, t), k, t | 256) for w, k, t in mats]  # the layout loading gives

    def pass_of(r, ms):
        def f():
            for w, k, t in ms:
                mod.int8_linear(xs[(r, k)], w, t, None, args.path)
        return f

    fns = [read] + [pass_of(r, mats) for r in rows] + [pass_of(r, tiled) for r in rows if tiled]
    names = ["read"] + [f"int8 x{r}" for r in rows] + [f"tiled x{r}" for r in rows if tiled]
    res = interleaved_ms(fns, args.repeat)
    print(f"cold pass: {len(mats)} matrices, {total / 1e6:.0f} MB of weights ({args.layers} layers of the 1.7B shapes)")
    print(f"{'':10} {'ms med':>8} {'ms min':>8} {'GB/s med':>9} {'GB/s best':>9}")
    for name, (med, low) in zip(names, res):
        print(f"{name:10} {med:8.2f} {low:8.2f} {total / med / 1e6:9.1f} {total / low / 1e6:9.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--only", default=None, choices=sorted(SHAPES))
    ap.add_argument("--path", type=int, default=0, help="int8 path (0: the best built)")
    ap.add_argument("--cold", action="store_true", help="DRAM-resident pass over distinct matrices (see above)")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = native.module()
    if mod is None:
        raise SystemExit(f"eagle2's native code: {native.status()}")
    if args.cold:
        if args.rows == "1,2,4,8,16":
            args.rows = "1,2,4,8"
        print(f"torch threads {torch.get_num_threads()}; int8 path {args.path or 'best'}; {native.status()}")
        cold(args, mod)
        return
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"torch threads {torch.get_num_threads()}; int8 paths {mod.int8_paths()} (running {args.path or 'best'}); {native.status()}")
    head = "".join(f"{r:>8}" for r in rows)
    print("median ms (min ms in brackets under it); ratios: median k rows / median one row")
    print(f"{'model':5} {'out x in':>12} {'type':5} {'kernel':6} {'MB':>6} |{head} | ratios k/1")
    for model, shapes in SHAPES.items():
        if args.only and model != args.only:
            continue
        for n, k, qtype in shapes:
            w = random_blocks(n, k, qtype, rng)
            xs = {r: torch.randn(r, k) for r in rows}
            res = {r: interleaved_ms([lambda r=r: mod.int8_linear(xs[r], w, qtype, None, args.path),
                                      lambda r=r: mod.block_linear(xs[r], w, qtype, None)], args.repeat) for r in rows}
            for i, name in enumerate(("int8", "f32blk")):
                med = [res[r][i][0] for r in rows]
                low = [res[r][i][1] for r in rows]
                ratios = " ".join(f"{m / med[0]:.2f}" for m in med)
                cells = "".join(f"{m:8.3f}" for m in med)
                mins = "".join(f"{m:8.3f}" for m in low)
                print(f"{model:5} {n:>6}x{k:<5} {BLOCK[qtype][2]:5} {name:6} {w.numel() / 1e6:6.1f} |{cells} | {ratios}", flush=True)
                print(f"{'':5} {'':12} {'':5} {'(min)':6} {'':6} |{mins} |", flush=True)


if __name__ == "__main__":
    main()
