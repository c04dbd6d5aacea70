"""Structured output under speculation: JSON schemas of increasing difficulty (benchmarks/schemas.jsonl).

For each schema, in one process and interleaved per schema (so slow drifts hit every method alike):
  eagle2   the default engine (drafting) with the schema as a constraint
  plain    eagle2's own plain decoding (`--total-tokens 1`: the root alone) with the same constraint
greedy, and with --sample also seeded sampling (speculation and plain decoding on the same seed).
Reports per schema the finish reason, whether the answer validates (jsonschema), whether
speculation's tokens equal plain decoding's, and over all schemas the speed ratio (tokens over
time, eagle2 over plain), tau and the grammar's cost: the time its mask took per emitted token
(the processor's calls, timed here), against a plain step (plain decoding's time per token, its
mask's time taken out).

The token budget of each schema is twice the characters of its longest answer in ASCII (strings at
maxLength, arrays at maxItems, integers at their widest bound; 24 characters for a number with a
fraction), an upper bound on tokens since a token holds at least one character.

    python3 benchmarks/structured_bench.py                       # the embedded SmolLM2
    python3 benchmarks/structured_bench.py --model q.gguf --sample --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

NUMBER_CHARS = 24  # a number with a fraction: sign, digits, point, digits, exponent


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown CPU")


def longest_chars(s: dict) -> int:
    """Characters of the longest answer to schema `s` as llguidance writes JSON (', ' and ': '),
    with ASCII strings: each string at its maxLength, each array at its maxItems, every optional
    property present."""
    if "enum" in s:
        return max(len(json.dumps(v)) for v in s["enum"])
    if "const" in s:
        return len(json.dumps(s["const"]))
    if "anyOf" in s:
        return max(longest_chars(x) for x in s["anyOf"])
    t = s.get("type")
    if t == "string":
        return 2 + s["maxLength"]  # schemas here bound every string
    if t == "integer":
        return max(len(str(s.get("minimum", -(10**18)))), len(str(s.get("maximum", 10**18))))
    if t == "number":
        return NUMBER_CHARS
    if t == "boolean":
        return 5
    if t == "null":
        return 4
    if t == "array":
        n = s["maxItems"]
        return 2 + n * longest_chars(s["items"]) + max(0, n - 1) * 2
    if t == "object":
        props = s.get("properties", {})
        return 2 + sum(len(json.dumps(k)) + 2 + longest_chars(v) for k, v in props.items()) + max(0, len(props) - 1) * 2
    raise ValueError(f"no bound for {s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    ap.add_argument("--schemas", default=os.path.join(HERE, "schemas.jsonl"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--sample", action="store_true", help="also seeded sampling (temperature 0.7, seed = schema index)")
    ap.add_argument("--json", default=None, help="write every answer and figure here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1: with --cpu-time, figures that other jobs on the cores do not move)")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time instead of the wall clock")
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter

    import jsonschema

    from eagle2_core import structured
    from eagle2_core.methods import BatchedEagle
    from eagle2_core.runtime import Runtime

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    timer = {"s": 0.0}
    call = structured.GrammarMask.__call__

    def timed(self, input_ids, scores):  # the grammar's whole cost: matcher moves, masks, the fill
        t0 = clock()
        try:
            return call(self, input_ids, scores)
        finally:
            timer["s"] += clock() - t0

    structured.GrammarMask.__call__ = timed

    rows = [json.loads(line) for line in open(args.schemas) if line.strip()][: args.limit]
    rt = Runtime.load(args.model)
    eagle, plain = rt.eagle(), BatchedEagle(rt, 1, 1)

    def one(dec, ids, gen):
        timer["s"] = 0.0
        t0 = clock()
        tokens, summary = dec.generate(ids, gen)
        return tokens, summary, clock() - t0, timer["s"]

    def prompt_of(r):
        return rt.encode([{"role": "user", "content": f"{r['prompt']} Reply with JSON only, matching this schema: {json.dumps(r['schema'])}"}])

    # warm-up: the first schema, a few tokens, each method
    c0 = structured.json_schema(rows[0]["schema"])
    for dec in (eagle, plain):
        dec.generate(prompt_of(rows[0]), dataclasses.replace(rt.gen, constraint=c0, max_new_tokens=8, temperature=0.0))

    out, modes = [], [("greedy", 0.0)] + ([("seeded", 0.7)] if args.sample else [])
    for i, r in enumerate(rows):
        c = structured.json_schema(r["schema"], r["id"])
        ids = prompt_of(r)
        budget = 2 * longest_chars(r["schema"])
        for mode, temp in modes:
            gen = dataclasses.replace(rt.gen, constraint=c, max_new_tokens=budget, temperature=temp, seed=i, top_k=0, top_p=1.0)
            e_tok, e_sum, e_wall, e_mask = one(eagle, ids, gen)
            p_tok, p_sum, p_wall, p_mask = one(plain, ids, gen)
            text = rt.decode(e_tok)
            try:
                jsonschema.validate(json.loads(text), r["schema"])
                valid = True
            except (json.JSONDecodeError, jsonschema.ValidationError):
                valid = False
            rec = {"id": r["id"], "mode": mode, "budget": budget, "tokens": len(e_tok), "finish": e_sum.finish_reason, "valid": valid,
                   "same_as_plain": e_tok == p_tok, "eagle_s": e_wall, "plain_s": p_wall, "eagle_mask_s": e_mask, "plain_mask_s": p_mask,
                   "plain_tokens": len(p_tok), "tau": e_sum.tau, "text": text}
            out.append(rec)
            print(f"{r['id']:14s} {mode:6s} {rec['finish']:6s} valid={valid!s:5s} same={rec['same_as_plain']!s:5s} "
                  f"{len(e_tok):4d}/{budget:4d} tok  eagle {e_wall:6.2f}s plain {p_wall:6.2f}s tau {e_sum.tau:.2f}  {text[:70]!r}",
                  flush=True)

    import torch

    print(f"\n{rt.target.name} ({rt.arithmetic}), {cpu_name()}, {torch.get_num_threads()} threads, "
          f"{'CPU time' if args.cpu_time else 'wall clock'}, {datetime.date.today()}")
    for mode, _ in modes:
        rs = [x for x in out if x["mode"] == mode]
        stop_valid = sum(x["finish"] == "stop" and x["valid"] for x in rs)
        stopped_invalid = sum(x["finish"] == "stop" and not x["valid"] for x in rs)
        same = sum(x["same_as_plain"] for x in rs)
        e_tok, p_tok = sum(x["tokens"] for x in rs), sum(x["plain_tokens"] for x in rs)
        e_s, p_s = sum(x["eagle_s"] for x in rs), sum(x["plain_s"] for x in rs)
        mask_per_tok = sum(x["eagle_mask_s"] for x in rs) / max(1, e_tok)
        plain_step = (p_s - sum(x["plain_mask_s"] for x in rs)) / max(1, p_tok)
        print(f"{mode}: {stop_valid}/{len(rs)} stop and valid ({stopped_invalid} stopped invalid), {same}/{len(rs)} same as plain; "
              f"eagle {e_tok / e_s:.1f} tok/s, plain {p_tok / p_s:.1f} tok/s: {e_tok / e_s / (p_tok / p_s):.2f}x; "
              f"tau {e_tok / max(1, sum(x['tokens'] / x['tau'] for x in rs if x['tau'])):.2f}; "
              f"mask {1000 * mask_per_tok:.2f} ms/token = {100 * mask_per_tok / plain_step:.1f}% of a plain step ({1000 * plain_step:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
