"""Prompt input: the line formats `eagle2 generate` and `eagle2 compare -f` read, and chat encoding.

Accepted JSON lines (one object per line, blank lines skipped):

- `{"id": ..., "prompt": "text"}`                     one user message
- `{"id": ..., "messages": [{"role", "content"}]}`    a conversation (OpenAI chat format)
- `{"question_id": ..., "turns": ["t1", "t2"]}`       MT-bench: multi-turn, each answer feeds the next turn
- `{"custom_id": ..., "body": {"messages": [...], "max_tokens": N, "temperature": T}}`   OpenAI batch

Sampling overrides may sit on the line (`max_new_tokens`/`max_tokens`, `temperature`, `top_p`,
`top_k`, `seed`, `stop`), or in `body` for OpenAI batch lines, and so may a `response_format`
(structured.py: JSON schema, JSON object, regex, grammar), and `logprobs` (OpenAI's chat or
completions form). OpenAI fields that eagle2 cannot apply (tools, n > 1, ...) are refused, never dropped. A line without an id is named by
its line number. No terminal code here: errors are `InputError`s carrying file, line and field.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch's generators accept
OVERRIDE_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class InputError(ValueError):
    """A prompt line that cannot run; `describe()` gives the one-line report with file, line and field."""

    def __init__(self, message: str, field: str | None = None, line: int | None = None, path: str | None = None,
                 key: str | None = None, id: Any = None):
        super().__init__(message)
        self.message, self.field, self.line, self.path, self.key, self.id = message, field, line, path, key, id

    def describe(self) -> str:
        where = f"{self.path or '<input>'}:{self.line}" if self.line is not None else (self.path or "<input>")
        what = f" field {self.field!r}:" if self.field else ""
        return f"{where}:{what} {self.message}"

    def record(self) -> dict:
        """The output line for this failure: the id when known, else the line number."""
        out: dict[str, Any] = {self.key: self.id} if self.key and self.key != "line" else {}
        if self.line is not None:  # always: two failing lines may carry the same id
            out["line"] = self.line
        if self.field:
            out["field"] = self.field
        out["error"] = self.message
        return out


@dataclass
class PromptItem:
    key: str                           # "id", "question_id", "custom_id", or "line" when the line has no id
    id: Any
    messages: list[dict]               # the conversation up to the first answer
    followups: list[str] = field(default_factory=list)   # further user turns (MT-bench)
    multi_turn: bool = False           # output "turns" rather than "text"
    overrides: dict = field(default_factory=dict)        # GenerationSettings fields
    category: str | None = None
    line: int | None = None

    @property
    def ident(self) -> tuple[str, str]:
        """A hashable identity for resume bookkeeping."""
        return ident(self.key, self.id)

    def echo(self) -> dict:
        out: dict[str, Any] = {self.key: self.id}
        if self.category is not None:
            out["category"] = self.category
        return out


def ident(key: str, value: Any) -> tuple[str, str]:
    return key, json.dumps(value, sort_keys=True)


# -- parsing --------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    """A finite number: JSON lines may hold NaN and Infinity, which no sampling setting means."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def text_problem(text: str) -> str | None:
    """Why `text` cannot be encoded (None when it can). JSON's \\u escapes can spell half of a
    surrogate pair on its own (`"\\ud800"`), and Python decodes it into a str that no UTF-8
    encoder accepts: the tokenizer then fails with a TypeError that names no line. The reason
    names the code point as an escape, so the message itself stays printable."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode text: a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}"
    return None


def check_text(text: str, fld: str) -> str:
    """`text` itself, or an InputError naming `fld` when it cannot be encoded."""
    why = text_problem(text)
    if why is not None:
        raise InputError(why, field=fld)
    return text


def _content_text(content, fld: str) -> str:
    if isinstance(content, str):
        return check_text(content, fld)
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = []
        for i, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(check_text(p["text"], f"{fld}[{i}].text"))
            else:
                raise InputError("only text content parts are supported", field=fld)
        return "".join(parts)
    raise InputError(f"must be a string, not {type(content).__name__}", field=fld)


def parse_messages(msgs, fld: str = "messages") -> list[dict]:
    """Each message as `{"role", "content"}` (content as text), plus an assistant's `tool_calls`
    (its content then may be null or missing, and is "") and a tool message's `tool_call_id`."""
    if not isinstance(msgs, list):
        raise InputError(f"must be a list of {{role, content}} objects, not {type(msgs).__name__}", field=fld)
    if not msgs:
        raise InputError("is empty", field=fld)
    out = []
    for i, m in enumerate(msgs):
        f = f"{fld}[{i}]"
        if not isinstance(m, dict):
            raise InputError(f"must be an object with role and content, not {type(m).__name__}", field=f)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InputError(f"role must be one of {', '.join(ROLES)}, not {role!r}", field=f"{f}.role")
        calls = _tool_calls(m.get("tool_calls"), f"{f}.tool_calls") if role == "assistant" else None
        if calls and m.get("content") is None:
            out.append({"role": role, "content": "", "tool_calls": calls})
            continue
        if "content" not in m:
            raise InputError("is missing", field=f"{f}.content")
        msg = {"role": role, "content": _content_text(m["content"], f"{f}.content")}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise InputError("must be the id (a string) of the call this message answers", field=f"{f}.tool_call_id")
            msg["tool_call_id"] = check_text(m["tool_call_id"], f"{f}.tool_call_id")
            if isinstance(m.get("name"), str):
                msg["name"] = check_text(m["name"], f"{f}.name")
        out.append(msg)
    if out[-1]["role"] == "assistant":
        raise InputError("ends with an assistant message; nothing to answer", field=fld)
    return out


