"""The products' arithmetic on targets held as blocks (rowgemm.ARITHMETICS): exact (bitwise the
dequantized float32 model) and int8 (activations quantized per row, integer dots). In either a
row's result does not depend on the other rows, so speculation is bitwise plain decoding; in
exact that is also `generate`'s. Tiny Llama targets whose weights are GGUF blocks only, of the
types llama.cpp's Q4_K_M mix puts side by side (a fused q/k/v of Q4_K and Q6_K runs as parts)."""
from __future__ import annotations

import collections

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


def block_target(seed: int = 0, vocab: int = 300, fit: bool = False, mix: dict | None = None):
    """A tiny Llama (hidden 256, so K-quant rows fit) whose linears and embedding are held as
    blocks only (loading.drop_floats), each weight the dequantization of its own blocks, of the
    types `mix` gives them (MIX's by default)."""
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
        t = (mix or MIX)[mod_name.rsplit(".", 1)[-1]]
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
    from eagle2_core.target import TargetRunner

    lean = TargetRunner(model).lean  # the fit asked transformers for hidden states: its hooks stay on the model, inert
    assert lean is not None and lean.native_ok
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


# -- int8: a token's activations are the same bits on every path --------------------------------
# A prompt's rows go through the native layer loop as decode steps and verifies do, so what a
# kept prefix restores is what a whole prefill computes, and chunking changes no bit.
def _uniform(t: str) -> dict:
    return {name: t for name in MIX}


TYPES = {"Q4_K_M": MIX, "Q4_0": _uniform("Q4_0"), "Q8_0": _uniform("Q8_0"), "Q5_1": _uniform("Q5_1"),
         "Q5_K/Q6_K": {**_uniform("Q5_K"), "v_proj": "Q6_K", "down_proj": "Q6_K", "lm_head": "Q6_K"}}


def _prefill(model, ids, cuts=(), batch: int = 1, row: int = 0, kept=None, reuse: int = 0):
    """(last row's logits, the row's K/V per layer) of `ids` admitted into `row` of a `batch`-row
    cycle (the other rows holding prompts of their own), in pieces ending at `cuts`, each piece
    restoring the cells before it from the last one kept; `kept`/`reuse`: the first piece's restore."""
    from eagle2_core import TreeSettings
    from eagle2_core.cycle import Cycle, Slot
    from eagle2_core.target import TargetRunner

    cyc = Cycle(TargetRunner(model), None, TreeSettings(total_tokens=1), batch, len(ids) + 8)
    got = {}

    def pick(logits):
        got["logits"] = logits.clone()
        return 0

    with cyc.session():
        for b in range(batch):
            if b != row:
                cyc.admit(b, [(5 * b + 3 * i + 1) % 48 for i in range(6 + 9 * b)], Slot(b, None), pick)
        start = reuse
        for end in [c for c in cuts if c > start] + [len(ids)]:
            cyc.admit(row, ids[:end], Slot("x", None), pick, kept, start)
            if end < len(ids):
                kept, start = cyc.kept_row(row, ids[:end]), end
                cyc.release(row)
        return got["logits"], cyc.rows.cache.take(row, len(ids))


def _same_bits(a, b) -> bool:
    (la, kva), (lb, kvb) = a, b
    return torch.equal(la, lb) and len(kva) == len(kvb) and all(torch.equal(x, y) for p, q in zip(kva, kvb) for x, y in zip(p, q))


@pytest.mark.parametrize("types", list(TYPES))
def test_int8_prompt_rows_are_the_same_bits_whole_chunked_restored_batched_and_decoded(types, monkeypatch):
    """int8: a prompt's last logits and every cell of its cache (each layer's K and V, so each
    layer's activations) are bitwise the same prefilled whole, in chunks of 1, 3 and 7 rows
    (admitted in pieces, or one admission run 5 rows a native forward), after a prefix restored
    from another prompt's kept cells, in row 1 of three beside other prompts, and where its cells
    were written by plain decoding steps instead."""
    from eagle2_core import GenerationSettings, leanbody, rowgemm
    from eagle2_core.prefix import PrefixCache
    from eagle2_core.engine import Engine

    if not rowgemm.have_int8():
        pytest.skip("no int8 kernels built here")
    model = block_target(seed=2, vocab=48, mix=TYPES[types])
    rowgemm.interleave(model)
    ids = [(7 * i + 3) % 48 for i in range(41)]
    with rowgemm.using_arithmetic("int8"):
        whole = _prefill(model, ids)
        for size in (1, 3, 7):
            assert _same_bits(_prefill(model, ids, cuts=range(size, len(ids), size)), whole), f"chunks of {size}"
        with monkeypatch.context() as m:
            m.setattr(leanbody, "PREFILL_ROWS", 5)
            assert _same_bits(_prefill(model, ids), whole), "5 rows a native forward"
        assert _same_bits(_prefill(model, ids, batch=3, row=1), whole), "row 1 of 3"
        other = ids[:17] + [(5 * i) % 48 for i in range(20)]  # shares 17 ids, then parts
        _, cells = _prefill(model, other)
        from eagle2_core.prefix import Kept

        assert _same_bits(_prefill(model, ids, kept=Kept(tuple(other), cells, None, 0), reuse=17), whole), "restored prefix"
        # cells written by one-row decoding steps (the cycle's native loop with a longer view)
        eng = Engine(model, None, batch=1, sources=(), prefix_cache=PrefixCache())
        tokens, _ = eng.generate(ids[:20], GenerationSettings(max_new_tokens=12, eos_token_ids=()), keep=True)
        kept, _ = eng.prefix.lookup(ids[:20] + tokens)
        seq = list(kept.ids)
        assert len(seq) == 31
        assert _same_bits((torch.zeros(1), kept.target), (torch.zeros(1), _prefill(model, seq)[1]))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("sampling", list(GENS))
