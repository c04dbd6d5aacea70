"""The products from GGUF blocks against the float32 products over the dequantized weights.

For each distinct (type, shape) of the embedded SmolLM2 GGUF's 2-D weights (or --gguf FILE):
ms per product at 1 / 4 / 16 rows of the float32 stream kernel over gguf-py's dequantization
(what eagle2 streams today) and of the block kernel over the file's own blocks, the bytes each
reads, and whether every output is bitwise equal. Ratios within one run; name the CPU with them.

    python3 benchmarks/blocks_bench.py [--gguf FILE] [--rows 1,4,16] [--repeat 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle2_core import native  # noqa: E402


def timed(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e3


def main() -> None:
    import gguf

    from eagle2_core.loading import smollm2_gguf_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = native.module()
    if mod is None:
        raise SystemExit(f"eagle2's native code: {native.status()}")
    reader = gguf.GGUFReader(args.gguf or smollm2_gguf_path())
    seen, rows = {}, [int(r) for r in args.rows.split(",")]
    for t in reader.tensors:
        if len(t.shape) != 2 or not mod.block_type_known(int(t.tensor_type)):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        seen.setdefault((t.tensor_type.name, n, k), t)
    print(f"torch threads {torch.get_num_threads()}; {len(seen)} distinct (type, shape)")
    print(f"{'type':6} {'out x in':>11} {'rows':>4} {'f32 ms':>8} {'block ms':>8} {'speedup':>7} {'MB f32':>7} {'MB blk':>7}  bitwise")
    for (name, n, k), t in sorted(seen.items()):
        count = sum(1 for u in reader.tensors if u.tensor_type.name == name and (int(u.shape[1]), int(u.shape[0])) == (n, k))
        blocks = torch.from_numpy(np.ascontiguousarray(t.data).reshape(n, -1).copy())
        w = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k).copy())
        for r in rows:
            x = torch.randn(r, k)
            same = torch.equal(mod.block_linear(x, blocks, int(t.tensor_type), None), mod.stream_linear(x, w, None))
            f = timed(lambda: mod.stream_linear(x, w, None), args.repeat)
            b = timed(lambda: mod.block_linear(x, blocks, int(t.tensor_type), None), args.repeat)
            print(f"{name:6} {n:>5}x{k:<5} {r:>4} {f:8.3f} {b:8.3f} {f / b:6.2f}x {w.numel() * 4 / 1e6:7.1f} {blocks.numel() / 1e6:7.1f}  "
                  f"{'yes' if same else 'NO'}  (x{count})")
    # The real case: every weight of the model once, as a decoding step reads them (distinct
    # tensors, so nothing stays in cache between products: float32 streams 5x the bytes).
    every = [(torch.from_numpy(np.ascontiguousarray(t.data).reshape(int(t.shape[1]), -1).copy()), int(t.tensor_type),
              torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0])).copy()))
             for t in reader.tensors if len(t.shape) == 2 and mod.block_type_known(int(t.tensor_type))]
    mb_f, mb_b = sum(w.numel() * 4 for _, _, w in every) / 1e6, sum(b.numel() for b, _, _ in every) / 1e6
    for r in rows:
        xs = {w.shape[1]: torch.randn(r, w.shape[1]) for _, _, w in every}
        f = timed(lambda: [mod.stream_linear(xs[w.shape[1]], w, None) for _, _, w in every], max(2, args.repeat // 10))
        b = timed(lambda: [mod.block_linear(xs[w.shape[1]], bl, q, None) for bl, q, w in every], max(2, args.repeat // 10))
        print(f"every 2-D weight once at {r} rows: float32 {f:.1f} ms ({mb_f:.0f} MB, {mb_f / f:.1f} GB/s), "
              f"blocks {b:.1f} ms ({mb_b:.0f} MB, {mb_b / b:.1f} GB/s): {f / b:.2f}x")

if __name__ == "__main__":
    main()
