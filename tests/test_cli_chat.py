"""`eagle2 chat`: non-TTY stdin, --prompt, the prompt-toolkit REPL through a pipe input, Ctrl-C."""
from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from eagle2_cli.main import cli


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """A cache folder of the test's own (the chat history file lives there), seeded with the
    session's cost profiles so the tiny model's profile is measured once, not per test."""
    import os
    import shutil

    profiles = os.path.join(os.environ["EAGLE2_CACHE"], "profiles")
    if os.path.isdir(profiles):
        shutil.copytree(profiles, tmp_path / "cache" / "profiles")
    monkeypatch.setenv("EAGLE2_CACHE", str(tmp_path / "cache"))


def model_args(tiny_model_dir, tiny_head_dir, n=4):
    return ["--model", tiny_model_dir, "--draft", tiny_head_dir, "--max-new-tokens", str(n), "--device", "cpu"]


def test_chat_reads_stdin_lines(tmp_path, tiny_model_dir, tiny_head_dir):
    save = tmp_path / "conv.json"
    stdin = f"Hello\n/set temperature=0.5 depth=3 nope=1\n\nTell me more\n/stats\n/save {save}\n/exit\nnever sent\n"
    r = CliRunner().invoke(cli, ["chat", "--baseline-tokens", "2", "-s", "Be brief."] + model_args(tiny_model_dir, tiny_head_dir), input=stdin)
    assert r.exit_code == 0, r.output + r.stderr
    assert "vanilla baseline:" in r.stderr and "tau" in r.stderr and "measured at start-up" in r.stderr
    assert "temperature = 0.5" in r.stderr and "error: unknown setting 'nope'" in r.stderr
    d = json.loads(save.read_text())
    assert [m["role"] for m in d["messages"]] == ["user", "assistant", "user", "assistant"]
    assert d["messages"][2]["content"] == "Tell me more" and d["system_prompt"] == "Be brief."
    assert d["settings"]["temperature"] == 0.5 and d["settings"]["depth"] == 3
    assert len(d["turns"]) == 2 and "vanilla_baseline" in d


def test_chat_prompt_option_with_compare(tiny_model_dir, tiny_head_dir):
    r = CliRunner().invoke(cli, ["chat", "--prompt", "Hi", "--compare", "--show-draft"] + model_args(tiny_model_dir, tiny_head_dir))
    assert r.exit_code == 0, r.output + r.stderr
    assert r.stdout.strip()  # the answer
    assert "vs vanilla generate on this prompt" in r.stderr and "identical to vanilla" in r.stderr


def _app(tiny_model_dir, tiny_head_dir, width=100):
    from eagle2_cli.chat_cmd import ChatApp
    from eagle2_core.events import GenerationSettings
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(tiny_model_dir, tiny_head_dir, device="cpu", gen=GenerationSettings(max_new_tokens=3))
    out = Console(file=io.StringIO(), force_terminal=True, width=width)  # the Live (terminal) path
    err = Console(file=io.StringIO(), width=width)
    return ChatApp(rt, out, err, show_draft=True), out, err


def test_chat_repl_pipe_input(tmp_path, tiny_model_dir, tiny_head_dir):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    app, out, err = _app(tiny_model_dir, tiny_head_dir)
    hist = tmp_path / "hist"
    with create_pipe_input() as inp:
        inp.send_text('Hello \\\rworld\r/system Be terse.\r"""a\rb"""\r/reset\r/help\r/exit\r')
        app.repl(str(hist), pt_input=inp, pt_output=DummyOutput())
    assert app.conv.system_prompt == "Be terse."
    assert app.conv.messages == []  # /reset after two answers
    text = err.file.getvalue()
    assert "conversation cleared" in text and "/save FILE" in text
    assert "tau" in out.file.getvalue() and "\x1b[" in out.file.getvalue()
    assert "+Hello \n+world\n" in hist.read_text()  # FileHistory keeps the multi-line entry
    assert out.file.getvalue().count("EAGLE-2") >= 2  # two answers, each with its panel


def test_chat_repl_turns_and_ctrl_c(tiny_model_dir, tiny_head_dir):
    from eagle2_core.events import StepEvent

    app, out, err = _app(tiny_model_dir, tiny_head_dir)
    app.handle('"""multi\nline"""')
    assert app.conv.messages[0]["content"] == "multi\nline" and app.conv.messages[1]["role"] == "assistant"

    class Interrupting:  # a decoder whose stream is interrupted after the first token (Ctrl-C)
        def stream(self, ids, gen, keep=False):
            yield StepEvent([5], 0, 1, 0.0, 0.0)
            raise KeyboardInterrupt

    real = app.rt.eagle
    app.rt.eagle = lambda tree=None: Interrupting()
    app.handle("stop me")
    assert "interrupted" in err.file.getvalue()
    assert app.conv.messages[-1]["role"] == "assistant" and app.conv.turns[-1].finish_reason == "interrupted"
    app.rt.eagle = real
    app.handle("/set show_draft=off compare=on")
    assert app.show_draft is False and app.compare is True
    app.handle("and again")  # the session goes on after Ctrl-C
    assert len(app.conv.turns) == 3 and len(app.vanilla_turns) == 1
    app.handle("/stats")
    assert "3 answers this session" in out.file.getvalue()


