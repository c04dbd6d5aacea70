"""The GPU run (benchmarks/device_run.py): its plan fits the remote machine's
limits, and it reaches the library through public names only, so a refactor cannot break it
unseen (the training itself runs in the dry run, not here)."""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_run.py"


@pytest.fixture(scope="module")
def dr():
    spec = importlib.util.spec_from_file_location("device_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_run"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smollm2_config(dr):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", **dr.SMOLLM2)


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_plan_fits_the_device(dr, smollm2_config, dry_run):
    plan = dr.make_plan(420, smollm2_config, "eagle3", dry_run)
    assert plan.train_end_s == 280 and plan.train_end_s < plan.check_end_s < plan.budget_s  # two thirds, then the checks
    assert len(plan.returned) <= dr.FILES_LIMIT and sum(plan.returned.values()) <= dr.BACK_LIMIT
    assert plan.head_bytes + dr.MIB <= dr.HEAD_PIECES * dr.PIECE and plan.draft_vocab == 16384
    assert plan.device == ("cpu" if dry_run else "cuda")


def test_head_bytes_is_what_a_saved_head_weighs(dr, smollm2_config, tmp_path):
    """The size the plan reserves is the size `save` writes (bf16 floats, integer maps as they are)."""
    import torch

    from eagle2_core.eagle3 import Eagle3Head, Eagle3Spec

    head = Eagle3Head(Eagle3Spec.for_target(smollm2_config, draft_vocab_size=4096))
    head.save(str(tmp_path), dtype=torch.bfloat16)
    written = os.path.getsize(tmp_path / "model.safetensors")
    assert dr.head_bytes("eagle3", smollm2_config, 4096) <= written < dr.head_bytes("eagle3", smollm2_config, 4096) + 64 * 1024


def test_a_wider_target_gets_a_smaller_draft_vocabulary_or_a_refusal(dr, smollm2_config):
    from transformers import AutoConfig

    wide = AutoConfig.for_model("llama", **{**dr.SMOLLM2, "hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12,
                                             "num_key_value_heads": 4})  # wider than SmolLM2
    v, nbytes = dr.choose_draft_vocab("eagle3", wide)
    assert v < 16384 and nbytes + dr.MIB <= dr.HEAD_PIECES * dr.PIECE
    huge = AutoConfig.for_model("llama", **{**dr.SMOLLM2, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                                             "num_key_value_heads": 8})
    with pytest.raises(ValueError, match="no draft vocabulary"):
        dr.choose_draft_vocab("eagle3", huge)
    plan = dr.make_plan(480, smollm2_config)
    plan.returned.update({f"extra{i}": dr.PIECE for i in range(4)})
    with pytest.raises(ValueError, match="would return"):
        dr.check_plan(plan)


def test_each_call_carries_under_the_limit(dr):
    """The working tree travels with every call; the GGUF goes in pieces beside it, the wheels
    (~15 MiB) and the prompts (~4 MiB) with the last piece."""
    from eagle2_core.loading import smollm2_gguf_path

    tree = dr.tree_bytes()
    gguf = os.path.getsize(smollm2_gguf_path())
    last = gguf % dr.CARRY_PIECE or dr.CARRY_PIECE
    assert tree + dr.CARRY_PIECE <= dr.TREE_LIMIT, f"the working tree is {tree / dr.MIB:.1f} MiB"
    assert tree + last + 16 * dr.MIB + 8 * dr.MIB <= dr.TREE_LIMIT
    calls = dr.device_calls()
    assert calls[-1]["timeout_s"] <= 600 and "--budget-s 420" in calls[-1]["command"]


def test_it_uses_public_names_only():
    """No `from eagle2_core... import _private` and no `module._private` attribute: the engine's
    refactors keep public names (or break this test, not the device run)."""
    tree = ast.parse(SCRIPT.read_text())
    private = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("eagle2_core")
               for a in n.names if a.name.startswith("_")]
    assert private == []
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("eagle2_core")
                for a in n.names}
    attrs = [f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id in imported and n.attr.startswith("_")]
    assert attrs == []
