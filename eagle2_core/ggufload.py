"""A GGUF target built from its own file, one tensor at a time, never as a whole float32 model.

transformers' `from_pretrained(gguf_file=...)` dequantizes every tensor to float32 before the model
exists (four bytes a parameter at its peak). Here the model's skeleton is made on the meta device,
and each tensor of the file then becomes its parameter: the linear weights and the embedding of a
block type (ggufblocks.BLOCK_SIZES) as views of the file's own blocks in a memory map (held only as
blocks, rowgemm.make_floatless), everything else dequantized by gguf-py and put through
transformers' own per-architecture transform (its TensorProcessor), so that every value is
bitwise what `from_pretrained` holds. Config and tokenizer come from transformers' metadata
conversions (fed by one parse of the header of ours, ggufmeta.py, in place of its slow readers)
and are kept in eagle2's cache; weights never are.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import torch

from . import atomic
from .ggufblocks import BLOCK_SIZES, BlockWeight, tensor_infos

# How the weights of block types are held: only as blocks ("blocks"), as float32 with the blocks
# beside them ("keep", EAGLE2_BLOCKS=keep), or dequantized into the model's dtype ("floats").
MODES = ("blocks", "keep", "floats")


def meta_folder(folder: str, gguf: str, cache: str) -> str:
    """Where the file's config and tokenizer are cached under the cache folder `cache`
    (loading.cache_dir): keyed by the file's path, size and time."""
    import hashlib

    path = os.path.join(folder, gguf)
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return os.path.join(cache, "gguf-meta", f"{os.path.splitext(gguf)[0]}-{key}")


GGUF_CONFIG = "gguf_config.json"  # the config keys transformers read from the file, as it read them


def read_metadata(folder: str, gguf: str, cache: str):
    """(config, the file's config keys as transformers parsed them, fast tokenizer), the config
    named by the file's folder as from_pretrained names it."""
    config, parsed, tok = _read_metadata(folder, gguf, cache)
    config.name_or_path = folder
    return config, parsed, tok


def _read_metadata(folder: str, gguf: str, cache: str):
    """The first load parses the metadata (transformers' conversions, fed by one parse of ours: no
    tensor is read) and caches the config and the tokenizer; later loads read the cache."""
    from transformers import AutoConfig, AutoTokenizer

    cached = meta_folder(folder, gguf, cache)
    if os.path.isfile(os.path.join(cached, GGUF_CONFIG)):
        try:
            with open(os.path.join(cached, GGUF_CONFIG)) as f:
                parsed = json.load(f)
            return AutoConfig.from_pretrained(cached), parsed, AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # a damaged cache entry: read the file again
    with _served(os.path.join(folder, gguf)):
        parsed = parse_config(os.path.join(folder, gguf))
        with quiet_gguf():
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    tmp = atomic.temp_sibling(cached)
    published = False
    try:
        atomic.clean_stale(cached)
        os.makedirs(tmp)
        _write_meta(tmp, parsed, tok)
        atomic.publish_dir(tmp, cached)  # two first runs: the second finds the first's folder
        published = os.path.isfile(os.path.join(cached, GGUF_CONFIG))
    except OSError:  # no cache (cache_dir warned) or a full disk: this run reads a private copy
        shutil.rmtree(tmp, ignore_errors=True)
    if published:
        return AutoConfig.from_pretrained(cached), parsed, tok
    return config_of(parsed), parsed, tok


def _served(path: str):
    """transformers' GGUF readers answered from one parse of ours (ggufmeta: the same values, read
    in a fraction of their time); a file that parse does not take is read by them as before."""
    import contextlib

    from . import ggufmeta

    try:
        meta = ggufmeta.parse(path)
    except ggufmeta.Unusual:
        return contextlib.nullcontext()
    return ggufmeta.served(meta)


