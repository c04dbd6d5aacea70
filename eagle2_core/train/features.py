"""Feature extraction: run the frozen target once over the training data and cache what the head needs.

Per token we keep the target's last hidden state after its final norm (the EAGLE-1/2 feature,
bf16), with `layers` also the fused input of those layers (the EAGLE-3 feature, bf16, key
`fused`), and its top-k next-token probabilities (fp16 values, int32 ids). One pass serves both
kinds of head, so the two can be compared on exactly the same data. The top-32 hold nearly all
of the probability mass on SmolLM2 (docs/benchmarks.md), so the distillation loss never touches the full lm_head
during training, which was the dominant cost on a CPU. Shards are safetensors, written one at a
time, so an interrupted extraction resumes at the next shard.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from .. import atomic
from ..target import TargetRunner, capture_layer_inputs, fuse
from .parallel import world


FEATURE_DTYPES = ("bfloat16", "float8")


def pack(x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A feature matrix [T, F] as stored: bf16, or fp8 (e4m3) with one fp32 scale per row
    (row absmax / 448), half the bytes. Measured on SmolLM2 (docs/training.md): neither changes
    the shipped head's top-1 agreement with the target."""
    if dtype == "bfloat16":
        return {"": x.to(torch.bfloat16)}
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return {"": (x.float() / scale).to(torch.float8_e4m3fn), "_scale": scale}


def unpack(d: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    x = d[key]
    if key + "_scale" in d:
        return (x.float() * d[key + "_scale"]).to(torch.bfloat16)
    return x


@torch.no_grad()
def extract_features(model, samples: list[tuple[list[int], list[int]]], out_dir: str, shard_tokens: int = 65536, topk: int = 32,
                     progress: Callable[[int, int], None] | None = None, layers: tuple[int, ...] | None = None,
                     feature_dtype: str = "bfloat16") -> int:
    """Write shards `features-00000.safetensors`...; returns the number of shards. Resumable.
    `feature_dtype`: how features are stored (FEATURE_DTYPES; `pack`)."""
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)}, not {feature_dtype!r}")
    os.makedirs(out_dir, exist_ok=True)
    keep = torch.bfloat16 if feature_dtype == "bfloat16" else torch.float32  # what a shard holds until `pack`
    runner = TargetRunner(model)
    # Group samples into shards deterministically, so a resumed run skips exactly the shards done.
    shards, cur, n = [], [], 0
    for s in samples:
        cur.append(s)
        n += len(s[0])
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    total = len(shards)
    w = world(runner.device)  # under a distributed launcher each process extracts every size-th shard
    for k, shard in enumerate(shards):
        path = os.path.join(out_dir, f"features-{k:05d}.safetensors")
        if k % w.size != w.rank:
            continue
        mark = shard_fingerprint(shard) + ("" if feature_dtype == "bfloat16" else f"-{feature_dtype}")
        if os.path.exists(path) and shard_holds(path, shard, mark):
            if progress:
                progress(k + 1, total)
            continue
        # Missing, or holding other samples (a run with more --original-tokens reshapes the last
        # shard; another data file or seed changes them all): extract it (again).
        hid, fused, ids, mask, pv, pi, lens = [], [], [], [], [], [], []
        for seq, m in shard:
            x = torch.tensor(seq, device=runner.device)
            with capture_layer_inputs(runner.body, layers) as seen:
                out = runner.body(input_ids=x[None], use_cache=False)
            h = out.last_hidden_state[0]
            if layers:
                fused.append(fuse(seen, layers)[0].to(keep).cpu())
            probs = torch.softmax(runner.logits(h), dim=-1)
            v, i = torch.topk(probs, topk, dim=-1)
            hid.append(h.to(keep).cpu())
            pv.append(v.half().cpu())
            pi.append(i.int().cpu())
            ids.append(x.cpu())
            mask.append(torch.tensor(m, dtype=torch.bool))
            lens.append(len(seq))
        record = {"input_ids": torch.cat(ids), "loss_mask": torch.cat(mask),
                  "top_probs": torch.cat(pv), "top_ids": torch.cat(pi), "lengths": torch.tensor(lens)}
        record.update({"hidden" + k: v for k, v in pack(torch.cat(hid), feature_dtype).items()})
        if layers:
            record.update({"fused" + k: v for k, v in pack(torch.cat(fused), feature_dtype).items()})
        meta = {"layers": json.dumps(list(layers or [])), "fingerprint": mark}
        atomic.replace_with(path, lambda tmp: save_file(record, tmp, metadata=meta))
        if progress:
            progress(k + 1, total)
    w.barrier()
    if not w.main:
        return total
    with open(os.path.join(out_dir, "features.json"), "w") as f:
        json.dump({"shards": total, "topk": topk, "tokens": sum(len(s[0]) for s in samples), "layers": list(layers or [])}, f)
    return total


def shard_fingerprint(shard: list[tuple[list[int], list[int]]]) -> str:
    """What a shard holds, as a hash of its samples' tokens and loss masks."""
    h = hashlib.sha1()
    for seq, mask in shard:
        h.update(json.dumps([seq, mask]).encode())
    return h.hexdigest()[:16]


def shard_holds(path: str, shard, mark: str) -> bool:
    """Whether the shard file at `path` holds exactly these samples (shards written before
    fingerprints existed are matched by their sequence lengths)."""
    meta = shard_metadata(path)
    if "fingerprint" in meta:
        return meta["fingerprint"] == mark
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return f.get_tensor("lengths").tolist() == [len(s[0]) for s in shard]
    except Exception:  # noqa: BLE001
        return False


def shard_metadata(path: str) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001 - a torn or foreign file is re-extracted
        return {}


def load_features(out_dir: str, keys: tuple[str, ...] = ("hidden", "input_ids", "loss_mask", "top_probs", "top_ids")) -> list[dict[str, torch.Tensor]]:
    """All shards' sequences as a list of dicts with `keys` (`fused` for EAGLE-3 heads, whose
    shards must have been extracted with their layers; `hidden` can then be left out)."""
    seqs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))):
        d = load_file(path)
        d.update({k: unpack(d, k) for k in keys if k in d and k + "_scale" in d})  # fp8 shards come back as bf16
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} in these features (extracted for another kind of head); use a new --work-dir")
        start = 0
        for n in d["lengths"].tolist():
            seqs.append({k: d[k][start : start + n] for k in keys})
            start += n
    return seqs