def _tool_calls(calls, fld: str) -> list[dict] | None:
    """An assistant message's `tool_calls`, each `{id, type: "function", function: {name,
    arguments}}` with arguments as the JSON text of an object (an object is taken too); None for none."""
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise InputError("must be a list of tool calls", field=fld)
    out = []
    for j, c in enumerate(calls):
        f = f"{fld}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InputError('must be an object like {"id", "type": "function", "function": {"name", "arguments"}}', field=f)
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif isinstance(args, str):
            check_text(args, f"{f}.function.arguments")
        try:
            ok = isinstance(args, str) and isinstance(json.loads(args), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:  # rendered again as an object, by the template or in the call format
            raise InputError("must be the JSON text of an object", field=f"{f}.function.arguments")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise InputError("must be a string", field=f"{f}.id")
        out.append({"id": check_text(cid, f"{f}.id") if cid else f"call_{j}", "type": "function",
                    "function": {"name": check_text(fn["name"], f"{f}.function.name"), "arguments": args}})
    return out


def parse_overrides(obj: dict, prefix: str = "") -> dict:
    """GenerationSettings fields from a line's sampling keys, type-checked."""
    out: dict[str, Any] = {}
    for k in OVERRIDE_FIELDS:
        if k not in obj or obj[k] is None:
            continue
        v, f = obj[k], prefix + k
        if k in ("max_new_tokens", "max_tokens", "max_completion_tokens"):
            if not _is_int(v) or v < 0:
                raise InputError(f"must be a non-negative integer, not {v!r}", field=f)
            out["max_new_tokens"] = v
        elif k == "temperature":
            if not _is_num(v) or v < 0:
                raise InputError(f"must be a number >= 0, not {v!r}", field=f)
            out["temperature"] = float(v)
        elif k == "top_p":
            if not _is_num(v) or not 0 < v <= 1:
                raise InputError(f"must be a number in (0, 1], not {v!r}", field=f)
            out["top_p"] = float(v)
        elif k == "top_k":
            if not _is_int(v) or v < 0:
                raise InputError(f"must be a non-negative integer, not {v!r}", field=f)
            out["top_k"] = v
        elif k == "seed":
            if not _is_int(v) or not SEED_MIN <= v <= SEED_MAX:
                raise InputError(f"must be an integer from {SEED_MIN} to {SEED_MAX}, not {v!r}", field=f)
            out["seed"] = v
        elif k == "stop":
            stops = [v] if isinstance(v, str) else v
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InputError("must be a string or a list of strings", field=f)
            for i, s in enumerate(stops):
                check_text(s, f if isinstance(v, str) else f"{f}[{i}]")
            out["stop_strings"] = tuple(stops)
    return out


# OpenAI request fields that would change the output and that eagle2 cannot apply: each is
# refused in one line where its value asks for something (never dropped), as the server refuses them.
UNSUPPORTED_FIELDS = (
    ("tools", lambda v: bool(v), "no tool calling"),
    ("functions", lambda v: bool(v), "no tool calling"),
    ("tool_choice", lambda v: v not in ("none", "auto"), "no tool calling"),
    ("function_call", lambda v: v not in ("none", "auto"), "no tool calling"),
    ("n", lambda v: v != 1, "one answer per prompt"),
    ("best_of", lambda v: v != 1, "one answer per prompt"),
    ("frequency_penalty", lambda v: v != 0, "repetition_penalty is applied instead"),
    ("presence_penalty", lambda v: v != 0, "repetition_penalty is applied instead"),
    ("logit_bias", lambda v: bool(v), "no logit bias"),
    ("echo", lambda v: v is not False, "the prompt is not echoed"),
    ("suffix", lambda v: bool(v), "no insertion"),
    ("prediction", lambda v: True, "predicted outputs"),
    ("audio", lambda v: True, "text only"),
    ("modalities", lambda v: v != ["text"], "text only"),
)


def parse_logprobs(obj: dict, prefix: str = "", shape: str | None = None) -> dict:
    """{"logprobs": N} (GenerationSettings.logprobs: each token's log-probability and its N
    likeliest alternatives) from OpenAI's fields, or {} when none are asked for. Chat's shape
    (`shape="chat"`) is `logprobs: true` with `top_logprobs: N`; completions' (`"completions"`)
    is `logprobs: N`; a prompt file's line may use either."""
    from .logprobs import MAX_TOP

    v, top = obj.get("logprobs"), obj.get("top_logprobs")
    if top is not None:
        if shape == "completions":
            raise InputError("is not a completions field (logprobs: N asks for N alternatives)", field=prefix + "top_logprobs")
        if not _is_int(top) or not 0 <= top <= MAX_TOP:
            raise InputError(f"must be an integer from 0 to {MAX_TOP}, not {top!r}", field=prefix + "top_logprobs")
        if v is not True:
            raise InputError("needs logprobs: true", field=prefix + "top_logprobs")
    if v is None or v is False:
        return {}
    if v is True and shape != "completions":
        return {"logprobs": top or 0}
    if _is_int(v) and shape != "chat" and 0 <= v <= MAX_TOP:
        return {"logprobs": v}
    want = {"chat": "true or false", "completions": f"an integer from 0 to {MAX_TOP}"}.get(shape, f"true or false, or an integer from 0 to {MAX_TOP}")
    raise InputError(f"must be {want}, not {json.dumps(v)[:40]}", field=prefix + "logprobs")


def parse_request_fields(obj: dict, prefix: str = "") -> dict:
    """GenerationSettings fields from a line's OpenAI request fields beyond sampling: logprobs,
    the constraint of its `response_format` (structured.py); an InputError for a field eagle2
    cannot apply (UNSUPPORTED_FIELDS) or a response_format it cannot compile."""
    for name, asks, why in UNSUPPORTED_FIELDS:
        if name in obj and obj[name] is not None and asks(obj[name]):
            raise InputError(f"{json.dumps(obj[name])[:60]} is not supported by eagle2 ({why})", field=prefix + name)
    out = parse_logprobs(obj, prefix)
    if obj.get("response_format") is None:
        return out
    from .structured import ConstraintError, from_response_format

    try:
        c = from_response_format(obj["response_format"], prefix + "response_format")
    except ConstraintError as e:
        raise InputError(str(e), field=prefix + "response_format") from None
    return out if c is None else {**out, "constraint": c}


def _id_of(obj: dict, line: int | None) -> tuple[str, Any]:
    for key in ("custom_id", "question_id", "id"):
        if key in obj:
            v = obj[key]
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise InputError(f"must be a string or an integer, not {type(v).__name__}", field=key)
            if isinstance(v, str):  # echoed into the output record, which must stay UTF-8
                check_text(v, key)
            return key, v
    return "line", line


def parse_record(obj, line: int | None = None) -> PromptItem:
    """One decoded JSON value to a PromptItem; InputError (with key/id when known) otherwise."""
    if not isinstance(obj, dict):
        raise InputError(f"a line must be a JSON object, not {type(obj).__name__}", line=line)
    key, rid = "line", line
    try:
        key, rid = _id_of(obj, line)
        if key == "custom_id":  # OpenAI batch line
            body = obj.get("body")
            if not isinstance(body, dict):
                raise InputError("must be an object holding messages", field="body")
            if "messages" not in body:
                raise InputError("is missing", field="body.messages")
            msgs = parse_messages(body["messages"], "body.messages")
            over = parse_overrides(body, "body.")
            over.update(parse_request_fields(body, "body."))
            over.update(parse_overrides(obj))
            over.update(parse_request_fields(obj))
            return PromptItem(key, rid, msgs, overrides=over, line=line)
        over = parse_overrides(obj)
        over.update(parse_request_fields(obj))
        category = obj.get("category") if isinstance(obj.get("category"), str) else None
        if category is not None:  # echoed, like the id
            check_text(category, "category")
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns:
                raise InputError("must be a non-empty list of strings", field="turns")
            for i, t in enumerate(turns):
                if not isinstance(t, str) or not t:
                    raise InputError("must be a non-empty string", field=f"turns[{i}]")
                check_text(t, f"turns[{i}]")
            return PromptItem(key, rid, [{"role": "user", "content": turns[0]}], list(turns[1:]), True, over, category, line)
        if "messages" in obj:
            return PromptItem(key, rid, parse_messages(obj["messages"]), overrides=over, category=category, line=line)
        if "prompt" in obj:
            p = obj["prompt"]
            if not isinstance(p, str):
                raise InputError(f"must be a string, not {type(p).__name__}", field="prompt")
            if not p:
                raise InputError("is empty", field="prompt")
            check_text(p, "prompt")
            return PromptItem(key, rid, [{"role": "user", "content": p}], overrides=over, category=category, line=line)
        raise InputError("no prompt: give one of prompt, messages, turns, or an OpenAI batch body", field="prompt")
    except InputError as e:
        e.line = line if e.line is None else e.line
        if e.key is None and key != "line":
            e.key, e.id = key, rid
        raise


def parse_line(text: str, line: int | None = None) -> PromptItem:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e.msg} at column {e.colno})", line=line) from None
    return parse_record(obj, line)


