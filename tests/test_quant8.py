"""An 8-bit target on CPU: EAGLE-2 greedy output equals the 8-bit model's own `generate` output
(VanillaDecoder) token for token. `--load-in-8bit` on a CPU is eagle2's weight-only 8-bit (int8
rows with a float32 scale each, read by the block kernel: quantization.py); bitsandbytes' LLM.int8
is still tested directly where it runs (a GPU keeps it).

Identity is with the *same* quantized model, not with the float model: quantization changes the
target, speculative decoding must not change it further.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.vanilla import VanillaDecoder

VOCAB, MAXPOS = 12, 48


def bnb_cpu_int8_problem() -> str | None:
    """None if bitsandbytes can run an int8 linear layer on this CPU, else the precise reason."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # not installed, or its native library fails to load
        return f"bitsandbytes unavailable: {type(e).__name__}: {e}"
    try:
        torch.manual_seed(0)
        lin = bnb.nn.Linear8bitLt(32, 16, bias=False, has_fp16_weights=False)
        lin.weight = bnb.nn.Int8Params(torch.randn(16, 32), requires_grad=False, has_fp16_weights=False)
        lin = lin.to("cpu")
        y = lin(torch.randn(3, 32))
        assert y.shape == (3, 16) and torch.isfinite(y).all()
    except Exception as e:
        return f"bitsandbytes {bnb.__version__} cannot run Linear8bitLt on CPU: {type(e).__name__}: {e}"
    return None


