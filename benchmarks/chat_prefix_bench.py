"""A four-turn chat, as a user would type it in the REPL, with and without the kept cache (prefix.py).

Each turn runs twice, interleaved so both see the same machine state: once continuing the
conversation's kept cache, once with --no-prefix-cache's behaviour (every prompt prefilled
whole). Reports per turn the prompt length, the tokens restored, the prefill time and the
tokens/s of both, the ratio of turn 4's prefill to turn 1's, and whether the answers are
identical (float32, greedy).

With --repeats N the whole conversation runs N times over (each time two fresh conversations and
an empty kept cache, the side that goes first alternating), and each turn's figures are summed
over the repeats: tokens/s as all tokens over all decoding time, prefill as the mean. One run of
160 tokens a turn lasts about two seconds, too short for a ratio within a few percent on a
machine whose speed drifts by that much from one second to the next.

    python benchmarks/chat_prefix_bench.py [--model M] [--draft D] [--tokens 160] [--repeats 3] [--json out.json]
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
    ap.add_argument("--repeats", type=int, default=1, help="run the conversation this many times over and sum per turn")
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
    # warm-up, not counted: the first forwards of a process pay for allocations and kernel plans, and
    # the per-cycle budget (shared by both sides) learns this machine's costs over its first cycles
    warm = Conversation()
    warm.add_user("Hello! What can you do?")
    collect(rt.eagle().stream(warm.encode(rt.tokenizer, rt.chat_template), GenerationSettings(max_new_tokens=args.tokens)))
    runs = []  # per repeat, per turn: {side: figures}
    for rep in range(args.repeats):
        cache = PrefixCache()  # empty: a repeat must not restore the previous repeat's conversation
        convs = {"kept": Conversation(), "whole": Conversation()}
        turns = []
        for k, text in enumerate(TURNS, 1):
            row = {}
            order = list(convs.items()) if (k + rep) % 2 else list(convs.items())[::-1]  # alternate which runs first
            for name, conv in order:
                rt.prefix_cache = cache if name == "kept" else None
                conv.add_user(text)
                ids = conv.encode(rt.tokenizer, rt.chat_template)
                t0 = time.perf_counter()
                tokens, s = collect(rt.eagle().stream(ids, rt.gen, keep=rt.prefix_cache is not None))
                wall = time.perf_counter() - t0
                conv.add_assistant(rt.decode(tokens), s, tokens, rt.tokenizer)
                row[name] = {"prompt_tokens": len(ids), "cached_tokens": s.cached_tokens, "prefill_s": s.prefill_s,
                             "new_tokens": s.new_tokens, "decode_s": s.wall_s,
                             "wall_s": wall, "tokens": tokens}
            turns.append(row)
        runs.append(turns)
    rows = []
    for k in range(1, len(TURNS) + 1):
        row = {"turn": k}
        for name in ("kept", "whole"):
            got = [run[k - 1][name] for run in runs]
            row[name] = {"prompt_tokens": got[0]["prompt_tokens"], "cached_tokens": got[0]["cached_tokens"],
                         "prefill_s": round(sum(g["prefill_s"] for g in got) / len(got), 4),
                         "new_tokens": sum(g["new_tokens"] for g in got),
                         "tokens_per_s": round(sum(g["new_tokens"] for g in got) / sum(g["decode_s"] for g in got), 2),
                         "wall_s": round(sum(g["wall_s"] for g in got), 3), "tokens": [g["tokens"] for g in got],
                         "per_repeat_tokens_per_s": [round(g["new_tokens"] / g["decode_s"], 2) for g in got]}
        row["identical"] = all(a == b for a, b in zip(row["kept"]["tokens"], row["whole"]["tokens"]))
        row["tokens_per_s_ratio"] = round(row["kept"]["tokens_per_s"] / row["whole"]["tokens_per_s"], 3)
        rows.append(row)
        print(f"turn {k}: prompt {row['kept']['prompt_tokens']:4d} tokens | kept: {row['kept']['cached_tokens']:4d} restored, "
              f"prefill {row['kept']['prefill_s']:.3f} s, {row['kept']['tokens_per_s']:6.1f} tok/s | whole: prefill "
              f"{row['whole']['prefill_s']:.3f} s, {row['whole']['tokens_per_s']:6.1f} tok/s | identical {row['identical']}", flush=True)
    ratio = {name: rows[-1][name]["prefill_s"] / rows[0][name]["prefill_s"] for name in ("kept", "whole")}
    print(f"turn 4 prefill / turn 1 prefill: kept {ratio['kept']:.2f}x, whole {ratio['whole']:.2f}x")
    print(f"tokens/s kept / whole per turn: {[r['tokens_per_s_ratio'] for r in rows]}; identical {sum(r['identical'] for r in rows)}/4")
    if args.json:
        for r in rows:
            for name in ("kept", "whole"):
                r[name].pop("tokens")
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "threads": torch.get_num_threads(), "model": rt.target.name, "draft": rt.draft_name,
                       "tokens": args.tokens, "repeats": args.repeats, "turns": rows, "turn4_over_turn1_prefill": {k: round(v, 3) for k, v in ratio.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
