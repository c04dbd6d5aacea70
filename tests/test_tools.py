"""Tool calls (tools.py, server.py): tools and tool_choice as a call grammar on every tree node.

On a tiny random Llama over a real byte-level BPE tokenizer (tests/conftest.py) and a head fitted to it:
  * through the server's app (in-process): required and named calls come back as `tool_calls`
    whose arguments validate against the function's schema, a streamed call is one delta with
    the same call then finish_reason tool_calls, and a conversation with the call and the tool's
    answer is accepted;
  * speculation emits exactly what plain decoding emits under each tool_choice's grammar;
  * the grammars: required takes only a whole call, auto takes text or a call but no text that
    starts like one; a stream holds a call back and passes text once it cannot be one;
  * message parsing takes assistant calls with null or missing content and tool results, and the
    prompt shows them in the system block, or through a template that renders tools;
  * bad tools, tool_choice and tool turns are refused with a 400 naming the field.
"""
from __future__ import annotations

import collections
import json

import pytest

pytest.importorskip("llguidance")

from eagle2_core import Engine, GenerationSettings, TreeSettings  # noqa: E402
from eagle2_core.costs import CostProfile  # noqa: E402
from eagle2_core.engine import Request  # noqa: E402
from eagle2_core.prompts import InputError, encode_chat, parse_messages, render_chat  # noqa: E402
from eagle2_core import tools  # noqa: E402
from eagle2_core.tools import parse_tools  # noqa: E402

TREE = TreeSettings(shape="dynamic", total_tokens=10, depth=4, top_k=3)
FLAT = CostProfile(key={}, verify_ms={1: 10.0, 16: 12.0}, draft_ms={1: 1.0, 4: 1.0})
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather at a place.", "parameters": {
    "type": "object", "properties": {"location": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "Hello! How are you today?"}]
# a template that renders tools, calls and results (as Qwen's does, in short)
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def setup(tiny_lm, fitted_head, tmp_path_factory):
    from conftest import tiny_chat_target

    return tiny_chat_target(tiny_lm, fitted_head, str(tmp_path_factory.mktemp("tools_tok")), max_positions=1024)


def run(eng: Engine, reqs) -> dict:
    out = {}
    eng.run(collections.deque(reqs), lambda key, toks, summary: out.__setitem__(key, (toks, summary)))
    return out


def validate(arguments: str, fn: dict) -> None:
    pytest.importorskip("jsonschema").validate(json.loads(arguments), fn["function"]["parameters"])


# -- the grammars --------------------------------------------------------------------------------
def consumes(tok, constraint, text: str) -> tuple[bool, bool]:
    """(whether a fresh matcher takes all of `text`, whether it then accepts)."""
    import llguidance

    m = llguidance.LLMatcher(tools_lt(tok), constraint.grammar, log_level=0)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return m.try_consume_tokens(ids) == len(ids), m.is_accepting()


def tools_lt(tok):
    from eagle2_core.structured import ll_tokenizer

    return ll_tokenizer(tok, len(tok))


def test_call_grammars_take_what_each_tool_choice_allows(setup):
    tok = setup[2]
    call = '<tool_call>{"name": "get_weather", "arguments": {"location": "paris", "unit": "celsius"}}</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    required = parse_tools(TOOLS, "required").constraint
    auto = parse_tools(TOOLS, "auto").constraint
    named = parse_tools(TOOLS, NAMED).constraint
    assert consumes(tok, required, call) == (True, True) and consumes(tok, required, time_call) == (True, True)
    assert consumes(tok, named, time_call) == (True, True) and not consumes(tok, named, call)[0]
    for bad in ["Hi there", call + " and more", call.replace("paris", "Paris"), call.replace("celsius", "kelvin"),
                '<tool_call>{"arguments": {"zone": "utc"}, "name": "get_time"}</tool_call>']:
        assert not all(consumes(tok, required, bad)), bad
    assert consumes(tok, auto, "Hi there, <tool_call> is a tag.") == (True, True)  # text: a call only at the start
    assert consumes(tok, auto, call) == (True, True) and consumes(tok, auto, "") == (True, True)
    assert not consumes(tok, auto, "<tool_call>not json")[0] and not consumes(tok, auto, "\n <tool_call>{")[0]
    none = parse_tools(TOOLS, "none").constraint
    assert consumes(tok, none, "Hi there") == (True, True) and not consumes(tok, none, call)[0]
    assert parse_tools(None, "auto") is None and parse_tools([], "none") is None


