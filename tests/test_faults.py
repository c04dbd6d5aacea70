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


def test_generate_refuses_a_locked_output_in_one_line(holder, tmp_path, tiny_model_dir, tiny_head_dir):
    out, p = holder
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": "Hi", "max_new_tokens": 2}) for i in range(3)) + "\n")
    r = CliRunner().invoke(cli, ["generate", "-f", str(src), "-o", out, "--model", tiny_model_dir, "--draft", tiny_head_dir,
                                 "--device", "cpu"])
    line = one_line(r, code=1)
    assert out in line and str(p.pid) in line
    assert not os.path.exists(out) or not open(out).read()  # nothing was answered into it
    p.kill()
    p.wait()
    r = CliRunner().invoke(cli, ["generate", "-f", str(src), "-o", out, "--model", tiny_model_dir, "--draft", tiny_head_dir,
                                 "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert len([x for x in open(out) if x.strip()]) == 3 and not os.path.exists(lock_path(out))
