"""Version, help, shell completions, one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from eagle2_cli.main import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_and_help():
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("eagle2 ")
    for cmd in ("chat", "generate", "compare"):
        r = CliRunner().invoke(cli, [cmd, "--help"])
        assert r.exit_code == 0 and "Examples:" in r.output, cmd
        for opt in ("--model", "--draft", "--dtype", "--device-map", "--load-in-4bit", "--trust-remote-code", "--temperature",
                    "--top-p", "--top-k", "--max-new-tokens", "--seed", "--total-tokens", "--depth", "--tree-top-k",
                    "--draft-shape", "--system-prompt", "--chat-template", "--compile"):
            assert opt in r.output, (cmd, opt)


def test_cli_import_is_light():
    """`eagle2 --help` and completion must not import torch."""
    code = "import sys, eagle2_cli.main; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_files_match_click(shell):
    from eagle2_cli.completion import FILES, completion_script

    with open(os.path.join(ROOT, "completions", FILES[shell]), encoding="utf-8") as f:
        assert f.read() == completion_script(shell), "regenerate with: python -m eagle2_cli.completion"


def test_completion_env_var_matches_file():
    env = dict(os.environ, _EAGLE2_COMPLETE="bash_source")
    p = subprocess.run([sys.executable, "-m", "eagle2_cli"], capture_output=True, text=True, env=env, timeout=120)
    with open(os.path.join(ROOT, "completions", "eagle2.bash"), encoding="utf-8") as f:
        assert p.stdout.strip() == f.read().strip()


def _one_line_error(r):
    assert r.exit_code == 2, r.output + r.stderr  # input errors exit 2, as Click does for bad options
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)
    return lines[0]


def test_load_errors_are_one_line(tmp_path, tiny_model_dir, tiny_head_dir):
    from eagle2_core.head import DraftHead, HeadSpec

    line = _one_line_error(CliRunner().invoke(cli, ["chat", "--prompt", "x", "--model", str(tmp_path / "nope"), "--draft", "random"]))
    assert "nope" in line
    line = _one_line_error(CliRunner().invoke(cli, ["chat", "--prompt", "x", "--model", tiny_model_dir, "--draft", str(tmp_path / "nohead")]))
    assert "nohead" in line
    other = tmp_path / "other_head"  # a head for a model with another hidden size
    DraftHead(HeadSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=320)).save(str(other))
    line = _one_line_error(CliRunner().invoke(cli, ["compare", "--limit", "1", "--model", tiny_model_dir, "--draft", str(other)]))
    assert "hidden_size 32" in line and "another model" in line
    line = _one_line_error(CliRunner().invoke(cli, ["generate", "-f", str(tmp_path / "missing.jsonl"), "--model", tiny_model_dir]))
    assert "missing.jsonl" in line
    # an unknown head source: one line
    line = _one_line_error(CliRunner().invoke(cli, ["chat", "--prompt", "x", "--model", tiny_model_dir, "--draft-sources", "ngram"]))
    assert "--draft-sources" in line and "ngram" in line
    line = _one_line_error(CliRunner().invoke(cli, ["chat", "--prompt", "x", "--model", tiny_model_dir, "--draft", "none",
                                                    "--draft-sources", "head,match"]))
    assert "needs a draft head" in line


def test_a_model_without_a_head_drafts_head_free(tiny_model_dir):
    """No --draft and the folder ships no head: it decodes with the head-free sources (sources.py),
    says so in one line, and answers exactly as with `--draft none` and as plain decoding."""
    r = CliRunner().invoke(cli, ["chat", "--prompt", "x", "--model", tiny_model_dir, "-n", "12", "--no-baseline", "--compare"])
    assert r.exit_code == 0, r.stderr
    assert "no draft head known" in r.stderr and "recycle + match" in r.stderr
    assert "head-free drafts" in r.output + r.stderr
    outs = []
    for extra in (["--draft", "none"], ["--draft", "none", "--draft-sources", "match"]):
        r = CliRunner().invoke(cli, ["chat", "--prompt", "x", "--model", tiny_model_dir, "-n", "12", "--no-baseline"] + extra)
        assert r.exit_code == 0, r.stderr
        assert "no draft head known" not in r.stderr
        outs.append(r.output.split("╭")[0])  # the answer, before the stats panel
    assert outs[0] == outs[1] and outs[0].strip()


def test_random_head_and_folder_default_head(tmp_path, tiny_model_dir, tiny_head_dir):
    import shutil

    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "--model", tiny_model_dir, "--draft", "random", "-n", "2", "--no-baseline"])
    assert r.exit_code == 0 and "untrained draft head" in r.stderr
    model = tmp_path / "with_head"  # a model folder carrying its own eagle2-head/ needs no --draft
    shutil.copytree(tiny_model_dir, model)
    shutil.copytree(tiny_head_dir, model / "eagle2-head")
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "--model", str(model), "-n", "2", "--no-baseline"])
    assert r.exit_code == 0, r.stderr


def test_usage_errors():
    r = CliRunner().invoke(cli, ["chat", "--load-in-8bit", "--load-in-4bit"])
    assert r.exit_code == 2 and "exclude each other" in r.stderr
    r = CliRunner().invoke(cli, ["chat", "--draft-shape", "round"])
    assert r.exit_code == 2


def test_renamed_spellings_still_work(tiny_model_dir):
    """Old spellings of a renamed flag or method name say so in one line and keep working."""
    r = CliRunner().invoke(cli, ["compare", "--against", "fixed,bogus"])
    assert r.exit_code == 2 and "--against fixed is now graph" in r.stderr and "unknown baseline bogus;" in r.stderr
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "--model", tiny_model_dir, "--draft", "random", "-n", "2",
                                 "--no-calibrate", "--calibration-tokens", "3"])
    assert r.exit_code == 0, r.stderr
    assert "--no-calibrate is now --no-baseline" in r.stderr and "--calibration-tokens is now --baseline-tokens" in r.stderr
    assert "vanilla baseline:" not in r.stderr  # the old flag still skips the baseline run
