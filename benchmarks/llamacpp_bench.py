"""llama.cpp beside eagle2 and HF `generate`, on the same GGUF, the same prompt tokens and the same
token budget, in one run: what a CPU user would pick today, and how far eagle2 is from it.

Rows: HF `generate` (float32), eagle2's own plain decoding (same kernels, no draft), eagle2
(the chat default: dynamic tree, per-cycle budget), and llama.cpp's plain decoding of the shipped
GGUF (Q4_1 for the embedded SmolLM2) and of the same file requantized by llama.cpp itself to F32
and F16. Every row decodes the same chat-templated prompt token ids greedily for up to N new tokens
(stopping at the model's end-of-turn ids), prompt evaluation included, after one warm-up prompt.
Methods alternate per prompt, so a slow stretch of the machine hits them all alike.

llama.cpp is a benchmark here, not a dependency of the tool. Install it built for this machine's
instruction set (a few minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36

On a VM whose CPU lists AMX but does not grant the tile state (seen on an AMX Xeon VM: any prompt
of more than one token dies with SIGILL on `tilezero` in ggml_backend_amx_mul_mat), build it
without AMX and with every other instruction set the CPU has:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install --force-reinstall --no-deps llama-cpp-python==0.3.36
    python3 benchmarks/llamacpp_bench.py --prompts 16 --max-new-tokens 96 --json llamacpp.json
    python3 benchmarks/llamacpp_bench.py --prompts 2 --max-new-tokens 8 --formats f32   # dry run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch_bench import cpu_name  # noqa: E402

FTYPES = {"f32": 0, "f16": 1}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_F16


def requantize(src: str, fmt: str, folder: str) -> str:
    """The GGUF rewritten by llama.cpp's own quantize call into `fmt` (f32, f16)."""
    import llama_cpp

    os.makedirs(folder, exist_ok=True)
    dst = os.path.join(folder, f"model-{fmt}.gguf")
    if not os.path.exists(dst):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[fmt]
        params.nthread = torch.get_num_threads()
        params.allow_requantize = True  # the shipped file is already quantized (Q4_1)
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {fmt} failed ({rc})")
    return dst


class LlamaCpp:
    """llama.cpp's plain greedy decoding of prompt token ids, timed like a `Decoder`."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)

    def generate(self, ids: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
        self.llm.reset()
        out = []
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new:
                break
        return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--file", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "mt16.jsonl"),
                    help="prompt file (first turns); default benchmarks/mt16.jsonl")
    ap.add_argument("--formats", default="shipped,f32,f16", help="llama.cpp rows: shipped (the GGUF as it is), f32, f16")
    ap.add_argument("--work", default=None, help="folder for the requantized files (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2's)")
    ap.add_argument("--draft", default=None, help="eagle2's head (default: the model's known one; `random` where it has none)")
    args = ap.parse_args(argv)

    from eagle2_core.events import GenerationSettings
    from eagle2_core.loading import smollm2_gguf_path
    from eagle2_core.methods import BatchedEagle
    from eagle2_core.prompts import read_prompt_file
    from eagle2_core.runtime import Runtime
    from eagle2_core.target import model_eos_ids

    gguf = args.model or smollm2_gguf_path()
    rt = Runtime.load(args.model, args.draft, dtype="float32", device="cpu", sample_by_default=False)  # eagle2 on this very GGUF
    items = [it for it in read_prompt_file(args.file) if not hasattr(it, "describe")][: args.prompts]
    prompts = [rt.encode(it.messages[:1]) for it in items]
    eos = model_eos_ids(rt.model, rt.tokenizer)
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens, eos_token_ids=tuple(sorted(eos)))
    threads = torch.get_num_threads()
    work = args.work or tempfile.mkdtemp(prefix="eagle2-llamacpp-")
    n_ctx = max(len(p) for p in prompts) + args.max_new_tokens + 8

    rows: dict[str, dict] = {}

    def ours(name, dec):
        def run(ids, n):
            t0 = time.perf_counter()
            toks, s = dec.generate(ids, dataclasses.replace(gen, max_new_tokens=n))
            return toks, time.perf_counter() - t0, s
        rows[name] = {"run": run}

    van, plain, eagle = rt.vanilla(), BatchedEagle(rt, 1, 1), rt.eagle()
    ours("HF generate (float32)", van)
    ours(f"eagle2 plain ({rt.arithmetic}, no draft)", plain)
    ours(f"eagle2 ({rt.arithmetic}, chat default)", eagle)
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        path = gguf if fmt == "shipped" else requantize(gguf, fmt, work)
        lc = LlamaCpp(path, threads, n_ctx)
        label = f"llama.cpp {fmt if fmt != 'shipped' else 'shipped GGUF'} ({os.path.getsize(path) / 1e6:.0f} MB)"

        def run(ids, n, lc=lc):
            toks, wall = lc.generate(ids, n, eos)
            return toks, wall, None
        rows[label] = {"run": run}
    for r in rows.values():
        r.update(tokens=0, seconds=0.0, outputs=[], tau=[])
    for r in rows.values():  # warm-up: the first prompt, 8 tokens
        r["run"](prompts[0], 8)
    for i, ids in enumerate(prompts):
        for name, r in rows.items():
            toks, wall, s = r["run"](ids, args.max_new_tokens)
            r["tokens"] += len(toks)
            r["seconds"] += wall
            r["outputs"].append(toks)
            if s is not None and s.target_forwards:
                r["tau"].append((s.new_tokens, s.target_forwards))
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{n.split(' (')[0]} {r['tokens'] / r['seconds']:.1f}" for n, r in rows.items()),
              flush=True)
    ref = rows["HF generate (float32)"]
    base = ref["tokens"] / ref["seconds"]
    lc_f32 = next((r for n, r in rows.items() if n.startswith("llama.cpp f32")), None)
    print(f"\nmachine: {cpu_name()}; torch {torch.__version__}; {len(prompts)} prompts from {os.path.basename(args.file)} "
          f"x up to {args.max_new_tokens} new tokens; {threads} threads everywhere")
    print("| method | tok/s | vs HF generate | vs llama.cpp F32 | identical to HF generate |")
    print("|---|---|---|---|---|")
    out = []
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        same = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
        vs_lc = f"{tps / (lc_f32['tokens'] / lc_f32['seconds']):.2f}x" if lc_f32 else ""
        tau = sum(a for a, _ in r["tau"]) / sum(b for _, b in r["tau"]) if r["tau"] else None
        print(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {vs_lc} | {same}/{len(prompts)} |")
        out.append({"method": name, "tokens": r["tokens"], "seconds": round(r["seconds"], 3), "tokens_per_s": round(tps, 2),
                    "vs_generate": round(tps / base, 4), "identical_to_generate": same, "tau": None if tau is None else round(tau, 3)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "torch": torch.__version__, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                       "file": args.file, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
