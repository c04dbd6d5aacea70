"""GGUF block weights read by the stream kernel: for every block type, the product
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


@pytest.mark.parametrize("name,k", [(n, 96) for n in SIMPLE] + [(n, 288) for n in SIMPLE] + [(n, 512) for n in K_QUANTS])
def test_block_product_is_bitwise_the_float32_product_over_the_dequantized_weight(name, k):
    """k: several blocks a row; 96 = 3 blocks of 32 (less than one 256-value chunk), 288 = a chunk and a block"""
    mod = native.module()
    rng = np.random.default_rng(hash(name) % 2**32)
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
def test_the_embedded_gguf_read_as_blocks_rebuilds_transformers_weights_bitwise(monkeypatch):
    """Every mapped weight of the SmolLM2 file, q/k rows unpermuted on the blocks, dequantizes to
    the bits transformers loaded; and the block product over it is the float32 stream product."""
    from eagle2_core.ggufblocks import read_blocks
    from eagle2_core.loading import load_target, smollm2_gguf_path

    monkeypatch.setenv("EAGLE2_BLOCKS", "keep")  # the float32 weights stay beside the blocks
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


@pytest.mark.parametrize("src,dst", [("Q4_0", "Q5_0"), ("Q4_0", "Q8_0"), ("Q5_0", "Q8_0"), ("Q4_1", "Q5_1")])
def test_widened_blocks_rebuild_the_same_weights_and_products(src, dst):
    """ggufblocks.widen: a block type rewritten into a wider one holds the same float32 weights to
    the bit (gguf-py's dequantization of both), so their products are the same bits too."""
    from eagle2_core.ggufblocks import BlockWeight, common_type, widen

    k, n = 96, 9
    raw = blocks_of(src, n, k, np.random.default_rng(7))
    bw = BlockWeight(torch.from_numpy(raw.copy()), int(getattr(T, src)), src, k)
    wide = widen(bw, int(getattr(T, dst)))
    assert wide.type_name == dst and wide.blocks.shape == (n, k // 32 * gguf.GGML_QUANT_SIZES[getattr(T, dst)][1])
    a, b = dequantized(src, raw, k), dequantized(dst, wide.blocks.numpy(), k)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    x = torch.randn(3, k)
    mod = native.module()
    assert torch.equal(mod.block_linear(x, bw.blocks, bw.qtype, None), mod.block_linear(x, wide.blocks, wide.qtype, None))
    assert common_type([bw.qtype, wide.qtype]) == wide.qtype
    assert common_type([int(T.Q4_1), int(T.Q8_0)]) is None and common_type([int(T.Q4_K), int(T.Q6_K)]) is None
    with pytest.raises(ValueError):
        widen(wide, bw.qtype)


def quantized_tiny_llama(name: str = "Q8_0", hidden: int = 64, vocab: int = 48):
    """A tiny Llama whose every linear weight (lm_head too) holds the dequantization of its own
    GGUF blocks, with the blocks attached as loading attaches a GGUF target's."""
    from conftest import make_tiny_lm

    from eagle2_core import rowgemm
    from eagle2_core.ggufblocks import BlockWeight

    model = make_tiny_lm("llama", vocab_size=vocab, hidden_size=hidden, max_position_embeddings=64)
    for mod_name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]:
        t = MIXED.get(mod_name.rsplit(".", 1)[-1], "Q8_0") if name == "mixed" else name
        qtype = getattr(T, t)
        w = mod.weight.detach().float().numpy()
        blocks = gguf.quants.quantize(w, qtype).reshape(w.shape[0], -1)
        with torch.no_grad():
            mod.weight.copy_(dequantized(t, blocks, w.shape[1]))
        rowgemm.attach_blocks(mod.weight, BlockWeight(torch.from_numpy(blocks.copy()), int(qtype), t, w.shape[1]))
    return model


# "mixed": parts of one fused product in different types, as llama.cpp's mixes quantize them
# (Qwen2.5-Coder's file: Q5_0 q and k beside a Q8_0 v); the lean body widens them exactly
MIXED = {"q_proj": "Q5_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_1", "up_proj": "Q5_1", "down_proj": "Q5_0"}


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "mixed"])
def test_block_weights_through_the_one_engine(name, monkeypatch):
    """The block kernel forced for every product that has blocks (EAGLE2_KERNEL=block; the head's
    weights stream their floats): every forward is bitwise the one with the float32 stream kernel
    forced, so greedy decoding is `generate`'s, and the kernel really ran."""
    from eagle2_core import Engine, GenerationSettings, TreeSettings, rowgemm
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
            dec = Engine(model, head, tree=TreeSettings(total_tokens=6, depth=3, top_k=2))
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
    if name == "mixed":  # widened to one type each: q/k/v Q8_0, gate/up Q5_1
        assert [rowgemm.blocks_of(w).type_name for w in ws[:4]] == ["Q8_0", "Q4_0", "Q5_1", "Q5_0"]
    for w in ws:
        x = torch.randn(3, w.shape[1])
        with rowgemm.using_plan(rowgemm.forced("block")):
            a = rowgemm.linear_rows(x, w)
        with rowgemm.using_plan(rowgemm.forced("stream")):
            b = rowgemm.linear_rows(x, w)
        assert torch.equal(a, b)


