"""Logprobs (logprobs.py): each emitted token's log-probability and top alternatives, read from the
processed scores of the verify row that decided it.

  * on a tiny Llama held as GGUF blocks in int8 (row-invariant products, the native layer loop),
    speculation's logprobs are plain decoding's bit for bit, greedy and seeded, one row and three
    (and three rows' are one row's);
  * they are the definition: the log-softmax of the processed scores (a history-reading processor
    greedy; temperature and top-k sampling), recomputed from a plain forward over the answer;
    top_logprobs hold finite entries only;
  * one entry per completion token, with a stop string and with EOS; none computed when not asked;
  * prompt-file fields and records (one list per turn), and the server's shapes for chat and
    completions, streaming and not, read by the openai SDK's own types, through the app in-process.
"""
from __future__ import annotations

import collections
import dataclasses
import json

import pytest
import torch

from eagle2_core import Engine, GenerationSettings, TreeSettings
from eagle2_core.costs import CostProfile
from eagle2_core.engine import Request

FLAT = CostProfile(key={}, verify_ms={1: 10.0, 16: 12.0}, draft_ms={1: 1.0, 4: 1.0})  # trees always pay: speculation runs
TREE = TreeSettings(shape="dynamic", total_tokens=12, depth=4, top_k=3)


def run(eng: Engine, reqs) -> dict:
    out = {}
    eng.run(collections.deque(reqs), lambda key, tokens, summary: out.__setitem__(key, (tokens, summary)))
    return out


# -- bitwise: int8 block targets ------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8_twin():
    """The int8 block target of test_arith with a head fitted to it, on a twin never run by
    transformers' own forward (whose output-capturing hooks would keep the lean body off)."""
    from eagle2_core import native, rowgemm

    pytest.importorskip("gguf")
    if native.module() is None or not rowgemm.have_int8():
        pytest.skip("no native int8 kernels built here")
    from test_arith import block_target

    _, head = block_target(seed=1, vocab=48, fit=True)
    model = block_target(seed=1, vocab=48)
    rowgemm.interleave(model)
    return model, head.bind(model)


PROMPTS = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 30, 12, 7, 7, 3], [40], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GENS = {"greedy": dict(max_new_tokens=14, eos_token_ids=()), "seeded": dict(max_new_tokens=14, temperature=0.9, seed=7, eos_token_ids=())}


@pytest.mark.parametrize("sampling", list(GENS))
def test_speculative_logprobs_are_plain_logprobs_bitwise_at_batch_1_and_3(int8_twin, sampling):
    from eagle2_core import rowgemm

    model, head = int8_twin
    gen = GenerationSettings(**GENS[sampling], logprobs=5)
    with rowgemm.using_arithmetic("int8"):
        assert Engine(model, None, costs=FLAT).runner.lean is not None  # the native loop's arithmetic is what is checked
        out = {}
        for name, (h, tree, b) in {"plain": (None, None, 1), "spec": (head, TREE, 1), "plain3": (None, None, 3),
                                   "spec3": (head, TREE, 3)}.items():
            eng = Engine(model, h, tree=tree, costs=FLAT, batch=b, sources=() if h is None else None)
            out[name] = run(eng, [Request(i, ids, gen) for i, ids in enumerate(PROMPTS)])
    forwards = sum(s.target_forwards for _, s in out["spec"].values())
    assert forwards < 0.8 * sum(len(t) for t, _ in out["spec"].values())  # drafts were accepted: trees were verified
    for i in range(len(PROMPTS)):
        tokens, plain = out["plain"][i]
        assert len(plain.logprobs) == plain.new_tokens == len(tokens) and [e.token for e in plain.logprobs] == tokens
        assert all(len(e.top) == 5 and e.top[0][1] >= e.logprob for e in plain.logprobs)
        for name in ("spec", "plain3", "spec3"):
            assert out[name][i][0] == tokens and out[name][i][1].logprobs == plain.logprobs, (name, i)


