"""`eagle2 serve`: a real server, started as a subprocess on a free 127.0.0.1 port, driven by the
real `openai` client (and raw HTTP where a client would not send it).

On the tiny model of tests/conftest.py (float32, CPU, pinned batch of 3 and trees of 6 nodes, so
nothing is planned or measured per batch): answers equal the model's own greedy decoding,
streaming and not, alone and four at a time; usage with cached prompt tokens; stop strings cut
inside a chunk; a disconnect frees its row; every bad request gets a 4xx with a one-line
message and the server goes on; the API key, 429 on a full queue, and SIGTERM letting a running
stream finish, then exit 0.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

MESSAGES = [[{"role": "user", "content": t}] for t in ("Hello! How are you?", "Write a short poem.", "1 2 3 4", "def add(a, b):")]


class Server:
    def __init__(self, model_dir, head_dir, *extra):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "eagle2_cli", "serve", "--model", model_dir, "--draft", head_dir, "--device", "cpu", "--dtype",
               "float32", "--port", "0", "--total-tokens", "6", "--max-new-tokens", "24", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        deadline = time.time() + 240
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the server exited: " + "".join(self.lines) + self.proc.stderr.read())
            self.lines.append(line)
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise RuntimeError("the server did not start")
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none", **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def raw(self, path: str, body: bytes | None = None, headers: dict | None = None):
        req = urllib.request.Request(self.base + path, data=body, headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_head_dir):
    s = Server(tiny_model_dir, tiny_head_dir, "--batch-size", "3", "--max-body-mb", "1", "--header-timeout", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The model's own greedy decoding (transformers' generate) of a chat, as text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle2_core.prompts import encode_chat

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]

    def answer(messages, n=24):
        ids = torch.tensor([encode_chat(tok, messages)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return answer


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] and models.data[0].owned_by == "eagle2"
    status, body = server.raw("/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["engine_heartbeat_age_s"] < 5
    status, text = server.raw("/metrics")
    assert status == 200 and "eagle2_tokens_per_second" in text and "eagle2_prefix_cache_hits_total" in text


def test_chat_greedy_streaming_and_not(server, reference):
    c = server.client()
    for messages in MESSAGES[:2]:
        want = reference(messages)
        r = c.chat.completions.create(model="any", messages=messages, temperature=0)
        assert r.choices[0].message.content == want
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        chunks = list(c.chat.completions.create(model="any", messages=messages, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        # the same prompt again: all but its last token restored from the kept sequence
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_four_concurrent_streams(server, reference):
    c = server.client()
    out: dict = {}

    def run(i):
        stream = c.chat.completions.create(model="any", messages=MESSAGES[i], temperature=0, stream=True)
        out[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == {i: reference(MESSAGES[i]) for i in range(4)}


def test_completions_and_a_resent_conversation(server, reference):
    c = server.client()
    r = c.completions.create(model="any", prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    first = c.chat.completions.create(model="any", messages=MESSAGES[2], temperature=0)
    convo = MESSAGES[2] + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More"}]
    second = c.chat.completions.create(model="any", messages=convo, temperature=0)
    assert second.choices[0].message.content == reference(convo)
    # at least the first prompt (less its last token) is restored; how much of the answer depends on
    # whether its text encodes back to the ids generated (the random model's bytes do not)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_stop_strings_cut_inside_a_chunk(server, reference):
    c = server.client()
    want = reference(MESSAGES[1])
    stop = want[5:8]
    assert stop and want.find(stop) >= 0
    cut = want[: want.find(stop)]
    r = c.chat.completions.create(model="any", messages=MESSAGES[1], temperature=0, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model="any", messages=MESSAGES[1], temperature=0, stop=stop, stream=True)
    chunks = [ch for ch in stream if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_disconnect_frees_its_row(server):
    def cancelled():
        return int(re.search(r"^eagle2_requests_cancelled_total (\d+)", server.raw("/metrics")[1], re.M).group(1))

    before = cancelled()
    c = server.client()
    stream = c.chat.completions.create(model="any", messages=MESSAGES[0], temperature=0, stream=True, max_tokens=200)
    next(iter(stream))
    stream.close()  # the client goes away mid-answer
    deadline = time.time() + 30
    while cancelled() == before and time.time() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1
    assert json.loads(server.raw("/health")[1])["running"] == 0
    assert c.chat.completions.create(model="any", messages=MESSAGES[0], max_tokens=4).usage.completion_tokens == 4


@pytest.mark.parametrize("body,param", [
    ({"messages": MESSAGES[0], "n": 2}, "n"),
    ({"messages": MESSAGES[0], "frobnicate": 1}, "frobnicate"),
    ({"messages": MESSAGES[0], "temperature": "hot"}, "temperature"),
    ({"messages": MESSAGES[0], "logprobs": 3}, "logprobs"),
    ({"messages": MESSAGES[0], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MESSAGES[0], "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"messages": MESSAGES[0], "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}, "response_format"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "the sea is blue " * 300}]}, "messages"),
    ({"messages": MESSAGES[0], "max_tokens": -1}, "max_tokens"),
])
def test_bad_requests_are_refused_in_one_line(server, body, param):
    body = dict(body)
    with pytest.raises(openai.BadRequestError) as e:  # extra_body: sent as given, unchecked by the client
        server.client().chat.completions.create(model="any", messages=body.pop("messages"), extra_body=body)
    err = e.value.body
    assert err["param"] == param and "\n" not in err["message"], err
    ok = {"messages": MESSAGES[0], "n": 1, "tools": [], "frequency_penalty": 0, "user": "me", "metadata": {"a": "b"}, "max_tokens": 2}
    assert server.client().chat.completions.create(model="any", **ok).usage.completion_tokens == 2  # still serving


def test_a_body_that_is_not_json_and_an_unknown_route(server):
    status, body = server.raw("/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["message"] == "the body is not JSON"
    status, body = server.raw("/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def raw_exchange(server, data: bytes, wait: float = 60) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (socket.timeout
    past `wait` seconds: the server never did)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        while True:
            got = s.recv(65536)
            if not got:
                return out
            out += got


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n")
    reply = raw_exchange(server, head + b'{"messages": ')  # 50 MB announced, a few bytes sent
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413") and "--max-body-mb" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("raw,says", [(b"[" * 100000 + b"]" * 100000, "too deeply"),
                                      (b'{"messages": [], "max_tokens": 1' + b"1" * 5000 + b"}", "number too long")])
def test_deep_nesting_and_a_huge_integer_are_a_400_error_object(server, raw, says):
    status, body = server.raw("/v1/chat/completions", raw)
    err = json.loads(body)["error"]
    assert status == 400 and says in err["message"] and "\n" not in err["message"] and err["type"] == "invalid_request_error"
    assert server.client().chat.completions.create(model="any", messages=MESSAGES[0], max_tokens=2).usage.completion_tokens == 2


def test_a_temperature_too_small_to_divide_by_is_greedy(server, reference):
    r = server.client().chat.completions.create(model="any", messages=MESSAGES[0], temperature=1e-38)
    assert r.choices[0].message.content == reference(MESSAGES[0])


def test_a_client_that_leaves_mid_body_is_one_log_line(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "')
    deadline = time.time() + 30
    while not any("left before sending" in line for line in server.lines) and time.time() < deadline:
        time.sleep(0.1)
    assert sum("left before sending" in line for line in server.lines) == 1
    assert not any("Traceback" in line for line in server.lines)


def test_a_connection_without_a_whole_request_head_is_closed(server):
    assert raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost:") == b""  # closed, nothing answered
    assert server.raw("/health")[0] == 200


def test_key_queue_and_sigterm(tiny_model_dir, tiny_head_dir):
    """One row, no queue: a second request while a stream runs is answered 429; a wrong key 401.
    SIGTERM mid-stream: the stream runs to its end, then the server exits 0."""
    s = Server(tiny_model_dir, tiny_head_dir, "--batch-size", "1", "--max-queue", "0", "--api-key", "sk-test", "--grace", "60")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").chat.completions.create(model="any", messages=MESSAGES[0])
        # /health is open to probes, its figures only with the key; the API and /metrics are not
        assert s.raw("/health") == (200, '{"status":"ok"}')
        status, body = s.raw("/health", headers={"Authorization": "Bearer sk-test"})
        assert status == 200 and json.loads(body)["running"] == 0
        assert s.raw("/metrics")[0] == 401 and s.raw("/v1/models")[0] == 401
        c = s.client("sk-test")
        stream = c.chat.completions.create(model="any", messages=MESSAGES[0], temperature=0, stream=True, max_tokens=120)
        it = iter(stream)
        first = next(it)
        with pytest.raises(openai.RateLimitError) as busy:
            c.chat.completions.create(model="any", messages=MESSAGES[1], max_tokens=2)
        assert int(busy.value.response.headers["retry-after"]) >= 1
        s.proc.send_signal(signal.SIGTERM)
        rest = list(it)
        text = "".join(ch.choices[0].delta.content or "" for ch in [first] + rest if ch.choices)
        assert rest[-1].choices[0].finish_reason in ("stop", "length") and text is not None
        assert s.proc.wait(60) == 0
        s.reader.join(10)
        assert any("stopped" in line for line in s.lines)
    finally:
        s.stop()


def test_sigterm_past_the_grace_period_cancels_and_exits_0(tiny_model_dir, tiny_head_dir):
    s = Server(tiny_model_dir, tiny_head_dir, "--batch-size", "2", "--grace", "0", "--max-new-tokens", "230")
    try:
        stream = s.client().chat.completions.create(model="any", messages=MESSAGES[0], stream=True, max_tokens=230, temperature=0)
        it = iter(stream)
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as cut:  # cut: the stream's last event says so, then [DONE]
            for _ in it:
                pass
        assert not isinstance(cut.value, openai.APIConnectionError) and "grace period" in cut.value.message
        assert s.proc.wait(60) == 0
        s.reader.join(10)  # every line the server wrote
        assert any("1 cancelled" in line for line in s.lines) and not any("Traceback" in line for line in s.lines)
    finally:
        s.stop()


# -- the protocol's pieces, without a server ----------------------------------------------------

class _Tok:
    """A tokenizer whose ids are characters (id = ord), for TextStream."""
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_stream_cuts_at_a_stop_string_inside_a_chunk_and_holds_back_a_partial_one():
    from eagle2_core.server import TextStream

    ids = lambda s: [ord(c) for c in s]  # noqa: E731
    t = TextStream(_Tok(), ("END", "xyz"))
    assert t.push(ids("hello E")) == "hello "   # "E" could start "END": held back
    assert t.push(ids("N")) == ""               # "EN" too
    assert t.push(ids("Dmore")) == "" and t.stopped  # "END" completed inside the chunk: cut there
    assert t.finish() == "" and t.text == "hello "
    t = TextStream(_Tok(), ("END",))
    assert t.push(ids("a E")) == "a " and t.push(ids("x")) == "Ex"  # not a stop string after all: released
    assert t.finish() == "" and t.text == "a Ex" and not t.stopped
    t = TextStream(_Tok(), ())
    assert t.push(ids("abc")) == "abc" and t.finish() == ""


class _CountingTok(_Tok):
    """Ids are characters; records the length of every text it is asked to tokenize."""

    def __init__(self, longest: int):
        self.longest, self.calls = longest, []

    def get_vocab(self):
        return {"x" * self.longest: 0, "y": 1}

    def __call__(self, text, add_special_tokens=True):
        self.calls.append(len(text))
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("longest,text,tokenized", [(2, "x" * 1000, 0),   # 1000 characters, at most 2 a token: over 100
                                                    (10, "ab " * 300, 400)])  # could fit: a prefix's tokens decide
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized_whole(longest, text, tokenized):
    from types import SimpleNamespace

    from eagle2_core.events import GenerationSettings
    from eagle2_core.server import ApiError, parse_completion

    tok = _CountingTok(longest)
    model = SimpleNamespace(get_input_embeddings=lambda: SimpleNamespace(weight=SimpleNamespace(shape=(1000, 4))))
    rt = SimpleNamespace(tokenizer=tok, gen=GenerationSettings(), max_positions=100, model=model)
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": text}, rt)
    assert e.value.param == "prompt" and "100" in e.value.message
    assert sum(tok.calls) <= tokenized < len(text)


def test_a_model_without_a_chat_template_refuses_chat_in_one_line():
    from types import SimpleNamespace

    from eagle2_core.events import GenerationSettings
    from eagle2_core.server import ApiError, parse_chat

    rt = SimpleNamespace(chat_template=None, tokenizer=_Tok(), gen=GenerationSettings(), max_positions=100)
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": MESSAGES[0]}, rt)
    assert "no chat template" in e.value.message and "/v1/completions" in e.value.message and e.value.status == 400