def test_a_stream_holds_a_call_and_passes_text():
    plan = parse_tools(TOOLS, "auto")
    s = tools.CallStream(plan)
    assert [s.push(p) for p in ["<tool", "_call>", '{"name": "get_time", ', '"arguments": {"zone": "cet"}}']] == ["", "", "", ""]
    text, call = s.finish("</tool_call>")
    assert text == "" and call["function"] == {"name": "get_time", "arguments": '{"zone": "cet"}'} and call["id"].startswith("call_")
    s = tools.CallStream(plan)
    assert s.push("<to") == "" and s.push("day is") == "<today is" and s.push(" fine") == " fine"
    assert s.finish("") == ("", None)
    s = tools.CallStream(plan)
    assert s.push("<tool_c") == "" and s.finish("") == ("<tool_c", None)  # ended as text that looked like a start
    s = tools.CallStream(parse_tools(TOOLS, "required"))
    assert s.push("<tool_call>{") == "" and s.release("") == "<tool_call>{"  # a stream cut short: what it holds is its text
    assert tools.read_call('<tool_call>{"name": "other", "arguments": {}}</tool_call>', ("get_time",)) is None


# -- speculation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "seeded"])
def test_speculation_equals_plain_decoding_with_tools(setup, sample):
    model, head, tok, eos = setup
    kw = {"temperature": 0.9} if sample else {}
    choices = ["required", NAMED, "auto", "none"]
    reqs = []
    for i, choice in enumerate(choices):
        plan = parse_tools(TOOLS, choice)
        ids = encode_chat(tok, MESSAGES, tools=list(plan.specs))
        reqs.append(Request(i, ids, GenerationSettings(max_new_tokens=120, eos_token_ids=(eos,), constraint=plan.constraint,
                                                       seed=i + 3, **kw)))
    plain = run(Engine(model, None, tok, costs=FLAT), reqs)
    accepted = 0
    for eng in (Engine(model, head, tok, tree=TREE, costs=FLAT), Engine(model, head, tok, tree=TREE, costs=FLAT, batch=4)):
        got = run(eng, reqs)
        for r in reqs:
            assert got[r.key][0] == plain[r.key][0], r.key
            accepted += sum(i * n for i, n in enumerate(got[r.key][1].accepted_hist))
    assert accepted > 0  # drafts were accepted under the call grammars
    for i in (0, 1):  # required and named: a whole call, of the right function, valid
        toks, summary = plain[i]
        call = parse_tools(TOOLS, choices[i]).read(tok.decode(toks, skip_special_tokens=True))
        assert summary.finish_reason == "stop" and call is not None, tok.decode(toks)
        assert i == 0 or call["function"]["name"] == "get_time"
        validate(call["function"]["arguments"], WEATHER if call["function"]["name"] == "get_weather" else TIME)


# -- messages and the prompt ---------------------------------------------------------------------
def conversation(arguments='{"location": "paris", "unit": "celsius"}', **call_fields):
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [call], **call_fields},
            {"role": "tool", "tool_call_id": "call_abc", "content": "18 C"}, {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]