# -- the definition, on a float model -------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tiny_lm, fitted_head, tmp_path_factory):
    from conftest import tiny_chat_target

    return tiny_chat_target(tiny_lm, fitted_head, str(tmp_path_factory.mktemp("logprobs_tok")))


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(temperature=0.7, top_k=3, seed=3)], ids=["greedy", "sampling"])
def test_logprobs_are_the_log_softmax_of_the_processed_scores(setup, kw):
    from eagle2_core.sampling import TargetProcessors

    model, head, tok, _ = setup
    ids = tok("The quick brown fox")["input_ids"]
    gen = GenerationSettings(max_new_tokens=20, eos_token_ids=(), logprobs=4, **kw)
    tokens, summary = Engine(model, head, tok, tree=TREE, costs=FLAT).generate(ids, gen)
    assert summary.target_forwards < len(tokens)
    procs = TargetProcessors(gen, model.generation_config, ids, (), gen.max_new_tokens)
    seq = torch.tensor([ids + tokens])
    with torch.no_grad():
        logits = model(seq).logits[0, len(ids) - 1 : -1].float()
    for j, e in enumerate(summary.logprobs):
        want = torch.log_softmax(procs.scores(logits[j : j + 1], seq[:, : len(ids) + j]), -1)[0]
        assert e.token == tokens[j] and abs(e.logprob - float(want[e.token])) < 1e-4
        finite = int(torch.isfinite(want).sum())
        assert len(e.top) == min(4, finite) and all(abs(lp - float(want[t])) < 1e-4 for t, lp in e.top)
        if "top_k" in kw:
            assert finite <= 3  # masked tokens are never listed


def test_one_entry_per_completion_token_with_stop_strings_and_eos_and_none_unasked(setup):
    model, head, tok, eos = setup
    ids = tok("Hello! How are you today?")["input_ids"]
    eng = Engine(model, head, tok, tree=TREE, costs=FLAT)
    free, _ = eng.generate(ids, GenerationSettings(max_new_tokens=30, eos_token_ids=()))
    text = tok.decode(free)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cases = [GenerationSettings(max_new_tokens=30, eos_token_ids=(), stop_strings=(stop,), logprobs=2),
             GenerationSettings(max_new_tokens=30, eos_token_ids=(free[5],), logprobs=0)]
    for gen in cases:
        tokens, summary = eng.generate(ids, gen)
        assert summary.finish_reason == "stop" and len(tokens) < len(free)
        assert len(summary.logprobs) == summary.new_tokens == len(tokens) and [e.token for e in summary.logprobs] == tokens
        assert all(e.top == () for e in summary.logprobs) if gen.logprobs == 0 else True
    events = list(eng.stream(ids, GenerationSettings(max_new_tokens=8, eos_token_ids=())))
    assert events[-1].logprobs is None and all(ev.logprobs is None for ev in events[:-1])


