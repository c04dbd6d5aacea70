"""Batch generation over prompt files, resumable: what `eagle2 generate -f IN -o OUT` runs.

The output is JSON lines, one per input record, flushed as each finishes. Resuming reads the
existing output, keeps its successful records, drops failed ones and a half-written last line
(rewritten atomically), and skips the ids already done. No terminal code here.
"""
from __future__ import annotations

import errno
import json
import os
from typing import Any

from . import atomic, rowgemm
from .events import GenerationSettings, Summary
from .logprobs import chat_content, token_text
from .prompts import InputError, PromptItem, SplicedIds, apply_overrides, ident
from .stats import summary_metrics

ID_KEYS = ("custom_id", "question_id", "id", "task_id")


def _record_ident(rec: dict) -> tuple[str, str] | None:
    for k in ID_KEYS:
        if k in rec:
            return ident(k, rec[k])
    if "line" in rec:
        return ident("line", rec["line"])
    return None


class OutputError(Exception):
    """The output file refused a write (a full disk, a quota, an I/O error). The message names
    the file and the cause; what the file held before stays whole."""


class ForeignOutput(ValueError):
    """The output file holds lines that are not this run's eagle2 records: resuming into it would
    destroy them or mix two runs. The message names the file and the first such line."""


def _is_record(rec) -> bool:
    """An eagle2 output record: an id (or line number) and an answer or an error."""
    return isinstance(rec, dict) and _record_ident(rec) is not None and any(k in rec for k in ("text", "turns", "error"))


def _torn_record(line: bytes) -> bool:
    """Whether an unparseable last line can be the start of one of our records (a kill or a full
    disk mid-write): json.dumps puts the id key, or "line", first."""
    text = line.decode("utf-8", "replace")
    heads = [f'{{"{k}":' for k in ID_KEYS + ("line",)]
    return any(text.startswith(h) or h.startswith(text) for h in heads)


def _foreign(path: str, n: int, why: str) -> ForeignOutput:
    return ForeignOutput(f"{path}: line {n} {why}; the file is left as it was (use --overwrite to start it afresh, or another -o)")


