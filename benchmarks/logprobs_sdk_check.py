"""`eagle2 serve`'s logprobs read by the official openai SDK, against `eagle2 generate --logprobs`'s
records: each record's first turn is sent as a chat completion (`logprobs=True, top_logprobs=N`,
the record's token budget), and `choice.logprobs.content[i]` (token, logprob, bytes and every
top_logprobs entry) compared with the record's first list, bit for bit.

    python3 benchmarks/logprobs_sdk_check.py RECORDS.jsonl [-f benchmarks/mt16.jsonl] [-- serve flags]

Serve and generate should prefill alike (`--no-prefix-cache` on both): a prompt whose prefill
restored another number of kept cells gets other bits from its first token on.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("records")
    ap.add_argument("-f", "--file", default="benchmarks/mt16.jsonl")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="more `eagle2 serve` flags (after --)")
    args = ap.parse_args()
    import openai

    questions = {json.dumps(q.get("question_id", q.get("id"))): q for q in map(json.loads, open(args.file))}
    records = [json.loads(line) for line in open(args.records)]
    proc = subprocess.Popen([sys.executable, "-m", "eagle2_cli", "serve", "--port", "0", *args.extra], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            sys.exit("the server did not start")
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        same, tokens, first = 0, 0, None
        t0 = time.perf_counter()
        for rec in records:
            key = json.dumps(rec.get("question_id", rec.get("id")))
            q = questions[key]
            prompt = q["turns"][0] if "turns" in q else q["prompt"]
            want = rec["logprobs"][0] if "turns" in rec else rec["logprobs"]
            r = client.chat.completions.create(model="eagle2", messages=[{"role": "user", "content": prompt}], logprobs=True,
                                               top_logprobs=args.top, max_tokens=rec["usage"]["turns"][0]["completion_tokens"]
                                               if "turns" in rec else rec["usage"]["completion_tokens"])
            got = [{"token": c.token, "logprob": c.logprob, "bytes": c.bytes,
                    "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in c.top_logprobs]}
                   for c in r.choices[0].logprobs.content]
            ok = got == want and len(got) == r.usage.completion_tokens
            same += ok
            tokens += len(got)
            if not ok and first is None:
                first = key
        print(json.dumps({"records": len(records), "sdk_equal_to_generate": same, "tokens": tokens, "first_difference": first,
                          "seconds": round(time.perf_counter() - t0, 1)}))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
