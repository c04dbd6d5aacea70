"""`eagle2 generate` on the tiny model: good and bad lines, resume, a real subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from eagle2_cli.main import cli

GOOD = [
    {"id": "a", "prompt": "Hello there", "max_new_tokens": 3},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    {"question_id": 81, "category": "writing", "turns": ["Write a poem", "Shorter"]},
    {"custom_id": "req-1", "body": {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 2, "temperature": 0.7}, "seed": 3},
]
BAD = [
    ("not json at all", "line", None),
    ('{"id": "c"}', "id", "prompt"),
    ('{"id": "d", "prompt": 42}', "id", "prompt"),
    ('{"id": "e", "prompt": "x", "temperature": "hot"}', "id", "temperature"),
    (json.dumps({"id": "long", "prompt": "the sea is blue " * 200}), "id", "prompt"),  # > 256-token context
]


def write_input(path, good=GOOD, bad=BAD):
    lines = [json.dumps(g) for g in good[:2]] + [b[0] for b in bad] + [json.dumps(g) for g in good[2:]]
    path.write_text("\n".join(lines) + "\n")
    return lines


def model_args(tiny_model_dir, tiny_head_dir, n=4):
    return ["--model", tiny_model_dir, "--draft", tiny_head_dir, "--max-new-tokens", str(n), "--device", "cpu"]


def read_jsonl(path):
    return [json.loads(x) for x in open(path) if x.strip()]


def test_generate_good_and_bad_lines(tmp_path, tiny_model_dir, tiny_head_dir):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    r = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", str(out)] + model_args(tiny_model_dir, tiny_head_dir))
    assert r.exit_code == 1, r.output
    recs = read_jsonl(out)
    assert len(recs) == len(GOOD) + len(BAD)
    ok = [x for x in recs if "error" not in x]
    errs = [x for x in recs if "error" in x]
    assert {x.get("id") or x.get("question_id") or x.get("custom_id") for x in ok} == {"a", "b", 81, "req-1"}
    by = {x.get("id", x.get("question_id", x.get("custom_id"))): x for x in ok}
    assert by["a"]["usage"]["completion_tokens"] <= 3 and by["req-1"]["usage"]["completion_tokens"] <= 2
    assert len(by[81]["turns"]) == 2 and by[81]["category"] == "writing" and "text" not in by[81]
    for x in ok:
        assert x["finish_reason"] in ("length", "stop")
        assert set(x["usage"]) >= {"prompt_tokens", "completion_tokens"}
        assert set(x["metrics"]) >= {"tau", "acceptance_rate", "verify_steps", "new_tokens", "wall_time", "tokens_per_s"}
        assert x["metrics"]["new_tokens"] == x["usage"]["completion_tokens"]
    assert errs[0] == {"line": 3, "error": errs[0]["error"]} and "invalid JSON" in errs[0]["error"]
    assert {e.get("id") for e in errs[1:]} == {"c", "d", "e", "long"}
    assert next(e for e in errs if e.get("id") == "long")["field"] == "prompt"
    # one stderr line per failure, naming file, line and field
    err_lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err_lines) == len(BAD)
    assert f"{inp}:3:" in err_lines[0]
    assert any(f"{inp}:6: field 'temperature'" in x for x in err_lines)
    assert any(f"{inp}:7: field 'prompt'" in x and "context" in x for x in err_lines)
    assert "Traceback" not in r.output + r.stderr


def test_generate_resumes_after_kill(tmp_path, tiny_model_dir, tiny_head_dir):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, bad=[])
    # A killed run: "a" finished, "b" failed, then a torn half line.
    out.write_text(json.dumps({"id": "a", "text": "EARLIER", "finish_reason": "length"}) + "\n"
                   + json.dumps({"id": "b", "error": "boom"}) + "\n" + '{"question_id": 81, "tur')
    r = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", str(out)] + model_args(tiny_model_dir, tiny_head_dir, 2))
    assert r.exit_code == 0, r.output + r.stderr
    recs = read_jsonl(out)
    keys = [x.get("id", x.get("question_id", x.get("custom_id"))) for x in recs]
    assert sorted(map(str, keys)) == sorted(["a", "b", "81", "req-1"])  # each once, no error left
    assert recs[0]["text"] == "EARLIER"  # not regenerated
    assert "1 already done" in r.stderr
    # A second rerun has nothing to do and changes nothing.
    before = out.read_text()
    r2 = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", str(out)] + model_args(tiny_model_dir, tiny_head_dir, 2))
    assert r2.exit_code == 0 and out.read_text() == before and "0 done" in r2.stderr


def test_generate_to_stdout(tmp_path, tiny_model_dir, tiny_head_dir):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "Hi"}\n')
    r = CliRunner().invoke(cli, ["generate", "-f", str(inp)] + model_args(tiny_model_dir, tiny_head_dir, 2))
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["line"] == 1 and isinstance(rec["text"], str)


def test_generate_subprocess(tmp_path, tiny_model_dir, tiny_head_dir):
    """The installed entry point as a real process: error records, stderr lines, exit code 1."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": 1, "prompt": "Hi"}\n{"id": 2, "prompt": ["x"]}\n')
    env = dict(os.environ, EAGLE2_CACHE=str(tmp_path / "cache"), PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "eagle2_cli", "generate", "-f", str(inp), "-o", str(out)] + model_args(tiny_model_dir, tiny_head_dir, 2),
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 1, p.stderr
    recs = read_jsonl(out)
    assert recs[0]["id"] == 1 and "text" in recs[0]
    assert recs[1] == {"id": 2, "line": 2, "field": "prompt", "error": "must be a string, not list"}
    assert f"error: {inp}:2: field 'prompt': must be a string, not list" in p.stderr
    assert "Traceback" not in p.stderr and "Loading weights" not in p.stderr


