"""The engine of this checkout beside the engine of an older commit, in one run: HF `generate`,
the old default decoder and the new default decoder, prompt by prompt, interleaved (so drift in
the machine's speed hits all three alike). Speedups are ratios within this run.

The older commit's `eagle2_core` is imported under another name (its imports are relative), so
both live in one process and decode the same prompts with their own settings and cost profiles:

    mkdir -p /tmp/old && git archive <commit> eagle2_core | tar -x -C /tmp/old && mv /tmp/old/eagle2_core /tmp/old/eagle2_old
    python3 benchmarks/engine_regression.py --old /tmp/old -f benchmarks/mt16.jsonl -n 96 --dtype float32
    python3 benchmarks/engine_regression.py --old /tmp/old -f benchmarks/mt16.jsonl -n 8 --limit 2   # dry run
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from batch_bench import cpu_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="folder holding the older commit's package as eagle2_old/")
    ap.add_argument("-f", "--prompts", default="benchmarks/mt16.jsonl")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tree", default=None, help="N/D/K: both engines on this constant tree (engine cost alone, no chooser)")
    args = ap.parse_args()
    sys.path.insert(0, args.old)
    old_rt = importlib.import_module("eagle2_old.runtime")
    old_ev = importlib.import_module("eagle2_old.events")
    from eagle2_core.events import GenerationSettings
    from eagle2_core.runtime import Runtime

    lines = [json.loads(ln) for ln in open(args.prompts) if ln.strip()]
    if args.limit:
        lines = lines[: args.limit]
    new = Runtime.load(None, None, dtype=args.dtype, gen=GenerationSettings(max_new_tokens=args.max_new_tokens))
    old = old_rt.Runtime.load(None, None, dtype=args.dtype, gen=old_ev.GenerationSettings(max_new_tokens=args.max_new_tokens))
    if args.tree:
        n, d, k = (int(v) for v in args.tree.split("/"))
        old_tree = importlib.import_module("eagle2_old.treesettings").TreeSettings(total_tokens=n, depth=d, top_k=k)
        from eagle2_core.treesettings import TreeSettings
        new_dec, old_dec = new.eagle(TreeSettings(total_tokens=n, depth=d, top_k=k)), old.eagle(old_tree)
    else:
        new_dec, old_dec = new.eagle(), old.eagle()
    van = new.vanilla()
    prompts = [new.encode([{"role": "user", "content": ln.get("prompt") or ln["turns"][0]}]) for ln in lines]
    gen_new = GenerationSettings(max_new_tokens=args.max_new_tokens)
    gen_old = old_ev.GenerationSettings(max_new_tokens=args.max_new_tokens)
    # warm-up: each decoder once, short
    for d, g in ((van, gen_new), (old_dec, gen_old), (new_dec, gen_new)):
        d.generate(prompts[0], type(g)(max_new_tokens=4))
    rows = {"generate": [], "old": [], "new": []}
    cyc = {k: {"cycles": 0, "tokens": 0, "draft_s": 0.0, "verify_s": 0.0, "nodes": 0, "depth": 0} for k in ("old", "new")}
    same = {"old": 0, "new": 0}
    for i, ids in enumerate(prompts):
        order = [("generate", van, gen_new), ("old", old_dec, gen_old), ("new", new_dec, gen_new)]
        if i % 2:
            order = order[:1] + order[:0:-1]  # alternate which engine runs first
        outs = {}
        for name, d, g in order:
            t0 = time.perf_counter()
            toks, summ = d.generate(ids, g)
            rows[name].append((len(toks), time.perf_counter() - t0))
            if name in cyc:  # where the time went: per cycle, the prefill's token aside
                c = cyc[name]
                c["cycles"] += summ.cycles
                c["tokens"] += len(toks) - 1
                c["draft_s"] += summ.draft_s
                c["verify_s"] += summ.verify_s
                c["nodes"] += summ.tree_tokens
                c["depth"] += summ.depth_sum
            outs[name] = toks
        for k in same:
            same[k] += outs[k] == outs["generate"]
        print(f"prompt {i}: " + ", ".join(f"{k} {rows[k][-1][0] / rows[k][-1][1]:.1f} tok/s" for k in rows), flush=True)
    tps = {k: sum(n for n, _ in v) / sum(s for _, s in v) for k, v in rows.items()}
    res = {"machine": cpu_name(), "torch": torch.__version__, "dtype": args.dtype, "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "tok_s": {k: round(v, 2) for k, v in tps.items()},
           "speedup_old": round(tps["old"] / tps["generate"], 3), "speedup_new": round(tps["new"] / tps["generate"], 3),
           "new_over_old": round(tps["new"] / tps["old"], 3), "identical": same,
           "per_prompt_new_over_old": round(statistics.median(
               (rows["new"][i][0] / rows["new"][i][1]) / (rows["old"][i][0] / rows["old"][i][1]) for i in range(len(prompts))), 3),
           "per_cycle": {k: {"tokens": round(c["tokens"] / max(1, c["cycles"]), 3), "draft_ms": round(1000 * c["draft_s"] / max(1, c["cycles"]), 2),
                             "verify_ms": round(1000 * c["verify_s"] / max(1, c["cycles"]), 2), "nodes": round(c["nodes"] / max(1, c["cycles"]), 2),
                             "depth": round(c["depth"] / max(1, c["cycles"]), 2)} for k, c in cyc.items()}}
    print(json.dumps(res, indent=1))
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
