"""The CLI on the real embedded SmolLM2-135M-Instruct with its shipped head (slow). The session's
`smollm2` fixture has already dequantized the GGUF and measured the cost profile into this
session's EAGLE2_CACHE, so the commands below find both there."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from eagle2_cli.main import cli


def greedy_reference(rt, messages: list[dict], max_new_tokens: int) -> str:
    """Hugging Face `generate`, greedy, on the conversation as the CLI encodes it, decoded as it prints."""
    from eagle2_core.target import model_eos_ids

    ids = rt.encode(messages)
    eos = sorted(model_eos_ids(rt.model, rt.tokenizer))
    with torch.no_grad():
        out = rt.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
    return rt.decode(out)


@pytest.mark.slow
def test_readme_chat_demo(smollm2):
    """`eagle2 chat --exact --prompt "Hi" --max-new-tokens 32` as a user runs it (here without a
    TTY): under --exact the answer is `generate`'s greedy answer, and the panel reports a tau and a speedup that are
    numbers in range. (One intra-op thread, as in this session, so the measured profile is found.)"""
    p = subprocess.run([sys.executable, "-m", "eagle2_cli", "chat", "--exact", "--prompt", "Hi", "--max-new-tokens", "32"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(torch.get_num_threads())))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    want = greedy_reference(smollm2, [{"role": "user", "content": "Hi"}], 32)
    assert p.stdout.split() == want.split() and want.strip(), (p.stdout, want)
    tau = re.search(r"\btau (\d+\.\d+)", p.stderr)
    speedup = re.search(r"\bspeedup (\d+\.\d+)x", p.stderr)
    assert tau and speedup, p.stderr
    # tau counts tokens per target forward: at least 1 (the bonus), at most the default's depth + 1
    assert 1.0 <= float(tau.group(1)) <= smollm2.tree.depth + 1 and float(speedup.group(1)) > 0, p.stderr


@pytest.mark.slow
def test_compare_default_model_identical(tmp_path, smollm2, monkeypatch):
    """`eagle2 compare --vanilla` with no --model / --draft, on the session's loaded SmolLM2 (the
    loading itself is the subprocess test's): every prompt identical, and the JSON's tau is the
    default decoder's, >= 1."""
    import eagle2_core.runtime as runtime

    real = runtime.load_target
    monkeypatch.setattr(runtime, "load_target", lambda name=None, **kw: smollm2.target if name is None else real(name, **kw))
    out = tmp_path / "c.json"
    for exact in (True, False):
        r = CliRunner().invoke(cli, ["compare", "--vanilla", "--limit", "2", "--max-new-tokens", "24", "--json", str(out)]
                               + (["--exact"] if exact else []))
        assert r.exit_code == 0, r.output + r.stderr
        d = json.loads(out.read_text())
        assert d["prompts"] == 2 and d["identical"] == 2
        assert d["eagle2"]["tau"] >= 1.0 and d["settings"]["tree"]["budget"] == "auto", (d["eagle2"], d["settings"])
        if exact:  # checked against generate
            assert d["identical_to"] == "vanilla" and d["settings"]["arithmetic"] == "exact"
        elif smollm2.arithmetic == "int8":  # checked against eagle2's plain decoding; generate (float32) only counted
            assert d["identical_to"] == "plain" and d["settings"]["arithmetic"] == "int8" and "identical_to_generate" in d
