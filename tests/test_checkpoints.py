"""Draft-head checkpoints in the published EAGLE-1/2 format: keys, config fields, safety, hub path."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.head import DraftHead, HeadMismatchError, HeadSpec
from eagle2_core.headfiles import load_head_folder
from eagle2_core.loading import HUB_HEAD_FILES, LoadedTarget, LoadError, load_draft_head

VOCAB, HIDDEN, INTER, HEADS, KV = 12, 32, 64, 4, 2

# config.json of yuhuili/EAGLE-LLaMA3-Instruct-8B, field for field (bias false, no head_dim)
LLAMA3_8B_HEAD_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256,
}
# the tensors of its pytorch_model.bin (embed_tokens.weight is in the file; we ignore it)
LLAMA3_8B_HEAD_SHAPES = {
    "fc.weight": (4096, 8192),
    "layers.0.self_attn.q_proj.weight": (4096, 4096),
    "layers.0.self_attn.k_proj.weight": (1024, 4096),
    "layers.0.self_attn.v_proj.weight": (1024, 4096),
    "layers.0.self_attn.o_proj.weight": (4096, 4096),
    "layers.0.mlp.gate_proj.weight": (14336, 4096),
    "layers.0.mlp.up_proj.weight": (14336, 4096),
    "layers.0.mlp.down_proj.weight": (4096, 14336),
    "layers.0.post_attention_layernorm.weight": (4096,),
}


def test_published_llama3_8b_head_shapes_on_meta():
    spec = HeadSpec.from_config_dict(LLAMA3_8B_HEAD_CONFIG)
    assert (spec.hidden_size, spec.vocab_size, spec.bias, spec.rope_theta, spec.rms_norm_eps) == (4096, 128256, False, 500000.0, 1e-5)
    assert spec.max_position_embeddings == 8192 and spec.rope_scaling is None
    with torch.device("meta"):
        head = DraftHead(spec)
    shapes = {k: tuple(v.shape) for k, v in head.head_state_dict().items()}
    assert shapes == LLAMA3_8B_HEAD_SHAPES  # exactly these keys, no input_layernorm, no fc.bias
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)


def test_vicuna_style_config_without_bias_key_has_fc_bias():
    """EAGLE-Vicuna configs have no `bias` field; the reference code then uses a biased fc."""
    cfg = {k: v for k, v in LLAMA3_8B_HEAD_CONFIG.items() if k != "bias"}
    cfg.update(hidden_size=4096, intermediate_size=11008, num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0)
    spec = HeadSpec.from_config_dict(cfg)
    assert spec.bias is True
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DraftHead(spec).head_state_dict().items()}
    assert shapes["fc.bias"] == (4096,) and shapes["layers.0.self_attn.k_proj.weight"] == (4096, 4096)
    assert shapes["layers.0.mlp.down_proj.weight"] == (4096, 11008)


# -- tiny heads written by hand in the published format -----------------------------------------

def published_tensors(bias: bool, embed: bool, seed: int = 0, hidden: int = HIDDEN, inter: int = INTER, vocab: int = VOCAB) -> dict:
    g = torch.Generator().manual_seed(seed)
    kvd = hidden // HEADS * KV
    shapes = {
        "fc.weight": (hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": (hidden, hidden),
        "layers.0.self_attn.k_proj.weight": (kvd, hidden),
        "layers.0.self_attn.v_proj.weight": (kvd, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "layers.0.mlp.gate_proj.weight": (inter, hidden),
        "layers.0.mlp.up_proj.weight": (inter, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inter),
        "layers.0.post_attention_layernorm.weight": (hidden,),
    }
    if bias:
        shapes["fc.bias"] = (hidden,)
    if embed:
        shapes["embed_tokens.weight"] = (vocab, hidden)
    return {k: (torch.randn(s, generator=g) * 0.1).to(torch.float16) for k, s in shapes.items()}


def write_published_head(folder: str, fmt: str, bias: bool = False, embed: bool = True, bias_key: bool = True, **dims) -> dict:
    os.makedirs(folder, exist_ok=True)
    hidden, inter, vocab = dims.get("hidden", HIDDEN), dims.get("inter", INTER), dims.get("vocab", VOCAB)
    cfg = dict(LLAMA3_8B_HEAD_CONFIG, hidden_size=hidden, intermediate_size=inter, num_attention_heads=HEADS,
               num_key_value_heads=KV, vocab_size=vocab, max_position_embeddings=64, bias=bias)
    if not bias_key:
        del cfg["bias"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = published_tensors(bias, embed, hidden=hidden, inter=inter, vocab=vocab)
    if fmt == "bin":
        torch.save(sd, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(sd, os.path.join(folder, "model.safetensors"))
    return sd


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm("llama", vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=64)


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("bias,embed", [(False, True), (True, False), (True, True), (False, False)])
def test_published_format_loads(tmp_path, target, fmt, bias, embed):
    folder = str(tmp_path / "head")
    sd = write_published_head(folder, fmt, bias=bias, embed=embed)
    head = load_head_folder(folder, target)
    own = head.head_state_dict()
    assert set(own) == set(sd) - {"embed_tokens.weight"}
    for k, v in own.items():
        assert torch.equal(v, sd[k].float()), k
    assert (head.fc.bias is not None) == bias
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert head.embed is target.get_input_embeddings()  # shared with the target, never copied
    assert head.draft_lm_head.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    # and it decodes losslessly
    ids = [3, 1, 4, 1, 5]
    out, _ = Engine(target, head, tree=TreeSettings(total_tokens=8, depth=3, top_k=3)).generate(
        ids, GenerationSettings(max_new_tokens=12, eos_token_ids=()))
    ref = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=12,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert out == ref


def test_missing_bias_key_means_biased_fc(tmp_path, target):
    folder = str(tmp_path / "vicuna_style")
    write_published_head(folder, "bin", bias=True, bias_key=False)
    assert load_head_folder(folder, target).fc.bias is not None
    folder2 = str(tmp_path / "vicuna_style_nobias_tensor")
    write_published_head(folder2, "bin", bias=False, bias_key=False)  # config implies bias, file lacks it
    with pytest.raises(HeadMismatchError, match=r"missing tensors \['fc.bias'\]"):
        load_head_folder(folder2, target)


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_mismatched_heads_fail_clearly(tmp_path, target, fmt):
    folder = str(tmp_path / "wrong_hidden")
    write_published_head(folder, fmt, hidden=48)
    with pytest.raises(HeadMismatchError, match=r"hidden_size 48 does not match the target's 32.*another model"):
        load_head_folder(folder, target)
    folder = str(tmp_path / "wrong_vocab")
    write_published_head(folder, fmt, vocab=20)
    with pytest.raises(HeadMismatchError, match=r"vocab_size 20 does not match the target's lm_head rows 12"):
        load_head_folder(folder, target)
    # tensors that disagree with their own config.json are named
    folder = str(tmp_path / "wrong_tensor")
    sd = write_published_head(folder, fmt)
    sd["layers.0.mlp.up_proj.weight"] = torch.zeros(80, HIDDEN, dtype=torch.float16)
    sd["embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN, dtype=torch.float16)
    (torch.save(sd, os.path.join(folder, "pytorch_model.bin")) if fmt == "bin"
     else save_file(sd, os.path.join(folder, "model.safetensors")))
    with pytest.raises(HeadMismatchError, match=r"layers.0.mlp.up_proj.weight has shape \(80, 32\), expected \(64, 32\)"):
        load_head_folder(folder, target)


def test_unsupported_or_incomplete_heads(tmp_path, target):
    folder = str(tmp_path / "mixed")
    sd = write_published_head(folder, "safetensors")
    sd["midlayer.hidden_norm.weight"] = torch.ones(HIDDEN)  # an EAGLE-3 tensor in an EAGLE-1/2 head
    save_file(sd, os.path.join(folder, "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="mix EAGLE-1/2 tensors"):
        load_head_folder(folder, target)
    sd.pop("midlayer.hidden_norm.weight")
    sd["layers.0.self_attn.rotary.weight"] = torch.ones(HIDDEN)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="unexpected tensors.*for an EAGLE-1/2 head"):
        load_head_folder(folder, target)
    sd.pop("layers.0.self_attn.rotary.weight")
    sd["embed_tokens.weight"] = torch.zeros(VOCAB + 1, HIDDEN)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="embed_tokens.weight has shape"):
        load_head_folder(folder, target)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_head_folder(str(empty), target)
    (empty / "config.json").write_text(json.dumps(LLAMA3_8B_HEAD_CONFIG))
    with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
        load_head_folder(str(empty), target)


def test_published_layout_fc_input_is_embedding_then_feature(tmp_path, target):
    """Known-answer check of the layer wiring the published weights assume (EAGLE cnets.py:
    fc(cat(embed(token), feature)), layer 0 without input norm, no final norm): with
    fc.weight = [I | 0] and the attention/MLP output projections zeroed, the head must return
    embed(token) exactly; with fc.weight = [0 | I] it must return the feature."""
    folder = str(tmp_path / "known")
    sd = write_published_head(folder, "safetensors", embed=False)
    eye, zero = torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)
    sd["layers.0.self_attn.o_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
    sd["layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER)
    ids = torch.tensor([[3, 1, 4]])
    feats = torch.randn(1, 3, HIDDEN) * 5
    for fc, expect in ((torch.cat([eye, zero], 1), target.get_input_embeddings()(ids)), (torch.cat([zero, eye], 1), feats)):
        sd["fc.weight"] = fc
        save_file({k: v.float() for k, v in sd.items()}, os.path.join(folder, "model.safetensors"))
        head = load_head_folder(folder, target)
        with torch.no_grad():
            out = head(ids, feats, torch.arange(3)[None])
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)


# -- round trip -------------------------------------------------------------------------------

def test_save_load_round_trip_identical_tensors_and_decoding(tmp_path, target, fitted_head):
    head = fitted_head(target)
    folder = str(tmp_path / "rt")
    head.save(folder, metadata={"trained_on": "unit test", "steps": 150})
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["bias"] is False and cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == HIDDEN
    loaded = load_head_folder(folder, target)
    a, b = head.head_state_dict(), loaded.head_state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.metadata == {"trained_on": "unit test", "steps": 150}
    tree = TreeSettings(total_tokens=10, depth=4, top_k=3)
    for ids in ([1, 2, 3], [7, 7, 0, 11, 4, 2, 9], [5]):
        gen = GenerationSettings(max_new_tokens=25, eos_token_ids=())
        out1, s1 = Engine(target, head, tree=tree).generate(ids, gen)
        out2, s2 = Engine(target, loaded, tree=tree).generate(ids, gen)
        assert out1 == out2 and s1.accepted_hist == s2.accepted_hist  # same drafts, not just same output


def test_pruned_draft_vocab_round_trip_and_lossless(tmp_path, target):
    vocab = torch.tensor([0, 2, 3, 5, 7, 8, 11])  # drafting scores only these target ids
    torch.manual_seed(4)
    head = DraftHead(HeadSpec.for_target(target.config), draft_vocab=vocab).bind(target)
    folder = str(tmp_path / "pruned")
    head.save(folder)
    loaded = load_head_folder(folder, target)
    assert torch.equal(loaded.draft_vocab, vocab) and loaded.draft_lm_head.shape == (7, HIDDEN)
    dec = Engine(target, loaded, tree=TreeSettings(total_tokens=10, depth=3, top_k=3))
    for ids in ([1, 2, 3], [4, 6, 9, 10]):
        out, _ = dec.generate(ids, GenerationSettings(max_new_tokens=20, eos_token_ids=()))
        ref = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=20,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out == ref


# -- safety ----------------------------------------------------------------------------------

MARKER = {"path": None}


def _payload(path):  # what a malicious checkpoint would run on unpickling
    with open(path, "w") as f:
        f.write("executed")
    return torch.zeros(1)


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_payload, (self.path,))


def test_pickle_payload_is_refused(tmp_path, target):
    folder = str(tmp_path / "evil")
    sd = write_published_head(folder, "bin")
    marker = str(tmp_path / "pwned")
    sd["layers.0.post_attention_layernorm.weight"] = Evil(marker)
    torch.save(sd, os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(HeadMismatchError, match="not a weights-only checkpoint: refusing to unpickle code"):
        load_head_folder(folder, target)
    assert not os.path.exists(marker)  # nothing ran
    # the same file does run its payload under a plain unpickler: the check above is meaningful
    torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=False)
    assert os.path.exists(marker)


# -- hub ids ------------------------------------------------------------------------------------

def test_hub_id_goes_through_snapshot_download(tmp_path, target, monkeypatch):
    import huggingface_hub

    folder = str(tmp_path / "hub_head")
    write_published_head(folder, "safetensors")
    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return folder

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    lt = LoadedTarget(model=target, tokenizer=None, name="some/target", source="some/target")
    head = load_draft_head("owner/name", lt)
    assert calls == [("owner/name", {"allow_patterns": HUB_HEAD_FILES})]
    assert {"config.json", "model.safetensors", "pytorch_model.bin"} <= set(HUB_HEAD_FILES)
    assert not any("*" in p for p in HUB_HEAD_FILES)  # never the whole repository
    assert head.embed is target.get_input_embeddings()
    # the registry maps a known target to its published head, through the same path
    calls.clear()
    lt = LoadedTarget(model=target, tokenizer=None, name="meta-llama/Meta-Llama-3-8B-Instruct", source="x")
    load_draft_head(None, lt)
    assert calls[0][0] == "yuhuili/EAGLE-LLaMA3-Instruct-8B"

    def offline(repo_id, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore lines")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(LoadError, match=r"could not fetch draft head 'owner/name' from the hub: We couldn't connect"):
        load_draft_head("owner/name", LoadedTarget(model=target, tokenizer=None, name="t", source="t"))
    with pytest.raises(LoadError, match="not a hub id"):
        load_draft_head("no-such-folder", LoadedTarget(model=target, tokenizer=None, name="t", source="t"))
