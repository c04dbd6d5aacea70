"""EAGLE-3 heads: feature capture, published format, decoding identity, sampling, validation.

Tiny random-weight targets with 8 layers (an EAGLE-3 head reads the inputs of layers 2, L//2
and L-3, so L >= 7), vocabulary 12; the heads draft over a pruned 10-token vocabulary so the
d2t map is exercised on every drafted token. Nothing is downloaded.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle2_core import Engine, GenerationSettings, Summary, TreeSettings
from eagle2_core.eagle3 import EAGLE3_ARCHITECTURE, Eagle3Head, Eagle3Spec, default_feature_layers
from eagle2_core.head import DraftHead, HeadMismatchError
from eagle2_core.headfiles import load_head_folder
from eagle2_core.target import TargetRunner, capture_layer_inputs, fuse

from conftest import CORE_ARCHS, distill_tiny_head, tiny_eagle3_head
from test_decoder_identity import MAXPOS, SHAPES, VOCAB, build_cases

LAYERS = 8
DRAFT_IDS = [0, 1, 2, 3, 4, 5, 7, 8, 10, 11]  # 6 and 9 are never drafted

# config.json of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, as published (fields that matter here).
LLAMA31_EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256,
    "draft_vocab_size": 32000,
}
PUBLISHED_SHAPES = {  # ../shared/docs/eagle3.md, for H = 4096, 32 heads, 8 KV heads, I = 14336
    "fc.weight": (4096, 3 * 4096),
    "midlayer.self_attn.q_proj.weight": (4096, 8192), "midlayer.self_attn.k_proj.weight": (1024, 8192),
    "midlayer.self_attn.v_proj.weight": (1024, 8192), "midlayer.self_attn.o_proj.weight": (4096, 4096),
    "midlayer.mlp.gate_proj.weight": (14336, 4096), "midlayer.mlp.up_proj.weight": (14336, 4096),
    "midlayer.mlp.down_proj.weight": (4096, 14336),
    "midlayer.hidden_norm.weight": (4096,), "midlayer.input_layernorm.weight": (4096,),
    "midlayer.post_attention_layernorm.weight": (4096,), "norm.weight": (4096,),
    "lm_head.weight": (32000, 4096), "d2t": (32000,), "t2d": (128256,),
}


def tiny8(tiny_lm, arch="llama", **kw):
    return tiny_lm(arch, vocab_size=VOCAB, max_position_embeddings=MAXPOS, num_layers=LAYERS, **kw)


@pytest.fixture(scope="module", params=CORE_ARCHS)
def env3(request, tiny_lm):
    arch = request.param
    model = tiny8(tiny_lm, arch)
    head = distill_tiny_head(model, arch="eagle3", draft_ids=DRAFT_IDS, steps=200)
    return dict(arch=arch, model=model, head=head, cases=build_cases(model, seed=2000 + CORE_ARCHS.index(arch)))


# -- feature capture ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", CORE_ARCHS)
def test_captured_feature_is_the_input_of_layers_2_mid_and_L_minus_3(tiny_lm, arch):
    """The hooks give exactly transformers' hidden_states[2], [L//2], [L-3], concatenated, and
    leave no hook behind."""
    model = tiny8(tiny_lm, arch)
    layers = default_feature_layers(LAYERS)
    assert layers == (2, 4, 5)
    x = torch.randint(0, VOCAB, (1, 9))
    ref = model(x, output_hidden_states=True).hidden_states
    body = model.get_decoder()
    with capture_layer_inputs(body, layers) as seen:
        body(input_ids=x, use_cache=False)
    assert torch.equal(fuse(seen, layers), torch.cat([ref[k] for k in layers], -1))
    assert all(not layer._forward_pre_hooks for layer in body.layers)


# -- decoding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_identity_with_eagle3_head(env3, shape):
    dec = Engine(env3["model"], env3["head"], tree=SHAPES[shape])
    hist: list[int] = []
    mismatches = []
    for case in env3["cases"]:
        out, s = dec.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
        if out != case["ref"]:
            mismatches.append((case, out))
            continue
        for d, c in enumerate(s.accepted_hist):
            hist.extend([0] * (d + 1 - len(hist)))
            hist[d] += c
    print(f"\n[identity eagle3] {env3['arch']:8s} {shape:8s} {len(env3['cases']) - len(mismatches)}/{len(env3['cases'])} "
          f"identical accepted_hist={hist}")
    assert not mismatches, mismatches[:2]
    assert sum(hist[2:]) > 0, f"no cycle accepted >= 2 draft tokens: {hist}"
    assert hist[0] > 0, f"no cycle rejected every draft token: {hist}"


def test_drafted_tokens_stay_in_the_draft_vocabulary(env3, monkeypatch):
    """Every tree node below the root is a target id reached through d2t."""
    import eagle2_core.engine as engine

    seen = set()
    real = engine.Cycle.draft_fn

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        seen.update(out[0][:, 1:].flatten().tolist())  # (tokens [B, N], parents, ...): node 0 is the root
        return out

    monkeypatch.setattr(engine.Cycle, "draft_fn", spy)
    dec = Engine(env3["model"], env3["head"], tree=SHAPES["dynamic"])
    for case in env3["cases"][:6]:
        dec.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"]))
    assert seen and seen <= set(DRAFT_IDS)


def test_the_head_reads_the_fused_feature_not_the_last_hidden_state(tiny_lm):
    """The engine's target forward (TargetRunner.body_forward on kvcache.KVCache, with the layer
    hooks) returns the fused feature hidden_states[2, L//2, L-3], and changing what enters layer
    L-3 changes the EAGLE-3 draft, proving the fused feature is wired in."""
    from eagle2_core.engine import KVCache, num_cache_layers
    from eagle2_core.tree import causal_rows, windowed

    model = tiny8(tiny_lm)
    head = tiny_eagle3_head(model, DRAFT_IDS)
    run = TargetRunner(model)
    ids = torch.tensor([1, 2, 3, 4])
    pos = torch.arange(4)[None]
    cache = KVCache(num_cache_layers(model.config), 1, 16)
    cache.cells, cache.view = pos, 4
    mask = run.masks(lambda w: windowed(causal_rows(pos, 4), pos, pos, w))
    with torch.no_grad(), capture_layer_inputs(run.body, head.feature_layers) as seen:
        _, feats = run.body_forward(ids[None], pos, mask, cache, seen, head.feature_layers)
        ref = model(ids[None], output_hidden_states=True).hidden_states
    assert feats.shape == (1, 4, 3 * model.config.hidden_size)
    torch.testing.assert_close(feats, torch.cat([ref[k] for k in head.feature_layers], -1), rtol=1e-5, atol=1e-5)
    feats = feats[0]
    a = head.draft_logits(head(ids[None], head.project(feats[None]), torch.arange(4)[None]))
    feats2 = feats.clone()
    feats2[:, -model.config.hidden_size:] += 1.0
    b = head.draft_logits(head(ids[None], head.project(feats2[None]), torch.arange(4)[None]))
    assert not torch.allclose(a, b)


# -- checkpoints -----------------------------------------------------------------------------------
def test_published_llama31_eagle3_shapes_on_meta():
    spec = Eagle3Spec.from_config_dict(LLAMA31_EAGLE3_CONFIG)
    with torch.device("meta"):
        head = Eagle3Head(spec)
    shapes = {k: tuple(v.shape) for k, v in head.head_state_dict().items()}
    assert shapes == PUBLISHED_SHAPES
    assert head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool


def write_published_style(folder, model, draft_ids, fmt="bin", dtype=torch.float16, seed=3):
    """A head written the way the official checkpoints are: fp16 pytorch_model.bin (or
    safetensors), the 15 published keys, the reference's config fields."""
    os.makedirs(folder, exist_ok=True)
    c = model.config
    H, V, Vd = c.hidden_size, c.vocab_size, len(draft_ids)
    hd = c.hidden_size // c.num_attention_heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    ids = torch.tensor(sorted(draft_ids))
    sd = {
        "fc.weight": w(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": w(c.num_attention_heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(c.num_key_value_heads * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(c.num_key_value_heads * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, c.num_attention_heads * hd),
        "midlayer.mlp.gate_proj.weight": w(2 * H, H), "midlayer.mlp.up_proj.weight": w(2 * H, H),
        "midlayer.mlp.down_proj.weight": w(H, 2 * H),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=dtype), "midlayer.input_layernorm.weight": torch.ones(H, dtype=dtype),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=dtype), "norm.weight": torch.ones(H, dtype=dtype),
        "lm_head.weight": w(Vd, H), "d2t": ids - torch.arange(Vd),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
    }
    cfg = {**LLAMA31_EAGLE3_CONFIG, "hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "vocab_size": V, "draft_vocab_size": Vd, "torch_dtype": str(dtype)[6:]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if fmt == "bin":
        torch.save(sd, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(sd, os.path.join(folder, "model.safetensors"))
    return sd


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_published_style_head_loads_and_decodes_losslessly(tmp_path, tiny_lm, fmt):
    model = tiny8(tiny_lm)
    sd = write_published_style(tmp_path / "h", model, DRAFT_IDS, fmt)
    head = load_head_folder(str(tmp_path / "h"), model)
    assert isinstance(head, Eagle3Head) and head.feature_layers == (2, 4, 5)
    assert torch.equal(head.d2t.cpu(), sd["d2t"]) and torch.equal(head.draft_ids().cpu(), torch.tensor(DRAFT_IDS))
    assert torch.equal(head.fc.weight, sd["fc.weight"].float())
    dec = Engine(model, head, tree=SHAPES["dynamic"])
    for case in build_cases(model, seed=5)[:8]:
        out, _ = dec.generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
        assert out == case["ref"]


def test_draft_option_tells_the_two_formats_apart(tmp_path, tiny_lm):
    from conftest import build_tiny_head

    model = tiny8(tiny_lm)
    write_published_style(tmp_path / "e3", model, DRAFT_IDS)
    build_tiny_head(str(tmp_path / "e2"), model.config)
    assert isinstance(load_head_folder(str(tmp_path / "e3"), model), Eagle3Head)
    assert isinstance(load_head_folder(str(tmp_path / "e2"), model), DraftHead)
    # the reference's own training config says LlamaForCausalLM: the keys still say EAGLE-3
    cfg = json.load(open(tmp_path / "e3" / "config.json"))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(tmp_path / "e3" / "config.json", "w"))
    assert isinstance(load_head_folder(str(tmp_path / "e3"), model), Eagle3Head)


def test_save_reload_decode_and_the_serving_engines_expectations(tmp_path, env3):
    """Saved heads are what vLLM's and SGLang's EAGLE-3 loaders read (their expectations written
    out here from ../shared/docs/eagle3.md, without importing them)."""
    model, head = env3["model"], env3["head"]
    head.save(str(tmp_path / "h"), metadata={"note": "test"}, dtype=torch.bfloat16)
    cfg = json.load(open(tmp_path / "h" / "config.json"))
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    # config: both engines dispatch on the architecture; SGLang ties lm_head to the embedding
    # unless tie_word_embeddings is false; rope settings at top level; no custom aux layer ids.
    assert cfg["architectures"] == [EAGLE3_ARCHITECTURE]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and cfg["vocab_size"] == VOCAB
    assert "rope_theta" in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg
    # weights: the 15 published keys (vLLM maps midlayer. -> layers.0.), no embedding, d2t int64, t2d bool
    assert set(sd) == set(PUBLISHED_SHAPES)
    assert not any(k.startswith("embed_tokens") for k in sd)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["fc.weight"].dtype == torch.bfloat16
    assert int(sd["t2d"].sum()) == len(DRAFT_IDS)
    assert torch.equal(torch.arange(len(DRAFT_IDS)) + sd["d2t"], torch.tensor(DRAFT_IDS))
    for k in ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"):
        assert sd[k].shape[1] == 2 * cfg["hidden_size"]
    assert sd["fc.weight"].shape == (cfg["hidden_size"], 3 * cfg["hidden_size"])
    assert sd["lm_head.weight"].shape == (cfg["draft_vocab_size"], cfg["hidden_size"])
    # round trip in float32: identical tensors and identical decoding
    head.save(str(tmp_path / "f"))
    again = load_head_folder(str(tmp_path / "f"), model)
    a, b = head.head_state_dict(), again.head_state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for case in env3["cases"][:6]:
        g = GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"])
        assert Engine(model, again, tree=SHAPES["static"]).generate(case["ids"], g)[0] == case["ref"]


def _one_line(msg: str) -> str:
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("breakage, words", [
    ("hidden", "hidden_size 16 does not match the target's 32"),
    ("vocab", "vocab_size 13 does not match"),
    ("d2t_range", "outside the vocabulary"),
    ("lm_head_rows", "lm_head.weight has 9 rows but draft_vocab_size is 10"),
    ("d2t_float", "d2t must be 10 integer offsets"),
    ("missing", "missing tensors ['midlayer.mlp.down_proj.weight']"),
])
def test_mismatched_eagle3_heads_fail_with_one_clear_line(tmp_path, tiny_lm, breakage, words):
    model = tiny8(tiny_lm)
    folder = tmp_path / "h"
    sd = write_published_style(folder, model, DRAFT_IDS, fmt="safetensors")
    cfg = json.load(open(folder / "config.json"))
    if breakage == "hidden":
        cfg["hidden_size"] = 16
    elif breakage == "vocab":
        cfg["vocab_size"] = 13
    elif breakage == "d2t_range":
        sd["d2t"] = sd["d2t"].clone()
        sd["d2t"][-1] = 5
    elif breakage == "lm_head_rows":
        sd["lm_head.weight"] = sd["lm_head.weight"][:9].contiguous()
    elif breakage == "d2t_float":
        sd["d2t"] = sd["d2t"].float()
    elif breakage == "missing":
        del sd["midlayer.mlp.down_proj.weight"]
    json.dump(cfg, open(folder / "config.json", "w"))
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(HeadMismatchError) as e:
        load_head_folder(str(folder), model)
    assert words in _one_line(str(e.value))


def test_target_with_too_few_layers_is_caught_at_load(tmp_path, tiny_lm):
    big = tiny8(tiny_lm)
    write_published_style(tmp_path / "h", big, DRAFT_IDS)
    small = tiny_lm("llama", vocab_size=VOCAB, max_position_embeddings=MAXPOS, num_layers=4)
    with pytest.raises(HeadMismatchError) as e:
        load_head_folder(str(tmp_path / "h"), small)
    assert "the target has 4 layers" in _one_line(str(e.value)) and "at least 7" in str(e.value)


def test_head_with_other_hidden_size_needs_and_uses_its_own_embedding(tmp_path, tiny_lm):
    """target_hidden_size != hidden_size: fc reads 3 x the target's width, the head embeds tokens itself."""
    model = tiny8(tiny_lm)
    spec = Eagle3Spec.for_target(model.config, draft_vocab_size=len(DRAFT_IDS))
    spec.target_hidden_size, spec.hidden_size, spec.intermediate_size, spec.head_dim = 32, 48, 96, None
    torch.manual_seed(0)
    head = Eagle3Head(spec)
    head.set_draft_vocab(torch.tensor(DRAFT_IDS))
    assert head.fc.weight.shape == (48, 96) and head.embed_tokens is not None
    head.save(str(tmp_path / "h"))
    cfg = json.load(open(tmp_path / "h" / "config.json"))
    assert cfg["target_hidden_size"] == 32 and cfg["hidden_size"] == 48
    loaded = load_head_folder(str(tmp_path / "h"), model)
    for case in build_cases(model, seed=9)[:6]:
        out, _ = Engine(model, loaded, tree=SHAPES["dynamic"]).generate(case["ids"], GenerationSettings(max_new_tokens=case["n"], eos_token_ids=case["eos"]))
        assert out == case["ref"]
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    del sd["embed_tokens.weight"]
    save_file(sd, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="needs its own embed_tokens.weight"):
        load_head_folder(str(tmp_path / "h"), model)


def test_registry_prefers_the_published_eagle3_heads():
    from eagle2_core.loading import HEAD_REGISTRY

    assert HEAD_REGISTRY["meta-llama/Llama-3.1-8B-Instruct"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert HEAD_REGISTRY["meta-llama/Llama-3.3-70B-Instruct"] == "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"
    assert HEAD_REGISTRY["lmsys/vicuna-13b-v1.3"] == "yuhuili/EAGLE3-Vicuna1.3-13B"
    assert HEAD_REGISTRY["deepseek-ai/DeepSeek-R1-Distill-Llama-8B"] == "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B"
    assert HEAD_REGISTRY["meta-llama/Meta-Llama-3-8B-Instruct"] == "yuhuili/EAGLE-LLaMA3-Instruct-8B"  # no EAGLE-3 head: EAGLE-1/2


# -- sampling --------------------------------------------------------------------------------------
def test_sampling_with_an_eagle3_head_follows_the_target_law(tiny_lm, monkeypatch):
    """The chi-square test of test_sampling_lossless, with an EAGLE-3 head on an 8-layer target
    (vocabulary 5, drafting over 4 of them), at temperature 0.7: the same exact law, seeded
    generations, alpha = 0.001. First analytically: the keyed rule on this head's own trees gives
    the target's law exactly. Then N = 300 sampled answers, with power >= 0.99 required against
    the law with the temperature skipped (1.0000 at N = 200 already). The stale-uniform bug (one
    uniform for every depth of a cycle) barely moves the law with this head, which rarely drafts
    right (power 0.044 at N = 300, 0.995 only at N = 1100): its power is printed, not required;
    test_sampling_lossless tests that bug with a head that shows it."""
    import test_sampling_lossless as sl
    from conftest import chisquare_power, pooled_chisquare

    model = tiny_lm("llama", vocab_size=sl.V, hidden_size=16, num_layers=LAYERS, max_position_embeddings=32,
                    initializer_range=0.3, logit_scale=1.0)
    head = tiny_eagle3_head(model, [0, 1, 2, 4], seed=2)
    dec = Engine(model, head, tree=TreeSettings(shape="dynamic", total_tokens=8, depth=3, top_k=3))
    gen = GenerationSettings(temperature=0.7)
    exact = sl.exact_target_law(model, gen)
    p0 = [sum(v for k, v in exact.items() if k[0] == a) for a in range(sl.V)]
    correct = sl.engine_rule_law(dec, gen, p0, "keyed", monkeypatch)
    stale = sl.engine_rule_law(dec, gen, p0, "stale_uniform", monkeypatch)
    no_temperature = sl.exact_target_law(model, GenerationSettings(temperature=1.0))
    for k in set(exact) | set(correct):  # analytic: the rule on this head's trees gives the target's law
        assert correct.get(k, 0.0) == pytest.approx(exact.get(k, 0.0), abs=1e-6), k
    n = 300
    counts = sl.sample_counts(dec, dict(temperature=0.7), n)
    stat, dof, pval, bins = pooled_chisquare(counts, exact, n)
    power = chisquare_power(exact, no_temperature, bins, n, sl.ALPHA)
    print(f"\n[lossless eagle3] T0.7, N={n}: chi2={stat:.1f} df={dof} p={pval:.3f}; power vs no temperature={power:.4f}, "
          f"vs stale_uniform={chisquare_power(exact, stale, bins, n, sl.ALPHA):.4f} (reported)")
    assert pval > sl.ALPHA
    assert power >= 0.99
