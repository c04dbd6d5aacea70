"""An 8-bit (bitsandbytes LLM.int8) target on CPU: EAGLE-2 greedy output equals the 8-bit model's
own `generate` output (VanillaDecoder) token for token.

Identity is with the *same* quantized model, not with the float model: quantization changes the
target, speculative decoding must not change it further.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from eagle2_core import Eagle2Decoder, GenerationSettings, TreeSettings
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
    dec = Eagle2Decoder(model, head, tree=TreeSettings(total_tokens=10, depth=4, top_k=3))
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
    require_bnb()
    from eagle2_core.loading import load_target

    folder = str(tmp_path / "model")
    write_model_folder(folder, tiny_lm)
    lt = load_target(folder, load_in_8bit=True, device="cpu")
    q = lt.model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "Linear8bitLt" and q.weight.dtype == torch.int8  # really quantized
    same, n, hist, diffs = compare_with_vanilla(lt.model, fitted_head(lt.model, steps=100))
    print(f"\n[quant8] 8-bit llama on CPU (no activation outliers): {same}/{n} identical to 8-bit vanilla, accepted_hist={hist}")
    assert not diffs, diffs[:2]
    assert sum(hist[2:]) > 0


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
    require_bnb()
    from eagle2_core.loading import load_target

    lt = load_target(outlier_folder, load_in_8bit=True, device="cpu")
    same, n, hist, diffs = compare_with_vanilla(lt.model, fitted_head(lt.model, steps=60))
    print(f"\n[quant8] 8-bit via load_target, outliers, threshold 0 (load_target default): {same}/{n} identical to 8-bit vanilla")
    assert not diffs, diffs[:1]
