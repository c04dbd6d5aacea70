"""Structured output (structured.py): a grammar's mask as one more logits processor on every tree node.

On a tiny random Llama over a real byte-level BPE tokenizer (tests/conftest.py), with more
lm_head rows than the tokenizer has ids, and a head fitted to it:
  * constrained speculation emits exactly what constrained plain decoding emits, greedy and
    seeded sampling, one row and three (rows of different constraints, and a free one, side by
    side), with the head, with the head-free sources alone, in fixed (graph) mode, and with a
    prefix cache and a stop string; Hugging Face `generate` with the same mask agrees;
  * every answer is accepted by its grammar (a fresh matcher), and a finished JSON one validates;
  * a tree's masks leave the matcher at the committed text, whatever the tree held (tokens off
    the grammar, an end-of-turn id inside a path); each node's row is the mask after its own path;
  * ids past the tokenizer are never allowed; an ended grammar allows only the end-of-turn ids;
  * response_format parsing, bad schemas and grammars in one line, prompt-file records, and a
    round trip through the server's app (in-process).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import random

import pytest
import torch

pytest.importorskip("llguidance")

from eagle2_core import Engine, GenerationSettings, TreeSettings  # noqa: E402
from eagle2_core.costs import CostProfile  # noqa: E402
from eagle2_core.engine import Request  # noqa: E402
from eagle2_core.prefix import PrefixCache  # noqa: E402
from eagle2_core.sampling import TargetProcessors  # noqa: E402
from eagle2_core import structured  # noqa: E402
from eagle2_core.structured import ConstraintError  # noqa: E402
from eagle2_core.tree import tree_from_parents  # noqa: E402

EXTRA_ROWS = 7  # lm_head rows past the tokenizer's ids, as Qwen's 151,936 past its 151,665
TREE = TreeSettings(shape="dynamic", total_tokens=10, depth=4, top_k=3)
FLAT = CostProfile(key={}, verify_ms={1: 10.0, 16: 12.0}, draft_ms={1: 1.0, 4: 1.0})
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "pet": {"enum": ["fox", "dog", "sea"]},
    "words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, "minItems": 1, "maxItems": 2}},
    "required": ["n", "pet", "words"], "additionalProperties": False}
CONSTRAINTS = {
    "json": lambda: structured.json_schema(SCHEMA, "pet"),
    "regex": lambda: structured.regex(r"(the|a) [a-z]{1,6}( [a-z]{1,6}){0,3}\."),
    "gbnf": lambda: structured.grammar('root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
}
PROMPTS = ["The quick brown fox", "Hello! How are you today?", "1 2 3 4 5", "def add(a, b):"]


@pytest.fixture(scope="module")
def setup(tiny_lm, fitted_head, tmp_path_factory):
    from conftest import tiny_chat_target

    return tiny_chat_target(tiny_lm, fitted_head, str(tmp_path_factory.mktemp("structured_tok")), extra_rows=EXTRA_ROWS)


def gen_for(setup, name, **kw) -> GenerationSettings:
    c = CONSTRAINTS[name]() if name else None
    return GenerationSettings(max_new_tokens=64, eos_token_ids=(setup[3],), constraint=c, **kw)


def run(eng: Engine, reqs) -> dict:
    out = {}
    eng.run(collections.deque(reqs), lambda key, tokens, summary: out.__setitem__(key, (tokens, summary)))
    return out


def cases(setup, names, **kw):
    tok = setup[2]
    return [Request(i, tok(p)["input_ids"], gen_for(setup, names[i % len(names)], seed=i + 5, **kw))
            for i, p in enumerate(PROMPTS)]


def accepted(constraint, tok, vocab, tokens, eos, finished) -> bool:
    """Whether a fresh matcher takes every emitted token (the end-of-turn id aside), and ends accepting when the answer stopped."""
    import llguidance

    m = llguidance.LLMatcher(structured.ll_tokenizer(tok, vocab), constraint.grammar, log_level=0)
    body = tokens[:-1] if tokens and tokens[-1] == eos else tokens
    return m.try_consume_tokens(body) == len(body) and (not finished or m.is_accepting())


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "seeded"])
def test_speculation_equals_plain_constrained_decoding(setup, sample):
    model, head, tok, eos = setup
    kw = {"temperature": 0.9} if sample else {}
    names = ["json", "regex", None, "gbnf"]  # a free row beside constrained ones
    reqs = cases(setup, names, **kw)
    plain = run(Engine(model, None, tok, costs=FLAT), reqs)
    drafted = {"head": Engine(model, head, tok, tree=TREE, costs=FLAT),
               "head, 3 rows": Engine(model, head, tok, tree=TREE, costs=FLAT, batch=3),
               "sources": Engine(model, None, tok, tree=TREE, costs=FLAT, sources=("recycle", "match")),
               "fixed, 3 rows": Engine(model, head, tok, tree=TREE, costs=FLAT, batch=3, graph=True)}
    vocab = model.get_output_embeddings().weight.shape[0]
    accepted_draft = 0
    for label, eng in drafted.items():
        got = run(eng, reqs)
        for r in reqs:
            assert got[r.key][0] == plain[r.key][0], (label, r.key)
            accepted_draft += sum(i * n for i, n in enumerate(got[r.key][1].accepted_hist))
    assert accepted_draft > 0  # drafts were accepted, under the constraints
    for r in reqs:
        tokens, summary = plain[r.key]
        if r.gen.constraint is not None:
            assert accepted(r.gen.constraint, tok, vocab, tokens, eos, summary.finish_reason == "stop"), (r.key, tok.decode(tokens))
            assert all(t < len(tok) for t in tokens)  # ids past the tokenizer never come out
        if r.gen.constraint is not None and r.gen.constraint.kind == "json_schema" and summary.finish_reason == "stop":
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), SCHEMA)
    if not sample:  # generate with the same mask as its logits processor
        from eagle2_core.vanilla import VanillaDecoder

        for r in reqs[:2]:
            assert VanillaDecoder(model, tok).generate(r.ids, r.gen)[0] == plain[r.key][0]


def test_prefix_cache_and_stop_strings(setup):
    model, head, tok, eos = setup
    stop = dataclasses.replace(gen_for(setup, "regex"), stop_strings=(" ",))
    ids = tok(PROMPTS[0])["input_ids"]
    want = run(Engine(model, None, tok, costs=FLAT), [Request(0, ids, stop)])[0]
    assert tok.decode(want[0]).count(" ") == 1 and want[1].finish_reason == "stop"
    eng = Engine(model, head, tok, tree=TREE, costs=FLAT, prefix_cache=PrefixCache())
    first = run(eng, [Request(0, ids, gen_for(setup, "json"), keep=True)])[0][0]
    again = run(eng, [Request(1, ids + first, gen_for(setup, "regex"))])[1]  # restores the kept prefix
    assert again[1].cached_tokens > 0
    assert again[0] == run(Engine(model, None, tok, costs=FLAT), [Request(1, ids + first, gen_for(setup, "regex"))])[1][0]
    assert run(eng, [Request(2, ids, stop)])[2][0] == want[0]


def random_tree(rng, n: int, tokens: list[int]):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return tree_from_parents(torch.tensor([rng.choice(tokens) for _ in range(n)]), torch.tensor(parents))


def test_tree_masks_leave_the_committed_state_alone(setup):
    import llguidance
    import llguidance.numpy

    model, _, tok, eos = setup
    vocab = model.get_output_embeddings().weight.shape[0]
    c = CONSTRAINTS["json"]()
    prompt = tok("Hello")["input_ids"]
    text = tok('{"n": 12, "pet": "fox", "words": ["a"')["input_ids"]
    rng = random.Random(0)
    # tokens that continue the JSON, tokens that break it, and the end-of-turn id
    pool = sorted(set(tok(' , ] } "b" 3 x "')["input_ids"]) | {eos, 0})
    for step in range(1, len(text)):
        procs = TargetProcessors(GenerationSettings(constraint=c), None, prompt, [eos], tokenizer=tok, vocab_size=vocab)
        history = torch.tensor(prompt + text[: step - 1])  # the root, text[step - 1], is not in it
        for seed in range(3):
            tree = random_tree(rng, 12, pool)
            tree.tokens[0] = text[step - 1]
            logits = torch.randn(tree.size, vocab)
            got = procs.tree_scores(logits, history, tree)
            assert procs.grammar.at == text[:step]  # the committed text, nothing of the tree
            fresh = llguidance.LLMatcher(structured.ll_tokenizer(tok, vocab), c.grammar, log_level=0)
            assert fresh.try_consume_tokens(text[:step]) == step
            a, b = (llguidance.numpy.allocate_token_bitmask(1, vocab) for _ in range(2))
            llguidance.numpy.fill_next_token_bitmask(procs.grammar.matcher, a)
            llguidance.numpy.fill_next_token_bitmask(fresh, b)
            assert (a == b).all()
            for i in range(tree.size):  # each node's row: the mask after its own path, alone
                path = tree.tokens[tree.ancestors[i]]
                alone = TargetProcessors(GenerationSettings(constraint=c), None, prompt, [eos], tokenizer=tok, vocab_size=vocab)
                want = alone.scores(logits[i : i + 1], torch.cat([history, path])[None])
                torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=0)
                ok = torch.isfinite(want[0])
                assert not ok[len(tok):].any()  # ids past the tokenizer: never
                seq = text[: step - 1] + path.tolist()
                if eos in seq or fresh.validate_tokens(path.tolist()[1:]) < len(path) - 1:
                    assert ok.nonzero().flatten().tolist() == [eos]  # past the end, or off the grammar


def test_an_ended_grammar_allows_only_the_end_of_turn_ids(setup):
    model, _, tok, eos = setup
    vocab = model.get_output_embeddings().weight.shape[0]
    mask = structured.GrammarMask(structured.regex("yes|no"), tok, vocab, 0, [eos, 0])
    done = tok("yes")["input_ids"]
    part = tok("y")["input_ids"]
    rows = mask.allowed([done, part, []], vocab)
    assert rows[0].nonzero().flatten().tolist() == [0, eos]
    assert not rows[1, [0, eos]].any() and rows[1].any()  # not accepting yet: no end
    assert mask.at == []  # back at the rows' common prefix


def test_response_format_and_bad_constraints_in_one_line():
    f = structured.from_response_format
    assert f({"type": "text"}) is None
    assert f({"type": "json_object"}).kind == "json_object"
    c = f({"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    assert c.kind == "json_schema" and c.name == "pet" and json.loads(c.source) == SCHEMA
    assert f({"type": "regex", "regex": "[0-9]+"}).kind == "regex"
    assert f({"type": "grammar", "grammar": 'start: "a"+', "syntax": "lark"}).name == "lark"
    assert f({"type": "grammar", "grammar": 'root ::= "a"+'}).name == "gbnf"
    for bad in [{"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a-"}}},
                {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema"}, {"type": "xml"}, "json", {"type": "regex", "regex": "[unclosed"},
                {"type": "grammar", "grammar": "start: foo"}, {"type": "grammar", "grammar": "root ::= [", "syntax": "gbnf"},
                {"type": "grammar", "grammar": 'start: "a"', "syntax": "ebnf"}]:
        with pytest.raises(ConstraintError) as e:
            f(bad)
        assert "\n" not in str(e.value) and str(e.value), bad


def test_prompt_records_apply_response_format_and_refuse_what_cannot_run():
    from eagle2_core.prompts import InputError, parse_record

    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    item = parse_record({"id": 1, "prompt": "hi", "response_format": rf})
    assert item.overrides["constraint"].kind == "json_schema"
    item = parse_record({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": rf}})
    assert item.overrides["constraint"].name == "pet"
    assert "constraint" not in parse_record({"id": 1, "prompt": "hi", "response_format": {"type": "text"}}).overrides
    for rec, fld in [({"id": 1, "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
                      "response_format"),
                     ({"id": 1, "prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                     ({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": 30}}, "body.logprobs"),
                     ({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "n": 2}}, "body.n")]:
        with pytest.raises(InputError) as e:
            parse_record(rec, line=3)
        assert e.value.field == fld and "\n" not in e.value.describe(), e.value.describe()


def asgi_post(app, path: str, body: dict) -> tuple[int, dict]:
    from asgi_client import post

    status, raw = post(app, path, body)
    return status, json.loads(raw)


def test_serve_response_format_round_trip(setup):
    from eagle2_core.server import create_app

    model, head, tok, eos = setup

    class Rt:  # what the server reads of a Runtime
        tokenizer, chat_template, prefix_cache, max_positions = tok, None, None, 160
        gen = GenerationSettings(max_new_tokens=40, eos_token_ids=(eos,))
        arithmetic = "exact"

        def __init__(self):
            self.model = model

        def encode(self, messages):
            from eagle2_core.prompts import encode_chat
            return encode_chat(tok, messages)

    rt = Rt()
    engine = Engine(model, head, tok, tree=TREE, costs=FLAT, batch=2)
    app, worker = create_app(rt, engine, model_name="tiny")
    worker.start()
    try:
        msgs = [{"role": "user", "content": "Hello! How are you today?"}]
        rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
        status, body = asgi_post(app, "/v1/chat/completions", {"messages": msgs, "response_format": rf})
        assert status == 200, body
        text = body["choices"][0]["message"]["content"]
        from eagle2_core.prompts import encode_chat

        plain = run(Engine(model, None, tok, costs=FLAT), [Request(0, encode_chat(tok, msgs), dataclasses.replace(
            rt.gen, constraint=structured.from_response_format(rf)))])[0]
        assert text == tok.decode(plain[0], skip_special_tokens=True)
        if body["choices"][0]["finish_reason"] == "stop":
            pytest.importorskip("jsonschema").validate(json.loads(text), SCHEMA)
        status, body = asgi_post(app, "/v1/chat/completions", {"messages": msgs, "response_format": {"type": "regex", "regex": "[a-z]{3}"}})
        assert status == 200 and len(body["choices"][0]["message"]["content"]) == 3, body
        status, body = asgi_post(app, "/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": {"type": "objekt"}}}})
        assert status == 400 and body["error"]["param"] == "response_format" and "\n" not in body["error"]["message"], body
    finally:
        worker.close()


def test_cli_constraint_flags(tmp_path):
    import click

    from eagle2_cli.options import UserInputError, load_constraint

    good = tmp_path / "s.json"
    good.write_text(json.dumps({"name": "pet", "schema": SCHEMA}))  # OpenAI's wrapper is read too
    c = load_constraint(str(good), None, None)
    assert c.kind == "json_schema" and c.name == "pet"
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    assert load_constraint(None, None, str(gbnf)).name == "gbnf"
    assert load_constraint(None, None, None) is None
    bad = tmp_path / "bad.json"
    for text in ['{"type": "objekt"}', "{not json"]:
        bad.write_text(text)
        with pytest.raises(UserInputError) as e:
            load_constraint(str(bad), None, None)
        assert "\n" not in e.value.message and e.value.message.startswith(str(bad) if "not" in text else "--json-schema")
    with pytest.raises(UserInputError):
        load_constraint(None, "[a-", None)
    with pytest.raises(click.UsageError):
        load_constraint(str(good), "a", None)