def parse_config(path: str) -> dict:
    """The config keys of a GGUF as transformers reads them (its metadata reader, no tensor read)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with quiet_gguf():
        return load_gguf_checkpoint(path, return_tensors=False)["config"]


def config_of(parsed: dict):
    """The config AutoConfig makes of a GGUF's keys (read through a config.json of them, as a cached
    load reads them, so that both agree)."""
    from transformers import AutoConfig

    private = tempfile.mkdtemp(prefix="eagle2-gguf-config-")
    try:
        with open(os.path.join(private, "config.json"), "w") as f:
            json.dump(parsed, f)
        return AutoConfig.from_pretrained(private)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _write_meta(where: str, parsed: dict, tok) -> None:
    """The cache entry: the keys as AutoConfig reads a config.json, the tokenizer, and the keys
    again under their own name, written last so that their presence marks the folder whole."""
    with open(os.path.join(where, "config.json"), "w") as f:
        json.dump(parsed, f, indent=2)
    tok.save_pretrained(where)
    with open(os.path.join(where, GGUF_CONFIG), "w") as f:
        json.dump(parsed, f, indent=2)


class quiet_gguf:
    """transformers' GGUF readers log each key they did not map (hundreds of lines at info level)
    and draw a tqdm bar; neither says anything to a user of eagle2 (EAGLE2_DEBUG keeps them)."""

    def __enter__(self):
        from transformers.utils import logging

        self.level = None
        if not os.environ.get("EAGLE2_DEBUG"):
            self.level = logging.get_verbosity()
            logging.set_verbosity_error()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging

        if self.level is not None:
            logging.set_verbosity(self.level)
        return False


class _one_name_map:
    """transformers' name mapping recurses into every submodule and builds gguf-py's table of
    tensor names anew at each (most of a GGUF load's time on SmolLM2); the table depends only on the
    architecture and the layer count, so inside the block it is built once per pair."""

    def __enter__(self):
        import functools

        import gguf

        self.real = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(self.real)
        return self

    def __exit__(self, *exc):
        import gguf

        gguf.get_tensor_name_map = self.real
        return False


class TensorFile:
    """A GGUF file's tensors as numpy arrays over one copy-on-write memory map of it, shaped as
    gguf-py's reader shapes them (what transformers dequantizes): nothing is read until used."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            self.arch, tensors, start = tensor_infos(f)
        # mode "c": pages stay the page cache's until written, and a write never reaches the file
        self.map = np.memmap(path, dtype=np.uint8, mode="c") if size else np.zeros(0, np.uint8)
        self.tensors = {}
        for name, dims, qtype, offset in tensors:
            n = int(np.prod(dims)) if dims else 1
            block, nbytes = _quant_size(qtype)
            begin, length = start + offset, n * nbytes // block
            if begin + length > size:
                raise ValueError(f"tensor {name} is cut short ({size - begin} of {length} bytes in the file)")
            self.tensors[name] = (tuple(reversed(dims)), qtype, begin, length)

    def copied(self, name: str) -> np.ndarray:
        """The tensor as `raw` gives it, but read into memory of its own rather than through the map:
        for a tensor only copied from (llama's permuted q/k rows), whose mapped pages would otherwise
        stay counted to the process beside the copy."""
        shape, qtype, begin, length = self.tensors[name]
        out = np.empty(length, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(begin)
            if f.readinto(out) != length:
                raise ValueError(f"tensor {name} is cut short")
        return self._shaped(out, shape, qtype)

    def raw(self, name: str) -> np.ndarray:
        """The tensor as gguf-py's reader gives it: float types as floats, block types as uint8
        rows of blocks ([..., bytes a row])."""
        shape, qtype, begin, length = self.tensors[name]
        return self._shaped(self.map[begin: begin + length], shape, qtype)

    @staticmethod
    def _shaped(data: np.ndarray, shape: tuple, qtype: int) -> np.ndarray:
        item = _ITEMS.get(qtype)
        if item is not None:
            return data.view(item).reshape(shape)
        block, nbytes = _quant_size(qtype)
        return data.reshape(*shape[:-1], shape[-1] // block * nbytes)


_ITEMS = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def _quant_size(qtype: int) -> tuple[int, int]:
    if qtype in BLOCK_SIZES:
        return BLOCK_SIZES[qtype][1:]
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown GGML type {qtype}") from None


def _row_order(processor, name: str, rows: int, mapping: dict) -> np.ndarray | None:
    """The rows of a weight in the order transformers' processor leaves them, found by passing it
    row numbers in place of the weights: None where it keeps them as they are. ValueError where it
    does anything but move whole rows (a transpose, a value changed), which blocks cannot follow."""
    probe = np.stack([np.arange(rows, dtype=np.int64) * 2, np.arange(rows, dtype=np.int64) * 2 + 1], axis=1)
    try:
        out = np.asarray(processor.process(weights=probe, name=name, tensor_key_mapping=mapping,
                                           parsed_parameters={"tensors": {}}).weights)
    except Exception as e:  # a processor that reshapes by the config's sizes fails on the probe
        raise ValueError(f"{name}: not a row permutation ({e})") from None
    if out.shape != probe.shape or out.dtype != probe.dtype or not np.array_equal(out[:, 1], out[:, 0] + 1):
        raise ValueError(f"{name}: not a row permutation")
    order = out[:, 0] // 2
    if not np.array_equal(np.sort(order), np.arange(rows)) or (out[:, 0] % 2).any():
        raise ValueError(f"{name}: not a row permutation")
    return None if np.array_equal(order, np.arange(rows)) else order


# transformers' processors that only transform the tensor they are given; the others also place
# tensors of their own (MoE experts, GPT-2's lm_head), so every tensor of the file goes through them
PURE_PROCESSORS = {"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor",
                   "MambaTensorProcessor", "Lfm2TensorProcessor", "BloomTensorProcessor", "T5TensorProcessor"}


def floatless_kind(mod):
    """The Floatless class a module turns into once its weight is held as blocks only (the
    conversion is loading.drop_floats'), or None for a kind that cannot be: only plain linears and
    embeddings without max_norm, subclasses of the embedding included (their forward is checked
    when converted)."""
    from . import rowgemm

    if type(mod) is torch.nn.Linear:
        return rowgemm.FloatlessLinear
    if isinstance(mod, torch.nn.Embedding) and not isinstance(mod, rowgemm.FloatlessEmbedding) and mod.max_norm is None:
        return rowgemm.floatless_embedding_kind(type(mod))
    return None


def build_model(path: str, config, parsed: dict, dtype: torch.dtype, mode: str, device: str = "cpu",
                attn_implementation: str = "sdpa"):
    """The model of `config` with every tensor of the GGUF at `path` in place, as transformers'
    `from_pretrained(gguf_file=..., dtype=dtype)` would hold it (bitwise), and the bytes of the
    blocks the weights are held as (mode "blocks" and "keep"; 0 for "floats")."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from . import rowgemm

    assert mode in MODES
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    tensors = TensorFile(path)
    processor = TENSOR_PROCESSORS.get(tensors.arch, TensorProcessor)(config=parsed)
    with quiet_gguf(), _one_name_map():
        mapping = get_gguf_hf_weights_map(model, processor)
    owners = {}  # parameter or buffer name -> (module, attribute)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr in list(mod._parameters) + list(mod._buffers):
            owners[f"{mod_name}.{attr}" if mod_name else attr] = (mod, attr)
    new: dict[int, torch.Tensor] = {}  # id of the meta tensor -> its loaded value (tied ones share it)
    extra: dict[str, torch.Tensor] = {}  # tensors a processor placed itself (MoE experts)
    block_bytes = 0
    side = type(processor).__name__ not in PURE_PROCESSORS
    for gname in tensors.tensors:
        hf = mapping.get(gname)
        if hf is None and not side:
            continue  # transformers would not load it either (rope_freqs, names it does not map)
        shape, qtype, _, _ = tensors.tensors[gname]
        owner = owners.get(hf)
        old = getattr(owner[0], owner[1]) if owner else None
        if old is not None and id(old) in new:
            continue
        bw = None
        if (mode != "floats" and dtype == torch.float32 and qtype in BLOCK_SIZES and owner is not None and owner[1] == "weight"
                and isinstance(old, torch.nn.Parameter) and len(shape) == 2 and tuple(old.shape) == shape
                and floatless_kind(owner[0]) is not None):
            try:
                order = _row_order(processor, gname, shape[0], mapping)
                if order is None:
                    blocks = torch.from_numpy(tensors.raw(gname))
                else:
                    blocks = torch.from_numpy(np.ascontiguousarray(tensors.copied(gname)[order]))
                bw = BlockWeight(blocks, qtype, BLOCK_SIZES[qtype][0], shape[1], mapped=order is None)
            except ValueError:  # the processor does more than move rows: dequantized below
                bw = None
        if bw is not None and mode == "blocks":
            value = rowgemm.stand_in(*shape)
        else:
            # exactly transformers' steps: gguf-py's float32, its processor, a copy, the dtype
            parsed_parameters = {"tensors": {}}
            weights = gguf.dequantize(tensors.raw(gname), gguf.GGMLQuantizationType(qtype))
            result = processor.process(weights=weights, name=gname, tensor_key_mapping=mapping,
                                       parsed_parameters=parsed_parameters)
            extra.update({k: v.to(dtype) for k, v in parsed_parameters["tensors"].items()})
            if result.name is None or result.name not in mapping or owner is None:
                continue
            value = torch.from_numpy(np.copy(result.weights)).to(dtype)
            del weights, result
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"tensor {gname} is {tuple(value.shape)} where the model's {hf} is {tuple(old.shape)}")
        value = value.to(device)
        if isinstance(old, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=False)
        new[id(old)] = value
        if bw is not None:
            (rowgemm.make_floatless if mode == "blocks" else rowgemm.attach_blocks)(value, bw)
            block_bytes += bw.nbytes
    for k, v in extra.items():
        if k in owners:
            new[id(getattr(*owners[k]))] = torch.nn.Parameter(v.to(device), requires_grad=False)
    _install(model, new, device)
    return model, block_bytes


def _install(model, new: dict, device: str) -> None:
    """Put the loaded tensors in place of the meta ones (tied parameters stay one), give what the
    file lacks a place on the device, then let the model's own initialization fill what is not
    loaded: the non-persistent buffers (rotary frequencies, Gemma's embedding scale) computed as
    `from_pretrained` computes them, and a parameter the file lacks drawn as it draws one."""
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for attr, t in list(table.items()):
                if t is None:
                    continue
                if id(t) in new:
                    value = new[id(t)]
                    value._is_hf_initialized = True
                elif t.device.type == "meta":
                    if id(t) not in made:
                        empty = torch.empty_like(t, device=device)
                        made[id(t)] = torch.nn.Parameter(empty, requires_grad=False) if isinstance(t, torch.nn.Parameter) else empty
                    value = made[id(t)]
                else:
                    continue
                table[attr] = value
    with torch.no_grad():
        model.initialize_weights()
