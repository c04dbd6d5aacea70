"""A prompt's prefill in int8: the ATen layer loop against the native one, by rows per native forward.

One prompt of --tokens tokens (the MT-bench prompts' text, encoded and cut) admitted into a fresh
row of the cycle (cycle.admit, as every request's prefill is), the ways timed in turns: "aten"
(the Python loop over ATen's SDPA, what prefill ran before the native loop took it), "native/all"
(every row in one native forward) and "native/R" (R rows a forward, leanbody.PREFILL_ROWS).
Median ms of each and its ratio to aten, and whether every native way wrote the same bits into
the cache (it must). Name the CPU and the thread count with the figures.

    python3 benchmarks/prefill_bench.py [--model M] [--tokens 512] [--rows 64,128,256] [--repeat 7]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle2_core import leanbody, rowgemm  # noqa: E402
from eagle2_core.cycle import Cycle, Slot  # noqa: E402
from eagle2_core.runtime import Runtime  # noqa: E402
from eagle2_core.target import TargetRunner  # noqa: E402
from eagle2_core.treesettings import TreeSettings  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = []
    with open(os.path.join(HERE, "mt16.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            text += r.get("turns", [r.get("text", "")])
    ids = tokenizer(" ".join(text))["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    rt = Runtime.load(args.model, need_head=False)
    if rt.arithmetic != "int8":
        sys.exit(f"the target runs {rt.arithmetic}, not int8: nothing to compare")
    run = TargetRunner(rt.model)
    if run.lean is None or not run.lean.native_ok or leanbody.native_loop() is None:
        sys.exit("no native layer loop for this target here")
    ids = prompt_ids(rt.tokenizer, args.tokens)
    cycle = Cycle(run, None, TreeSettings(total_tokens=1), 1, len(ids) + 8)
    real_native = leanbody.LeanBody._native

    def aten(self, b, n, mask, cache, layers, dtype):
        return (None, None, None) if cache.row is not None else real_native(self, b, n, mask, cache, layers, dtype)

    ways = {"aten": None, "native/all": 1 << 30, **{f"native/{r}": int(r) for r in args.rows.split(",")}}
    times = {w: [] for w in ways}
    cells = {}
    with cycle.session(), torch.no_grad():
        for rep in range(args.repeat + 1):  # the first round warms up (packings, work buffers)
            for way, rows in ways.items():
                leanbody.LeanBody._native = aten if rows is None else real_native
                leanbody.PREFILL_ROWS = rows or leanbody.PREFILL_ROWS
                t0 = time.perf_counter()
                cycle.admit(0, ids, Slot(way, None), lambda logits: 0)
                dt = time.perf_counter() - t0
                cycle.release(0)
                if rep:
                    times[way].append(dt * 1e3)
                else:
                    cells[way] = cycle.rows.cache.take(0, len(ids))
    leanbody.LeanBody._native = real_native
    ref = cells["native/all"]
    same = {w: all(torch.equal(a, b) for kv, rv in zip(cells[w], ref) for a, b in zip(kv, rv)) for w in ways}
    base = statistics.median(times["aten"])
    print(json.dumps({"model": rt.target.name, "tokens": len(ids), "threads": torch.get_num_threads(), "arithmetic": rt.arithmetic,
                      "median_ms": {w: round(statistics.median(t), 1) for w, t in times.items()},
                      "ratio_to_aten": {w: round(statistics.median(t) / base, 3) for w, t in times.items()},
                      "cells_equal_native_all": same}, indent=1))


if __name__ == "__main__":
    main()