def test_generate_batched_equals_one_at_a_time(tmp_path, tiny_model_dir, tiny_head_dir):
    """--batch-size 3 (trees of 4, and plain) writes the same records' texts as --batch-size 1,
    multi-turn items and per-line budgets included."""
    inp = tmp_path / "in.jsonl"
    good = [g for g in GOOD if "custom_id" not in g] + [{"id": f"p{i}", "prompt": f"Count to {i}", "max_new_tokens": 2 + i} for i in range(5)]
    write_input(inp, good=good, bad=[])
    texts = {}
    for name, extra in {"one": ["--batch-size", "1"], "tree": ["--batch-size", "3", "--total-tokens", "4"],
                        "plain": ["--batch-size", "3", "--total-tokens", "1"],
                        # head-free sources alone (sources.py), per-row contexts at B = 3 and at B = 1
                        "head-free": ["--batch-size", "3", "--draft-sources", "recycle,match"],
                        "head-free-1": ["--batch-size", "1", "--draft-sources", "recycle,match"]}.items():
        out = tmp_path / f"{name}.jsonl"
        r = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", str(out)] + model_args(tiny_model_dir, tiny_head_dir, 6) + extra)
        assert r.exit_code == 0, r.output + r.stderr
        if name not in ("one", "head-free-1"):
            assert "batch of 3" in r.stderr
        recs = read_jsonl(out)
        texts[name] = {str(x.get("id", x.get("question_id"))): (x.get("text"), x.get("turns")) for x in recs}
        assert len(texts[name]) == len(good) == len(recs)
    assert texts["tree"] == texts["one"] and texts["plain"] == texts["one"]
    assert texts["head-free"] == texts["one"] and texts["head-free-1"] == texts["one"]


def test_generate_seeded_sampling_is_the_same_at_every_batch_size(tmp_path, tiny_model_dir, tiny_head_dir):
    """`--temperature 0.8 --seed 7`: the same texts at -b 1, at -b 3 (trees of 4 nodes, and plain)
    and at the measured batch size (-b auto, the default), multi-turn items included (one sampling rule, one uniform per
    output position); another seed gives other texts."""
    inp = tmp_path / "in.jsonl"
    good = [g for g in GOOD if "custom_id" not in g] + [{"id": f"p{i}", "prompt": f"Count to {i}", "max_new_tokens": 4 + i} for i in range(4)]
    write_input(inp, good=good, bad=[])
    texts = {}
    for name, extra in {"one": ["-b", "1"], "tree": ["-b", "3", "--total-tokens", "4"], "plain": ["-b", "3", "--total-tokens", "1"],
                        "auto": [], "seed 8": ["-b", "1", "--seed", "8"]}.items():
        out = tmp_path / f"{name}.jsonl"
        r = CliRunner().invoke(cli, ["generate", "-f", str(inp), "-o", str(out), "--temperature", "0.8", "--seed", "7"]
                               + model_args(tiny_model_dir, tiny_head_dir, 8) + extra)
        assert r.exit_code == 0, r.output + r.stderr
        texts[name] = {str(x.get("id", x.get("question_id"))): (x.get("text"), x.get("turns")) for x in read_jsonl(out)}
        assert len(texts[name]) == len(good)
    assert texts["tree"] == texts["one"] and texts["plain"] == texts["one"] and texts["auto"] == texts["one"]
    assert texts["seed 8"] != texts["one"]


def test_generate_killed_with_a_batch_in_flight_resumes_without_loss_or_repeat(tmp_path, tiny_model_dir, tiny_head_dir):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 24
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"Say {i} " * (1 + i % 5)}) + "\n" for i in range(n)))
    env = dict(os.environ, PYTHONWARNINGS="ignore")  # the session's cache folder: cost profiles measured once
    args = ["generate", "-f", str(inp), "-o", str(out), "--batch-size", "4", "--total-tokens", "3"] + model_args(tiny_model_dir, tiny_head_dir, 16)
    # The first run is SIGKILLed by itself right after its third record, with the other rows of
    # its batch mid-answer: where the kill lands does not depend on how fast this machine is.
    killer = ("import os, signal, sys\n"
              "from eagle2_core.batch import OutputWriter\n"
              "write, done = OutputWriter.write, []\n"
              "def wrapped(self, record):\n"
              "    write(self, record)\n"
              "    done.append(1)\n"
              "    if len(done) == 3:\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "OutputWriter.write = wrapped\n"
              "from eagle2_cli.main import cli\n"
              "cli(sys.argv[1:])\n")
    p = subprocess.run([sys.executable, "-c", killer] + args, capture_output=True, env=env, timeout=300)
    assert p.returncode == -9, p.stderr  # it did die by the kill, not by finishing
    cmd = [sys.executable, "-m", "eagle2_cli"] + args
    partial = len(read_jsonl(out)) if out.exists() else 0
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    recs = read_jsonl(out)
    assert sorted(x["id"] for x in recs) == list(range(n))  # each once: nothing lost, nothing repeated
    assert partial == 3  # the kill landed mid-file, after three whole records
    ref = tmp_path / "ref.jsonl"
    rr = CliRunner().invoke(cli, cmd[3:7] + [str(ref)] + cmd[8:])
    assert rr.exit_code == 0, rr.output
    by = {x["id"]: x["text"] for x in read_jsonl(ref)}
    assert {x["id"]: x["text"] for x in recs} == by
