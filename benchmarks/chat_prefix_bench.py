"""A four-turn chat, as a user would type it in the REPL, with and without the kept cache (prefix.py).

Each turn runs twice, interleaved so both see the same machine state: once continuing the
conversation's kept cache, once with --no-prefix-cache's behaviour (every prompt prefilled
whole). Reports per turn the prompt length, the tokens restored, the prefill time and the
tokens/s of both, the ratio of turn 4's prefill to turn 1's, and whether the answers are
identical (float32, greedy).

    python benchmarks/chat_prefix_bench.py [--model M] [--draft D] [--tokens 160] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

TURNS = [
    "Write a short story about a robot who learns to paint.",
    "Now rewrite it so that it rhymes.",
    "Give the story a title and explain why you chose it.",
    "Summarize the story in two sentences for a child.",
]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 is steadier on a shared machine)")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from eagle2_core.chat import Conversation
    from eagle2_core.events import GenerationSettings, collect
    from eagle2_core.prefix import PrefixCache
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(args.model, args.draft, dtype="float32", gen=GenerationSettings(max_new_tokens=args.tokens))
    cache = PrefixCache()
    convs = {"kept": Conversation(), "whole": Conversation()}
    # warm-up, not counted: the first forwards of a process pay for allocations and kernel plans, and
    # the per-cycle budget (shared by both sides) learns this machine's costs over its first cycles
    warm = Conversation()
    warm.add_user("Hello! What can you do?")
    collect(rt.eagle().stream(warm.encode(rt.tokenizer, rt.chat_template), GenerationSettings(max_new_tokens=args.tokens)))
    rows = []
    for k, text in enumerate(TURNS, 1):
        row = {"turn": k}
        order = list(convs.items()) if k % 2 else list(convs.items())[::-1]  # alternate which runs first
        for name, conv in order:
            rt.prefix_cache = cache if name == "kept" else None
            conv.add_user(text)
            ids = conv.encode(rt.tokenizer, rt.chat_template)
            t0 = time.perf_counter()
            tokens, s = collect(rt.eagle().stream(ids, rt.gen, keep=rt.prefix_cache is not None))
            wall = time.perf_counter() - t0
            conv.add_assistant(rt.decode(tokens), s, tokens, rt.tokenizer)
            row[name] = {"prompt_tokens": len(ids), "cached_tokens": s.cached_tokens, "prefill_s": round(s.prefill_s, 4),
                         "new_tokens": s.new_tokens, "tokens_per_s": round(s.tokens_per_s, 2), "wall_s": round(wall, 3),
                         "tokens": tokens}
        row["identical"] = row["kept"]["tokens"] == row["whole"]["tokens"]
        row["tokens_per_s_ratio"] = round(row["kept"]["tokens_per_s"] / row["whole"]["tokens_per_s"], 3)
        rows.append(row)
        print(f"turn {k}: prompt {row['kept']['prompt_tokens']:4d} tokens | kept: {row['kept']['cached_tokens']:4d} restored, "
              f"prefill {row['kept']['prefill_s']:.3f} s, {row['kept']['tokens_per_s']:6.1f} tok/s | whole: prefill "
              f"{row['whole']['prefill_s']:.3f} s, {row['whole']['tokens_per_s']:6.1f} tok/s | identical {row['identical']}", flush=True)
    ratio = {name: rows[-1][name]["prefill_s"] / rows[0][name]["prefill_s"] for name in convs}
    print(f"turn 4 prefill / turn 1 prefill: kept {ratio['kept']:.2f}x, whole {ratio['whole']:.2f}x")
    print(f"tokens/s kept / whole per turn: {[r['tokens_per_s_ratio'] for r in rows]}; identical {sum(r['identical'] for r in rows)}/4")
    if args.json:
        for r in rows:
            for name in convs:
                r[name].pop("tokens")
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "threads": torch.get_num_threads(), "model": rt.target.name, "draft": rt.draft_name,
                       "tokens": args.tokens, "turns": rows, "turn4_over_turn1_prefill": {k: round(v, 3) for k, v in ratio.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
