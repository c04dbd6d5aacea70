"""Faults as a user meets them (issue 23, parts 2 and 6): a second run on a locked output, a
device that is not there, a template that renders nothing, a fallback that must be said."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from eagle2_cli.main import cli
from eagle2_core.outputlock import OutputLocked, lock_output, lock_path

HOLD = textwrap.dedent("""
    import sys, time
    from eagle2_core.outputlock import lock_output
    with lock_output(sys.argv[1]):
        print("held", flush=True)
        time.sleep(120)
""")


def one_line(r, code: int = 2) -> str:
    out = r.stderr
    assert r.exit_code == code, (r.exit_code, r.output, out)
    assert "Traceback" not in out and "Traceback" not in r.output, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


def usage_error(r) -> str:
    """Click's usage error: exit 2, the usage lines, then one `Error:` line; no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.stderr)
    assert "Traceback" not in r.output + r.stderr
    last = [x for x in r.stderr.splitlines() if x.strip()][-1]
    assert last.startswith("Error: Invalid value"), r.stderr
    return last


@pytest.fixture()
def holder(tmp_path):
    """A second process holding the lock of tmp_path/out.jsonl until killed."""
    out = str(tmp_path / "out.jsonl")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-c", HOLD, out], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "held"
        yield out, p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_second_holder_is_refused_with_the_holders_pid(holder):
    out, p = holder
    with pytest.raises(OutputLocked) as e:
        with lock_output(out):
            pass
    assert e.value.pid == p.pid and str(p.pid) in str(e.value)


def test_a_lock_left_by_kill_9_does_not_block(holder):
    out, p = holder
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert os.path.exists(lock_path(out))  # the dead run's sidecar is still there, with its pid
    with lock_output(out):
        assert open(lock_path(out)).read().strip() == str(os.getpid())
    assert not os.path.exists(lock_path(out))


def test_the_lock_is_released_after_the_block(tmp_path):
    out = str(tmp_path / "o.jsonl")
    with lock_output(out):
        with pytest.raises(OutputLocked):  # flock is per open file: the same process is refused too
            with lock_output(out):
                pass
    with lock_output(out):
        pass


@pytest.mark.parametrize("batch", ["1", "2"])  # the per-prompt decoder and the batched one: the lock covers both
def test_generate_refuses_a_locked_output_in_one_line(holder, tmp_path, tiny_model_dir, tiny_head_dir, batch):
    out, p = holder
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": "Hi", "max_new_tokens": 2}) for i in range(3)) + "\n")
    args = ["generate", "-f", str(src), "-o", out, "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu",
            "--total-tokens", "4", "--batch-size", batch]
    r = CliRunner().invoke(cli, args)
    line = one_line(r, code=1)
    assert out in line and str(p.pid) in line
    assert not os.path.exists(out) or not open(out).read()  # nothing was answered into it
    p.kill()
    p.wait()
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert ("batch of 2" in r.stderr) == (batch == "2")  # the path under test is the one that ran
    assert len([x for x in open(out) if x.strip()]) == 3 and not os.path.exists(lock_path(out))


# -- part 6: every option and input ends in one line, never a traceback ---------------------
def chat(tiny_model_dir, tiny_head_dir, *args):
    return CliRunner().invoke(cli, ["chat", "--prompt", "x", "-n", "2", "--no-baseline", "--model", tiny_model_dir,
                                    "--draft", tiny_head_dir, *args])


@pytest.mark.parametrize("device, says", [("cuda", "no CUDA device"), ("cuda:7", "CUDA"), ("banana", "unknown device"),
                                          ("cuda:x", "unknown device"), ("mps", "MPS")])
def test_a_device_the_machine_lacks_is_one_line(tiny_model_dir, tiny_head_dir, device, says):
    import torch

    if device.startswith("cuda") and device != "cuda:x" and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the device")
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    line = one_line(chat(tiny_model_dir, tiny_head_dir, "--device", device))
    assert says in line and device in line


def test_a_template_that_renders_nothing_is_one_line(tmp_path, tiny_model_dir, tiny_head_dir):
    tpl = tmp_path / "nothing.jinja"
    tpl.write_text("{% for m in messages %}{% endfor %}")
    assert "rendered no tokens" in one_line(chat(tiny_model_dir, tiny_head_dir, "--chat-template", str(tpl)))


def test_an_empty_template_file_is_refused_not_replaced(tmp_path, tiny_model_dir, tiny_head_dir):
    tpl = tmp_path / "empty.jinja"
    tpl.write_text("\n")
    line = one_line(chat(tiny_model_dir, tiny_head_dir, "--chat-template", str(tpl)))
    assert str(tpl) in line and "empty" in line


@pytest.mark.parametrize("args, says", [(["--seed", str(2**64)], "--seed"), (["--temperature", "nan"], "finite"),
                                        (["--temperature", "inf"], "finite"), (["--top-p", "nan"], "finite")])
def test_out_of_range_options_are_usage_errors(tiny_model_dir, tiny_head_dir, args, says):
    assert says in usage_error(chat(tiny_model_dir, tiny_head_dir, *args))


@pytest.mark.parametrize("args", [["--epochs", "0"], ["--lr", "nan"], ["--lr", "0"], ["--batch-tokens", "0"], ["--ttt-steps", "0"],
                                  ["--draft-vocab", "-1"], ["--time-budget", "-1"], ["--distill-batch", "0"], ["--max-len", "1"]])
def test_train_numbers_out_of_range_are_usage_errors(tmp_path, args):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    r = CliRunner().invoke(cli, ["train", "-d", str(data), "-o", str(tmp_path / "h"), *args])
    assert args[0] in usage_error(r)