def prepare_output(path: str, known: set[tuple[str, str]] | None = None) -> set[tuple[str, str]]:
    """Identities already done in `path` (successful records). Failed records and any partial
    last line (a kill or a full disk mid-write) are removed first, so the file never holds
    duplicates. A torn tail is cut off in place, which needs no free space: the usual state after
    a disk filled up, and a rerun should not need room for a copy before it can free any.

    A file that holds anything else is refused before a byte of it changes (ForeignOutput): a
    line that is not an eagle2 record, or (given `known`, the identities of this run's prompt
    file) a record of a prompt that is not in this file, i.e. another run's output."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        raw = f.read()
    kept: list[bytes] = []
    done: set[tuple[str, str]] = set()
    lines = raw.split(b"\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if n == len(lines) and _torn_record(line):
                continue  # torn write (only the unterminated last line can be one): that record runs again
            raise _foreign(path, n, "is not an eagle2 output record (not JSON)") from None
        if not _is_record(rec):
            raise _foreign(path, n, "is not an eagle2 output record (no id with a text, turns or error)")
        rid = _record_ident(rec)
        if "error" in rec or rid in done:
            continue  # failures run again; duplicates are dropped
        if known is not None and rid not in known:
            raise _foreign(path, n, f"answers {rid[0]} {rid[1]}, which is not in this prompt file: it is another run's output")
        done.add(rid)
        kept.append(line)
    new = b"".join(k + b"\n" for k in kept)
    if new == raw:
        return done
    try:
        if raw.startswith(new):  # only a tail to drop
            os.truncate(path, len(new))
        elif new.startswith(raw):  # only the last record's newline to add
            with open(path, "ab") as f:
                f.write(new[len(raw):])
                f.flush()
                os.fsync(f.fileno())
        else:  # records go from the middle: a whole new copy, swapped in atomically
            atomic.write_bytes(path, new, sync=True)  # a failed copy is removed: it would hold the space the rerun needs
    except OSError as e:
        raise OutputError(f"{path}: could not tidy the output before resuming ({e.strerror or e}); it is unchanged") from None
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
    """Appends one JSON line per record and syncs it at once (a kill loses at most the record
    being written). A record the file refuses (ENOSPC, EDQUOT, EIO) is cut back off the file, so
    the file ends with the last whole record, and the write raises OutputError."""

    def __init__(self, path: str | None, stream=None):
        self.path = path
        self.records = 0  # written by this run
        self.fd = None
        self.f = None
        if path and path != "-":
            # Unbuffered: a buffered file keeps what the disk refused and fails again when it is
            # closed, a second traceback after the first.
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self.end = os.fstat(self.fd).st_size  # where the last whole record ends
        else:
            self.f = stream

    def write(self, record: dict) -> None:
        # backslashreplace: a lone surrogate (none should get this far) becomes its JSON escape
        # instead of failing the encode halfway through a record
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
        if self.fd is None:
            if self.f is not None:
                self.f.write(data.decode("utf-8"))
                self.f.flush()
            return
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)  # a full disk may take part of the record, then refuse
                if n <= 0:
                    raise OSError(errno.EIO, "the write made no progress")
                view = view[n:]
            os.fsync(self.fd)  # some filesystems (NFS) report a full disk only here
        except OSError as e:
            self._fail(e)
        self.end += len(data)
        self.records += 1

    def _fail(self, e: OSError) -> None:
        cut = True
        try:
            os.ftruncate(self.fd, self.end)  # shrinking needs no free space
            os.fsync(self.fd)
        except OSError:
            cut = False  # the next run's prepare_output drops the torn line instead
        self.close()
        if self.records == 0:
            kept = "the file is as it was before this run"
        else:
            kept = f"the {self.records} record{'s' if self.records > 1 else ''} written before it {'are' if self.records > 1 else 'is'} whole"
        if not cut:
            kept += " (the torn one is dropped when you rerun)"
        when = " once there is room" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise OutputError(f"{self.path}: could not write record {self.records + 1} of this run ({e.strerror or e}); "
                          f"{kept}; rerun with the same -o{when} to answer the rest") from None

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def _prompt_field(item: PromptItem, turn: int) -> str:
    if item.multi_turn:
        return f"turns[{turn}]"
    if item.key == "custom_id":
        return "body.messages"
    return "messages" if len(item.messages) > 1 or item.messages[0]["role"] != "user" else "prompt"


def _too_long(runtime, item: PromptItem, ids: list[int], turn: int) -> InputError | None:
    if len(ids) < runtime.max_positions:
        return None
    return InputError(f"prompt is {len(ids)} tokens, the model's context is {runtime.max_positions}",
                      field=_prompt_field(item, turn), line=item.line, key=item.key, id=item.id)


def item_record(item: PromptItem, texts: list[str], reasons: list[str], total: Summary, depth: int,
                turns: list[Summary] | None = None, tokenizer=None) -> dict[str, Any]:
    """The output record of a finished item (every turn answered); `turns`, one summary a turn.
    Where the settings asked for logprobs, `logprobs` lists each answer token's entry in chat's
    shape (`choice.logprobs.content`): one list, or one per turn for a multi-turn item."""
    out = item.echo()
    if item.multi_turn:
        out["turns"] = texts
        out["finish_reason"] = reasons[-1]
        out["finish_reasons"] = reasons
    else:
        out["text"] = texts[0]
        out["finish_reason"] = reasons[0]
    # cached_tokens: prompt tokens restored from the item's earlier turn (prefix.py), as OpenAI reports them
    out["usage"] = {"prompt_tokens": total.prompt_tokens, "completion_tokens": total.new_tokens,
                    "total_tokens": total.prompt_tokens + total.new_tokens,
                    "prompt_tokens_details": {"cached_tokens": total.cached_tokens}}
    if item.multi_turn and turns:  # what each turn prefilled: a later turn restores its earlier turns' tokens
        out["usage"]["turns"] = [{"prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                                  "completion_tokens": s.new_tokens} for s in turns]
    if turns and turns[0].logprobs is not None and tokenizer is not None:
        lists = [chat_content(s.logprobs or [], token_text(tokenizer)) for s in turns]
        out["logprobs"] = lists if item.multi_turn else lists[0]
    out["metrics"] = summary_metrics(total, depth)
    out["metrics"]["arithmetic"] = rowgemm.arithmetic()  # int8 answers are another model's than exact (float32) ones
    return out


def run_item(runtime, decoder, item: PromptItem, gen: GenerationSettings, on_tokens=None) -> dict[str, Any]:
    """Generate every turn of `item`; returns its output record. Raises InputError for a prompt
    that does not fit the context (the caller turns it into an error record)."""
    g = apply_overrides(gen, item.overrides)
    messages = list(item.messages)
    user_turns = [None] + list(item.followups)
    texts, reasons, turns = [], [], []
    total, spliced = Summary(), SplicedIds()
    for t, followup in enumerate(user_turns):
        if followup is not None:
            messages.append({"role": "user", "content": followup})
        ids = runtime.encode(messages, spliced)
        err = _too_long(runtime, item, ids, t)
        if err is not None:
            raise err
        # kept while a later turn follows: it continues this one (prefix.py)
        tokens, summary = decoder.generate(ids, g, keep=t < len(item.followups))
        text = runtime.decode(tokens)
        if on_tokens:
            on_tokens(len(tokens))
        texts.append(text)
        reasons.append(summary.finish_reason)
        turns.append(summary)
        total.merge(summary)
        messages.append({"role": "assistant", "content": text})
        spliced.answered(text, tokens, runtime.tokenizer)
    return item_record(item, texts, reasons, total, getattr(getattr(decoder, "tree", None), "depth", 0), turns, getattr(runtime, "tokenizer", None))


def run_batched(runtime, pending: list, writer: "OutputWriter", gen: GenerationSettings, decoder, on_fail=None,
                on_done=None) -> tuple[int, int]:
    """`run_pending` with continuous batching (engine.Engine with B rows): every prompt of the file is
    queued, a free slot takes the next one, and a record is written as soon as its item's last
    turn is answered, so records come in the order items finish. A conversation's next turn is
    queued first (it needs the previous answer, and its item's record waits for it).
    Returns (ok, failed)."""
    from collections import deque

    from .engine import Request

    counts = {"ok": 0, "failed": 0}
    state: dict[int, dict] = {}
    queue: deque = deque()

    def fail(entry: InputError) -> None:
        counts["failed"] += 1
        writer.write(entry.record())
        if on_fail:
            on_fail(entry)

    def submit(key: int, front: bool = False) -> None:
        st = state[key]
        item, turn = st["item"], len(st["texts"])
        ids = runtime.encode(st["messages"], st["spliced"])
        err = _too_long(runtime, item, ids, turn)
        if err is not None:
            del state[key]
            fail(err)
            return
        req = Request(key, ids, st["gen"], keep=turn < len(item.followups))  # kept for the item's next turn
        queue.appendleft(req) if front else queue.append(req)

    def done(key: int, tokens: list[int], summary: Summary) -> None:
        st = state[key]
        text = runtime.decode(tokens)
        st["texts"].append(text)
        st["reasons"].append(summary.finish_reason)
        st["turns"].append(summary)
        st["total"].merge(summary)
        st["messages"].append({"role": "assistant", "content": text})
        st["spliced"].answered(text, tokens, runtime.tokenizer)
        item = st["item"]
        if len(st["texts"]) <= len(item.followups):
            st["messages"].append({"role": "user", "content": item.followups[len(st["texts"]) - 1]})
            submit(key, front=True)
            return
        del state[key]
        rec = item_record(item, st["texts"], st["reasons"], st["total"], decoder.tree.depth, st["turns"], getattr(runtime, "tokenizer", None))
        writer.write(rec)
        counts["ok"] += 1
        if on_done:
            on_done(item, rec)

    for key, entry in enumerate(pending):
        if isinstance(entry, InputError):
            fail(entry)
            continue
        state[key] = {"item": entry, "gen": apply_overrides(gen, entry.overrides), "messages": list(entry.messages),
                      "texts": [], "reasons": [], "turns": [], "total": Summary(), "spliced": SplicedIds()}
        submit(key)
    decoder.run(queue, done)
    return counts["ok"], counts["failed"]