def test_chat_refuses_over_long_conversation(tiny_model_dir, tiny_head_dir):
    app, out, err = _app(tiny_model_dir, tiny_head_dir)
    app.handle("the sea is blue " * 200)
    assert app.conv.messages == [] and "context is 256" in err.file.getvalue()


def test_show_draft_colours_draft_text():
    from eagle2_cli.ui import AnswerView

    for show in (True, False):
        out = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=80)
        err = Console(file=io.StringIO(), width=80)
        with AnswerView(out, err, show_draft=show) as view:
            view.add([("drafted", True), (" own\nnext ", False), ("line", True)])
        text = out.file.getvalue()
        assert "drafted" in text and "next" in text
        assert ("\x1b[1;36mdrafted" in text) is show


def test_answer_view_plain_mode():
    from eagle2_cli.ui import AnswerView

    out, err = Console(file=io.StringIO(), width=80), Console(file=io.StringIO(), width=80)
    with AnswerView(out, err, show_draft=True) as view:
        view.add([("a", True), ("b\nc", False)])
        view.set_stats("STATS")
    assert out.file.getvalue() == "ab\nc\n" and "STATS" in err.file.getvalue()


PTY_SCRIPT = r"""
import sys
from eagle2_cli.ui import AnswerView, consoles
out, err = consoles()
words = ("speculative decoding drafts several tokens ahead and the target verifies them together " * 3).split()
with AnswerView(out, err) as view:
    for i, w in enumerate(words):
        view.add([(w + " ", i % 2 == 0)])
    view.add([("\nlast line", False)])
"""


def test_streamed_answer_wraps_at_word_boundaries_in_a_real_terminal(tmp_path):
    """Through a pseudo-terminal 28 columns wide: every line of the streamed answer fits the
    width and ends at a word boundary (no word is cut at the edge)."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 28, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm"
    p = subprocess.Popen([sys.executable, "-c", PTY_SCRIPT], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=60)
    os.close(master)
    raw = b"".join(chunks).decode("utf-8", "replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", raw)
    lines = [ln.rstrip() for ln in text.split("\n") if ln.strip()]
    words = set(("speculative decoding drafts several tokens ahead and the target verifies them together").split())
    body = [ln for ln in lines if "last" not in ln]  # the live area redraws its last line in place
    assert p.returncode == 0, raw
    assert len(body) >= 6 and all(len(ln) <= 28 for ln in body), lines
    bad = [w for ln in body for w in ln.split() if w not in words]
    assert not bad, (bad, lines)  # every piece is a whole word


def test_chat_seeded_answer_is_generates_at_any_batch_size(tmp_path, tiny_model_dir, tiny_head_dir):
    """`--temperature 0.8 --seed 7`: the chat's answer is the text `generate` writes for the same
    message at batch 3 beside two other prompts (one engine, one sampling rule keyed by seed and
    position); another seed answers otherwise."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["Count to 3", "Say hi", "Name a colour"])))
    common = ["--temperature", "0.8"] + model_args(tiny_model_dir, tiny_head_dir, 8)
    g = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", str(out), "-b", "3", "--seed", "7"] + common)
    assert g.exit_code == 0, g.output + g.stderr
    text = {json.loads(x)["id"]: json.loads(x)["text"] for x in out.read_text().splitlines()}[0]
    answers = {}
    for seed in ("7", "8"):
        r = CliRunner().invoke(cli, ["chat", "--prompt", "Count to 3", "--seed", seed] + common)
        assert r.exit_code == 0, r.output + r.stderr
        answers[seed] = r.stdout.strip()
    assert text.strip() and answers["7"] == text.strip() and answers["8"] != answers["7"]


def test_a_finished_chat_process_skips_the_interpreters_teardown_only(tmp_path, tiny_model_dir, tiny_head_dir):
    """`python -m eagle2_cli chat` that finished its turns ends without the interpreter's
    teardown (eagle2_cli.main.run): its answer, panel and /save file are whole, exit handlers
    ran, the exit code is 0, and a module-level object is not finalized; another command, or a
    chat that fails, exits as Python does (the object finalized: the check can fail)."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('[exit handler ran]', file=sys.stderr, flush=True))\n"
        "class _Marker:\n"
        "    def __del__(self):\n"
        "        print('[interpreter teardown]', file=sys.stderr, flush=True)\n"
        "marker = _Marker()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), root])}
    save = tmp_path / "conv.json"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "eagle2_cli", *args], capture_output=True, text=True, env=env, timeout=300)

    r = run("chat", "--no-baseline", "--prompt", "Hello", "--prompt", f"/save {save}", *model_args(tiny_model_dir, tiny_head_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "tau" in r.stderr and f"saved {save}" in r.stderr
    assert json.loads(save.read_text())["messages"][0]["content"] == "Hello"
    assert "[exit handler ran]" in r.stderr and "[interpreter teardown]" not in r.stderr
    bad = run("chat", "--model", str(tmp_path / "missing"), "--prompt", "Hi")
    assert bad.returncode != 0 and "[exit handler ran]" in bad.stderr and "[interpreter teardown]" in bad.stderr
    other = run("--version")
    assert other.returncode == 0 and "[interpreter teardown]" in other.stderr