def test_nan_and_huge_seeds_in_input_lines_are_line_errors(tmp_path, tiny_model_dir, tiny_head_dir):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 1, "prompt": "hi", "temperature": NaN}\n{"id": 2, "prompt": "hi", "top_p": Infinity}\n'
                   f'{{"id": 3, "prompt": "hi", "seed": {2**64}}}\n')
    r = CliRunner().invoke(cli, ["generate", "-f", str(src), "-o", str(out), "--model", tiny_model_dir, "--draft", tiny_head_dir,
                                 "--device", "cpu", "-n", "2"])
    assert r.exit_code == 1 and "Traceback" not in r.output + r.stderr
    recs = [json.loads(x) for x in open(out)]
    assert [(x["id"], x["field"]) for x in recs] == [(1, "temperature"), (2, "top_p"), (3, "seed")]


@pytest.mark.parametrize("assignment", ["temperature=nan", "temperature=inf", f"seed={2**64}"])
def test_chat_set_refuses_what_the_options_refuse(assignment):
    from eagle2_core.chat import apply_setting
    from eagle2_core.drafter import TreeSettings
    from eagle2_core.events import GenerationSettings

    with pytest.raises(ValueError):
        apply_setting(GenerationSettings(), TreeSettings(), assignment)


# -- part 2: a launcher's process group that cannot form stops the run -----------------------
def test_world_size_without_a_group_fails_instead_of_training_alone(monkeypatch):
    from eagle2_core.train import parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(parallel.ProcessGroupError, match="WORLD_SIZE=2 .*could not be formed.*MASTER_ADDR"):
        parallel.world("cpu")
    monkeypatch.setattr(parallel.dist, "is_available", lambda: False)
    with pytest.raises(parallel.ProcessGroupError, match="no torch.distributed"):
        parallel.world("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert parallel.world("cpu").size == 1


def test_chat_set_auto_takes_the_expansion_total_tokens_auto_takes(tiny_model_dir, tiny_head_dir):
    """`/set total_tokens=auto` in a chat started with a constant budget runs what `--total-tokens auto`
    runs: the measured expansion width and the auto depth, not the constant tree's."""
    import io

    from rich.console import Console

    from eagle2_cli.chat_cmd import ChatApp
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(tiny_model_dir, tiny_head_dir, device="cpu", tree={"total_tokens": 5})
    want = Runtime.load(tiny_model_dir, tiny_head_dir, device="cpu", tree={"total_tokens": "auto"}).tree
    app = ChatApp(rt, Console(file=io.StringIO()), Console(file=io.StringIO()))
    app.handle("/set depth=1 tree_top_k=1")
    assert rt.tree.budget == "constant" and (rt.tree.depth, rt.tree.top_k) == (1, 1) != (want.depth, want.top_k)
    app.handle("/set total_tokens=auto")
    assert (rt.tree.budget, rt.tree.depth, rt.tree.top_k, rt.tree.total_tokens) == (want.budget, want.depth, want.top_k, want.total_tokens)


# -- part 2: no silent fallbacks -------------------------------------------------------------
@pytest.mark.parametrize("args, says", [(["--total-tokens", "auto"], "per-cycle budget"), (["--draft-shape", "static"], "static draft shape"),
                                        (["--draft-shape", "chain"], "chain draft shape")])
def test_compile_on_a_tree_it_cannot_capture_says_so_once(tiny_model_dir, tiny_head_dir, args, says):
    r = chat(tiny_model_dir, tiny_head_dir, "--device", "cpu", "--compile", *args)
    assert r.exit_code == 0, r.output
    notes = [x for x in r.stderr.splitlines() if x.startswith("note: --compile")]
    assert len(notes) == 1 and says in notes[0] and "uncaptured" in notes[0]


def test_compile_on_a_capturable_tree_has_no_notice(tiny_model_dir, tiny_head_dir, monkeypatch):
    from eagle2_core.runtime import Runtime

    rt = Runtime.load(tiny_model_dir, tiny_head_dir, device="cpu", tree={"total_tokens": 4}, compile=True)
    assert rt.compile == "inductor" and rt.notices == []


def test_a_capture_failure_is_reported_as_what_ran(tmp_path, tiny_model_dir, tiny_head_dir, monkeypatch):
    """A cycle whose capture fails runs uncaptured: compare's JSON and table say so, not 'compiled'."""
    from eagle2_core import graphcycle

    def broken(fn, backend):
        def run(*args):
            raise RuntimeError("no C compiler found\nmore detail")
        return run

    monkeypatch.setattr(graphcycle, "_compile", broken)
    out = tmp_path / "c.json"
    with pytest.warns(UserWarning, match="capture failed \\(RuntimeError: no C compiler found\\); running the cycle uncaptured"):
        r = CliRunner().invoke(cli, ["compare", "--no-vanilla", "--limit", "1", "-n", "4", "--warmup-tokens", "2", "--against", "compiled,graph,batch:2",
                                     "--total-tokens", "4", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu",
                                     "--json", str(out)])
    assert r.exit_code == 0, r.output
    comp = json.loads(out.read_text())
    assert comp["compiled"]["backend_used"] == "eager (capture failed: RuntimeError: no C compiler found)"
    assert comp["graph"]["backend_used"] == "eager" and comp["eagle2"]["backend_used"] == "eager"
    assert comp["batch:2"]["backend_used"] == "eager"  # the batched cycle is never captured
    assert "compiled (uncaptured)" in r.output
