"""Draft sources side by side: the head alone, the head-free sources alone, all together.

One `eagle2 compare` run per prompt set, every method interleaved per prompt (compare.py), so the
ratios are within one run:
  plain (no draft)        eagle2's own plain decoding (same kernels): the speedups below are over it
  eagle2                  the default: every source there is (head + recycle + match; without a head, recycle + match)
  sources:head            the trained head alone (what eagle2 did before the sources)
  sources:recycle+match   the head-free sources alone
Sets: MT-bench first turns (benchmarks/mt16.jsonl), HumanEval's first 16, and MT-bench second
turns (the first turn's greedy answer in the context, made here by `eagle2 generate`).

    python3 benchmarks/sources_bench.py                       # SmolLM2 with its head, 96 tokens
    python3 benchmarks/sources_bench.py --model q.gguf --tokens 128 --sets humaneval,mt16
    python3 benchmarks/sources_bench.py --repeats 2           # interleaved repeats: the spread of each ratio
    python3 benchmarks/sources_bench.py --also tree:6/3/2    # and more compare methods beside them

Writes one compare JSON per set and repeat under --out, and prints a markdown table of the speedup
over plain decoding, tau, and each source's share of the output, with the machine's CPU named.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown CPU")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags.split()]
    return f"{name}, {os.cpu_count()} cores, {' '.join(have)}"


def second_turns(model: str | None, tokens: int, out: str) -> str:
    """MT-bench lines of benchmarks/mt16.jsonl as conversations: turn 1, eagle2's greedy answer to
    it (identical to `generate`'s), turn 2. The answers come from `eagle2 generate`."""
    src = os.path.join(HERE, "mt16.jsonl")
    first = os.path.join(out, "mt16-first.jsonl")
    answers = os.path.join(out, "mt16-answers.jsonl")
    with open(src) as f, open(first, "w") as g:
        rows = [json.loads(line) for line in f if line.strip()]
        for r in rows:
            g.write(json.dumps({"id": r["question_id"], "prompt": r["turns"][0]}) + "\n")
    cmd = [sys.executable, "-m", "eagle2_cli", "generate", "-f", first, "-o", answers, "--overwrite", "--max-new-tokens", str(tokens)]
    subprocess.run(cmd + (["--model", model] if model else []), check=True)
    text = {}
    with open(answers) as f:
        for line in f:
            rec = json.loads(line)
            text[rec["id"]] = rec["text"]
    path = os.path.join(out, "mt16-second.jsonl")
    with open(path, "w") as g:
        for r in rows:
            msgs = [{"role": "user", "content": r["turns"][0]}, {"role": "assistant", "content": text[r["question_id"]]},
                    {"role": "user", "content": r["turns"][1]}]
            g.write(json.dumps({"id": r["question_id"], "messages": msgs, "category": r.get("category")}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--sets", default="mt16,humaneval,mt16-second")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--vanilla", action="store_true", help="also run HF generate (identity is then checked against it)")
    ap.add_argument("--also", default="", help="more compare methods, comma-separated (e.g. no-gate: the head every cycle)")
    ap.add_argument("--out", default="/tmp/eagle2-sources-bench")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch  # noqa: F401  (only to fail early where torch is missing)

    rows = []
    for name in a.sets.split(","):
        if name == "mt16":
            where = ["-f", os.path.join(HERE, "mt16.jsonl")]
        elif name == "humaneval":
            where = ["--dataset", "humaneval"]
        elif name == "mt16-second":
            where = ["-f", second_turns(a.model, a.tokens, a.out)]
        else:
            where = ["-f", name]
        for rep in range(a.repeats):
            js = os.path.join(a.out, f"{os.path.basename(name)}-{rep}.json")
            cmd = [sys.executable, "-m", "eagle2_cli", "compare", *where, "--limit", str(a.limit), "--max-new-tokens", str(a.tokens),
                   "--plain", "--vanilla" if a.vanilla else "--no-vanilla", "--json", js]
            from eagle2_core.loading import default_head_for

            # with a head: the head alone and the head-free sources alone beside the default (all of them);
            # without one the default is the head-free sources, so nothing to add
            against = ["sources:head", "sources:recycle+match"] if default_head_for(a.model) else []
            against += [m for m in a.also.split(",") if m]
            cmd += (["--against", ",".join(against)] if against else []) + (["--model", a.model] if a.model else [])
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            with open(js) as f:
                res = json.load(f)
            rows.append((name, rep, res))
    print(f"\nmachine: {cpu_name()}; model: {a.model or 'SmolLM2-135M-Instruct (embedded, shipped head)'}; {a.tokens} tokens, greedy\n")
    print("| set | repeat | method | tok/s | over plain | tau | identical | sources (share of output) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rep, res in rows:
        methods = {k: v for k, v in res.items() if isinstance(v, dict) and "tokens_per_s" in v}
        for m, d in methods.items():
            if m == "vanilla":
                continue
            over = d.get("speedup_over_plain", 1.0 if m.startswith("plain") else None)
            src = ", ".join(f"{s} {v['share']:.0%}" for s, v in (d.get("sources") or {}).items())
            same = d.get("identical")
            print(f"| {name} | {rep} | {m} | {d['tokens_per_s']:.1f} | {over:.2f}x | {d.get('tau', 1.0):.2f} | {same} | {src} |"
                  if over else f"| {name} | {rep} | {m} | {d['tokens_per_s']:.1f} | - | {d.get('tau', 1.0):.2f} | {same} | {src} |")
    summary(rows)


def summary(rows) -> None:
    """Per set over its repeats: each method's mean speedup over plain and [min, max], and the
    default (all sources) against the better single source of each repeat: the issue's 'on no
    set below the better single source beyond the run-to-run spread'."""
    sets = list(dict.fromkeys(name for name, _, _ in rows))
    print("\n| set | method | over plain, mean [min, max] | repeats |")
    print("|---|---|---|---|")
    verdicts = []
    for name in sets:
        runs = [res for n, _, res in rows if n == name]
        per: dict[str, list[float]] = {}
        for res in runs:
            for m, d in res.items():
                if isinstance(d, dict) and d.get("speedup_over_plain") is not None:
                    per.setdefault(m, []).append(d["speedup_over_plain"])
        for m, xs in per.items():
            print(f"| {name} | {m} | {sum(xs) / len(xs):.3f}x [{min(xs):.3f}, {max(xs):.3f}] | {len(xs)} |")
        singles = [m for m in per if m.startswith("sources:")]
        if "eagle2" in per and singles:
            best = max(singles, key=lambda m: sum(per[m]) / len(per[m]))
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            ratio = mean(per["eagle2"]) / mean(per[best])
            inside = mean(per["eagle2"]) >= min(per[best])
            verdicts.append(f"{name}: eagle2 {mean(per['eagle2']):.3f}x vs the better single source ({best}) "
                            f"{mean(per[best]):.3f}x [{min(per[best]):.3f}, {max(per[best]):.3f}]: {ratio:.3f}x, "
                            + ("within or above its spread" if inside else "BELOW its spread"))
    for v in verdicts:
        print("\n" + v if v is verdicts[0] else v)


if __name__ == "__main__":
    main()
