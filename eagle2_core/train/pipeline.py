"""`eagle2 train` as a library call: data -> (self-distillation) -> features -> head -> evaluation.

Every stage writes to a work folder and skips what is already there, so a run stopped by
Ctrl-C or a crash continues with `resume=True` where it stopped.
"""
from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..engine import Engine
from ..treesettings import TreeSettings
from ..events import GenerationSettings, Summary
from ..headfiles import build_head
from .data import ReadReport, first_user_prompts, read_conversations, render
from .distill import self_distill
from .features import extract_features, load_features
from .trainer import TrainConfig, feature_key, feature_layers_for, train_head


@dataclass
class TrainJob:
    data: list[str]
    out_dir: str
    work_dir: str
    self_distill: bool = True
    distill_prompts: int = 2000
    distill_max_new_tokens: int = 256
    distill_batch: int = 48
    distill_max_prompt_tokens: int = 256
    use_original: bool = True          # also train on the data's own assistant turns
    max_original_tokens: int | None = None  # extract at most this many tokens of them (None: all)
    features_only: bool = False        # stop after feature extraction (train later, or elsewhere)
    mix: dict[str, float] = field(default_factory=dict)  # source -> weight per epoch ("distill", "original"; default 1)
    feature_dtype: str = "bfloat16"    # how prefill-extracted features are stored (bfloat16 | float8: half the disk)
    max_len: int = 1024
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    seed: int = 0
    config: TrainConfig = field(default_factory=TrainConfig)


def _stage(log, name):
    log(f"== {name}")


def weighted(seqs: list, weight: float, rng: random.Random) -> list:
    """A source's sequences at `weight` per epoch: each whole unit repeats them all, the fraction
    adds a random subset (0 drops the source; 0.5 trains on half of it)."""
    if weight < 0:
        raise ValueError(f"a source weight must be >= 0, not {weight}")
    whole, frac = int(weight), weight - int(weight)
    return seqs * whole + rng.sample(seqs, round(frac * len(seqs)))


def held_out_eval(target_model, tokenizer, prompts: list[list[int]], max_new_tokens: int, tree: TreeSettings | None = None) -> Callable:
    """tau of the head being trained, measured with the real dynamic-tree decoder."""
    def evaluate(head) -> dict:
        # A copy in the target's dtype and device, as inference loads it: the trained head keeps
        # fp32 master weights, which a bf16 target's features would not match.
        head = build_head(head.spec, head.head_state_dict(), head.draft_vocab).bind(target_model).eval()
        dec = Engine(target_model, head, tokenizer, tree or TreeSettings())
        total = Summary()
        with torch.no_grad():
            for ids in prompts:
                _, s = dec.generate(ids, GenerationSettings(max_new_tokens=max_new_tokens))
                total.merge(s)
        return {"tau": round(total.tau, 3), "acceptance_by_depth": [round(a, 3) for a in total.acceptance_by_depth]}
    return evaluate