# -- eagle2's weight-only 8-bit (ROW_I8) and rows rebuilt for lookups -----
def test_row_int8_product_is_bitwise_the_float32_product_over_scale_times_q():
    """`--load-in-8bit` on a CPU: int8 rows with a float32 scale each; the block product is the
    float32 stream product over `scale * q` at every row count (so speculation is exact against
    the 8-bit model's plain decoding), and the quantization is absmax per row."""
    from eagle2_core.quantization import ROW_I8, row_int8
    from int8_reference import rebuild_row_int8

    mod = native.module()
    torch.manual_seed(5)
    n, k = 6 * 5 + 3, 96
    w = torch.randn(n, k) * 0.05
    w[1] = 0.0  # a zero row: scale 0
    w[2, 7] = 3.0  # one large value: that row's scale follows it
    bw = row_int8(w)
    assert bw.qtype == ROW_I8 and bw.blocks.shape == (n, 4 + k) and bw.blocks.dtype == torch.uint8
    r = rebuild_row_int8(bw)
    assert r[2, 7] == 3.0 and (r[1] == 0).all() and ((r - w).abs() <= w.abs().amax(1, keepdim=True) / 254 + 1e-7).all()
    bias = torch.randn(n)
    for rows in range(1, 24):
        x = torch.randn(rows, k)
        got = mod.block_linear(x, bw.blocks, ROW_I8, None)
        want = mod.stream_linear(x, r, None)
        assert torch.equal(got, want), (rows, (got - want).abs().max())
    assert torch.equal(mod.block_linear(x, bw.blocks, ROW_I8, bias), mod.stream_linear(x, r, bias))
    with pytest.raises(RuntimeError, match="block_into"):
        mod.block_linear(torch.randn(2, 80), bw.blocks, ROW_I8, None)  # rows of 96 values, not 80


@pytest.mark.parametrize("name", SIMPLE + K_QUANTS + ["ROW_I8"])
def test_block_rows_rebuild_the_dequantized_rows_bitwise(name):
    """An embedding lookup, or the float32 weight `generate` runs, from the blocks: gguf-py's
    dequantization (scale * q for ROW_I8) of exactly the rows asked for, into a buffer or not."""
    from eagle2_core.quantization import ROW_I8, row_int8
    from int8_reference import rebuild_row_int8

    mod = native.module()
    k = 512 if name in K_QUANTS else 96
    if name == "ROW_I8":
        bw = row_int8(torch.randn(9, k))
        blocks, qtype, want = bw.blocks, ROW_I8, rebuild_row_int8(bw)
    else:
        raw = blocks_of(name, 9, k, np.random.default_rng(2))
        blocks, qtype, want = torch.from_numpy(raw.copy()), int(getattr(T, name)), dequantized(name, raw, k)
    assert torch.equal(mod.block_rows(blocks, qtype, k), want)
    idx = torch.tensor([8, 0, 3, 3])
    assert torch.equal(mod.block_rows(blocks, qtype, k, idx), want[idx])
    buf = torch.full((9 * k,), float("nan"))
    mod.block_rows(blocks, qtype, k, None, buf)
    assert torch.equal(buf.view(9, k), want)
    with pytest.raises(RuntimeError, match="out of range"):
        mod.block_rows(blocks, qtype, k, torch.tensor([9]))


