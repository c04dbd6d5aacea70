"""Head folders on disk: which format a folder holds, and loading it as a head of that kind.

This module knows both head kinds (`head.py`: the shared interface and EAGLE-1/2; `eagle3.py`:
EAGLE-3), so neither kind's module needs the other. Reading is safe: safetensors, or a
weights-only `torch.load`; a pickle that would run code is refused.
"""
from __future__ import annotations

import json
import os

import torch

from .eagle3 import Eagle3Spec, build_eagle3_head, check_eagle3_fits
from .head import DRAFT_VOCAB_FILE, METADATA_FILE, HeadMismatchError, HeadSpec, build_draft_head, check_head_fits

HEAD_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class HeadFileError(HeadMismatchError):
    """A head folder's file is missing a field, is not valid JSON, or its weights are unreadable."""


def read_json_file(path: str, what: str = "file") -> dict:
    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise HeadFileError(f"{path}: the {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise HeadFileError(f"{path}: the {what} is not UTF-8 text") from None
    if not isinstance(data, dict):
        raise HeadFileError(f"{path}: the {what} must be a JSON object, not {type(data).__name__}")
    return data


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """safetensors, or a weights-only `torch.load`: a pickle that would run code is refused, not run."""
    name = os.path.basename(path)
    if name.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise HeadFileError(f"{path}: the head's {name} is truncated or corrupt ({str(e).splitlines()[0][:80]})") from None
    import pickle

    for mmap in (True, False):  # mmap needs the zip format torch.save writes; older files load without it
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            break
        except pickle.UnpicklingError:
            raise HeadFileError(f"{path}: not a weights-only checkpoint: refusing to unpickle code "
                                "(convert it to model.safetensors where you trust its source)") from None
        except (RuntimeError, EOFError, OSError, ValueError) as e:
            if mmap and "mmap" in str(e):
                continue
            raise HeadFileError(f"{path}: the head's {name} is truncated or corrupt ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HeadFileError(f"{path}: holds no state dict of tensors; not an EAGLE head checkpoint")
    return sd


def is_eagle3(config: dict, keys, where: str = "draft head") -> bool:
    """Tell the formats apart by what the checkpoint holds, then by its config."""
    three = any(k.startswith("midlayer.") for k in keys) or "d2t" in keys
    two = any(k.startswith("layers.0.") for k in keys)
    if three and two:
        raise HeadMismatchError(f"{where}: the weights mix EAGLE-1/2 tensors (layers.0.*) with EAGLE-3 ones (midlayer.*, d2t); not a head of either format")
    if three or two:
        return three
    return "Eagle3" in " ".join(config.get("architectures") or []) or "draft_vocab_size" in config


def read_head_folder(folder: str) -> tuple[HeadSpec, dict[str, torch.Tensor], torch.Tensor | None, dict]:
    """Read config, weights, optional draft vocabulary and metadata, safely (no pickle execution)."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{folder}: no config.json; not an EAGLE draft head folder")
    config = read_json_file(cfg_path, "head's config.json")
    sd = None
    for name in HEAD_WEIGHTS:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            sd = read_weights(path)
            break
    if sd is None:
        raise FileNotFoundError(f"{folder}: no {' or '.join(HEAD_WEIGHTS)}")
    try:
        spec = Eagle3Spec.from_config_dict(config) if is_eagle3(config, sd.keys(), f"draft head {folder}") else HeadSpec.from_config_dict(config)
    except KeyError as e:
        raise HeadFileError(f"{cfg_path}: no {e.args[0]!r} field; not an EAGLE head config") from None
    except (TypeError, ValueError) as e:
        raise HeadFileError(f"{cfg_path}: a field has the wrong type ({e})") from None
    draft_vocab = None
    dv = os.path.join(folder, DRAFT_VOCAB_FILE)
    if os.path.isfile(dv):
        vocab = read_weights(dv)
        if "draft_vocab" not in vocab:
            raise HeadFileError(f"{dv}: no draft_vocab tensor")
        draft_vocab = vocab["draft_vocab"].long()
    meta = {}
    mp = os.path.join(folder, METADATA_FILE)
    if os.path.isfile(mp):
        meta = read_json_file(mp, METADATA_FILE)
    return spec, sd, draft_vocab, meta


def build_head(spec: HeadSpec, sd: dict[str, torch.Tensor], draft_vocab=None, where: str = "draft head"):
    """Instantiate a head of the spec's kind and load weights, naming any missing, unexpected or
    misshapen key (an EAGLE-3 head's draft vocabulary is in its weights, `d2t`)."""
    if isinstance(spec, Eagle3Spec):
        return build_eagle3_head(spec, sd, where)
    return build_draft_head(spec, sd, draft_vocab, where)


def check_fits(spec: HeadSpec, target_model, where: str = "draft head") -> None:
    """Either kind of head against a target: hidden size, vocabulary (and EAGLE-3's layers)."""
    (check_eagle3_fits if isinstance(spec, Eagle3Spec) else check_head_fits)(spec, target_model, where)


def load_head_folder(folder: str, target_model=None):
    spec, sd, draft_vocab, meta = read_head_folder(folder)
    if target_model is not None:
        check_fits(spec, target_model, where=f"draft head {folder}")
    head = build_head(spec, sd, draft_vocab, where=f"draft head {folder}")
    head.metadata = meta
    if target_model is not None:
        head.bind(target_model)
    return head
