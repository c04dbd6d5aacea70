"""Training data for draft heads: conversations in, token ids with an assistant-only loss mask out.

Accepted inputs (one file may mix nothing: the format is detected per record):
  * ShareGPT JSON or JSONL: {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}.
    The public ShareGPT dump is one JSON array cut off mid-record, so arrays are parsed record
    by record and a truncated tail is counted, not fatal.
  * {"messages": [{"role", "content"}, ...]} JSONL.
  * {"prompt": "..."} JSONL (prompts only; the answer comes from --self-distill).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class ReadReport:
    records: int = 0
    skipped: int = 0
    truncated_tail: bool = False
    reasons: list[str] = field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.reasons) < 20:
            self.reasons.append(f"{where}: {why}")


def _record_to_messages(rec) -> list[dict] | None:
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("conversations"), list):
        msgs = []
        for turn in rec["conversations"]:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                return None
            role = ROLE_MAP.get(str(turn.get("from", "")).lower())
            if role is None:
                return None
            msgs.append({"role": role, "content": turn["value"]})
        return msgs or None
    if isinstance(rec.get("messages"), list):
        msgs = [m for m in rec["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user", "assistant")]
        return msgs if len(msgs) == len(rec["messages"]) and msgs else None
    if isinstance(rec.get("prompt"), str):
        return [{"role": "user", "content": rec["prompt"]}]
    return None


def iter_json_array(text: str, report: ReadReport):
    """Yield the whole records of a (possibly truncated) top-level JSON array."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            report.truncated_tail = True
            return
        if text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            report.truncated_tail = True  # the cut-off last record
            return
        yield rec


def read_conversations(path: str, report: ReadReport | None = None, limit: int | None = None) -> list[list[dict]]:
    """Conversations (lists of {"role","content"}) from one file, skipping malformed records."""
    report = report if report is not None else ReadReport()
    out: list[list[dict]] = []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = ((f"{path} record {k + 1}", r) for k, r in enumerate(iter_json_array(stripped, report)))
    else:
        def lines():
            for ln, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{ln}", json.loads(line)
                except json.JSONDecodeError as e:
                    report.skip(f"{path}:{ln}", f"invalid JSON ({e.msg})")
        records = lines()
    for where, rec in records:
        msgs = _record_to_messages(rec)
        if msgs is None:
            report.skip(where, "no conversations/messages/prompt field of the expected shape")
            continue
        report.records += 1
        out.append(msgs)
        if limit is not None and len(out) >= limit:
            break
    return out


def normalise(messages: list[dict]) -> list[dict]:
    """Drop empty turns and merge consecutive same-role turns, so chat templates accept them."""
    out: list[dict] = []
    for m in messages:
        if not m["content"].strip():
            continue
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    while out and out[0]["role"] == "assistant":
        out.pop(0)
    return out


def _ids(tokenizer, messages, add_generation_prompt: bool, chat_template=None) -> list[int]:
    r = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template)
    if hasattr(r, "keys"):
        r = r["input_ids"]
    return list(r)


def prompt_ids(tokenizer, messages: list[dict], chat_template=None) -> list[int]:
    """A conversation's token ids in the target's chat template, ending in the generation prompt:
    what the target answers from (self-distillation's prompts)."""
    return _ids(tokenizer, messages, True, chat_template)


def render(tokenizer, messages: list[dict], max_len: int = 2048, chat_template=None) -> tuple[list[int], list[int]] | None:
    """Token ids of the conversation in the target's chat template, and a mask of assistant tokens.

    Each assistant turn's tokens are found as the difference between the rendering up to the
    turn's generation prompt and the rendering including the turn; this works for any template
    that renders a prefix of a conversation as a prefix of its tokens.
    """
    messages = normalise(messages)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:i], True, chat_template)
        after = _ids(tokenizer, messages[: i + 1], False, chat_template)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            return None  # template does not render prefixes as prefixes
        mask += [0] * (len(before) - len(ids)) + [1] * (len(after) - len(before))
        ids = after
        if len(ids) >= max_len:
            break
    return ids[:max_len], mask[:max_len]


def first_user_prompts(conversations: list[list[dict]]) -> list[list[dict]]:
    """The opening (system +) user turn of each conversation: prompts for self-distillation."""
    out = []
    for conv in conversations:
        conv = normalise(conv)
        head = []
        for m in conv:
            head.append(m)
            if m["role"] == "user":
                break
        if head and head[-1]["role"] == "user":
            out.append(head)
    return out
