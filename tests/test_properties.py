"""Property-based tests (hypothesis) of the prompt-line parser and of resumable batch output.

Invariants: every input line gives a prompt or an error record, never an exception; after a
kill at any byte of the output and a rerun, there is exactly one record per input line, no id
lost or repeated; once every line is done, a rerun changes no record.
"""
from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle2_core.batch import OutputWriter, plan_resume, prepare_output, run_pending
from eagle2_core.prompts import InputError, PromptItem, parse_line, read_prompt_file

FIELDS = ["id", "prompt", "messages", "question_id", "turns", "custom_id", "body", "category", "task_id",
          "max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "role", "content"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), children, max_size=4),
    max_leaves=12)
records = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot", 3]), "content": json_values})
plausible = st.one_of(
    st.fixed_dictionaries({"id": json_values, "prompt": json_values}, optional={"temperature": json_values, "top_p": json_values}),
    st.fixed_dictionaries({"id": json_values, "messages": st.lists(message, max_size=3)}),
    st.fixed_dictionaries({"question_id": json_values, "turns": st.lists(json_values, max_size=3)}),
    st.fixed_dictionaries({"custom_id": json_values, "body": st.dictionaries(st.sampled_from(["messages", "max_tokens", "temperature"]), json_values)}),
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _check(text: str, n: int = 3) -> None:
    try:
        item = parse_line(text, n)
    except InputError as e:  # the only way a line may fail, and its report is one line naming it
        assert e.line == n
        assert "\n" not in e.describe()
        rec = e.record()
        assert "error" in rec and json.dumps(rec)
        return
    assert isinstance(item, PromptItem) and item.messages
    assert all(isinstance(m["content"], str) and m["role"] in ("system", "user", "assistant") for m in item.messages)
    json.dumps(item.echo())


@SETTINGS
@given(records | plausible)
def test_any_json_object_parses_or_fails_with_an_input_error(rec):
    _check(json.dumps(rec))


@SETTINGS
@given(json_values)
def test_any_json_value_parses_or_fails_with_an_input_error(value):
    _check(json.dumps(value))


@SETTINGS
@given(st.text(max_size=60))
def test_any_text_parses_or_fails_with_an_input_error(text):
    if text.strip():
        _check(text)


@SETTINGS
@given(st.binary(max_size=200))
def test_any_bytes_give_items_errors_or_one_file_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("b") / "in.jsonl"
    path.write_bytes(data)
    try:
        got = list(read_prompt_file(str(path)))
    except InputError as e:  # not UTF-8, or nothing in it: one line about the whole file
        assert "\n" not in e.describe() and str(path) in e.describe()
        return
    lines = [t for t in data.decode("utf-8-sig").splitlines() if t.strip()]
    assert len(got) <= len(lines) and got


def _fake_run(item):
    """What run_item returns, without a model: the echo plus a deterministic text."""
    if isinstance(item.id, str) and item.id.startswith("too-long"):
        raise InputError("prompt is too long", field="prompt", line=item.line, key=item.key, id=item.id)
    return {**item.echo(), "text": f"answer to {item.id!r}"}


def _run(inp: str, out: str) -> None:
    """One batch run. fsync is a no-op here: what a killed process leaves is what it wrote and
    flushed (the page cache survives the process; fsync is for power loss), and the kill is
    simulated by truncation anyway. With a disk shared by other jobs the fsync per record made
    this test's 150 examples take 1-13 s."""
    from unittest import mock

    entries = list(read_prompt_file(inp))
    with mock.patch.object(os, "fsync", lambda fd: None):
        pending, _ = plan_resume(entries, prepare_output(out))
        w = OutputWriter(out)
        try:
            run_pending(pending, w, _fake_run)
        finally:
            w.close()


ids = st.one_of(st.integers(0, 30), st.sampled_from(["a", "b", "too-long-1", "c", "too-long-2"]))
input_line = st.one_of(
    st.builds(lambda i: json.dumps({"id": i, "prompt": "p"}), ids),
    st.builds(lambda i: json.dumps({"question_id": i, "turns": ["t"]}), st.integers(0, 5)),
    st.just("{not json"), st.just('["a list"]'), st.just(""), st.just('{"id": "x"}'),
)


@SETTINGS
@given(st.lists(input_line, min_size=1, max_size=14), st.lists(st.floats(0, 1), min_size=1, max_size=3))
def test_kill_at_any_byte_then_rerun_gives_one_record_per_line(tmp_path_factory, lines, kills):
    d = tmp_path_factory.mktemp("resume")
    inp, out = str(d / "in.jsonl"), str(d / "out.jsonl")
    with open(inp, "w") as f:
        f.write("\r\n".join(lines) + "\n")
    if not any(t.strip() for t in lines):
        return  # an empty file is refused as a whole (test_cli_errors)
    entries = list(read_prompt_file(inp))
    for frac in kills:  # a run killed after writing some bytes: the file is a prefix of a full run
        _run(inp, out)
        size = os.path.getsize(out)
        with open(out, "rb+") as f:
            f.truncate(int(size * frac))
    _run(inp, out)
    recs = [json.loads(t) for t in open(out, encoding="utf-8").read().splitlines()]
    assert len(recs) == len(entries)  # one record per non-blank input line
    keys = []
    for r in recs:  # error records always carry their line; results their id (or line when the input had none)
        k = "line" if "error" in r else next((kk for kk in ("custom_id", "question_id", "id", "task_id") if kk in r), "line")
        keys.append((k, json.dumps(r[k])))
    assert len(set(keys)) == len(keys)  # none repeated
    want = set()
    for e in entries:
        if isinstance(e, InputError) or (isinstance(e.id, str) and e.id.startswith("too-long")):
            want.add(("line", json.dumps(e.line)))
        else:
            want.add((e.key, json.dumps(e.id if e.key != "line" else e.line)))
    assert set(keys) == want  # none lost
    before = sorted(map(json.dumps, recs))
    _run(inp, out)  # all done: a rerun leaves the same records (failed lines are redone, to the same result)
    after = sorted(json.dumps(json.loads(t)) for t in open(out, encoding="utf-8").read().splitlines())
    assert after == before