def test_int8_speculation_with_kept_prefixes_is_plain_decoding_to_the_logprob_bit(int8_target, sampling, batch):
    """int8, the prefix cache on: each turn of three conversations restores the last turn's cells
    (its prompt prefilled, its answer verified) and prefills only what is new; its tokens and
    every token's logprobs are bitwise those of plain decoding that prefills every turn whole,
    one conversation at a time, at batch 1 and 3."""
    from eagle2_core import GenerationSettings, rowgemm
    from eagle2_core.engine import Request

    model, head = int8_target
    gen = GenerationSettings(**GENS[sampling], logprobs=2)
    convs = [[[1, 5, 9, 2], [7, 3, 11], [4, 30, 12, 5]], [[6, 2], [8, 8, 1, 40, 3], [2]], [[33, 4, 9, 17, 5, 3], [12], [9, 9, 1]]]

    def turns(eng, batch: int) -> dict:
        out, ids = {}, [[] for _ in convs]
        for t in range(3):
            for c, conv in enumerate(convs):
                ids[c] = ids[c] + conv[t]
            if batch == 1:
                done = {c: eng.generate(ids[c], gen, keep=True) for c in range(len(convs))}
            else:
                done = {}
                eng.run(collections.deque(Request(c, ids[c], gen, keep=True) for c in range(len(convs))),
                        lambda key, tokens, summary: done.__setitem__(key, (tokens, summary)))
            for c, (tokens, summary) in done.items():
                out[c, t] = (tokens, summary.logprobs, summary.cached_tokens, summary.target_forwards)
                ids[c] = ids[c] + tokens
        return out

    with rowgemm.using_arithmetic("int8"):
        plain = turns(_engine(model, head, 1), 1)
        kept = turns(_engine(model, head, 12, batch=batch, prefix=True), batch)
    assert all(kept[c, t][2] > 0 for c in range(len(convs)) for t in (1, 2))  # later turns restored earlier ones
    assert all(plain[k][2] == 0 for k in plain)
    assert sum(v[3] for v in kept.values()) < 0.9 * sum(len(v[0]) for v in kept.values())  # drafts were accepted
    for k in plain:
        assert kept[k][0] == plain[k][0], k
        assert kept[k][1] == plain[k][1], k  # TokenLogprob's floats compared exactly


def test_int8_layout_interleaved_between_answers_gives_the_same_answers():
    """chat answers first from the file's layout and interleaves after (Runtime.settle): an engine
    that answered before the interleave answers the same after it, and then reads the tiles."""
    from eagle2_core import GenerationSettings, rowgemm
    from eagle2_core.target import TargetRunner

    if not rowgemm.have_int8():
        pytest.skip("no int8 kernels built here")
    model, head = block_target(seed=2, vocab=48), None
    gen = GenerationSettings(max_new_tokens=10, eos_token_ids=())
    with rowgemm.using_arithmetic("int8"):
        plain, eng = _engine(model, head, 1), _engine(model, head, 1)
        before = [eng.generate(ids, gen)[0] for ids in PROMPTS]
        if rowgemm.interleave(model) == 0:
            pytest.skip("this CPU's int8 kernel reads no interleaved layout")
        after = [eng.generate(ids, gen)[0] for ids in PROMPTS]
        assert after == before == [plain.generate(ids, gen)[0] for ids in PROMPTS]
        tiled = {id(rowgemm.blocks_of(w).tiled) for w in model.parameters() if rowgemm.blocks_of(w) is not None}
        lean = TargetRunner(model).lean
        read = [t for _, _, (tensors, _, _) in lean._packs.values() for kind in tensors for t in kind]
        assert read and all(id(t) in tiled for t in read)  # the native loop's cached operands were renewed