def test_message_parsing_takes_tool_turns_and_the_prompt_shows_them(setup):
    tok = setup[2]
    for fields in ({}, {"content": None}, {"content": ""}):
        msgs = parse_messages(conversation(**fields))
        assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "paris", "unit": "celsius"}'}}]}
        assert msgs[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_abc"}
    assert json.loads(parse_messages(conversation({"location": "rome", "unit": "celsius"}))[1]["tool_calls"][0]["function"]["arguments"]) \
        == {"location": "rome", "unit": "celsius"}  # arguments as an object are taken too
    msgs = parse_messages(conversation())
    # the tiny template renders no tools: the system block, the call as text, the results as tool turns
    text, _ = render_chat(tok, msgs, None, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"location": "paris", "unit": "celsius"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n18 C<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n" in text
    # a template that refuses the tool role: the results as one user turn
    strict = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}" \
             + tok.chat_template.split("{% for m in messages %}", 1)[1]
    text, _ = render_chat(tok, msgs, strict, [WEATHER])
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert "# Tools" not in render_chat(tok, msgs, None, None)[0]  # no tools: the calls shown all the same
    with_sys, _ = render_chat(tok, [{"role": "system", "content": "Be brief."}] + msgs, None, [WEATHER])
    assert with_sys.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # a template that renders tools gets them, and the calls' arguments as objects
    assert tools.renders_tools(tok, TOOL_TEMPLATE) and not tools.renders_tools(tok, tok.chat_template)
    text, _ = render_chat(tok, msgs, TOOL_TEMPLATE, [WEATHER, TIME])
    assert text.startswith("<|im_start|>system\nTOOLS get_weather get_time<|im_end|>")
    assert '"arguments": {"location": "paris", "unit": "celsius"}' in text  # an object, not its JSON text quoted
    assert "<|im_start|>tool\n18 C<|im_end|>" in text


@pytest.mark.parametrize("msgs,field", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "x"}], "messages[1].content"),
    (conversation(arguments="{not json"), "messages[1].tool_calls[0].function.arguments"),
    (conversation(arguments="[1, 2]"), "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"type": "function"}]}, {"role": "user", "content": "x"}],
     "messages[1].tool_calls[0]"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "18 C"}], "messages[1].tool_call_id"),
])
def test_bad_tool_turns_name_their_field(msgs, field):
    with pytest.raises(InputError) as e:
        parse_messages(msgs)
    assert e.value.field == field


# -- the server ----------------------------------------------------------------------------------
def asgi_post(app, body: dict) -> tuple[int, bytes]:
    """One POST to /v1/chat/completions; the raw body back."""
    from asgi_client import post

    return post(app, "/v1/chat/completions", body)


@pytest.fixture(scope="module")
def app(setup):
    from eagle2_core.server import create_app

    model, head, tok, eos = setup

    class Rt:  # what the server reads of a Runtime
        tokenizer, chat_template, prefix_cache, max_positions = tok, None, None, 1024
        gen = GenerationSettings(max_new_tokens=120, eos_token_ids=(eos,))
        arithmetic = "exact"

        def __init__(self):
            self.model = model

        def encode(self, messages, tools=None):
            return encode_chat(tok, messages, tools=tools)

    app, worker = create_app(Rt(), Engine(model, head, tok, tree=TREE, costs=FLAT, batch=2), model_name="tiny")
    worker.start()
    yield app
    worker.close()


def stream_events(raw: bytes) -> list:
    lines = [ln[len("data: "):] for ln in raw.decode().split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_serve_calls_parse_validate_and_stream_the_same(app, choice):
    status, raw = asgi_post(app, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice})
    body = json.loads(raw)
    assert status == 200, body
    ch = body["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
    [call] = ch["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    fn = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    assert choice == "required" or fn is TIME
    validate(call["function"]["arguments"], fn)
    status, raw = asgi_post(app, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "stream": True})
    events = stream_events(raw)
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
    assert len(deltas) == 1 and reasons == ["tool_calls"], events
    assert deltas[0]["index"] == 0 and deltas[0]["id"].startswith("call_") and deltas[0]["function"] == call["function"]
    assert not any(e["choices"][0]["delta"].get("content") for e in events)  # nothing of the call went out as text
    # the call and the tool's answer sent back: a text answer, the same streamed and not
    msgs = MESSAGES + [ch["message"], {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]
    status, raw = asgi_post(app, {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 12})
    answer = json.loads(raw)["choices"][0]
    assert status == 200 and answer["message"].get("tool_calls") is None and answer["finish_reason"] in ("stop", "length")
    status, raw = asgi_post(app, {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 12, "stream": True})
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in stream_events(raw)) == answer["message"]["content"]


def test_serve_auto_streamed_and_not_agree(app):
    status, raw = asgi_post(app, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40})
    ch = json.loads(raw)["choices"][0]
    events = stream_events(asgi_post(app, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "stream": True})[1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    if ch["message"].get("tool_calls"):
        assert [d["function"] for d in deltas] == [c["function"] for c in ch["message"]["tool_calls"]] and not text
    else:
        assert text == ch["message"]["content"] and not deltas
    assert events[-1]["choices"][0]["finish_reason"] == ch["finish_reason"]


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"pattern": "[a-"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": {"get_weather": {}}}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": conversation(arguments="{not json")}, "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tools_are_refused_with_a_400_naming_the_field(app, fields, param):
    status, raw = asgi_post(app, {"messages": MESSAGES, **fields})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert "\n" not in err["message"] and err["message"], err
