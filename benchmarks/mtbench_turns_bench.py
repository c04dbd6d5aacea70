"""MT-bench's second turns through `eagle2 generate`, with and without the kept cache (prefix.py).

Every question of the file is one record with both turns; the second turn's prompt is the first
turn's prompt, its answer and the follow-up. With the kept cache the second turn restores what the
first left behind and prefills only the rest; with --no-prefix-cache it prefills all of it. Runs
both (same options, float32, greedy), then reports per record the second turn's prompt, how many
of its tokens were restored and how many prefilled, the totals, the wall time of each run, and
whether every answer is identical between the two runs. Outputs stay in --out, so a run cut short
resumes where it stopped (rerun the same command); wall times are then those of the last part.

    python benchmarks/mtbench_turns_bench.py [--file ../shared/data/mt_bench/question.jsonl] [--tokens 96]
        [--out mtbench_turns] [--json result.json] [-- generate options]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from batch_bench import cpu_name  # noqa: E402

DEFAULT_FILE = os.path.join(HERE, "..", "..", "shared", "data", "mt_bench", "question.jsonl")


def run(src: str, out: str, tokens: int, extra: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eagle2_cli", "generate", "-f", src, "-o", out, "-t", "0", "--max-new-tokens", str(tokens),
                    "--dtype", "float32", "--no-progress", *extra], check=True)
    return time.perf_counter() - t0


def records(path: str) -> dict[str, dict]:
    out = {}
    for line in open(path, encoding="utf-8"):
        if line.strip():
            r = json.loads(line)
            out[str(r.get("question_id", r.get("id")))] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=DEFAULT_FILE)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default="mtbench_turns")
    ap.add_argument("--json", default=None)
    ap.add_argument("generate_args", nargs="*", help="after --: options for `eagle2 generate` (both runs)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    reuse_out, fresh_out = os.path.join(args.out, "reuse.jsonl"), os.path.join(args.out, "no_reuse.jsonl")
    wall_reuse = run(args.file, reuse_out, args.tokens, args.generate_args)
    wall_fresh = run(args.file, fresh_out, args.tokens, [*args.generate_args, "--no-prefix-cache"])
    a, b = records(reuse_out), records(fresh_out)
    rows, same, differ = [], 0, []
    for qid, r in a.items():
        turns = r["usage"].get("turns", [])
        if len(turns) < 2:
            continue
        second = turns[1]
        rows.append({"id": qid, "prompt": second["prompt_tokens"], "restored": second["cached_tokens"],
                     "prefilled": second["prompt_tokens"] - second["cached_tokens"],
                     "new_text": second["prompt_tokens"] - turns[0]["prompt_tokens"] - turns[0]["completion_tokens"]})
        if qid in b and b[qid]["turns"] == r["turns"]:
            same += 1
        else:
            differ.append(qid)
    fresh_prefill = sum(x["prompt"] for x in rows)
    reuse_prefill = sum(x["prefilled"] for x in rows)
    for x in rows:
        print(f"{x['id']:>4}: second turn {x['prompt']:>4} tokens, {x['restored']:>4} restored, {x['prefilled']:>3} prefilled "
              f"(follow-up and template {x['new_text']})")
    print(f"second turns of {len(rows)} records: {reuse_prefill} tokens prefilled with the kept cache, {fresh_prefill} without "
          f"({reuse_prefill / max(fresh_prefill, 1):.3f}x); beyond its follow-up and template a second turn prefilled at most "
          f"{max((x['prefilled'] - x['new_text'] for x in rows), default=0)} tokens (the answer's last token, never forwarded; "
          f"the head's pending pair; the re-run of the last restored position)")
    print(f"wall: {wall_reuse:.1f} s with the kept cache, {wall_fresh:.1f} s without ({wall_fresh / wall_reuse:.2f}x)")
    print(f"answers identical between the two runs: {same}/{len(a)}" + (f"; differ: {', '.join(differ)}" if differ else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpu": cpu_name(), "threads": os.cpu_count()}, "tokens": args.tokens, "rows": rows,
                       "prefilled_with": reuse_prefill, "prefilled_without": fresh_prefill, "wall_with_s": round(wall_reuse, 2),
                       "wall_without_s": round(wall_fresh, 2), "identical": same, "records": len(a), "differ": differ}, f, indent=2)


if __name__ == "__main__":
    main()
