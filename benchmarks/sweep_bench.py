"""The drafting policy against the best fixed choice (plain decoding or a constant tree), with
interleaved repeats.

Each repeat is one `eagle2 compare --no-vanilla` run in a fresh process, every method interleaved
per prompt (compare.py), so each repeat's ratios are within one run:
  plain          eagle2's own plain decoding (same kernels): a fixed choice, and what speedups are over
  eagle2         the default: the drafting policy (`--total-tokens auto`) over every source
  tree:N/D/K     a constant tree: N nodes (root included), depth D, top-k K, same sources

Repeats give each method's spread. The policy is read against the best fixed choice on average
(plain at 1.0x included): mean ratio, each repeat's ratio, and whether it falls below plain by
more than the repeats' spread.

    python3 benchmarks/sweep_bench.py                               # the default as shipped (int8), mt16, 64 tokens, 3 repeats
    python3 benchmarks/sweep_bench.py --set humaneval --limit 16 --arith exact
    python3 benchmarks/sweep_bench.py --dtype bfloat16 --trees tree:6/2/3 --repeats 3   # the default against one choice

Prints a markdown table (per repeat and over the repeats) with the machine's CPU named; writes
each run's compare JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from sources_bench import cpu_name  # noqa: E402

TREES = "tree:4/2/2,tree:6/2/3,tree:6/3/2,tree:8/3/3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=os.path.join(HERE, "mt16.jsonl"))
    ap.add_argument("--set", default=None, help="a built-in dataset instead of --prompts (mt-bench, humaneval)")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--arith", default="int8", choices=["int8", "exact", "float32-weights"],
                    help="int8: the default as shipped; exact: --exact; float32-weights: EAGLE2_BLOCKS=0")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--trees", default=TREES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/eagle2-sweep-bench")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ)
    if a.arith == "float32-weights":
        env["EAGLE2_BLOCKS"] = "0"
    runs = []
    for rep in range(a.repeats):
        js = os.path.join(a.out, f"{a.dtype}-{rep}.json")
        where = ["--dataset", a.set] if a.set else ["-f", a.prompts]
        cmd = [sys.executable, "-m", "eagle2_cli", "compare", "--no-vanilla", *where, "--limit", str(a.limit),
               "--max-new-tokens", str(a.tokens), "--dtype", a.dtype, "--against", a.trees, "--json", js]
        cmd += ["--exact"] if a.arith == "exact" else []
        cmd += ["--model", a.model] if a.model else []
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
        with open(js) as f:
            runs.append(json.load(f))

    methods = ["eagle2"] + [t for t in a.trees.split(",") if t]
    over = {m: [r[m]["speedup_over_plain"] for r in runs] for m in methods}
    over["plain"] = [1.0] * len(runs)
    fixed = methods[1:] + ["plain"]
    print(f"\nmachine: {cpu_name()}; model: {a.model or 'SmolLM2-135M-Instruct (embedded, shipped head)'}; {a.dtype}, {a.arith}; "
          f"{a.limit} prompts of {a.set or os.path.basename(a.prompts)}, {a.tokens} tokens, greedy\n")
    print("| repeat | policy (eagle2) | " + " | ".join(methods[1:]) + " | policy / best fixed | identical |")
    print("|---" * (len(methods) + 3) + "|")
    for i, r in enumerate(runs):
        best = max(over[m][i] for m in fixed)
        cells = [f"{r[m]['speedup_over_plain']:.3f}x (tau {r[m].get('tau', 1):.2f}, {r[m].get('mean_tree_size', 0):.1f} nodes)"
                 for m in methods]
        same = min(r[m].get("identical") or 0 for m in methods)
        print(f"| {i + 1} | " + " | ".join(cells) + f" | {r['eagle2']['speedup_over_plain'] / best:.3f}x | {same}/{r['prompts']} |")
    mean = {m: statistics.fmean(v) for m, v in over.items()}
    best = max(fixed, key=lambda m: mean[m])
    ratios = [over["eagle2"][i] / over[best][i] for i in range(len(runs))]
    spread = max(over["eagle2"]) - min(over["eagle2"])
    print("| mean [min, max] | " + " | ".join(f"{mean[m]:.3f}x [{min(over[m]):.3f}, {max(over[m]):.3f}]" for m in methods)
          + f" | {mean['eagle2'] / mean[best]:.3f}x ({best}) | |")
    print(f"\npolicy mean {mean['eagle2']:.3f}x over plain; best fixed choice on average {best} {mean[best]:.3f}x; "
          f"policy / best per repeat {', '.join(f'{x:.3f}' for x in ratios)} (mean {statistics.fmean(ratios):.3f}); "
          f"below plain by more than its spread ({spread:.3f}): {'yes' if mean['eagle2'] < 1.0 - spread else 'no'}")


if __name__ == "__main__":
    main()