def _open_text(path: str):
    if path == "-":
        return sys.stdin
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first line
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def read_prompt_file(path: str) -> Iterator[PromptItem | InputError]:
    """Every non-blank line of a JSONL file (`.gz` allowed, `-` for stdin), parsed or failed.

    Duplicate ids become InputErrors naming the line, so each id runs once.
    """
    if path != "-" and not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    seen: dict[tuple, int] = {}
    f = _open_text(path)
    lines = 0
    try:
        for n, text in enumerate(f, 1):
            if n == 1 and text.startswith("\ufeff"):  # stdin is not opened by us: drop its BOM here
                text = text[1:]
            if not text.strip():
                continue
            lines += 1
            try:
                item = parse_line(text, n)
            except InputError as e:
                e.path = path
                yield e
                continue
            if item.ident in seen:
                yield InputError(f"duplicate {item.key} {item.id!r} (first on line {seen[item.ident]})", field=item.key, line=n, path=path)
                continue
            seen[item.ident] = n
            yield item
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text ({e.reason})", path=path) from None
    except (OSError, EOFError) as e:  # a cut .gz file
        raise InputError(f"unreadable ({e})", path=path) from None
    finally:
        if f is not sys.stdin:
            f.close()
    if not lines:
        raise InputError("no prompts: the file is empty (or only blank lines)", path=path)


