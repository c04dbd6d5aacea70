"""Logprobs under speculation against plain decoding: `eagle2 generate --logprobs N` on a prompt
file, once speculating and once with --no-speculation, and every record compared: the text and
each token's logprob and top alternatives, bit for bit (floats compared as JSON numbers, which
round-trip exactly).

    python3 benchmarks/logprobs_identity.py [-f benchmarks/mt16.jsonl] [-n 96] [--logprobs 5] [-- extra generate flags]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run(args, out: str, plain: bool) -> float:
    cmd = [sys.executable, "-m", "eagle2_cli", "generate", "-f", args.file, "-o", out, "--overwrite", "--no-progress",
           "-n", str(args.max_new_tokens), "--logprobs", str(args.logprobs), *args.extra] + (["--no-speculation"] if plain else [])
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def records(path: str) -> dict:
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out[json.dumps(r.get("question_id", r.get("id")))] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-f", "--file", default="benchmarks/mt16.jsonl")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="more `eagle2 generate` flags (after --)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="eagle2-logprobs-")
    spec_out, plain_out = os.path.join(tmp, "spec.jsonl"), os.path.join(tmp, "plain.jsonl")
    t_spec = run(args, spec_out, plain=False)
    t_plain = run(args, plain_out, plain=True)
    spec, plain = records(spec_out), records(plain_out)
    same, tokens, first = 0, 0, None
    for key, p in plain.items():
        s = spec.get(key)
        ok = s is not None and s.get("logprobs") == p.get("logprobs") and s.get("turns", s.get("text")) == p.get("turns", p.get("text"))
        same += ok
        lists = p["logprobs"] if "turns" in p else [p["logprobs"]]
        tokens += sum(len(x) for x in lists)
        if not ok and first is None:
            first = key
    print(json.dumps({"records": len(plain), "bitwise_equal": same, "tokens": tokens, "first_difference": first,
                      "speculation_s": round(t_spec, 1), "plain_s": round(t_plain, 1), "outputs": tmp}))
    sys.exit(0 if same == len(plain) == len(spec) else 1)


if __name__ == "__main__":
    main()
