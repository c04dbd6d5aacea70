"""The CLI on the real embedded SmolLM2-135M-Instruct (slow: loads and dequantizes the GGUF once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from eagle2_cli.main import cli


def _draft_args():
    from eagle2_core.loading import packaged_head_path

    return [] if packaged_head_path("smollm2") else ["--draft", "random"]  # shipped head once it exists


@pytest.mark.slow
def test_readme_chat_demo(tmp_path):
    """`eagle2 chat --prompt "Hi" --max-new-tokens 32` as a user runs it (here without a TTY)."""
    p = subprocess.run([sys.executable, "-m", "eagle2_cli", "chat", "--prompt", "Hi", "--max-new-tokens", "32"] + _draft_args(),
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and "tau" in p.stderr and "speedup" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_compare_default_model_identical(tmp_path):
    out = tmp_path / "c.json"
    r = CliRunner().invoke(cli, ["compare", "--vanilla", "--limit", "2", "--max-new-tokens", "24", "--json", str(out)] + _draft_args())
    assert r.exit_code == 0, r.output + r.stderr
    d = json.loads(out.read_text())
    assert d["prompts"] == 2 and d["identical"] == 2