def run_training(target, job: TrainJob, resume: bool = False, log: Callable[[str], None] = print,
                 progress: Callable[[str, int, int, dict], None] | None = None) -> dict:
    os.makedirs(job.work_dir, exist_ok=True)
    t_start = time.time()
    model, tok = target.model, target.tokenizer
    if tok.chat_template is None:
        raise ValueError(f"{target.name} has no chat template; pass one with --chat-template")
    with open(os.path.join(job.work_dir, "job.json"), "w") as f:
        json.dump({**asdict(job), "model": target.name}, f, indent=2)

    _stage(log, "read data")
    conversations: list[list[dict]] = []
    for path in job.data:
        rep = ReadReport()
        convs = read_conversations(path, rep)
        log(f"{path}: {rep.records} records" + (f", {rep.skipped} skipped" if rep.skipped else "") + (", truncated tail ignored" if rep.truncated_tail else ""))
        conversations += convs
    if not conversations:
        raise ValueError("no usable training records in " + ", ".join(job.data))
    prompts = first_user_prompts(conversations)
    random.Random(job.seed).shuffle(prompts)
    # Held-out prompts come from the end, distillation prompts from the front: a larger
    # --distill-prompts on --resume extends the same list, and indices in distill.jsonl stay valid.
    eval_prompts = prompts[len(prompts) - job.eval_prompts :] if job.eval_prompts else []
    held_out = {json.dumps(p) for p in eval_prompts}
    random.Random(job.seed).shuffle(conversations)
    train_convs = [c for c in conversations if json.dumps((first_user_prompts([c]) or [None])[0]) not in held_out]
    eval_ids = []
    for p in eval_prompts:
        r = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
        eval_ids.append(list(r["input_ids"] if hasattr(r, "keys") else r))

    arch = job.config.arch
    # EAGLE-3 features are the fused inputs of three target layers; their shards also keep the
    # final hidden state, so one extraction serves both kinds of head.
    layers = feature_layers_for(arch, model.config)
    if layers:
        from ..eagle3 import MIN_TARGET_LAYERS, num_target_layers

        if num_target_layers(model.config) < MIN_TARGET_LAYERS:
            raise ValueError(f"{target.name} has {num_target_layers(model.config)} layers; an EAGLE-3 head needs at least {MIN_TARGET_LAYERS}")
    suffix = "-eagle3" if layers else ""
    feat_dir = os.path.join(job.work_dir, "features" + suffix)
    orig_dir = os.path.join(job.work_dir, "features-original" + suffix)
    if job.self_distill:
        _stage(log, "self-distillation (the target answers the prompts itself)")
        distill_prompts = prompts[: min(job.distill_prompts, len(prompts) - job.eval_prompts)]
        self_distill(model, tok, distill_prompts, os.path.join(job.work_dir, f"distill{suffix}.jsonl"), batch_size=job.distill_batch,
                     max_new_tokens=job.distill_max_new_tokens, max_prompt_tokens=job.distill_max_prompt_tokens, feature_dir=feat_dir,
                     progress=(lambda d, t: progress("distill", d, t, {})) if progress else None, layers=layers)
    if job.use_original:
        _stage(log, "feature extraction (the data's own assistant turns)")
        samples = []
        budget = job.max_original_tokens
        for c in train_convs:
            r = render(tok, c, job.max_len)
            if r and sum(r[1]):
                samples.append(r)
                if budget is not None:
                    budget -= len(r[0])
                    if budget <= 0:
                        break
        extract_features(model, samples, orig_dir, layers=layers, feature_dtype=job.feature_dtype,
                         progress=(lambda d, t: progress("features", d, t, {})) if progress else None)
    if job.features_only:
        log(f"features in {job.work_dir}; train with the same command without --features-only")
        return {"features_only": True, "work_dir": job.work_dir}

    _stage(log, "training")
    seqs = []
    keys = (feature_key(arch), "input_ids", "loss_mask", "top_probs", "top_ids")
    counts = {}
    for source, d in (("distill", feat_dir), ("original", orig_dir)):
        if os.path.isdir(d):
            part = weighted(load_features(d, keys), job.mix.get(source, 1.0), random.Random(job.seed))
            counts[source] = sum(len(s["input_ids"]) for s in part)
            seqs += part
    n_tokens = sum(counts.values())
    log(f"{len(seqs)} sequences, {n_tokens} tokens per epoch (" + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")
    meta = {"arch": arch, "target": target.name, "data": job.data, "self_distill": job.self_distill, "training_tokens": n_tokens,
            "tokens_by_source": counts, "mix": job.mix,
            "trained_with": "eagle2 train", "device": str(next(model.parameters()).device)}
    state = train_head(model, seqs, job.out_dir, job.config, os.path.join(job.work_dir, "train" + suffix), resume=resume,
                       eval_fn=held_out_eval(model, tok, eval_ids, job.eval_max_new_tokens), log=log,
                       progress=(lambda s, t, st: progress("train", s, t, st)) if progress else None, metadata=meta)
    result = {"steps": state.step, "epochs": state.epoch, "tokens_seen": state.tokens_seen, "train_s": round(state.train_s, 1),
              "best_tau": state.best_tau, "wall_s": round(time.time() - t_start, 1), "out_dir": job.out_dir}
    log(json.dumps(result))
    return result
