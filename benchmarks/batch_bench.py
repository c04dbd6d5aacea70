"""A prompt file through every decoder, in one run: HF `generate` at batch 1 (the reference),
HF `generate` batched with left padding, transformers' `generate_batch` (continuous batching),
eagle2 one prompt at a time, and eagle2's batched decoder at the measured choice and pinned sizes.

Generation time only (models and heads are loaded once, before any timing; the eagle2 batch cost
table is measured or read from the cache before timing too). Identical counts are against batch-1
greedy `generate` and, for the batched rows, against HF's own batched output of the same batch size.

    python3 benchmarks/batch_bench.py --prompts 32 --max-new-tokens 96 --dtype float32 --json bench.json
    python3 benchmarks/batch_bench.py --methods hf:32,eagle2:auto --rounds 3     # interleaved: the ratio's spread
    python3 benchmarks/batch_bench.py --prompts 4 --max-new-tokens 8 --methods hf:1,hf:4,eagle2:auto,eagle2:4x1   # dry run
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import torch


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), platform.processor())
        flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
        feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
        return f"{model} ({', '.join(feats)}), {torch.get_num_threads()} threads"
    except OSError:
        return platform.processor()


def hf_batched(model, tok, prompts, batch, max_new, eos):
    """HF generate over the prompts in order, `batch` at a time, left-padded (as HF asks)."""
    outs = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, eos_token_id=eos, pad_token_id=pad)
        for row in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            outs.append(row[:cut])
    return outs


def hf_continuous(model, prompts, max_new, eos):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    res = model.generate_batch(inputs=prompts, generation_config=cfg)
    by = sorted(res.values(), key=lambda r: int(str(r.request_id).split("_")[-1]) if str(r.request_id).split("_")[-1].isdigit() else 0)
    outs = []
    for r in by:
        row = list(r.generated_tokens)
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        outs.append(row[:cut])
    return outs


def eagle_batched(rt, prompts, max_new, spec: str):
    """spec: auto | BxN (N = 1: plain) | Bxauto; runs methods.BatchedEagle, what `compare --against batch:` runs."""
    from eagle2_core.events import GenerationSettings
    from eagle2_core.methods import BatchedEagle

    b, n = (None, None) if spec == "auto" else spec.split("x")
    dec = BatchedEagle(rt, None if b is None else int(b), None if n in (None, "auto") else int(n))
    t0 = time.perf_counter()
    res = dec.generate_many(prompts, [GenerationSettings(max_new_tokens=max_new)] * len(prompts))
    return [t for t, _ in res], time.perf_counter() - t0, dec.plan, [s for _, s in res], dec.stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--methods", default="hf:1,hf:4,hf:8,hf:16,hf-continuous,eagle2:1,eagle2:auto,eagle2:8x1,eagle2:16x1,eagle2:32x1,eagle2:4x3,eagle2:8x3",
                    help="comma list: hf:B, hf-continuous, eagle2:1 (per prompt), eagle2:auto, eagle2:BxN, eagle2:Bxauto")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the methods this many times, interleaved (HF and eagle2 alternate): a VM drifts between minutes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from eagle2_core.datasets import dataset_items
    from eagle2_core.runtime import Runtime
    from eagle2_core.target import model_eos_ids

    rt = Runtime.load(None, None, dtype=args.dtype, device="cpu")
    tok = rt.tokenizer
    items = dataset_items(args.dataset)[: args.prompts]
    prompts = [rt.encode(it.messages) for it in items]
    eos = sorted(model_eos_ids(rt.model, tok))
    # the batch cost table is measured (or read) before any timing
    from eagle2_core.measure import load_or_measure_batch
    from eagle2_core.treesettings import BATCH_DEPTH, BATCH_TOP_K

    costs = load_or_measure_batch(rt.model, rt.head, BATCH_DEPTH, BATCH_TOP_K)
    methods = args.methods.split(",")
    if "hf:1" in methods:
        methods.remove("hf:1")
    rows, ref = [], None
    t0 = time.perf_counter()
    ref = hf_batched(rt.model, tok, prompts, 1, args.max_new_tokens, eos)
    ref_s = time.perf_counter() - t0
    n_tok = sum(len(r) for r in ref)
    rows.append({"method": "HF generate, batch 1", "seconds": ref_s, "tokens": n_tok, "identical": len(prompts)})
    hf_out = {}
    print(f"{rows[-1]['method']}: {ref_s:.1f} s, {n_tok / ref_s:.1f} tok/s", flush=True)
    for rnd, m in [(r, m) for r in range(args.rounds) for m in methods]:
        kind, _, arg = m.partition(":")
        extra = {}
        t0 = time.perf_counter()
        if kind == "hf":
            outs = hf_batched(rt.model, tok, prompts, int(arg), args.max_new_tokens, eos)
            wall = time.perf_counter() - t0
            hf_out[int(arg)] = outs
            label = f"HF generate, batch {arg} (left padding)"
        elif kind == "hf-continuous":
            try:
                outs = hf_continuous(rt.model, prompts, args.max_new_tokens, eos)
            except Exception as e:  # noqa: BLE001 - report and go on with the other rows
                print(f"{m}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                continue
            wall = time.perf_counter() - t0
            label = "transformers generate_batch (continuous batching)"
        elif kind == "eagle2":
            outs, wall, info, summaries, stats = eagle_batched(rt, prompts, args.max_new_tokens, "1x2" if arg == "1" else arg)
            if arg == "1":
                label = "eagle2, one prompt at a time (per-cycle budget)"
            else:
                label = f"eagle2 batched {arg}: batch {info.get('batch_size')}, tree {info.get('tree_tokens')}"
            new = sum(s.new_tokens for s in summaries)
            fw = sum(s.target_forwards for s in summaries)
            extra = {"plan": info, "tau": round(new / fw, 3) if fw else None, "stats": {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()}) for k, v in stats.items()}}
        else:
            raise SystemExit(f"unknown method {m}")
        same = sum(o == r for o, r in zip(outs, ref))
        row = {"method": label, "spec": m, "round": rnd, "seconds": wall, "tokens": sum(len(o) for o in outs), "identical": same, **extra}
        b = int(arg) if kind == "hf" else (extra.get("plan", {}).get("batch_size") if kind == "eagle2" else None)
        if kind == "eagle2" and isinstance(b, int) and b in hf_out:
            row["identical_vs_hf_same_batch"] = sum(o == r for o, r in zip(outs, hf_out[b]))
        rows.append(row)
        print(f"{label}: {wall:.1f} s, {row['tokens'] / wall:.1f} tok/s, identical {same}/{len(prompts)}"
              + (f", tau {extra['tau']}" if extra.get("tau") else ""), flush=True)
    # each round's rows against that round's best batched HF row (the rounds interleave, so a drift
    # of the machine between minutes moves both sides of a ratio); the batch-1 reference against the first
    best = {}
    for r in rows:
        if r.get("spec", "").startswith("hf:"):
            best[r["round"]] = min(best.get(r["round"], float("inf")), r["seconds"])
    for r in rows:
        b = best.get(r.get("round", 0))
        r["vs_best_hf"] = round(b / r["seconds"], 3) if b else None
    print(f"\nmachine: {cpu_name()}; torch {torch.__version__}; dtype {args.dtype}; {len(prompts)} prompts x {args.max_new_tokens} new tokens"
          + (f"; {args.rounds} interleaved rounds" if args.rounds > 1 else ""))
    print("| method | round | s | tok/s | vs best HF batched (same round) | identical to batch-1 generate |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['vs_best_hf']:.2f}x" if r.get("vs_best_hf") else ""
        print(f"| {r['method']} | {r.get('round', '')} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:.1f} | {ratio} | {r['identical']}/{len(prompts)} |")
    if args.rounds > 1:
        for m in methods:
            got = sorted(r["vs_best_hf"] for r in rows if r.get("spec") == m and r.get("vs_best_hf"))
            if got:
                print(f"{m}: vs best HF batched {got[len(got) // 2]:.2f}x (median of {len(got)}, range {got[0]:.2f}-{got[-1]:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "torch": torch.__version__, "dtype": args.dtype, "prompts": len(prompts),
                       "max_new_tokens": args.max_new_tokens, "costs": costs.to_json(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
