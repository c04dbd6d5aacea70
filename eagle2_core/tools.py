"""Tool calls: OpenAI's `tools` and `tool_choice`, the prompt that shows them, the grammar that
holds a call to its function's parameters, and the answer read back as `tool_calls`.

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (a newline allowed
inside either tag, as Qwen's and Hermes' templates write it). `tool_choice` picks the grammar,
which runs as a structured.py constraint (one more logits processor, so speculation keeps
exactly the text of plain constrained decoding):

- `none`: free text that does not start like a call (the tools are shown all the same, so a
  conversation's prompt is the same whatever each turn's tool_choice, and its kept prefix serves);
- `auto`: free text, or one call and nothing after it (text that starts like a call must be one);
- `required`: one call of any of the tools; a named function: one call of that function.

A chat template that renders tools, and assistant turns' calls and tool results (probed once per
template, `renders_tools`), gets them as transformers passes them. Any other template gets plain
messages: the tools as a system block (`tool_block`), each earlier call as the assistant's text in
the call format, and tool results as `tool` turns where the template shows that role (SmolLM2
answers from such a turn, and echoes the tags of a user turn), else as one user turn of
`<tool_response>` blocks.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
CHOICES = ("none", "auto", "required")
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what OpenAI accepts as a function name
# The call's JSON as structured.py writes JSON: one line, ", " and ": " between items.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A `tools` or `tool_choice` that cannot run: one line, and the request field (`param`) it is about."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of its tools: `specs` (each `{"type": "function", "function": {name,
    description, parameters}}`, as the prompt shows them), `choice` (none, auto, required, or
    function for a named one, `name`), and `constraint` (structured.Constraint)."""
    specs: tuple
    choice: str
    name: str | None = None
    constraint: object = None

    @property
    def calls(self) -> bool:
        """Whether the answer may be a call."""
        return self.choice != "none"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,) if self.name else tuple(s["function"]["name"] for s in self.specs)

    def read(self, text: str) -> dict | None:
        """The answer as one OpenAI tool call, or None when it is not a whole call of these tools."""
        return read_call(text, self.names) if self.calls else None


# -- the request: tools and tool_choice, checked ----------------------------------------------------
def parse_tools(tools, tool_choice) -> ToolPlan | None:
    """The ToolPlan of a request's `tools` and `tool_choice` (None when it has no tools and its
    tool_choice is none or auto, or absent); ToolError naming the field otherwise. Each function's
    parameters are compiled here, so a bad schema is refused before anything runs."""
    from .structured import ConstraintError, json_schema

    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    specs, seen = [], {}
    for i, t in enumerate(tools or []):
        f = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolError(f"{f} must be an object like {{\"type\": \"function\", \"function\": {{...}}}}", f)
        if t.get("type", "function") != "function":
            raise ToolError(f"{f}.type must be \"function\", not {json.dumps(t.get('type'))[:40]}", f"{f}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{f}.function must be an object with a name", f"{f}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{f}.function.name is missing", f"{f}.function.name")
        if not NAME_RE.fullmatch(name):
            raise ToolError(f"{f}.function.name must be 1 to 64 letters, digits, _ or -, not {json.dumps(name)[:70]}", f"{f}.function.name")
        if name in seen:
            raise ToolError(f"{f}.function.name {name!r} is also tools[{seen[name]}]'s", f"{f}.function.name")
        seen[name] = i
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{f}.function.description must be a string", f"{f}.function.description")
        params = fn.get("parameters")
        if params is None:  # OpenAI: no parameters is an empty parameter list
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f"{f}.function.parameters must be a JSON schema of type object", f"{f}.function.parameters")
        try:
            json_schema(params)
        except ConstraintError as e:
            raise ToolError(f"{f}.function.parameters: {e}", f"{f}.function.parameters") from None
        spec = {"name": name, **({"description": desc} if desc else {}), "parameters": params}
        specs.append({"type": "function", "function": spec})
    choice, chosen = _choice(tool_choice, seen)
    if not specs:
        if choice in ("none", "auto"):
            return None
        raise ToolError(f"tool_choice {json.dumps(tool_choice)[:60]} needs tools", "tool_choice")
    plan = ToolPlan(tuple(specs), choice, chosen)
    return ToolPlan(plan.specs, choice, chosen, call_constraint(plan))


def _choice(tool_choice, names: dict) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None  # OpenAI's default where tools are given
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                            f"not {json.dumps(tool_choice)[:40]}", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if fn["name"] not in names:
        raise ToolError(f"tool_choice names {json.dumps(fn['name'])[:70]}, which is not one of the tools", "tool_choice")
    return "function", fn["name"]


def call_constraint(plan: ToolPlan):
    """The structured.Constraint of a plan's answer: a Lark grammar whose call is a JSON object
    `{"name": <one of the names>, "arguments": <its parameters>}` (name first), alone, or for
    auto beside free text that does not start like a call; for none, that text alone."""
    from .structured import grammar

    params = {s["function"]["name"]: s["function"]["parameters"] for s in plan.specs}
    objects = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                "required": ["name", "arguments"], "additionalProperties": False} for n in plan.names]
    schema = dict(objects[0]) if len(objects) == 1 else {"anyOf": objects}
    schema["x-guidance"] = JSON_STYLE
    lark = "\n".join([
        "start: " + {"auto": "call | TEXT", "none": "TEXT"}.get(plan.choice, "call"),
        f'call: "{CALL_OPEN}" /\\n?/ obj /\\n?/ "{CALL_CLOSE}"',
        "obj: %json " + json.dumps(schema),
        # any text, less what starts (after blanks) like a call: a call is the other branch, whole
        f"TEXT: /(.|\\n)*/ & ~/[ \\t\\r\\n]*{CALL_OPEN}(.|\\n)*/",
    ])
    c = grammar(lark, "lark")
    return type(c)(c.kind, c.source, c.grammar, "tools " + plan.choice)