def test_q4_0_quantizer_writes_blocks_gguf_py_reads_back_within_a_step():
    """`--load-in-4bit` on a CPU: our Q4_0 blocks dequantize (gguf-py) to within half a
    quantization step of the weights, and the Q4_0 kernel reads them bitwise as gguf-py does."""
    from eagle2_core.quantization import q4_0

    torch.manual_seed(6)
    w = torch.randn(10, 128) * 0.05
    w[3, :32] = 0.0
    bw = q4_0(w)
    back = dequantized("Q4_0", bw.blocks.numpy(), 128)
    step = (w.reshape(10, 4, 32).abs().amax(-1, keepdim=True) / 8).expand(10, 4, 32).reshape(10, 128)
    err = (back - w).abs()
    # half a step, but a full one where +8 steps (the far end from the block's peak) clip to +7
    assert (err <= step + 1e-6).all() and (err <= step / 2 + 1e-6).float().mean() > 0.95 and (back[3, :32] == 0).all()
    x = torch.randn(5, 128)
    assert torch.equal(native.module().block_linear(x, bw.blocks, 2, None), native.module().stream_linear(x, back, None))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_a_target_held_as_blocks_only_keeps_generate_bits_and_decodes_from_blocks(name):
    """Memory: the linears and the embedding keep their blocks only (stand-ins of one
    NaN for the floats). transformers' own forward and `generate` rebuild each weight and give the
    bits of the float32 model; eagle2 reads the blocks (its products cannot see a float: a miss
    would be NaN) and greedy decoding is `generate`'s."""
    import copy

    from eagle2_core import Engine, GenerationSettings, TreeSettings, rowgemm
    from eagle2_core.ggufblocks import BlockWeight
    from eagle2_core.head import DraftHead, HeadSpec
    from eagle2_core.loading import drop_floats
    from eagle2_core.target import TargetRunner
    from eagle2_core.vanilla import VanillaDecoder

    model = quantized_tiny_llama(name, vocab=5000)  # lm_head rows past the chunk size: generate's lm_head runs in chunks
    emb = model.get_input_embeddings().weight
    qtype = getattr(T, name)
    eb = gguf.quants.quantize(emb.detach().numpy(), qtype).reshape(emb.shape[0], -1)
    with torch.no_grad():
        emb.copy_(dequantized(name, eb, emb.shape[1]))
    rowgemm.attach_blocks(emb, BlockWeight(torch.from_numpy(eb.copy()), int(qtype), name, emb.shape[1]))
    ref = copy.deepcopy(model)  # the float32 model: new tensors, no blocks
    torch.manual_seed(3)
    head = DraftHead(HeadSpec.for_target(model.config)).bind(model).eval()
    floats = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    assert drop_floats(model) == floats
    assert all(rowgemm.floatless(p) and p.stride() == (0, 0) for p in model.parameters() if p.dim() == 2)
    assert type(model.get_input_embeddings()) is rowgemm.FloatlessEmbedding and type(model.lm_head) is rowgemm.FloatlessLinear
    head.bind(model)  # the draft lm_head: the target's rows as blocks only
    assert rowgemm.floatless(head.draft_lm_head)
    x = torch.tensor([[1, 5, 9, 2, 4000, 7, 7]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    prompts = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 30, 12], [40]]
    refs = [ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=12,
                         do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    gen = GenerationSettings(max_new_tokens=12, eos_token_ids=())
    assert [VanillaDecoder(model).generate(ids, gen)[0] for ids in prompts] == refs
    before = rowgemm.PLAN
    try:
        rowgemm.install_plan(rowgemm.forced("stream"))  # a plan that names another kernel: blocks only still read blocks
        dec = Engine(model, head, tree=TreeSettings(total_tokens=6, depth=3, top_k=2))
        assert [dec.generate(ids, gen)[0] for ids in prompts] == refs
        run = TargetRunner(model)
        assert all(rowgemm.floatless(w) for w in run.lean.weights())  # fused q/k/v and gate/up: blocks only too
        w = run.lean.weights()[0]
        assert rowgemm.kernel_for(torch.randn(2, w.shape[1]), w) == "block"
        with rowgemm.float32_weights():  # `compare --against plain-float32`: the float32 path beside the blocks
            assert not any(rowgemm.floatless(p) for p in model.parameters()) and rowgemm.PLAN.everywhere == "stream"
            assert rowgemm.kernel_for(torch.randn(2, w.shape[1]), w) == "stream"
            assert [dec.generate(ids, gen)[0] for ids in prompts] == refs
        assert all(rowgemm.floatless(p) and p.stride() == (0, 0) for p in model.parameters() if p.dim() == 2)
        assert [dec.generate(ids, gen)[0] for ids in prompts] == refs
    finally:
        rowgemm.PLAN = before


def test_read_blocks_parses_a_tiny_gguf_written_here_as_gguf_py_reads_it(tmp_path):
    """eagle2 reads a GGUF's header itself (no gguf-py reader: its parse of the metadata held ~140
    MB at its peak on SmolLM2): every kind of metadata value skipped, a custom alignment, the
    block tensors' bytes (llama's q/k rows unpermuted) and the others' types as gguf-py reads them."""
    from eagle2_core.ggufblocks import read_blocks, unpermute_rows

    rng = np.random.default_rng(7)
    path = str(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_block_count(1)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_array("some.nested", [[1, 2], [3]])
    w.add_bool("some.flag", True)
    w.add_float32("some.eps", 1e-5)
    w.add_uint64("some.big", 1 << 40)
    tensors = {}
    for name, n, k, t in [("blk.0.attn_q.weight", 8, 64, "Q8_0"), ("blk.0.attn_k.weight", 4, 64, "Q4_1"),
                          ("blk.0.ffn_up.weight", 6, 64, "Q5_0"), ("token_embd.weight", 10, 64, "Q8_0")]:
        q = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.1).astype(np.float32), getattr(T, t))
        tensors[name] = (q, t)
        w.add_tensor(name, q, raw_dtype=getattr(T, t))
    w.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((64, 6)).astype(np.float32))  # F32: stays dequantized
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))  # 1-D: not a product weight
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    blocks, other = read_blocks(path, num_heads=4, num_kv_heads=2)
    assert other == {"model.layers.0.mlp.down_proj.weight": "F32"}
    reader = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    for name, (q, t) in tensors.items():
        from eagle2_core.ggufblocks import hf_name

        bw = blocks[hf_name(name)]
        assert bw.type_name == t and bw.in_features == 64 and bw.qtype == int(getattr(T, t))
        want = reader[name].reshape(q.shape[0], -1)
        if ".attn_q." in name:
            want = unpermute_rows(want, 4)
        elif ".attn_k." in name:
            want = unpermute_rows(want, 2)
        assert np.array_equal(bw.blocks.numpy(), want), name


