"""`--load-in-8bit` on a CPU: eagle2's weight-only 8-bit beside float32, one process.

The same Hugging Face folder loaded twice: in float32, and with `--load-in-8bit` (every linear
weight and the embedding as int8 rows with a float32 scale each, read by the block kernel; no
float32 copy). Rows: eagle2's plain decoding and eagle2's chat default on each, and HF `generate`
on each (on the 8-bit model `generate` runs transformers' F.linear over the rebuilt weights,
the rebuilding taken out of its time). Methods alternate per prompt. Reported: tok/s, the 8-bit
rows against float32's, each 8-bit answer against the 8-bit `generate` (must be identical) and
against float32 `generate` (quantization changes the model: differences expected), and the
resident weight bytes.

    python3 benchmarks/int8_bench.py --prompts 8 --max-new-tokens 64
    python3 benchmarks/int8_bench.py --model FOLDER --draft HEAD

Default model: the embedded SmolLM2, its GGUF dequantized into a float32 folder for the run's
length, with its shipped head.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch_bench import cpu_name  # noqa: E402


def default_folder() -> str:
    """A float32 Hugging Face folder of the embedded GGUF, for this run only: eagle2 loads GGUFs
    from their own file and keeps no float32 copy, but `--load-in-8bit` quantizes float weights."""
    import atexit
    import shutil
    import tempfile

    from eagle2_core import ggufload, loading

    where, gguf = loading.resolve_model(None)
    config, parsed, tok = ggufload.read_metadata(where, gguf, loading.cache_dir())
    model, _ = ggufload.build_model(os.path.join(where, gguf), config, parsed, torch.float32, "floats")
    folder = tempfile.mkdtemp(prefix="int8-bench-smollm2-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--file", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "mt16.jsonl"))
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: the embedded SmolLM2, dequantized for the run)")
    ap.add_argument("--draft", default=None, help="eagle2's head (default: SmolLM2's shipped one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from eagle2_core.events import GenerationSettings
    from eagle2_core.loading import packaged_head_path
    from eagle2_core.methods import BatchedEagle
    from eagle2_core.prompts import read_prompt_file
    from eagle2_core.runtime import Runtime
    from eagle2_core.target import model_eos_ids

    folder = args.model or default_folder()
    draft = args.draft or packaged_head_path("smollm2")
    rts = {bits: Runtime.load(folder, draft, dtype="float32", device="cpu", load_in_8bit=bits == 8, sample_by_default=False)
           for bits in (32, 8)}
    items = [it for it in read_prompt_file(args.file) if not hasattr(it, "describe")][: args.prompts]
    prompts = [rts[32].encode(it.messages[:1]) for it in items]
    eos = model_eos_ids(rts[32].model, rts[32].tokenizer)
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens, eos_token_ids=tuple(sorted(eos)))
    rows = {}
    for bits, rt in rts.items():
        tag = "float32" if bits == 32 else "8-bit"
        rows[f"HF generate ({tag})"] = rt.vanilla()
        rows[f"eagle2 plain ({tag})"] = BatchedEagle(rt, 1, 1)
        rows[f"eagle2 chat default ({tag})"] = rt.eagle()
    stats = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in rows}
    for dec in rows.values():
        dec.generate(prompts[0], dataclasses.replace(gen, max_new_tokens=8))
    for i, ids in enumerate(prompts):
        for name, dec in rows.items():
            t0 = time.perf_counter()
            toks, s = dec.generate(ids, gen)
            wall = s.wall_s if name.startswith("HF generate") else time.perf_counter() - t0  # generate: rebuilding taken out
            st = stats[name]
            st["tokens"] += len(toks)
            st["seconds"] += wall
            st["outputs"].append(toks)
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{n} {s['tokens'] / s['seconds']:.1f}" for n, s in stats.items()), flush=True)
    print(f"\nmachine: {cpu_name()}; torch {torch.__version__}; {torch.get_num_threads()} threads; {len(prompts)} prompts of "
          f"{os.path.basename(args.file)} x up to {args.max_new_tokens} new tokens, greedy; model {folder}")
    print(f"weights: float32 {sum(p.numel() * p.element_size() for p in rts[32].model.parameters()) / 1e6:.0f} MB; "
          f"8-bit {rts[8].target.block_bytes / 1e6:.0f} MB of int8 rows in place of {rts[8].target.floatless_bytes / 1e6:.0f} MB of float32")
    print("| method | tok/s | vs the same method in float32 | identical to generate of its own model | identical to float32 generate |")
    print("|---|---|---|---|---|")
    out = []
    for name, st in stats.items():
        tps = st["tokens"] / st["seconds"]
        twin = name.replace("8-bit", "float32")
        own = "HF generate (8-bit)" if "8-bit" in name else "HF generate (float32)"
        same_own = sum(a == b for a, b in zip(st["outputs"], stats[own]["outputs"]))
        same_32 = sum(a == b for a, b in zip(st["outputs"], stats["HF generate (float32)"]["outputs"]))
        ratio = tps / (stats[twin]["tokens"] / stats[twin]["seconds"])
        print(f"| {name} | {tps:.1f} | {ratio:.2f}x | {same_own}/{len(prompts)} | {same_32}/{len(prompts)} |")
        out.append({"method": name, "tok_s": round(tps, 2), "vs_float32": round(ratio, 3), "identical_own_generate": same_own,
                    "identical_float32_generate": same_32})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "rows": out, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
