"""The products' arithmetic on targets held as blocks (rowgemm.ARITHMETICS): exact (bitwise the
dequantized float32 model) and int8 (activations quantized per row, integer dots). In either a
row's result does not depend on the other rows, so speculation is bitwise plain decoding; in
exact that is also `generate`'s. Tiny Llama targets whose weights are GGUF blocks only, of the
types llama.cpp's Q4_K_M mix puts side by side (a fused q/k/v of Q4_K and Q6_K runs as parts)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle2_core import native

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(native.module() is None, reason="eagle2's native code is not built here")

T = gguf.GGMLQuantizationType
from test_blocks import blocks_of  # noqa: E402  (random blocks of a type, with a real file's scales)
# Q4_K_M's mix in a layer of "more bits": Q4_K q/k, Q6_K v and down; gate/up Q4_K beside Q5_K to
# have a second mixed fusion; the lm_head Q6_K, the embedding Q8_0
MIX = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K", "up_proj": "Q5_K",
       "down_proj": "Q6_K", "lm_head": "Q6_K", "embed_tokens": "Q8_0"}


def block_target(seed: int = 0, vocab: int = 300, fit: bool = False):
    """A tiny Llama (hidden 256, so K-quant rows fit) whose linears and embedding are held as
    blocks only (loading.drop_floats), each weight the dequantization of its own blocks."""
    from conftest import make_tiny_lm

    from eagle2_core import rowgemm
    from eagle2_core.ggufblocks import BlockWeight
    from eagle2_core.loading import drop_floats

    torch.manual_seed(seed)
    model = make_tiny_lm("llama", vocab_size=vocab, hidden_size=256, max_position_embeddings=96)  # intermediate 512
    rng = np.random.default_rng(seed)
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        t = MIX[mod_name.rsplit(".", 1)[-1]]
        n, k = mod.weight.shape
        raw = blocks_of(t, n, k, rng)
        with torch.no_grad():
            mod.weight.copy_(torch.from_numpy(gguf.quants.dequantize(raw, getattr(T, t)).reshape(n, k).copy()))
        rowgemm.attach_blocks(mod.weight, BlockWeight(torch.from_numpy(raw.copy()), int(getattr(T, t)), t, k))
    if fit:  # a head fitted to the float32 weights (the same values; faster than rebuilding them every step)
        from conftest import distill_tiny_head

        fitted = distill_tiny_head(model, steps=80, n_seq=24)
    drop_floats(model)
    return (model, fitted.bind(model)) if fit else model


def head_for(model):
    from eagle2_core.head import DraftHead, HeadSpec

    torch.manual_seed(3)
    return DraftHead(HeadSpec.for_target(model.config)).bind(model).eval()


def test_mixed_block_types_fuse_as_parts_and_keep_generate_bits_in_exact():
    """A fused q/k/v (Q4_K, Q4_K, Q6_K) and gate/up (Q4_K, Q5_K) run as parts through the native
    loop, never as float32: exact greedy speculation equals `generate` on the float32 rebuild."""
    from eagle2_core import Engine, GenerationSettings, TreeSettings, rowgemm
    from eagle2_core.target import TargetRunner

    model = block_target()
    run = TargetRunner(model)
    assert run.lean is not None and run.lean.native_ok
    qkv, gate_up = run.lean.layers[0][1], run.lean.layers[0][3]
    assert isinstance(qkv, list) and [rowgemm.blocks_of(w).type_name for w in qkv] == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(gate_up, list) and all(rowgemm.floatless(w) for w in qkv + gate_up)
    prompts = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 30, 12], [40]]
    refs = [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=10,
                           do_sample=False, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    with rowgemm.using_arithmetic("exact"):
        dec = Engine(model, head_for(model), tree=TreeSettings(total_tokens=6, depth=3, top_k=2))
        gen = GenerationSettings(max_new_tokens=10, eos_token_ids=())
        assert [dec.generate(ids, gen)[0] for ids in prompts] == refs


# -- int8: speculation is plain decoding, bit for bit, on every path ---------------------------
def _engine(model, head, tokens: int, batch: int = 1, prefix: bool = False):
    from eagle2_core import TreeSettings
    from eagle2_core.costs import CostProfile
    from eagle2_core.engine import Engine
    from eagle2_core.prefix import PrefixCache

    flat = CostProfile(key={}, verify_ms={1: 10.0, 16: 12.0}, draft_ms={1: 1.0, 4: 1.0})  # trees always pay: speculation runs
    if tokens == 1:  # plain decoding: no head, no tree, no source (as compare's plain)
        return Engine(model, None, batch=batch, costs=flat, sources=(), prefix_cache=PrefixCache() if prefix else None)
    tree = TreeSettings(shape="dynamic", total_tokens=tokens, depth=4, top_k=3)
    return Engine(model, head, tree=tree, costs=flat, batch=batch, prefix_cache=PrefixCache() if prefix else None)


def _run(eng, reqs) -> dict:
    import collections

    out = {}
    eng.run(collections.deque(reqs), lambda key, tokens, summary: out.__setitem__(key, tokens))
    return out


GENS = {"greedy": dict(max_new_tokens=14, eos_token_ids=()), "seeded": dict(max_new_tokens=14, temperature=0.9, seed=7, eos_token_ids=())}
PROMPTS = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 30, 12, 7, 7, 3], [40], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def _speculated(eng, prompts, gen) -> list:
    """Answers of `eng`, checking that its drafts were accepted (else the identity says nothing)."""
    outs, forwards, tokens = [], 0, 0
    for ids in prompts:
        out, summary = eng.generate(ids, gen)
        outs.append(out)
        forwards, tokens = forwards + summary.target_forwards, tokens + len(out)
    assert forwards < 0.9 * tokens, (forwards, tokens)
    return outs


@pytest.fixture(scope="module")
def int8_target():
    from eagle2_core import rowgemm

    if not rowgemm.have_int8():
        pytest.skip("no int8 kernels built here")
    model, head = block_target(seed=1, vocab=48, fit=True)
    tiled = rowgemm.interleave(model)  # as a loaded GGUF target is held in int8, where this CPU takes it
    assert tiled == 0 or sum(rowgemm.blocks_of(w).tiled is not None for w in model.parameters() if rowgemm.blocks_of(w)) > 10
    return model, head


@pytest.mark.parametrize("sampling", list(GENS))
def test_int8_speculation_is_int8_plain_decoding_at_batch_1_and_3(int8_target, sampling):
    from eagle2_core import GenerationSettings, rowgemm
    from eagle2_core.engine import Request

    model, head = int8_target
    gen = GenerationSettings(**GENS[sampling])
    with rowgemm.using_arithmetic("int8"):
        plain = [_engine(model, head, 1).generate(ids, gen)[0] for ids in PROMPTS]
        assert _speculated(_engine(model, head, 12), PROMPTS, gen) == plain
        reqs = [Request(i, ids, gen) for i, ids in enumerate(PROMPTS)]
        batched_plain = _run(_engine(model, head, 1, batch=3), reqs)
        batched = _run(_engine(model, head, 12, batch=3), [Request(i, ids, gen) for i, ids in enumerate(PROMPTS)])
        assert [batched[i] for i in range(len(PROMPTS))] == [batched_plain[i] for i in range(len(PROMPTS))]
    with rowgemm.using_arithmetic("exact"):  # the other arithmetic is another model: it must have been int8 that ran
        exact = [_engine(model, head, 1).generate(ids, gen)[0] for ids in PROMPTS]
    assert exact != plain


def test_int8_prefix_reuse_and_chunked_prefill_keep_plain_answers(int8_target):
    from eagle2_core import GenerationSettings, rowgemm
    from eagle2_core.engine import Request

    model, head = int8_target
    gen = GenerationSettings(max_new_tokens=10, eos_token_ids=())
    conv = [[1, 5, 9, 2], [7, 3, 11], [4, 30, 12, 5]]
    with rowgemm.using_arithmetic("int8"):
        answers = {}
        for name, eng in (("plain", _engine(model, head, 1)), ("kept", _engine(model, head, 12, prefix=True))):
            ids, outs = [], []
            for part in conv:
                ids = ids + part
                tokens, summary = eng.generate(ids, gen, keep=True)
                outs.append(tokens)
                ids = ids + tokens
            answers[name] = outs
            if name == "kept":
                assert summary.cached_tokens > 0  # the last turn restored the earlier ones
        assert answers["kept"] == answers["plain"]
        long_ids = [(7 * i) % 48 for i in range(50)]
        want = _engine(model, head, 1).generate(long_ids, gen)[0]
        eng = _engine(model, head, 12, batch=2)
        eng.prefill_chunk = 16
        out = _run(eng, [Request(0, [1, 2, 3], gen), Request(1, long_ids, gen)])
        assert out[1] == want
