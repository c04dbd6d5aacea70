"""What training-time test steps cost on this machine: head training tokens/s at 1, 3 and 7 steps.

    python benchmarks/ttt_cost.py WORK_DIR/features-original-eagle3 [--steps 6]

Reads the first feature shard (EAGLE-3 shards also hold the last hidden state, so both kinds of
head are timed on the same tokens), trains a fresh head of each kind for a few optimizer steps
per setting, and prints tokens/s. Run it with the machine otherwise idle.
"""
from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import torch

from eagle2_core.loading import load_target
from eagle2_core.train.features import load_features
from eagle2_core.train.trainer import TrainConfig, feature_key, train_head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("features")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ttt", default="1,3,7")
    args = ap.parse_args()
    target = load_target(None, dtype="float32", device="cpu")
    shard = sorted(glob.glob(os.path.join(args.features, "*.safetensors")))[:1]
    tmp = tempfile.mkdtemp()
    os.symlink(shard[0], os.path.join(tmp, os.path.basename(shard[0])))
    print(f"{torch.get_num_threads()} threads; {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}")
    for arch in ("eagle2", "eagle3"):
        seqs = load_features(tmp, (feature_key(arch), "input_ids", "loss_mask", "top_probs", "top_ids"))
        for ttt in (int(x) for x in args.ttt.split(",")):
            cfg = TrainConfig(arch=arch, epochs=1, max_steps=args.steps, warmup_steps=1, ttt_steps=ttt, draft_vocab=16384)
            out = tempfile.mkdtemp()
            t0 = time.perf_counter()
            state = train_head(target.model, seqs, os.path.join(out, "h"), cfg, os.path.join(out, "w"), log=lambda m: None)
            print(f"{arch} ttt={ttt}: {state.tokens_seen / state.train_s:.0f} tokens/s "
                  f"({state.step} steps, {state.tokens_seen} tokens, {state.train_s:.1f} s; {time.perf_counter() - t0:.1f} s with set-up)")


if __name__ == "__main__":
    main()