def apply_overrides(gen, overrides: dict):
    """A copy of GenerationSettings `gen` with the line's overrides applied."""
    return dataclasses.replace(gen, **overrides) if overrides else gen


# -- chat encoding --------------------------------------------------------------------------
def load_chat_template(path: str) -> str:
    """A Jinja chat template from a file: the raw template, or a JSON file with `chat_template`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such chat template file")
    with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"invalid JSON ({e.msg})", path=path) from None
        tpl = obj.get("chat_template") if isinstance(obj, dict) else None
        if isinstance(tpl, list):  # named templates: take "default"
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(tpl, str):
            raise InputError("no chat_template string in this JSON file", path=path, field="chat_template")
        text = tpl
    if not text.strip():  # an empty template would silently give way to the tokenizer's
        raise InputError("the chat template is empty", path=path, field="chat_template" if path.endswith(".json") else None)
    check_template_syntax(text, path)
    return text


def check_template_syntax(template: str, path: str) -> None:
    """Compile the template now, so a typo is reported with its file and line before any model loads."""
    try:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # transformers needs jinja2 for chat templates anyway
        return
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as e:
        raise InputError(f"chat template is not valid Jinja ({e.message})", path=path, line=e.lineno) from None


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if not system_prompt or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}] + list(messages)


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None, tools=None) -> tuple[str, bool]:
    """(text, templated): the conversation rendered with a generation prompt.

    Uses `chat_template`, else the tokenizer's; a model without one gets plain text (the lone
    user message itself, or "Role: content" paragraphs). A template that rejects the system
    role gets the system text folded into the first user message. `tools` (OpenAI function specs)
    and tool turns go to a template that renders them, or become plain messages (tools.prepare).
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    extra = {}
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        from .tools import prepare

        messages, shown = prepare(tokenizer, messages, template, tools)
        extra = {"tools": shown} if shown else {}
    if template:
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False, **extra), True
        except Exception as e:  # jinja TemplateError, "System role not supported", ...
            if messages and messages[0]["role"] == "system" and len(messages) > 1:
                folded = [dict(messages[1], content=messages[0]["content"] + "\n\n" + messages[1]["content"])] + list(messages[2:])
                return tokenizer.apply_chat_template(folded, chat_template=template, add_generation_prompt=True, tokenize=False, **extra), True
            raise InputError(f"chat template failed: {e}") from None
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"], False
    text = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return text + "\n\nAssistant:", False


