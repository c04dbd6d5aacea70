"""Batch generation over prompt files, resumable: what `eagle2 generate -f IN -o OUT` runs.

The output is JSON lines, one per input record, flushed as each finishes. Resuming reads the
existing output, keeps its successful records, drops failed ones and a half-written last line
(rewritten atomically), and skips the ids already done. No terminal code here.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .events import GenerationSettings, Summary
from .prompts import InputError, PromptItem, apply_overrides, ident
from .stats import summary_metrics

ID_KEYS = ("custom_id", "question_id", "id", "task_id")


def _record_ident(rec: dict) -> tuple[str, str] | None:
    for k in ID_KEYS:
        if k in rec:
            return ident(k, rec[k])
    if "line" in rec:
        return ident("line", rec["line"])
    return None


def prepare_output(path: str) -> set[tuple[str, str]]:
    """Identities already done in `path` (successful records). Failed records and any partial
    last line (a kill mid-write) are removed first, so the file never holds duplicates."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        raw = f.read()
    kept: list[bytes] = []
    done: set[tuple[str, str]] = set()
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn write: that record runs again
        rid = _record_ident(rec) if isinstance(rec, dict) else None
        if rid is None or "error" in rec or rid in done:
            continue  # failures run again; duplicates are dropped
        done.add(rid)
        kept.append(line)
    new = b"".join(k + b"\n" for k in kept)
    if new != raw:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return done


def plan_resume(entries: list, done: set) -> tuple[list, int]:
    """(entries still to run, how many are done): failed lines always run again."""
    pending = [e for e in entries if isinstance(e, InputError) or e.ident not in done]
    return pending, len(entries) - len(pending)


def run_pending(pending: list, writer: "OutputWriter", process, on_fail=None, on_done=None) -> tuple[int, int]:
    """One output record per pending entry, written as soon as it exists: `process(item)`'s
    record, or the error record of a line that failed to parse or to run. Returns (ok, failed).
    A kill at any point leaves whole records plus at most one torn line, which `prepare_output`
    drops on the next run."""
    ok = failed = 0
    for entry in pending:
        if not isinstance(entry, InputError):
            try:
                rec = process(entry)
            except InputError as e:
                entry = e
            else:
                writer.write(rec)
                ok += 1
                if on_done:
                    on_done(entry, rec)
                continue
        failed += 1
        writer.write(entry.record())
        if on_fail:
            on_fail(entry)
    return ok, failed


class OutputWriter:
    """Appends one JSON line per record and flushes it (and fsyncs) at once."""

    def __init__(self, path: str | None, stream=None):
        self.path = path
        self.f = open(path, "a", encoding="utf-8") if path and path != "-" else stream

    def write(self, record: dict) -> None:
        if self.f is None:
            return
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()
        if self.path and self.path != "-":
            os.fsync(self.f.fileno())

    def close(self) -> None:
        if self.path and self.path != "-" and self.f is not None:
            self.f.close()


def _prompt_field(item: PromptItem, turn: int) -> str:
    if item.multi_turn:
        return f"turns[{turn}]"
    if item.key == "custom_id":
        return "body.messages"
    return "messages" if len(item.messages) > 1 or item.messages[0]["role"] != "user" else "prompt"


def run_item(runtime, decoder, item: PromptItem, gen: GenerationSettings, on_tokens=None) -> dict[str, Any]:
    """Generate every turn of `item`; returns its output record. Raises InputError for a prompt
    that does not fit the context (the caller turns it into an error record)."""
    g = apply_overrides(gen, item.overrides)
    messages = list(item.messages)
    user_turns = [None] + list(item.followups)
    texts, reasons = [], []
    total = Summary()
    for t, followup in enumerate(user_turns):
        if followup is not None:
            messages.append({"role": "user", "content": followup})
        ids = runtime.encode(messages)
        if len(ids) >= runtime.max_positions:
            raise InputError(f"prompt is {len(ids)} tokens, the model's context is {runtime.max_positions}",
                             field=_prompt_field(item, t), line=item.line, key=item.key, id=item.id)
        tokens, summary = decoder.generate(ids, g)
        text = runtime.decode(tokens)
        if on_tokens:
            on_tokens(len(tokens))
        texts.append(text)
        reasons.append(summary.finish_reason)
        total.merge(summary)
        messages.append({"role": "assistant", "content": text})
    out = item.echo()
    if item.multi_turn:
        out["turns"] = texts
        out["finish_reason"] = reasons[-1]
        out["finish_reasons"] = reasons
    else:
        out["text"] = texts[0]
        out["finish_reason"] = reasons[0]
    out["usage"] = {"prompt_tokens": total.prompt_tokens, "completion_tokens": total.new_tokens,
                    "total_tokens": total.prompt_tokens + total.new_tokens}
    out["metrics"] = summary_metrics(total, getattr(getattr(decoder, "tree", None), "depth", 0))
    return out