# -- the answer: a call read back -------------------------------------------------------------------
def read_call(text: str, names) -> dict | None:
    """`text` as an OpenAI tool call `{id, type: "function", function: {name, arguments}}`
    (arguments as JSON text), or None when it is not one whole call of `names`."""
    body = text.strip()
    if not (body.startswith(CALL_OPEN) and body.endswith(CALL_CLOSE)):
        return None
    try:
        obj = json.loads(body[len(CALL_OPEN) : -len(CALL_CLOSE)])
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments"), dict):
        return None
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}


class CallStream:
    """A streamed answer that may be a call: text passes once it can no longer begin one (it is
    then free text), and is held while it could, so a call goes out whole, as one delta."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held, self.free = "", not plan.calls

    def push(self, piece: str) -> str:
        """What of `piece` may be sent now as text."""
        if self.free:
            return piece
        self.held += piece
        lead = self.held.lstrip()
        if self.plan.choice == "auto" and not (CALL_OPEN.startswith(lead) or lead.startswith(CALL_OPEN)):
            self.free = True
            out, self.held = self.held, ""
            return out
        return ""

    def release(self, rest: str) -> str:
        """Everything held, and `rest`: the answer's text as far as it went (a stream cut short)."""
        held, self.held = self.held, ""
        return held + rest

    def finish(self, rest: str) -> tuple[str, dict | None]:
        """(text still to send, the call or None) at the answer's end, `rest` its last text."""
        out = self.push(rest)
        if self.free:
            return out, None
        held, self.held = self.held, ""
        call = self.plan.read(held)
        return ("", call) if call is not None else (held, None)


# -- the prompt: tools and tool turns, rendered -----------------------------------------------------
def tool_block(specs) -> str:
    """The system text that shows `specs` where the chat template does not render tools."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    return ("# Tools\n\nYou may call one of these functions to answer the user. Their signatures, one a line:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call one, answer with the call alone, in this form:\n"
            f'{CALL_OPEN}{{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}}{CALL_CLOSE}\n'
            "Its result comes back in the next turn.")


def call_text(call: dict) -> str:
    """An OpenAI tool call (arguments as JSON text, or an object) in the call format."""
    fn = call["function"]
    args = fn["arguments"]
    args = json.loads(args) if isinstance(args, str) else args
    return CALL_OPEN + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + CALL_CLOSE


def has_tool_turns(messages) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def plain_messages(messages: list[dict], specs, tool_role: bool = True) -> list[dict]:
    """`messages` as role and content only: `specs` in a system block (after any system text),
    calls as assistant text, tool results as they are (`tool_role`) or consecutive ones as one
    user turn."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool" and not tool_role:
            result = f"{RESULT_OPEN}\n{m['content']}\n{RESULT_CLOSE}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [call_text(c) for c in m["tool_calls"]])
        out.append({"role": m["role"], "content": content})
    if specs:
        block = tool_block(specs)
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + block if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def native_messages(messages: list[dict]) -> list[dict]:
    """`messages` for a template that renders tool turns: calls' arguments as objects, as
    transformers' templates expect them."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {"name": c["function"]["name"], "arguments": _args(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _args(args):
    return json.loads(args) if isinstance(args, str) else args


_PROBE_TOOL, _PROBE_CALL, _PROBE_RESULT = "eagle2_probe_tool_7c1", "eagle2_probe_call_7c1", "eagle2_probe_result_7c1"
_PROBES: dict = {}
_PROBES_LOCK = threading.Lock()


def _shows(tokenizer, template: str, messages: list[dict], tools, names: tuple[str, ...]) -> bool:
    """Whether `template` renders `messages` (and `tools`) with every one of `names` in the text;
    read once per template and probe."""
    key = (template, names)
    with _PROBES_LOCK:
        if key in _PROBES:
            return _PROBES[key]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}))
        ok = all(s in text for s in names)
    except Exception:  # noqa: BLE001  (a template may raise anything on roles or fields it does not know)
        ok = False
    with _PROBES_LOCK:
        _PROBES[key] = ok
    return ok


def renders_tools(tokenizer, template: str) -> bool:
    """Whether `template` shows a tool, an assistant's call and a tool's result (each probed by a
    name of its own in the rendered text)."""
    probe = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_probe", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {"a": 1}}}]},
             {"role": "tool", "tool_call_id": "call_probe", "name": _PROBE_CALL, "content": _PROBE_RESULT}]
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "d",
                                             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    return _shows(tokenizer, template, probe, [tool], (_PROBE_TOOL, _PROBE_CALL, _PROBE_RESULT))


def shows_tool_role(tokenizer, template: str) -> bool:
    """Whether `template` renders a `tool` turn's content (any role's, as ChatML templates do)."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": _PROBE_RESULT}]
    return _shows(tokenizer, template, probe, None, (_PROBE_RESULT,))


def prepare(tokenizer, messages: list[dict], template: str | None, specs) -> tuple[list[dict], list | None]:
    """(messages, tools for the template) to render: as they are where the template renders tools
    and tool turns, else plain messages with the tools' system block (and no tools for the
    template). Messages without tool turns and no tools pass unchanged."""
    if not specs and not has_tool_turns(messages):
        return messages, None
    if template and renders_tools(tokenizer, template):
        return native_messages(messages), (list(specs) or None)
    return plain_messages(messages, specs, tool_role=not template or shows_tool_role(tokenizer, template)), None
