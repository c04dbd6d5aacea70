"""What logprobs cost: plain decoding (and speculation) of a prompt file's first turns with
logprobs off and on, interleaved prompt by prompt in one process, tokens per second of each.
Run it from another checkout (`cd /work/main && python3 .../logprobs_cost.py --off-only`) to time
that checkout's decoding with logprobs off, the same way.

    python3 benchmarks/logprobs_cost.py [-f benchmarks/mt16.jsonl] [-n 96] [--prompts 8] [--batch 1] [--rounds 2]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout this runs from, not the one the script sits in


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-f", "--file", default="benchmarks/mt16.jsonl")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--off-only", action="store_true", help="logprobs off only (a checkout without them)")
    ap.add_argument("--speculation", action="store_true", help="the runtime's speculating engine instead of plain decoding")
    args = ap.parse_args()

    import torch

    from eagle2_core.engine import Engine, Request
    from eagle2_core.prompts import read_prompt_file
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(None, need_head=args.speculation)
    items = [it for it in read_prompt_file(args.file)][: args.prompts]
    prompts = [rt.encode(it.messages) for it in items]
    gen = dataclasses.replace(rt.gen, max_new_tokens=args.max_new_tokens, temperature=0.0)
    if args.speculation:
        eng = rt.eagle() if args.batch == 1 else rt.batch_decoder(len(prompts), args.batch)[0]
    else:
        eng = Engine(rt.model, None, rt.tokenizer, batch=args.batch, costs=rt.costs)
    modes = {"off": gen} if args.off_only else {"off": gen, "on": dataclasses.replace(gen, logprobs=args.logprobs)}
    tokens = {m: 0 for m in modes}
    seconds = {m: 0.0 for m in modes}
    with torch.no_grad():
        eng.generate(prompts[0], dataclasses.replace(gen, max_new_tokens=4))  # warm-up
        for _ in range(args.rounds):
            for i in range(0, len(prompts), args.batch):
                group = prompts[i : i + args.batch]
                for m, g in modes.items():
                    t0 = time.perf_counter()
                    out = {}
                    eng.run(collections.deque(Request(j, ids, g) for j, ids in enumerate(group)),
                            lambda k, t, s: out.__setitem__(k, len(t)))
                    seconds[m] += time.perf_counter() - t0
                    tokens[m] += sum(out.values())
    rates = {m: round(tokens[m] / seconds[m], 2) for m in modes}
    report = {"tok_s": rates, "tokens": tokens, "batch": args.batch, "speculation": args.speculation, "cwd": os.getcwd()}
    if "on" in rates:
        report["on_over_off"] = round(rates["on"] / rates["off"], 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
