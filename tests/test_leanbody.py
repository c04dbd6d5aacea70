"""The lean decoder body (leanbody.py): the stock transformers body's arithmetic in plain tensor
ops, for the Llama family on CPUs. Same hidden states as the stock body on our cache (prefill and
a tree verify), the model's parameters unchanged in value, `generate` unchanged, and the stock
body kept wherever the model is not one it recognises."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_lm, model_digest
from eagle2_core import leanbody, native
from eagle2_core.engine import KVCache, num_cache_layers
from eagle2_core.target import TargetRunner
from eagle2_core.tree import batch_trees, causal_rows, context_and_tree, windowed


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=40, initializer_range=0.1,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def tiny_qwen2_hybrid():
    """Qwen2 with sliding windows from layer 1 on (max_window_layers): one mask per layer type."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=40, initializer_range=0.1, tie_word_embeddings=False,
                      use_sliding_window=True, sliding_window=3, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return Qwen2ForCausalLM(cfg).eval().requires_grad_(False)


def build(arch):
    return {"qwen3": tiny_qwen3, "qwen2-hybrid": tiny_qwen2_hybrid}.get(arch, lambda: make_tiny_lm(arch))()


def run_both(run, ids, tree_parents, lean: bool, monkeypatch):
    """Prefill `ids`, then verify a tree after it, with the lean body or the stock one."""
    if not lean:
        monkeypatch.setattr(run, "lean", None)
    n = len(ids)
    cache = KVCache(num_cache_layers(run.config), 1, 32)
    pos = torch.arange(n)[None]
    cache.row, cache.cells, cache.view = 0, pos[0], n
    mask = run.masks(lambda w: windowed(causal_rows(pos, n), pos, pos, w))
    with torch.no_grad():
        pre, _ = run.body_forward(ids[None], pos, mask, cache, {}, None)
        cache.row = None
        parents = torch.tensor([tree_parents])
        m = parents.shape[1]
        depth, anc = batch_trees(parents, m)
        seq_len = torch.tensor([n])
        view = n + m
        cache.cells, cache.view = seq_len[:, None] + torch.arange(m), view
        q_pos = seq_len[:, None] + depth
        k_pos = torch.arange(view)[None].scatter(1, cache.cells, q_pos)
        mask = run.masks(lambda w: windowed(context_and_tree(seq_len, anc, view), q_pos, k_pos, w))
        tree, _ = run.body_forward(torch.tensor([[3, 5, 7, 2, 9]])[:, :m], q_pos, mask, cache, {}, None)
    return pre, tree, [layer.keys.clone() for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "qwen2-hybrid"])