def encode_chat(tokenizer, messages: list[dict], system_prompt: str | None = None, chat_template: str | None = None,
                tools=None) -> list[int]:
    """Token ids of the conversation plus the assistant generation prompt; `tools` (OpenAI
    function specs) shown as render_chat shows them."""
    # Parsed lines are checked already; a chat turn or --system-prompt from a non-UTF-8 argv or
    # stdin is not, and the tokenizer's own failure (a TypeError) names nothing.
    if system_prompt and text_problem(system_prompt):
        raise InputError(text_problem(system_prompt), path="system prompt")
    for i, m in enumerate(messages):
        check_text(m["content"], f"messages[{i}].content")
    text, templated = render_chat(tokenizer, with_system(messages, system_prompt), chat_template, tools)
    # A template writes its own BOS; plain text gets the tokenizer's special tokens.
    ids = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
    if not ids:  # the model needs at least one position to predict from
        raise InputError("rendered no tokens for this conversation (it must write the messages or at least the "
                         "assistant's generation prompt)", path="chat template") if templated else \
            InputError("encodes to no tokens", path="prompt")
    return ids


@dataclass
class SplicedIds:
    """A conversation as the model saw it: token ids. An answer's text encoded again can give
    other ids than the ones generated (tokenization is not compositional), and a kept cache
    (prefix.py) is only valid for the ids it was computed on, so the next turn's prompt is the ids
    seen so far (the last prompt's and the answer's own) followed by the encoding of what the
    template adds after the answer, wherever the template renders the earlier turns and the answer
    verbatim. Elsewhere (a template that trims answers, a changed system prompt) the whole
    conversation is encoded afresh, and a kept cache still serves the longest common prefix.
    Chat turns and the turns of a prompt file's item use it alike."""
    seen_text: str = ""                                   # the last prompt rendered, and its answer's text
    seen_ids: list[int] = field(default_factory=list)     # their ids: the prompt's, then the answer's own
    spliced: int = 0                                      # turns whose prompt continued `seen_ids`
    prompt: tuple | None = field(default=None, repr=False)  # (rendered text, ids) of the turn being answered

    def encode(self, tokenizer, messages: list[dict], system_prompt: str | None = None, chat_template: str | None = None,
               tools=None) -> list[int]:
        """Token ids of `messages` plus the generation prompt, continuing the ids seen so far where
        the template allows. Raises InputError as encode_chat does."""
        ids = encode_chat(tokenizer, messages, system_prompt, chat_template, tools)  # checks the texts; the fallback
        text, _ = render_chat(tokenizer, with_system(messages, system_prompt), chat_template, tools)
        if self.seen_ids and text.startswith(self.seen_text):
            ids = self.seen_ids + list(tokenizer(text[len(self.seen_text):], add_special_tokens=False)["input_ids"])
            self.spliced += 1
        self.prompt = (text, ids)
        return ids

    def answered(self, text: str, token_ids: list[int] | None, tokenizer) -> None:
        """The answer to the last encoded prompt: with its `token_ids` (as generated) the ids seen so
        far become the prompt's, then the answer's, less the end-of-turn tokens the text leaves out
        (the template writes its own after the text). An answer with special tokens inside, or
        whose ids do not decode to `text`, is not spliced."""
        prompt, self.prompt = self.prompt, None
        self.seen_text, self.seen_ids = "", []
        if prompt is None or token_ids is None or tokenizer is None:
            return
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        answer = list(token_ids)
        while answer and answer[-1] in special:
            answer.pop()
        if any(t in special for t in answer) or tokenizer.decode(answer, skip_special_tokens=True) != text:
            return
        self.seen_text, self.seen_ids = prompt[0] + text, list(prompt[1]) + answer

    def reset(self) -> None:
        self.seen_text, self.seen_ids, self.prompt = "", [], None