def test_prompt_file_fields_and_records_one_list_per_turn(setup):
    from eagle2_core.batch import run_batched
    from eagle2_core.prompts import InputError, encode_chat, parse_logprobs, parse_record

    assert parse_record({"id": 1, "prompt": "hi", "logprobs": True, "top_logprobs": 3}).overrides["logprobs"] == 3
    assert parse_record({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}}).overrides["logprobs"] == 2
    assert "logprobs" not in parse_record({"id": 1, "prompt": "hi", "logprobs": False}).overrides
    for obj, shape, fld in [({"top_logprobs": 2}, None, "top_logprobs"), ({"logprobs": 21}, None, "logprobs"),
                            ({"logprobs": 3}, "chat", "logprobs"), ({"logprobs": True}, "completions", "logprobs"),
                            ({"logprobs": True, "top_logprobs": 21}, "chat", "top_logprobs")]:
        with pytest.raises(InputError) as e:
            parse_logprobs(obj, shape=shape)
        assert e.value.field == fld

    model, head, tok, eos = setup

    class Rt:
        tokenizer, max_positions = tok, 160

        def encode(self, messages, spliced=None):
            return encode_chat(tok, messages)

        @staticmethod
        def decode(tokens):
            return tok.decode(tokens, skip_special_tokens=True)

    class Writer:
        records: list = []

        def write(self, rec):
            self.records.append(rec)

    items = [parse_record({"id": 1, "turns": ["Hello!", "Write a short poem."]}, 1),
             parse_record({"id": 2, "prompt": "1 2 3 4", "logprobs": True, "top_logprobs": 1}, 2)]
    gen = GenerationSettings(max_new_tokens=10, eos_token_ids=(eos,), logprobs=3)
    eng = Engine(model, head, tok, tree=TREE, costs=FLAT, batch=2)
    w = Writer()
    assert run_batched(Rt(), items, w, gen, eng) == (2, 0)
    recs = {r["id"]: r for r in w.records}
    turns = recs[1]["logprobs"]
    assert [len(t) for t in turns] == [u["completion_tokens"] for u in recs[1]["usage"]["turns"]] and all(turns)
    assert all(len(e["top_logprobs"]) == 3 for t in turns for e in t)
    one = recs[2]["logprobs"]
    assert len(one) == recs[2]["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 1 for e in one)
    assert bytes(b for e in one for b in e["bytes"]).decode("utf-8", "replace").startswith(recs[2]["text"][:5])


# -- the server's shapes ------------------------------------------------------------------------

def asgi_post(app, path: str, body: dict) -> tuple[int, bytes]:
    from asgi_client import post

    return post(app, path, body)


def sse(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: {")]


def test_serve_shapes_chat_and_completions_streaming_and_not(setup):
    types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from eagle2_core.server import create_app

    model, head, tok, eos = setup

    class Rt:  # what the server reads of a Runtime
        tokenizer, chat_template, prefix_cache, max_positions = tok, None, None, 160
        gen = GenerationSettings(max_new_tokens=16, eos_token_ids=(eos,))
        arithmetic = "exact"

        def __init__(self):
            self.model = model

        def encode(self, messages):
            from eagle2_core.prompts import encode_chat
            return encode_chat(tok, messages)

    app, worker = create_app(Rt(), Engine(model, head, tok, tree=TREE, costs=FLAT, batch=2), model_name="tiny")
    worker.start()
    try:
        msgs = [{"role": "user", "content": "Hello! How are you today?"}]
        status, body = asgi_post(app, "/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 3})
        assert status == 200, body
        r = ChatCompletion.model_validate_json(body)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens > 0
        assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
        text = bytes(b for c in content for b in c.bytes).decode("utf-8", "replace")
        assert text.startswith(r.choices[0].message.content)
        status, body = asgi_post(app, "/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 3, "stream": True,
                                                               "stream_options": {"include_usage": True}})
        chunks = [ChatCompletionChunk.model_validate(c) for c in sse(body)]
        streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
        assert [(c.token, c.logprob, c.bytes) for c in streamed] == [(c.token, c.logprob, c.bytes) for c in content]
        assert chunks[-1].usage.completion_tokens == len(streamed)
        status, body = asgi_post(app, "/v1/chat/completions", {"messages": msgs})
        assert ChatCompletion.model_validate_json(body).choices[0].logprobs is None  # none unasked

        status, body = asgi_post(app, "/v1/completions", {"prompt": "The quick brown", "logprobs": 2, "max_tokens": 12})
        assert status == 200, body
        c = types.Completion.model_validate_json(body)
        lp = c.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == c.usage.completion_tokens
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
        status, body = asgi_post(app, "/v1/completions", {"prompt": "The quick brown", "logprobs": 2, "max_tokens": 12, "stream": True})
        parts = [x["choices"][0]["logprobs"] for x in sse(body)]  # chunks' finish_reason is null: the SDK reads them unvalidated
        assert [t for p in parts if p for t in p["tokens"]] == lp.tokens
        assert [o for p in parts if p for o in p["text_offset"]] == lp.text_offset
        assert [x for p in parts if p for x in p["token_logprobs"]] == lp.token_logprobs

        for path, bad, param in [("/v1/chat/completions", {"messages": msgs, "logprobs": 2}, "logprobs"),
                                 ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                 ("/v1/completions", {"prompt": "a", "logprobs": 2, "top_logprobs": 2}, "top_logprobs")]:
            status, body = asgi_post(app, path, bad)
            err = json.loads(body)["error"]
            assert status == 400 and err["param"] == param and "\n" not in err["message"], err
    finally:
        worker.close()


def test_token_text_spells_bytes_of_byte_level_tokens(setup):
    from eagle2_core.logprobs import token_text

    tok = setup[2]
    text = token_text(tok)
    ids = tok("caf\u00e9 \u2603 is here", add_special_tokens=False)["input_ids"]
    joined = b"".join(bytes(text(t)[1]) for t in ids)
    assert joined.decode("utf-8") == "caf\u00e9 \u2603 is here"
    assert text(tok.convert_tokens_to_ids("<|im_end|>")) == ("<|im_end|>", list(b"<|im_end|>"))