def write_model_folder(folder: str, tiny_lm, outliers: bool = False) -> None:
    """Tiny Llama + word-level tokenizer. With `outliers`, even tokens' embeddings get one dominant
    feature, so normalised activations exceed LLM.int8's outlier threshold (6.0) in that column,
    as activations of real models above ~6B parameters do."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_lm("llama", vocab_size=VOCAB, hidden_size=64, max_position_embeddings=MAXPOS)
    if outliers:
        with torch.no_grad():
            model.get_input_embeddings().weight[::2, 5] = 3.0
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)


def require_bnb():
    problem = bnb_cpu_int8_problem()
    if problem:
        print(f"\n[quant8] SKIPPED: {problem}")
        pytest.skip(problem)


def compare_with_vanilla(model, head, n_prompts: int = 8, seed: int = 8):
    """(prompts identical, prompts run, accepted histogram) of EAGLE-2 vs VanillaDecoder, greedy."""
    dec = Engine(model, head, tree=TreeSettings(total_tokens=10, depth=4, top_k=3))
    van = VanillaDecoder(model)
    rng = random.Random(seed)
    hist, same, diffs = [0] * 5, 0, []
    for i in range(n_prompts):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        gen = GenerationSettings(max_new_tokens=rng.randint(5, 30) if i < n_prompts - 1 else 100, eos_token_ids=())
        out, s = dec.generate(ids, gen)
        ref, _ = van.generate(ids, gen)
        same += out == ref
        if out != ref:
            diffs.append((ids, out, ref))
        for d, c in enumerate(s.accepted_hist[:5]):
            hist[d] += c
    return same, n_prompts, hist, diffs


def test_8bit_target_identical_to_8bit_vanilla(tmp_path, tiny_lm, fitted_head):
    """eagle2's CPU 8-bit: every linear weight (lm_head too) and the embedding held as int8 rows
    only (no float32 copy), the loading note says what it is, EAGLE-2 greedy == the 8-bit model's
    `generate`, which is the float32 model over the rebuilt weights `scale * q`, bitwise."""
    from transformers import AutoModelForCausalLM

    from eagle2_core import native, rowgemm
    from eagle2_core.loading import load_target
    from eagle2_core.quantization import ROW_I8
    from int8_reference import rebuild_row_int8

    if native.module() is None:
        pytest.skip("eagle2's native code is not built here")
    folder = str(tmp_path / "model")
    write_model_folder(folder, tiny_lm)
    lt = load_target(folder, load_in_8bit=True, device="cpu")
    model = lt.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is rowgemm.FloatlessLinear and rowgemm.floatless(m.weight) for m in linears)
    assert all(rowgemm.blocks_of(m.weight).qtype == ROW_I8 for m in linears)
    assert type(model.get_input_embeddings()) is rowgemm.FloatlessEmbedding
    assert any("LLM.int8" in line and "8-bit blocks" in line and "--exact" in line for line in lt.notes)
    n_float = sum(m.weight.shape[0] * m.weight.shape[1] for m in linears) + model.get_input_embeddings().weight.numel()
    assert lt.block_bytes < 0.3 * 4 * n_float and lt.floatless_bytes == 4 * n_float
    # the 8-bit model is the float32 model over scale * q
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            q = dict(model.named_parameters())[name]
            if rowgemm.floatless(q):
                p.copy_(rebuild_row_int8(rowgemm.blocks_of(q)))
        x = torch.tensor([[1, 5, 9, 2, 7, 3]])
        assert torch.equal(model(x).logits, ref(x).logits)
    same, n, hist, diffs = compare_with_vanilla(model, fitted_head(model, steps=100))
    print(f"\n[quant8] eagle2 8-bit llama on CPU: {same}/{n} identical to 8-bit vanilla, accepted_hist={hist}")
    assert not diffs, diffs[:2]
    assert sum(hist[2:]) > 0


def test_4bit_on_cpu_is_q4_0_blocks_and_exact(tmp_path, tiny_lm, fitted_head):
    from eagle2_core import native, rowgemm
    from eagle2_core.loading import load_target

    if native.module() is None:
        pytest.skip("eagle2's native code is not built here")
    folder = str(tmp_path / "model")
    write_model_folder(folder, tiny_lm)
    lt = load_target(folder, load_in_4bit=True, device="cpu")
    q = lt.model.model.layers[0].self_attn.q_proj
    assert rowgemm.floatless(q.weight) and rowgemm.blocks_of(q.weight).type_name == "Q4_0"
    assert any("Q4_0" in line for line in lt.notes)
    same, n, hist, diffs = compare_with_vanilla(lt.model, fitted_head(lt.model, steps=60), n_prompts=4)
    assert not diffs, diffs[:2]


def test_8bit_on_cpu_refuses_a_half_precision_dtype(tmp_path, tiny_lm):
    from eagle2_core import native
    from eagle2_core.loading import LoadError, load_target

    if native.module() is None:
        pytest.skip("eagle2's native code is not built here")
    folder = str(tmp_path / "model")
    write_model_folder(folder, tiny_lm)
    with pytest.raises(LoadError, match="float32 activations"):
        load_target(folder, load_in_8bit=True, device="cpu", dtype="bfloat16")


@pytest.fixture(scope="module")
def outlier_folder(tmp_path_factory, tiny_lm):
    folder = str(tmp_path_factory.mktemp("q8") / "outliers")
    write_model_folder(folder, tiny_lm, outliers=True)
    return folder


def test_8bit_pure_int8_with_outliers_is_identical(outlier_folder, fitted_head):
    """With llm_int8_threshold=0 (no fp16 outlier decomposition) every row is quantized on its
    own, the layer is batch-invariant, and identity holds even with outlier activations."""
    require_bnb()
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        outlier_folder, device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)).eval()
    same, n, hist, diffs = compare_with_vanilla(model, fitted_head(model, steps=60))
    print(f"\n[quant8] 8-bit, outliers, threshold 0.0: {same}/{n} identical to 8-bit vanilla")
    assert not diffs, diffs[:2]


def test_8bit_via_load_target_with_outliers_is_identical(outlier_folder, fitted_head):
    from eagle2_core import native
    from eagle2_core.loading import load_target

    if native.module() is None:
        pytest.skip("eagle2's native code is not built here")

    lt = load_target(outlier_folder, load_in_8bit=True, device="cpu")
    same, n, hist, diffs = compare_with_vanilla(lt.model, fitted_head(lt.model, steps=60))
    print(f"\n[quant8] eagle2 8-bit via load_target, outliers: {same}/{n} identical to 8-bit vanilla")
    assert not diffs, diffs[:1]


def test_a_head_beside_a_block_target_drafts_from_8bit_rows(tmp_path, tiny_lm, fitted_head):
    """Beside a target held as blocks the head's own linears become 8-bit rows too (its float32
    layer cost a quarter of a 4-bit target's step on SmolLM2): each product is the one over the
    rebuilt weights `scale * q`, the shared embedding and lm_head stay the target's, and the
    output is still exactly the target's, with drafts accepted."""
    from eagle2_core import leanbody, native, rowgemm
    from eagle2_core.loading import load_target
    from eagle2_core.quantization import ROW_I8, head_blocks
    from int8_reference import rebuild_row_int8

    if native.module() is None:
        pytest.skip("eagle2's native code is not built here")
    folder = str(tmp_path / "model")
    write_model_folder(folder, tiny_lm)
    model = load_target(folder, load_in_4bit=True, device="cpu").model
    assert any(map(rowgemm.floatless, model.parameters()))
    head = fitted_head(model, steps=60)
    assert not any(map(rowgemm.floatless, head.parameters()))
    floats = {n: p.detach().clone() for n, p in head.named_parameters()}
    H = model.config.hidden_size
    ids, feats, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.randn(1, 5, H), torch.arange(5)[None]
    made = head_blocks(head)
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert made > 0 and linears and all(rowgemm.floatless(m.weight) and rowgemm.blocks_of(m.weight).qtype == ROW_I8 for m in linears)
    assert head.embed is model.get_input_embeddings()  # shared, untouched
    with torch.no_grad():
        got = head(ids, feats, pos)
        ref = type(head)(head.spec).eval()
        for n, p in ref.named_parameters():
            q = dict(head.named_parameters())[n]
            p.copy_(rebuild_row_int8(rowgemm.blocks_of(q)) if rowgemm.floatless(q) else floats[n])
        ref.bind(model)
        want = ref(ids, feats, pos)
        assert not torch.equal(floats["fc.weight"], rebuild_row_int8(rowgemm.blocks_of(head.fc.weight)))  # rounded
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fused = leanbody._head_fused(head)  # the native draft step's fused products read the parts' blocks
    if fused is not None:
        a, m = head.layers[0].self_attn, head.layers[0].mlp
        for w, parts in ((fused[1], (a.q_proj, a.k_proj, a.v_proj)), (fused[3], (m.gate_proj, m.up_proj))):
            assert rowgemm.floatless(w)
            assert torch.equal(rebuild_row_int8(rowgemm.blocks_of(w)), torch.cat([rebuild_row_int8(rowgemm.blocks_of(x.weight)) for x in parts]))
    same, n, hist, diffs = compare_with_vanilla(model, head, n_prompts=4)
    assert not diffs, diffs[:2]
    assert sum(hist[1:]) > 0


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_head_blocks_takes_every_head_kind_with_a_pruned_vocabulary(tiny_lm, arch):
    """A float32 head of either kind with a pruned draft vocabulary: its linears (EAGLE-3's own
    lm_head among them) and an EAGLE-1/2 head's copy of the scored lm_head rows become 8-bit rows;
    the target's own weights are not touched, and the scoring product is the one over `scale * q`."""
    from eagle2_core import native, rowgemm
    from eagle2_core.quantization import head_blocks
    from int8_reference import rebuild_row_int8
    from eagle2_core.train.trainer import new_head

    if native.module() is None:
        pytest.skip("eagle2's native code is not built here")
    model = tiny_lm("llama", vocab_size=VOCAB, hidden_size=64, max_position_embeddings=MAXPOS, num_layers=8)  # EAGLE-3 reads 3 layers
    head = new_head(arch, model, torch.tensor([0, 2, 3, 5, 7, 11]))
    lm = head.lm_head.weight if arch == "eagle3" else head.draft_lm_head
    hid = torch.randn(3, 64)
    want = hid @ lm.detach().clone().t()
    assert head_blocks(head) > 0
    assert rowgemm.floatless(lm) and all(rowgemm.floatless(m.weight) for m in head.modules() if isinstance(m, torch.nn.Linear))
    assert not any(map(rowgemm.floatless, model.parameters()))
    got = rowgemm.linear_rows(hid, lm)  # the product draft_logits takes (EAGLE-3 normalises before it)
    torch.testing.assert_close(got, hid @ rebuild_row_int8(rowgemm.blocks_of(lm)).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # int8 rows: close to the float logits
