"""GGUF block weights read by the stream kernel (issue 41): for every block type, the product
from the blocks' bytes is bitwise the float32 stream product over gguf-py's dequantization of the
same blocks (the dequantization transformers loads GGUF files through), at every row count."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle2_core import native

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(native.module() is None, reason="eagle2's native code is not built here")

T = gguf.GGMLQuantizationType
SIMPLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]                # gguf-py only dequantizes these: raw blocks


def blocks_of(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8 blocks of type `name` holding an n x k weight."""
    qtype = getattr(T, name)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if name in SIMPLE:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w[0, :block] = 0.0  # an all-zero block (scale 0) too
        return gguf.quants.quantize(w, qtype).reshape(n, -1)
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    # the fp16 scales: finite, of the sizes real files hold (random bytes would give inf / nan)
    scale = (rng.standard_normal((n, k // block)) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    smin = (np.abs(rng.standard_normal((n, k // block))) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    if name == "Q6_K":
        raw[..., 208:210] = scale
    else:
        raw[..., 0:2], raw[..., 2:4] = scale, smin
    return raw.reshape(n, -1)


def dequantized(name: str, blocks: np.ndarray, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1), getattr(T, name)).reshape(-1, k).copy())


@pytest.mark.parametrize("name", SIMPLE + K_QUANTS)
def test_block_product_is_bitwise_the_float32_product_over_the_dequantized_weight(name):
    mod = native.module()
    rng = np.random.default_rng(hash(name) % 2**32)
    k = 512 if name in K_QUANTS else 96  # several blocks a row; 96 = 3 blocks of 32
    n = 6 * 5 + 3  # whole 6-row tiles and a remainder that runs one dot product at a time
    blocks = blocks_of(name, n, k, rng)
    w = dequantized(name, blocks, k)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    qtype = int(getattr(T, name))
    wb = torch.from_numpy(blocks.copy())
    bias = torch.randn(n)
    for rows in range(1, 24):
        x = torch.randn(rows, k)
        want = mod.stream_linear(x, w, None)
        got = mod.block_linear(x, wb, qtype, None)
        assert torch.equal(got, want), (name, rows, (got - want).abs().max())
    assert torch.equal(mod.block_linear(x, wb, qtype, bias), mod.stream_linear(x, w, bias))


@pytest.mark.parametrize("name", SIMPLE + K_QUANTS)
def test_one_hot_rows_read_back_the_dequantized_weights(name):
    """x = the identity: each output is one weight, rebuilt from its block exactly as gguf-py does."""
    mod = native.module()
    k = 256 if name in K_QUANTS else 64
    blocks = blocks_of(name, 7, k, np.random.default_rng(1))
    got = mod.block_linear(torch.eye(k), torch.from_numpy(blocks.copy()), int(getattr(T, name)), None)
    assert torch.equal(got.T.contiguous(), dequantized(name, blocks, k))


def test_a_weight_of_the_wrong_shape_or_type_is_refused():
    mod = native.module()
    blocks = torch.zeros(4, 20, dtype=torch.uint8)  # Q4_1: one block of 32 per row
    assert mod.block_type_known(3) and not mod.block_type_known(1)
    with pytest.raises(RuntimeError, match="block_into"):
        mod.block_linear(torch.randn(2, 64), blocks, 3, None)  # two blocks a row expected
    with pytest.raises(RuntimeError, match="unknown GGML type"):
        mod.block_linear(torch.randn(2, 32), blocks, 1, None)


@pytest.mark.slow
def test_the_embedded_gguf_read_as_blocks_rebuilds_transformers_weights_bitwise():
    """Every mapped weight of the SmolLM2 file, q/k rows unpermuted on the blocks, dequantizes to
    the bits transformers loaded; and the block product over it is the float32 stream product."""
    from eagle2_core.ggufblocks import read_blocks
    from eagle2_core.loading import load_target, smollm2_gguf_path

    model = load_target(None, dtype="float32", device="cpu").model  # as transformers dequantizes it
    cfg = model.config
    blocks, other = read_blocks(smollm2_gguf_path(), cfg.num_attention_heads, cfg.num_key_value_heads)
    params = dict(model.named_parameters())
    assert len(blocks) == 7 * cfg.num_hidden_layers + 1 and other == {}  # the tied embedding is the one Q8_0 tensor
    last = cfg.num_hidden_layers - 1
    for name, bw in blocks.items():  # the first and last layers and the embedding: every kind of name and row order
        if name.startswith(("model.layers.0.", f"model.layers.{last}.", "model.embed")):
            assert torch.equal(bw.dequantize(), params[name].detach().float()), name
    mod = native.module()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"):
        bw, w = blocks[name], params[name].detach().float().contiguous()
        x = torch.randn(5, bw.in_features)
        assert torch.equal(mod.block_linear(x, bw.blocks, bw.qtype, None), mod.stream_linear(x, w, None)), name


def quantized_tiny_llama(name: str = "Q8_0", hidden: int = 64, vocab: int = 48):
    """A tiny Llama whose every linear weight (lm_head too) holds the dequantization of its own
    GGUF blocks, with the blocks attached as loading attaches a GGUF target's."""
    from conftest import make_tiny_lm

    from eagle2_core import rowgemm
    from eagle2_core.ggufblocks import BlockWeight

    model = make_tiny_lm("llama", vocab_size=vocab, hidden_size=hidden, max_position_embeddings=64)
    qtype = getattr(T, name)
    for mod in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
        w = mod.weight.detach().float().numpy()
        blocks = gguf.quants.quantize(w, qtype).reshape(w.shape[0], -1)
        with torch.no_grad():
            mod.weight.copy_(dequantized(name, blocks, w.shape[1]))
        rowgemm.attach_blocks(mod.weight, BlockWeight(torch.from_numpy(blocks.copy()), int(qtype), name, w.shape[1]))
    return model


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_block_weights_through_the_one_engine(name, monkeypatch):
    """The block kernel forced for every product that has blocks (EAGLE2_KERNEL=block; the head's
    weights stream their floats): every forward is bitwise the one with the float32 stream kernel
    forced, so greedy decoding is `generate`'s, and the kernel really ran."""
    from eagle2_core import Eagle2Decoder, GenerationSettings, TreeSettings, rowgemm
    from eagle2_core.head import DraftHead, HeadSpec

    model = quantized_tiny_llama(name)
    torch.manual_seed(3)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model).eval()
    prompts = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 30, 12], [40]]
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        refs.append(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids):].tolist())
    outs, ran = {}, []
    real = rowgemm.kernel_for
    monkeypatch.setattr(rowgemm, "kernel_for", lambda x, w: ran.append(real(x, w)) or ran[-1])
    before = rowgemm.PLAN
    try:
        for kernel in ("block", "stream"):
            monkeypatch.setenv("EAGLE2_KERNEL", kernel)
            rowgemm.install_plan(rowgemm.ProductPlan())
            dec = Eagle2Decoder(model, head, tree=TreeSettings(total_tokens=6, depth=3, top_k=2))
            outs[kernel] = [dec.generate(ids, GenerationSettings(max_new_tokens=12))[0] for ids in prompts]
            if kernel == "block":
                assert "block" in ran
    finally:
        rowgemm.PLAN = before
    assert outs["block"] == outs["stream"] == refs
    # one forward of the body, bitwise, block against stream (the native loop's products included)
    from eagle2_core.target import TargetRunner

    run = TargetRunner(model)
    ws = run.lean.weights()
    assert all(rowgemm.blocks_of(w) is not None for w in ws)  # the fused q/k/v and gate/up carry blocks too
    for w in ws:
        x = torch.randn(3, w.shape[1])
        with rowgemm.using_plan(rowgemm.forced("block")):
            a = rowgemm.linear_rows(x, w)
        with rowgemm.using_plan(rowgemm.forced("stream")):
            b = rowgemm.linear_rows(x, w)
        assert torch.equal(a, b)