def _blocks_everywhere(model, name: str = "Q8_0") -> None:
    """Every linear weight and the embedding hold the dequantization of their own blocks, attached."""
    from eagle2_core import rowgemm
    from eagle2_core.ggufblocks import BlockWeight

    seen = set()
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and id(mod.weight) not in seen:
            seen.add(id(mod.weight))
            w = mod.weight.detach().float().numpy()
            blocks = gguf.quants.quantize(w, getattr(T, name)).reshape(w.shape[0], -1)
            with torch.no_grad():
                mod.weight.copy_(dequantized(name, blocks, w.shape[1]))
            rowgemm.attach_blocks(mod.weight, BlockWeight(torch.from_numpy(blocks.copy()), int(getattr(T, name)), name, w.shape[1]))


def test_a_gemma3_tied_to_its_scaled_embedding_keeps_generate_bits_from_blocks_only():
    """Gemma 3 looks tokens up through an nn.Embedding subclass that scales the rows, and its GGUF
    ties lm_head to that table. Both read the one weight once it is held as blocks only: the
    subclass's own forward must reach the rebuilt rows (it read the one-NaN stand-in before, and
    the Gemma 3 270M GGUF crashed in the draft sources on NaN probabilities)."""
    import copy

    from conftest import make_tiny_lm

    from eagle2_core import Engine, GenerationSettings, TreeSettings, rowgemm
    from eagle2_core.engine import Request
    from eagle2_core.loading import drop_floats
    from eagle2_core.vanilla import VanillaDecoder
    from test_engine import STEP, run_all

    model = make_tiny_lm("gemma3", vocab_size=48, hidden_size=64, max_position_embeddings=64)
    model.lm_head.weight = model.get_input_embeddings().weight
    model.config.tie_word_embeddings = True
    _blocks_everywhere(model)
    ref = copy.deepcopy(model)
    cls = type(model.get_input_embeddings())
    assert cls is not torch.nn.Embedding  # the scaled subclass
    drop_floats(model)
    emb = model.get_input_embeddings()
    assert isinstance(emb, cls) and isinstance(emb, rowgemm.FloatlessEmbedding) and rowgemm.floatless(emb.weight)
    assert model.lm_head.weight is emb.weight
    x = torch.tensor([[1, 5, 9, 2, 40, 7, 7]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    prompts = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 30, 12] * 2]
    refs = [ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=12,
                         do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    gen = GenerationSettings(max_new_tokens=12, eos_token_ids=())
    assert [VanillaDecoder(model).generate(ids, gen)[0] for ids in prompts] == refs
    engine = Engine(model, None, tree=TreeSettings(total_tokens=8, depth=4, top_k=2, budget="auto"), costs=STEP,
                    sources=("recycle", "match"))
    out = run_all(engine, [Request(i, p, gen) for i, p in enumerate(prompts)])
    assert [out[i][0] for i in range(len(prompts))] == refs


def test_an_embedding_whose_forward_bypasses_nn_embedding_keeps_its_floats():
    """A subclass that reads its table directly (not through nn.Embedding's forward) cannot be fed
    rebuilt rows: the conversion checks its output and gives the weight its floats back; a
    weight another, unknown module holds keeps them from the start."""
    import copy

    import torch.nn.functional as F

    from conftest import make_tiny_lm

    from eagle2_core import rowgemm
    from eagle2_core.loading import drop_floats

    class Direct(torch.nn.Embedding):
        def forward(self, ids):
            return F.embedding(ids, self.weight) * 2.0

    class Holder(torch.nn.Module):  # a module of a kind the conversion does not know, sharing the lm_head weight
        def __init__(self, w):
            super().__init__()
            self.w = w

    model = make_tiny_lm("llama", vocab_size=48, hidden_size=64, max_position_embeddings=64)
    model.model.embed_tokens.__class__ = Direct
    model.extra = Holder(model.lm_head.weight)
    _blocks_everywhere(model)
    ref = copy.deepcopy(model)
    drop_floats(model)
    emb = model.get_input_embeddings()
    assert type(emb) is Direct and not rowgemm.floatless(emb.weight) and torch.equal(emb.weight, ref.get_input_embeddings().weight)
    assert type(model.lm_head) is torch.nn.Linear and not rowgemm.floatless(model.lm_head.weight)
    assert rowgemm.floatless(model.model.layers[0].mlp.down_proj.weight)
    x = torch.tensor([[1, 5, 9, 2, 40, 7, 7]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