def test_lean_body_matches_the_stock_body(arch, monkeypatch):
    """Prefill of 9 tokens and a 5-node tree (root, two children, a grandchild each) give the same
    hidden states and the same cache through either body (Mistral's window of 5 included)."""
    model = build(arch)
    run = TargetRunner(model)
    assert run.lean is not None, leanbody.why_not(run.body, run.config)
    assert run.hybrid == (arch == "qwen2-hybrid")
    ids = torch.tensor([1, 4, 2, 8, 5, 7, 3, 3, 6])
    parents = [-1, 0, 0, 1, 2]
    stock = run_both(TargetRunner(model), ids, parents, False, monkeypatch)
    lean = run_both(run, ids, parents, True, monkeypatch)
    for a, b in zip(stock[:2], lean[:2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(stock[2], lean[2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_fusing_keeps_the_model_as_it_was(tmp_path):
    """The q/k/v and gate/up parameters become views of one weight each, with the same values:
    the state dict, `generate`, `save_pretrained` and a second runner (which reuses the fusion)
    are unchanged."""
    model = make_tiny_lm("qwen2")  # q/k/v with biases
    before = model_digest(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    run = TargetRunner(model)
    layer = model.model.layers[0]
    qkv = run.lean.layers[0][1]
    q, v = layer.self_attn.q_proj, layer.self_attn.v_proj
    assert q.weight.data_ptr() == qkv.data_ptr() and v.bias.data_ptr() + v.bias.numel() * 4 == run.lean.layers[0][2].data_ptr() + run.lean.layers[0][2].numel() * 4
    assert torch.equal(qkv[: q.out_features], q.weight) and isinstance(q.weight, torch.nn.Parameter)
    assert qkv.shape[0] == sum(getattr(layer.self_attn, p).out_features for p in ("q_proj", "k_proj", "v_proj"))
    assert model_digest(model) == before
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref)
    again = TargetRunner(model)
    assert again.lean is run.lean and again.lean.layers[0][1] is qkv
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path)  # safetensors refuses tensors sharing storage unless transformers handles them
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in model.state_dict().items())


def test_the_stock_body_is_kept_where_the_lean_one_does_not_apply(monkeypatch):
    gemma = make_tiny_lm("gemma3")
    assert TargetRunner(gemma).lean is None and "another kind" in leanbody.why_not(gemma.model, gemma.config)  # its scaled embedding
    eager = make_tiny_lm("llama")
    eager.config._attn_implementation = "eager"
    assert "attention implementation 'eager'" in leanbody.why_not(eager.model, eager.config)
    hooked = make_tiny_lm("llama", seed=3)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert TargetRunner(hooked).lean is None and "hooks" in leanbody.why_not(hooked.model, hooked.config)
    half = make_tiny_lm("llama", seed=4).half()
    assert "float32/bfloat16" in leanbody.why_not(half.model, half.config)
    monkeypatch.setenv("EAGLE2_BODY", "stock")
    assert TargetRunner(make_tiny_lm("llama", seed=5)).lean is None


def test_lean_body_in_bfloat16_matches_the_stock_body(monkeypatch):
    model = make_tiny_lm("llama").to(torch.bfloat16)
    ids = torch.tensor([1, 4, 2, 8, 5, 7])
    stock = run_both(TargetRunner(model), ids, [-1, 0, 1], False, monkeypatch)
    lean = run_both(TargetRunner(model), ids, [-1, 0, 1], True, monkeypatch)
    for a, b in zip(stock[:2], lean[:2]):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("hidden", [32, 576, 896])
def test_rms_norm_and_rotary_are_the_stock_arithmetic_bitwise(hidden):
    """torch.rms_norm in float32 and rotary as a roll with a signed sine are the stock ops'
    results bit for bit (a future torch that changes either fails here, not in a long run)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    torch.manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden)
    for x in (torch.randn(1, 1, hidden), torch.randn(2, 7, hidden) * 30, torch.randn(1, 300, hidden) * 0.01):
        assert torch.equal(leanbody.rms_norm(x, norm), norm(x))
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    signed = leanbody.signed_sine(sin)[:, None]
    assert torch.equal(leanbody.rotary(q, cos[:, None], signed), ref_q) and torch.equal(leanbody.rotary(k, cos[:, None], signed), ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["linear", "transposed", "packed", "stream"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama/64"])  # /64: hidden 64, head_dim 16 (the loops' vector paths)
def test_the_native_loop_is_the_python_loop(arch, kernel, dtype):
    """The native layer loop (C++, each product by the plan's kernel) gives the Python loop's
    hidden states and cache, at one row and at a 4-node tree, one sequence in live mode, with every
    kernel forced in turn: bit for bit in bfloat16 (the same ATen ops), to rounding in float32
    (our own loops between the products); it steps aside for what it does not serve (a prefill
    row, a batch whose cells are not its own, EAGLE-3 layer capture)."""
    from eagle2_core import rowgemm

    if not rowgemm._offered(kernel):
        pytest.skip(f"{kernel} is not offered here")
    if leanbody.native_loop() is None:
        pytest.skip(f"no native loop here: {leanbody.native_status()}")
    arch, _, hidden = arch.partition("/")
    model = make_tiny_lm(arch, hidden_size=int(hidden or 32)).to(dtype)
    run = TargetRunner(model)
    lean = run.lean
    assert lean.native_ok
    with rowgemm.using_plan(rowgemm.forced(kernel)):
        rowgemm.prepare(lean.weights())
        outs = {}
        for native in (False, True):
            lean.native_ok = native
            cache = KVCache(num_cache_layers(run.config), 1, 32)
            ids = torch.tensor([1, 4, 2, 8, 5, 7])
            pos = torch.arange(6)[None]
            cache.row, cache.cells, cache.view = 0, pos[0], 6
            with torch.no_grad():
                mask = run.masks(lambda w: windowed(causal_rows(pos, 6), pos, pos, w))
                assert lean._native(1, 6, mask, cache, None, dtype) == (None, None, None)  # a prefill row
                run.body_forward(ids[None], pos, mask, cache, {}, None)
                cache.row = None
                got = []
                for parents in ([-1], [-1, 0, 0, 1]):
                    m = len(parents)
                    depth, anc = batch_trees(torch.tensor([parents]), m)
                    seq_len = torch.tensor([6])
                    cache.cells, cache.view, cache.start = seq_len[:, None] + torch.arange(m), 6 + m, 6
                    q_pos = seq_len[:, None] + depth
                    k_pos = torch.arange(6 + m)[None].scatter(1, cache.cells, q_pos)
                    mask = run.masks(lambda w: windowed(context_and_tree(seq_len, anc, 6 + m), q_pos, k_pos, w))
                    assert (lean._native(1, m, mask, cache, None, dtype)[0] is not None) == native
                    assert lean._native(2, m, mask, cache, None, dtype) == (None, None, None)  # cells of one sequence
                    assert lean._native(1, m, mask, cache, (0,), dtype) == (None, None, None)
                    got.append(run.body_forward(torch.tensor([[3, 5, 7, 2]])[:, :m], q_pos, mask, cache, {}, None)[0])
                got.append(torch.stack([layer.keys for layer in cache.layers]))
            outs[native] = got
        lean.native_ok = True
        rowgemm.prepare(lean.weights(), rowgemm.ProductPlan())
    for a, b in zip(outs[False], outs[True]):
        if dtype == torch.bfloat16:  # the same ATen ops: bit for bit
            assert torch.equal(a, b)
        else:  # float32: our own loops between the products (csrc/layers.cpp), sums in another order
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("hidden", [64, 256])
def test_a_native_row_gets_the_same_bits_wherever_it_sits_in_the_tree(hidden):
    """float32, the native loop: a verified node's hidden state does not depend on where it sits
    among the forward's rows (attention takes rows four at a time, sharing each key and value
    read). A chain of 7 nodes, alone and behind a decoy child of the root (so each chain node moves
    one row, into another slot of its group of four), over the same 14 cells: bit for bit, at head
    sizes 16 and 64 (one and four 16-wide slices a pass; a head size that is no multiple of 16,
    as the tiny models' 8, takes scalar loops that do not keep this, before this change too)."""
    from eagle2_core import rowgemm

    if leanbody.native_loop() is None:
        pytest.skip(f"no native loop here: {leanbody.native_status()}")
    model = make_tiny_lm("qwen2", hidden_size=hidden)
    run = TargetRunner(model)
    assert run.lean is not None and run.lean.native_ok
    chain = [3, 5, 7, 2, 9, 4, 6]
    trees = {"alone": (chain, [-1, 0, 1, 2, 3, 4, 5]),
             "behind a decoy": ([3, 11] + chain[1:], [-1, 0, 0, 2, 3, 4, 5, 6])}
    out = {}
    with rowgemm.using_plan(rowgemm.forced("stream")):
        rowgemm.prepare(run.lean.weights())
        cache = KVCache(num_cache_layers(run.config), 1, 32)
        pos = torch.arange(6)[None]
        cache.row, cache.cells, cache.view = 0, pos[0], 6
        with torch.no_grad():
            run.body_forward(torch.tensor([[1, 4, 2, 8, 5, 7]]), pos, run.masks(lambda w: windowed(causal_rows(pos, 6), pos, pos, w)),
                             cache, {}, None)
            cache.row = None
            for name, (tokens, parents) in trees.items():
                m = len(tokens)
                depth, anc = batch_trees(torch.tensor([parents]), m)
                seq_len = torch.tensor([6])
                cache.cells, cache.view, cache.start = seq_len[:, None] + torch.arange(m), 14, 6
                q_pos = seq_len[:, None] + depth
                k_pos = torch.arange(14)[None].scatter(1, cache.cells, q_pos)
                mask = run.masks(lambda w: windowed(context_and_tree(seq_len, anc, 14), q_pos, k_pos, w))
                assert run.lean._native(1, m, mask, cache, None, torch.float32)[0] is not None
                out[name] = run.body_forward(torch.tensor([tokens]), q_pos, mask, cache, {}, None)[0][0]
        rowgemm.prepare(run.lean.weights(), rowgemm.ProductPlan())
    assert torch.equal(out["alone"][0], out["behind a decoy"][0])
    assert torch.equal(out["alone"][1:], out["behind a decoy"][2:])


def test_a_sequence_gets_the_same_bits_alone_and_beside_another():
    """float32, the native loop at batch 2 (live mode): each sequence's tree rows and its cache
    cells are the bits it gets alone at batch 1, though the two have other lengths (so the view
    covers the longer one's cells) and other trees."""
    from eagle2_core import rowgemm

    if leanbody.native_loop() is None:
        pytest.skip(f"no native loop here: {leanbody.native_status()}")
    model = make_tiny_lm("qwen2", hidden_size=64)
    run = TargetRunner(model)
    seqs = [([1, 4, 2, 8, 5, 7], [3, 5, 7, 2], [-1, 0, 0, 1]), ([9, 3, 6], [2, 8, 4, 1], [-1, 0, 1, 2])]

    def prefill(cache, row, ids):
        pos = torch.arange(len(ids))[None]
        cache.row, cache.cells, cache.view = row, pos[0], len(ids)
        run.body_forward(torch.tensor([ids]), pos, run.masks(lambda w: windowed(causal_rows(pos, len(ids)), pos, pos, w)), cache, {}, None)
        cache.row = None

    def tree_forward(cache, rows, starts):
        depth, anc = batch_trees(torch.tensor([p for _, _, p in rows]), 4)
        seq_len = torch.tensor(starts)
        view = max(starts) + 4
        cache.cells, cache.view = seq_len[:, None] + torch.arange(4), view
        cache.start = starts[0] if len(rows) == 1 else None
        q_pos = seq_len[:, None] + depth
        k_pos = torch.arange(view)[None].expand(len(rows), view).scatter(1, cache.cells, q_pos)
        mask = run.masks(lambda w: windowed(context_and_tree(seq_len, anc, view), q_pos, k_pos, w))
        assert run.lean._native(len(rows), 4, mask, cache, None, torch.float32)[0] is not None
        return run.body_forward(torch.tensor([t for _, t, _ in rows]), q_pos, mask, cache, {}, None)[0]

    with rowgemm.using_plan(rowgemm.forced("stream")), torch.no_grad():
        rowgemm.prepare(run.lean.weights())
        alone = []
        for ids, tokens, parents in seqs:
            cache = KVCache(num_cache_layers(run.config), 1, 32)
            prefill(cache, 0, ids)
            hidden = tree_forward(cache, [(ids, tokens, parents)], [len(ids)])[0]
            alone.append((hidden, cache.layers[0].keys[0, :, : len(ids) + 4].clone()))
        cache = KVCache(num_cache_layers(run.config), 2, 32)
        for b, (ids, _, _) in enumerate(seqs):
            prefill(cache, b, ids)
        both = tree_forward(cache, seqs, [len(ids) for ids, _, _ in seqs])
        rowgemm.prepare(run.lean.weights(), rowgemm.ProductPlan())
    for b, (ids, _, _) in enumerate(seqs):
        assert torch.equal(both[b], alone[b][0])
        assert torch.equal(cache.layers[0].keys[b, :, : len(ids) + 4], alone[b][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama/64"])
def test_the_draft_heads_native_step_is_its_stock_layer(arch, dtype, monkeypatch):
    """A draft step (one head layer over a tree level's rows, written after the context) through
    the native loop gives the stock transformers layer's states and head cache: bit for bit in
    bfloat16, to rounding in float32; the absorb of a prompt (no cache yet) and a step whose cells
    are not one run keep the stock layer. The fused copies follow the head's weights."""
    from eagle2_core.head import DraftHead, HeadSpec
    from eagle2_core.tree import additive

    if leanbody.native_loop() is None:
        pytest.skip(f"no native loop here: {leanbody.native_status()}")
    arch, _, hidden = arch.partition("/")
    model = make_tiny_lm(arch, hidden_size=int(hidden or 32)).to(dtype)
    torch.manual_seed(0)
    head = DraftHead(HeadSpec.for_target(model.config)).eval().bind(model)
    H = model.config.hidden_size
    feats = torch.randn(1, 9, H).to(dtype)
    ids = torch.tensor([[1, 4, 2, 8, 5, 7, 3, 5, 7]])
    seen = []
    real = leanbody.head_layer

    def counted(*a):
        got = real(*a)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(leanbody, "head_layer", counted)

    def run(native: bool):
        monkeypatch.setattr(leanbody, "native_loop", leanbody.native.module if native else (lambda: None))
        cache = KVCache(1, 1, 16)
        with torch.no_grad():
            cache.cells, cache.view = torch.arange(6)[None], 6  # the prompt's pairs: no cache yet, the stock layer
            head(ids[:, :6], feats[:, :6], torch.arange(6)[None], attention_mask=additive(causal_rows(torch.arange(6)[None], 6), dtype), cache=cache)
            depth, anc = batch_trees(torch.tensor([[-1, 0, 0]]), 3)
            cache.cells, cache.view = 6 + torch.arange(3)[None], 9
            mask = additive(context_and_tree(torch.tensor([6]), anc[:, :3, :3], 9), dtype)
            out = head(ids[:, 6:], feats[:, 6:], 6 + depth, attention_mask=mask, cache=cache)
            cache.cells = torch.tensor([[9, 11, 10]])  # not one run: the stock layer
            cache.view = 12
            mask2 = additive(context_and_tree(torch.tensor([9]), anc[:, :3, :3], 12), dtype)
            out2 = head(ids[:, 6:], feats[:, 6:], 9 + depth, attention_mask=mask2, cache=cache)
        return out, out2, cache.layers[0].keys.clone(), cache.layers[0].values.clone()

    stock = run(False)
    seen.clear()
    fast = run(True)
    assert seen == [False, True, False]
    for a, b in zip(stock, fast):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    qkv = leanbody.head_weights(head)[0]
    k = head.layers[0].self_attn.k_proj.weight
    assert k.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # a view into the fused weight, no copy
    before = qkv.clone()
    with torch.no_grad():
        k.mul_(2.0)  # a training step: the fused weight the native step reads has it too
    after = leanbody.head_weights(head)[0]
    assert not torch.equal(after, before)
    assert torch.equal(after[head.layers[0].self_attn.q_proj.weight.shape[0]:][: k.shape[0]], k)


@pytest.mark.skipif(native.module() is None, reason="eagle2's native code is not built here")
def test_the_native_loops_exp_is_expf_within_two_ulp():
    """silu and softmax in the float32 native loop use our vector exp (vec.h): held to float64's
    e^x within 2 ulp over the whole range where e^x is a normal float, and at the range's edges."""
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_003), torch.tensor([0.0, -0.0, 1e-8, -1e-8, 0.34657359, -0.34657359])])
    got = native.module().vector_exp(x[: len(x) // 16 * 16]).double()
    want = torch.exp(x[: len(x) // 16 * 16].double())
    ulp = (want.float().nextafter(torch.tensor(float("inf"))) - want.float()).double()
    assert ((got - want).abs() / ulp).max() <= 2.0
    # far below: 0, as softmax needs for a masked score (-inf or the dtype's minimum)
    low = torch.tensor([-88.0, -1e4, float("-inf"), torch.finfo(torch.float32).min] * 4)
    assert torch.equal(native.module().vector_exp(low), torch.zeros(16))
