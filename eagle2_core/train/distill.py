"""Self-distillation: the target answers the training prompts itself, in batches.

A head learns to predict the *target's* continuations; training on the target's own answers
puts the head on the contexts it meets at inference (EAGLE-3 trains on regenerated data for the
same reason). Greedy answers also match the temperature-0 use that benchmarks measure.
The loop is a plain batched KV-cache loop with left padding: roughly twice as fast on a CPU as
`generate` with the same batch, and the output need not be bit-exact (it is training data).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from .. import atomic
from ..target import capture_layer_inputs, fuse, model_eos_ids
from .data import _ids
from .parallel import world


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], eos: set[int], max_new_tokens: int, pad_id: int, topk: int = 32,
                   layers: tuple[int, ...] | None = None):
    """Greedy answers for a batch of prompts, plus the features training needs, captured on the way.

    The target computes its final hidden state and next-token distribution at every position
    while generating anyway; keeping them (bf16 features, top-k probabilities) makes a separate
    feature-extraction pass over self-distilled data unnecessary, halving its cost.
    Returns, per prompt: answer ids, and a feature record for prompt + answer (the final token,
    whose feature was never computed, is left out of the record). With `layers`, the records
    also hold the fused inputs of those layers (`fused`, the EAGLE-3 feature).
    """
    from transformers import DynamicCache

    body, lm_head = model.get_decoder(), model.get_output_embeddings()
    dev = lm_head.weight.device
    width = max(len(p) for p in prompts)
    B = len(prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=dev)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    cache = DynamicCache(config=model.config)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with capture_layer_inputs(body, layers) as seen:
        h = body(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
    f = fuse(seen, layers) if layers else None
    # Row by row: the whole batch's prompt logits at once would be B x width x vocab floats
    # (40 GB for 256 prompts of 256 tokens over Qwen2's 152k vocabulary).
    pv, pi = map(torch.stack, zip(*(torch.topk(torch.softmax(lm_head(row).float(), dim=-1), topk, dim=-1) for row in h)))
    feats = [[h[b, width - len(p):]] for b, p in enumerate(prompts)]
    fused = [[f[b, width - len(p):]] for b, p in enumerate(prompts)] if layers else None
    tops = [[(pv[b, width - len(p):], pi[b, width - len(p):])] for b, p in enumerate(prompts)]
    next_tok = pi[:, -1, 0]
    answers = [[] for _ in prompts]
    eos_t = torch.tensor(sorted(eos), device=dev)
    last_pos = pos[:, -1]
    active = torch.arange(B, device=dev)  # rows of the running batch, as indices into prompts
    for _ in range(max_new_tokens):
        for row, t in zip(active.tolist(), next_tok.tolist()):
            answers[row].append(t)
        finished = torch.isin(next_tok, eos_t)
        if bool(finished.all()) or len(answers[int(active[0])]) >= max_new_tokens:
            break
        if bool(finished.any()):
            # Drop finished rows from the batch and its cache: answers end at very different
            # lengths, and computing padding for them costs most of the time otherwise.
            keep = torch.nonzero(~finished).flatten()
            cache.batch_select_indices(keep)
            active, attn, next_tok, last_pos = active[keep], attn[keep], next_tok[keep], last_pos[keep]
        attn = torch.cat([attn, torch.ones(len(active), 1, dtype=attn.dtype, device=dev)], dim=1)
        last_pos = last_pos + 1
        with capture_layer_inputs(body, layers) as seen:
            h = body(input_ids=next_tok[:, None], attention_mask=attn, position_ids=last_pos[:, None], cache=cache, use_cache=True).last_hidden_state
        f = fuse(seen, layers) if layers else None
        probs = torch.softmax(lm_head(h[:, -1]).float(), dim=-1)
        pv, pi = torch.topk(probs, topk, dim=-1)
        for j, row in enumerate(active.tolist()):  # the token fed this step belongs to row's answer
            feats[row].append(h[j, -1:])
            if layers:
                fused[row].append(f[j, -1:])
            tops[row].append((pv[j : j + 1], pi[j : j + 1]))
        next_tok = pi[:, 0]
    records = []
    for b, p in enumerate(prompts):
        hid = torch.cat(feats[b])
        n = hid.shape[0]
        seq = (p + answers[b])[:n]
        records.append({
            "hidden": hid.to(torch.bfloat16).cpu(), "input_ids": torch.tensor(seq),
            "loss_mask": torch.tensor([0] * len(p) + [1] * (n - len(p)), dtype=torch.bool),
            "top_probs": torch.cat([v for v, _ in tops[b]]).half().cpu(), "top_ids": torch.cat([i for _, i in tops[b]]).int().cpu(),
            **({"fused": torch.cat(fused[b]).to(torch.bfloat16).cpu()} if layers else {}),
        })
    return answers, records


def self_distill(model, tokenizer, prompts: list[list[dict]], out_path: str, batch_size: int = 32, max_new_tokens: int = 256,
                 max_prompt_tokens: int = 384, chat_template=None, progress: Callable[[int, int], None] | None = None,
                 feature_dir: str | None = None, layers: tuple[int, ...] | None = None) -> int:
    """Append {"idx", "messages"} lines to out_path for every prompt not already there; resumable.

    With `feature_dir`, each batch's features are written there as one safetensors shard too.
    """
    import glob

    w = world(model.get_output_embeddings().weight.device)
    done: set[int] = set()
    # Under a distributed launcher each process answers every size-th batch into a file of its
    # own (OUT.rankN beside OUT); all of them count as done on resume.
    for path in [p for p in [out_path] if os.path.exists(p)] + sorted(glob.glob(out_path + ".rank*")):
        with open(path) as f:
            for line in f:
                try:
                    done.add(json.loads(line)["idx"])
                except (json.JSONDecodeError, KeyError):
                    pass  # a line cut by a kill; its prompt is redone
    eos = model_eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    todo = []
    for k, msgs in enumerate(prompts):
        if k in done:
            continue
        ids = _ids(tokenizer, msgs, True, chat_template)
        if len(ids) <= max_prompt_tokens:
            todo.append((k, ids))
    todo.sort(key=lambda x: len(x[1]))  # similar lengths per batch waste less padding
    written = 0
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path if w.main else f"{out_path}.rank{w.rank}", "a") as f:
        for b in w.share(list(range(0, len(todo), batch_size))):
            batch = todo[b : b + batch_size]
            answers, records = generate_batch(model, [ids for _, ids in batch], eos, max_new_tokens, pad, layers=layers)
            if feature_dir:
                write_shard(records, os.path.join(feature_dir, f"distill-{batch[0][0]:06d}.safetensors"))
            for (k, _), ans in zip(batch, answers):
                text = tokenizer.decode([t for t in ans if t not in eos], skip_special_tokens=True)
                f.write(json.dumps({"idx": k, "messages": prompts[k] + [{"role": "assistant", "content": text}]}) + "\n")
                written += 1
            f.flush()
            if progress:
                progress(len(done) + written * w.size, len(done) + len(todo))
    w.barrier()
    return written


def write_shard(records: list[dict], path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys = ("hidden", "input_ids", "loss_mask", "top_probs", "top_ids") + (("fused",) if "fused" in records[0] else ())
    data = {k: torch.cat([r[k] for r in records]) for k in keys}
    data["lengths"] = torch.tensor([len(r["input_ids"]) for r in records])
    atomic.replace_with(path, lambda tmp: save_file(data, tmp))
