"""An OpenAI-compatible HTTP server over the one engine: what `eagle2 serve` runs.

Built on Starlette (routing, streaming responses, CORS) and served by uvicorn: both small,
well kept, ASGI, and what FastAPI itself stands on; no validation framework is needed for a
handful of JSON fields, and every refusal here names its field in one line.

Handlers parse and check a request (`parse_chat`, `parse_completion`), hand it to the engine
thread (worker.py) and read its events back through an asyncio queue, so nothing blocks the
event loop. Text comes out through `TextStream`, which cuts at a stop string even inside a
chunk of several accepted tokens and, while streaming, holds back what could be the start of
one. A client that goes away (a closed stream, or a dropped connection while it waits) cancels
its job, which frees its row before the next cycle. No terminal code: the CLI's serve command
builds the runtime and runs uvicorn.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time

from .chat import IncrementalDetokenizer
from .events import GenerationSettings, StepEvent
from .logprobs import chat_content, completion_logprobs, token_text
from .prompts import InputError, apply_overrides, check_text, parse_logprobs, parse_messages, parse_overrides
from .tools import CallStream, ToolError, parse_tools
from .worker import EngineWorker, Job, QueueFull

# Fields of the OpenAI API that change nothing here, or that eagle2 applies.
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream",
               "stream_options", "n", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
               "prompt_cache_key", "logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
               "response_format", "frequency_penalty", "presence_penalty", "logit_bias", "modalities", "audio", "prediction",
               "reasoning_effort", "web_search_options", "verbosity",
               # extensions: the sampling keys `eagle2 generate` reads per line
               "top_k", "min_p", "repetition_penalty"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "n", "user",
                     "metadata", "logprobs", "echo", "suffix", "best_of", "frequency_penalty", "presence_penalty", "logit_bias",
                     "top_k", "min_p", "repetition_penalty", "response_format"}  # response_format: an extension here


class ClientGone(Exception):
    """The client closed its connection before sending its whole request body."""


class ApiError(Exception):
    """A request refused: HTTP `status` and an OpenAI-style error object naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def _refuse_if(body: dict, name: str, changes_output, why: str = "") -> None:
    """A field eagle2 cannot honour is refused when its value would change the output."""
    if name in body and body[name] is not None and changes_output(body[name]):
        raise ApiError(f"{name}={json.dumps(body[name])[:60]} is not supported by eagle2{why}", param=name)


def _check_common(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"unknown field {unknown[0]!r}", param=unknown[0])
    if "n" in body and body["n"] is not None:
        if not isinstance(body["n"], int) or isinstance(body["n"], bool) or body["n"] < 1:
            raise ApiError(f"n must be a positive integer, not {json.dumps(body['n'])}", param="n")
        _refuse_if(body, "n", lambda v: v != 1, " (one choice per request)")
    for name in ("frequency_penalty", "presence_penalty"):
        if name in body and body[name] is not None and (not isinstance(body[name], (int, float)) or isinstance(body[name], bool)):
            raise ApiError(f"{name} must be a number", param=name)
        _refuse_if(body, name, lambda v: v != 0, " (repetition_penalty is: an extension field)")
    _refuse_if(body, "logit_bias", lambda v: bool(v))
    for name in ("stream",):
        if name in body and body[name] is not None and not isinstance(body[name], bool):
            raise ApiError(f"{name} must be true or false", param=name)
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool)):
        raise ApiError("stream_options must be an object like {\"include_usage\": true}", param="stream_options")


def _settings(body: dict, default: GenerationSettings) -> GenerationSettings:
    """The request's GenerationSettings: the server's defaults (its flags and the model's
    generation_config) with the request's sampling fields on top."""
    try:
        over = parse_overrides({k: v for k, v in body.items() if k != "max_completion_tokens"})
        if body.get("max_completion_tokens") is not None:
            over.update(parse_overrides({"max_completion_tokens": body["max_completion_tokens"]}))
    except InputError as e:
        raise ApiError(f"{e.field}: {e.message}", param=e.field) from None
    if over.get("max_new_tokens") == 0:
        raise ApiError("max_tokens must be at least 1", param="max_tokens")
    for name, ok, what in (("min_p", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
                           ("repetition_penalty", lambda v: v > 0, "a number > 0")):
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not ok(v):
            raise ApiError(f"{name} must be {what}, not {json.dumps(v)}", param=name)
        over[name] = float(v)
    return apply_overrides(default, over)


def _constrained(body: dict, gen: GenerationSettings, rt, tools=None) -> GenerationSettings:
    """`gen` with the request's `response_format` (structured.py): OpenAI's json_schema and
    json_object, and the extensions regex and grammar; a 400 naming the field for one that
    does not compile. Or with the grammar of its `tools` (a tools.ToolPlan). The grammar is
    checked against the tokenizer here, in the request's thread, so the engine thread never
    meets a grammar it cannot run."""
    from .structured import ConstraintError, from_response_format, ll_tokenizer

    param = "response_format"
    try:
        c = from_response_format(body["response_format"]) if body.get("response_format") is not None else None
        if tools is not None and tools.constraint is not None:
            if c is not None:  # one grammar per answer: the tools', or the response_format's
                raise ApiError("response_format cannot apply beside tools: leave one of them out", param="response_format")
            c, param = tools.constraint, "tools"
        if c is not None:
            ll_tokenizer(rt.tokenizer, rt.model.get_output_embeddings().weight.shape[0])  # built once per process
    except ConstraintError as e:
        raise ApiError(str(e), param=param) from None
    return dataclasses.replace(gen, constraint=c) if c is not None else gen


def _logprobs(body: dict, gen: GenerationSettings, shape: str) -> GenerationSettings:
    """`gen` asking for the request's logprobs (None: none computed), in chat's or completions' form."""
    try:
        got = parse_logprobs(body, shape=shape)
    except InputError as e:
        raise ApiError(f"{e.field}: {e.message}", param=e.field) from None
    return dataclasses.replace(gen, logprobs=got.get("logprobs"))


@dataclasses.dataclass
class Parsed:
    ids: list[int]
    gen: GenerationSettings
    stream: bool
    include_usage: bool
    kind: str   # "chat" or "text"
    tools: object = None  # the chat request's tools.ToolPlan, None without tools


def _fits(ids: list[int], max_positions: int, param: str) -> None:
    if len(ids) >= max_positions:
        raise ApiError(f"the prompt is {len(ids)} tokens, the model's context is {max_positions}", param=param)


def _longest_token(tokenizer) -> int | None:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry: a
    byte-level entry has a character per byte, so never fewer than it decodes to); None when the
    tokenizer lists no vocabulary. Read once per tokenizer."""
    got = getattr(tokenizer, "_eagle2_longest_token", False)
    if got is False:
        try:
            got = max((len(t) for t in tokenizer.get_vocab()), default=None)
        except (AttributeError, NotImplementedError, TypeError):
            got = None
        try:
            tokenizer._eagle2_longest_token = got
        except AttributeError:
            pass
    return got


def check_length(text: str, tokenizer, max_positions: int, param: str) -> None:
    """Refuse text that cannot fit the context before it is tokenized whole: tokenizing costs
    seconds per megabyte and holds every token. Past the longest token's length times the
    context, no tokenization can fit it; past four characters a token, the tokens of a prefix cut
    before a space (the same pre-tokens as the whole text's start, so no more tokens than the
    whole gives) decide it."""
    n = len(text)
    longest = _longest_token(tokenizer)
    if longest and n > longest * max_positions:
        raise ApiError(f"{param}: {n} characters cannot fit the model's context of {max_positions} tokens", param=param)
    probe = 4 * max_positions
    if n > probe:
        cut = text.rfind(" ", 0, probe)
        if cut > 0:
            k = len(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
            if k >= max_positions:
                raise ApiError(f"the prompt is over {k} tokens, the model's context is {max_positions}", param=param)


def parse_chat(body, rt) -> Parsed:
    """A chat completion request, checked and encoded with the model's chat template."""
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    _check_common(body, CHAT_FIELDS)
    if not (rt.chat_template or getattr(rt.tokenizer, "chat_template", None)):
        raise ApiError("this model has no chat template: use /v1/completions (or serve with --chat-template FILE)", param="messages")
    _refuse_if(body, "functions", lambda v: bool(v), " (the deprecated form: give tools)")
    _refuse_if(body, "function_call", lambda v: v not in ("none", "auto"), " (the deprecated form: give tool_choice)")
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except ToolError as e:
        raise ApiError(e.message, param=e.param) from None
    _refuse_if(body, "modalities", lambda v: v != ["text"])
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options", "verbosity"):
        _refuse_if(body, name, lambda v: True)
    if "messages" not in body:
        raise ApiError("messages is missing", param="messages")
    try:
        messages = parse_messages(body["messages"])
    except InputError as e:
        raise ApiError(f"{e.field}: {e.message}", param=e.field) from None
    gen = _logprobs(body, _constrained(body, _settings(body, rt.gen), rt, tools), "chat")
    shown = list(tools.specs) if tools is not None else []
    check_length("\n".join([m["content"] for m in messages] + [json.dumps(shown)]), rt.tokenizer, rt.max_positions, "messages")
    try:
        ids = rt.encode(messages, tools=shown) if shown else rt.encode(messages)
    except InputError as e:
        raise ApiError(e.describe() if e.path else str(e), param="messages") from None
    _fits(ids, rt.max_positions, "messages")
    return Parsed(ids, gen, bool(body.get("stream")), bool((body.get("stream_options") or {}).get("include_usage")), "chat", tools)


def parse_completion(body, rt) -> Parsed:
    """A text completion request: the prompt as text (the tokenizer's special tokens added, as
    `generate` adds them) or as token ids, used as they are."""
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    _check_common(body, COMPLETION_FIELDS)
    _refuse_if(body, "echo", lambda v: v is not False)
    _refuse_if(body, "suffix", lambda v: bool(v))
    _refuse_if(body, "best_of", lambda v: v != 1)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    vocab = rt.model.get_input_embeddings().weight.shape[0]
    if isinstance(prompt, str):
        try:
            check_text(prompt, "prompt")
        except InputError as e:
            raise ApiError(f"prompt: {e.message}", param="prompt") from None
        check_length(prompt, rt.tokenizer, rt.max_positions, "prompt")
        ids = list(rt.tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(f"prompt: token ids must be from 0 to {vocab - 1}", param="prompt")
        ids = list(prompt)
    else:
        raise ApiError("prompt must be a string, a list of one string, or a list of token ids", param="prompt")
    if not ids:
        raise ApiError("prompt encodes to no tokens", param="prompt")
    gen = _logprobs(body, _constrained(body, _settings(body, rt.gen), rt), "completions")
    _fits(ids, rt.max_positions, "prompt")
    return Parsed(ids, gen, bool(body.get("stream")), bool((body.get("stream_options") or {}).get("include_usage")), "text")


class TextStream:
    """Token ids in, text out, cut at the first stop string: `push` returns what may be sent now
    (holding back incomplete UTF-8 and any tail that could begin a stop string), `finish` the rest."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(s for s in stops if s)
        self.text, self.sent = "", 0
        self.stopped = False

    def _cut(self) -> int | None:
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        for k in range(min(len(self.text) - self.sent, max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def push(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.text += "".join(piece for piece, _ in self.detok.push(StepEvent(list(token_ids), 0, 1, 0.0, 0.0)))
        cut = self._cut()
        if cut is not None:
            self.stopped = True
            out, self.sent = self.text[self.sent : cut], cut
            self.text = self.text[:cut]
            return out
        end = len(self.text) - self._held()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.detok.flush()
            cut = self._cut()
            if cut is not None:
                self.stopped = True
                self.text = self.text[:cut]
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


class TextOffsets:
    """Each token's character offset in the completion's text (completions' `text_offset`): the
    length of the text the tokens before it decode to, counted as the answer streams."""

    def __init__(self, tokenizer):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.length = 0

    def push(self, token_ids: list[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self.length)
            self.length += sum(len(piece) for piece, _ in self.detok.push(StepEvent([t], 0, 1, 0.0, 0.0)))
        return out


def usage(summary, prompt_tokens: int) -> dict:
    """OpenAI's usage object, cached prompt tokens included, and eagle2's own figures beside it."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": summary.new_tokens, "total_tokens": prompt_tokens + summary.new_tokens,
            "prompt_tokens_details": {"cached_tokens": summary.cached_tokens},
            "eagle2": {"tau": round(summary.tau, 4), "tokens_per_cycle": round(summary.new_tokens / summary.cycles, 4) if summary.cycles else None,
                       "mean_tree_size": round(summary.mean_tree_size, 2), "prefill_s": round(summary.prefill_s, 4),
                       "tokens_per_s": round(summary.tokens_per_s, 2)}}


def finish_reason(summary, text: TextStream) -> str:
    if text.stopped or summary.finish_reason == "stop":
        return "stop"
    return "length" if summary.finish_reason == "length" else summary.finish_reason or "stop"


def metrics_text(worker: EngineWorker, prefix_cache) -> str:
    """Prometheus text exposition of the engine's figures."""
    t = dict(worker.totals)
    age = worker.heartbeat_age()
    lines = []

    def metric(name, kind, help_, value):
        lines.extend([f"# HELP eagle2_{name} {help_}", f"# TYPE eagle2_{name} {kind}", f"eagle2_{name} {value}"])

    metric("requests_total", "counter", "Requests accepted.", t["requests"])
    metric("requests_finished_total", "counter", "Requests answered to the end.", t["finished"])
    metric("requests_cancelled_total", "counter", "Requests cancelled (client gone, or shutdown).", t["cancelled"])
    metric("requests_running", "gauge", "Requests holding a row of the batch.", worker.running)
    metric("queue_length", "gauge", "Requests waiting for a row.", worker.waiting)
    metric("generated_tokens_total", "counter", "Tokens generated.", t["new_tokens"])
    metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", t["prompt_tokens"])
    metric("cached_prompt_tokens_total", "counter", "Prompt tokens restored from kept sequences, not prefilled.", t["cached_tokens"])
    metric("tokens_per_second", "gauge", "Tokens generated per second over the last minute.", round(worker.tokens_per_s(), 3))
    metric("tau", "gauge", "Tokens per target forward over finished requests (prefill counted).",
           round(t["new_tokens"] / t["target_forwards"], 4) if t["target_forwards"] else 0)
    metric("mean_tree_size", "gauge", "Nodes verified per cycle over finished requests.",
           round(t["tree_tokens"] / t["cycles"], 3) if t["cycles"] else 0)
    metric("engine_cycles_total", "counter", "Decoding cycles run.", worker.engine.stats["cycles"])
    metric("engine_heartbeat_age_seconds", "gauge", "Seconds since the engine thread last completed a cycle or woke idle.", round(age, 3))
    if prefix_cache is not None:
        p = prefix_cache.stats()
        metric("prefix_cache_queries_total", "counter", "Prompts looked up among kept sequences.", p["queries"])
        metric("prefix_cache_hits_total", "counter", "Prompts that restored a kept prefix.", p["hits"])
        metric("prefix_cache_reused_tokens_total", "counter", "Cells restored instead of prefilled.", p["reused_tokens"])
        metric("prefix_cache_entries", "gauge", "Kept sequences.", p["entries"])
        metric("prefix_cache_bytes", "gauge", "Bytes held by kept sequences.", p["bytes"])
        metric("prefix_cache_evictions_total", "counter", "Kept sequences evicted for room.", p["evictions"])
    return "\n".join(lines) + "\n"


def read_json(raw: bytes):
    """A request body as JSON, or ApiError (400) saying in one line why not."""
    try:
        return json.loads(raw)
    except RecursionError:  # arrays or objects nested past the parser's recursion limit
        raise ApiError("the body nests JSON arrays or objects too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError("the body is not JSON") from None
    except ValueError as e:  # an integer past Python's digit limit for int() (4300 by default)
        raise ApiError(f"the body holds a number too long to read ({str(e).split(':')[0]})") from None


def head_timeout_protocol(seconds: float):
    """uvicorn's HTTP protocol class, with a watchdog that closes a connection whose request head
    is not complete `seconds` after its first byte (or after it opened). uvicorn's own keep-alive
    timer starts only after a response, so a client that sends part of a head, or nothing, would
    hold its connection and socket for good."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadTimeout(AutoHTTPProtocol):
        _head_timer = None
        _head_cycle = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data):
            # a new request begins once the last one is answered: its head gets the same time
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self):
            self._head_cycle = self.cycle  # a completed head replaces it (uvicorn starts a new cycle)
            self._head_timer = self.loop.call_later(seconds, self._expire)

        def _expire(self):
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeout


def create_app(rt, engine, *, model_name: str, api_key: str | None = None, cors: bool = False, max_queue: int = 64,
               stale_after: float = 120.0, max_body_mb: float = 16.0):
    """(the Starlette app, its EngineWorker). The worker starts with the app and stops with it.
    `stale_after`: /health answers 503 when the engine thread has shown no sign of life (a
    finished cycle, or an idle wake-up) for this long. `max_body_mb`: larger request bodies are
    refused (413) before they are read whole. Setting `app.state.stopping` (an asyncio.Event)
    ends every request still running: a stream with an error event and [DONE], a waiting
    request with 503 (the server's grace period is over)."""
    import logging

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    worker = EngineWorker(engine, max_queue=max_queue)
    created = int(time.time())
    fingerprint = f"eagle2-{getattr(rt, 'arithmetic', 'exact')}"  # the products' arithmetic: int8 answers differ from exact ones
    max_body = int(max_body_mb * 1024 * 1024)
    stopping = asyncio.Event()
    log = logging.getLogger("uvicorn.error")
    stopped_message = "the server stopped before the answer's end (its shutdown grace period ran out)"

    def error(e: ApiError, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def authorised(request) -> bool:
        if api_key is None:
            return True
        got = request.headers.get("authorization", "")
        return secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode())

    def too_large(size: str) -> ApiError:
        return ApiError(f"the body is {size}, over the server's limit of {max_body} bytes (--max-body-mb)", status=413)

    async def read_body(request):
        """The body as JSON, counted as it arrives: a declared or streamed size past the limit is
        refused before the rest is read (and the connection closed, as the rest is not read)."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise ApiError("the Content-Length header is not a number")
            if int(declared) > max_body:
                raise too_large(f"{int(declared)} bytes")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise too_large(f"over {max_body} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone(f"{size} of {declared or 'an unknown number of'} bytes") from None
        return read_json(b"".join(chunks))

    async def wait_disconnect(request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    def logprobs_of(kind: str, entries, offsets=None):
        """A choice's `logprobs` in the endpoint's shape for these tokens' entries (None: none asked for)."""
        if entries is None:
            return None
        if kind == "chat":
            return {"content": chat_content(entries, token_text(rt.tokenizer))}
        return completion_logprobs(entries, token_text(rt.tokenizer), offsets)

    def chunk(rid: str, kind: str, text: str | None, reason: str | None, role: bool = False, call: dict | None = None,
              logprobs=None) -> dict:
        if kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            if call is not None:  # a tool call goes out whole, as the stream's one call delta
                delta = {"tool_calls": [{"index": 0, **call}]}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                    "system_fingerprint": fingerprint, "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "system_fingerprint": fingerprint, "choices": [choice]}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def complete(request, parse, kind: str):
        if not authorised(request):
            return error(ApiError("invalid API key", status=401, kind="authentication_error"))
        try:
            body = await read_body(request)
            parsed = await run_in_threadpool(parse, body, rt)
        except ClientGone as e:
            log.warning("a client left before sending its whole request (%s received); nothing was answered", e)
            return PlainTextResponse("", status_code=400)
        except RecursionError:  # a structure nested deep enough for a check's own recursion
            return error(ApiError("the body nests JSON arrays or objects too deeply"))
        except ApiError as e:
            return error(e, {"Connection": "close"} if e.status == 413 else None)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        job = Job(parsed.ids, parsed.gen, lambda k, p: loop.call_soon_threadsafe(inbox.put_nowait, (k, p)),
                  keep=rt.prefix_cache is not None)
        try:
            key = worker.submit(job)
        except QueueFull as e:
            return error(ApiError(f"the server is busy: {e}; retry later", status=429, kind="rate_limit_error"), {"Retry-After": "1"})
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        text = TextStream(rt.tokenizer, parsed.gen.stop_strings)
        calls = CallStream(parsed.tools) if parsed.tools is not None and parsed.tools.calls else None
        asked = parsed.gen.logprobs is not None
        offsets = TextOffsets(rt.tokenizer) if asked and kind == "text" else None

        async def next_event():
            """The job's next event; ("stopped", None) once the server's grace period is over."""
            if stopping.is_set():
                return "stopped", None
            get, stop = asyncio.ensure_future(inbox.get()), asyncio.ensure_future(stopping.wait())
            try:
                await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not get.done():
                    get.cancel()
            return get.result() if get.done() and not get.cancelled() else ("stopped", None)

        if parsed.stream:
            async def events():
                finished = False
                try:
                    if kind == "chat":
                        yield sse(chunk(rid, kind, None, None, role=True))
                    while True:
                        k, payload = await next_event()
                        if k == "event":
                            piece = text.push(payload.token_ids)
                            piece = calls.push(piece) if calls is not None else piece
                            if asked and payload.token_ids:
                                # every token's entry goes out with the chunk of the cycle that made it, even where
                                # its text is held back (a stop string's possible start, part of a character, a call)
                                at = offsets.push(payload.token_ids) if offsets is not None else None
                                yield sse(chunk(rid, kind, piece, None, logprobs=logprobs_of(kind, payload.logprobs, at)))
                            elif piece:
                                yield sse(chunk(rid, kind, piece, None))
                            if text.stopped:
                                worker.cancel(key)  # cut by a stop string here: free the row now
                        elif k == "done":
                            summary, _ = payload
                            rest, call = text.finish(), None
                            if calls is not None:
                                rest, call = calls.finish(rest)
                            finished = True
                            if call is not None:
                                yield sse(chunk(rid, kind, None, None, call=call))
                            reason = "tool_calls" if call is not None else finish_reason(summary, text)
                            yield sse(chunk(rid, kind, rest if rest else ("" if kind == "text" else None), reason))
                            if parsed.include_usage:
                                yield sse({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                                           "created": int(time.time()), "model": model_name, "choices": [],
                                           "usage": usage(summary, len(parsed.ids))})
                            yield "data: [DONE]\n\n"
                            return
                        else:  # the engine failed, or the server stops: in-band, as the status is already 200
                            if k == "stopped":
                                worker.cancel(key)
                                rest = text.finish()  # what was held back (a possible stop string's start) is the answer's
                                rest = calls.release(rest) if calls is not None else rest
                                if rest:
                                    yield sse(chunk(rid, kind, rest, None))
                            finished = True
                            message = stopped_message if k == "stopped" else payload
                            yield sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if not finished:  # the client went away (or the server is stopping): free the row
                        worker.cancel(key)

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def collect():
            while True:
                k, payload = await next_event()
                if k == "event":
                    text.push(payload.token_ids)
                    if text.stopped:
                        worker.cancel(key)
                elif k == "done":
                    return payload
                elif k == "stopped":
                    worker.cancel(key)
                    raise ApiError(stopped_message, status=503, kind="server_error")
                else:
                    raise ApiError(payload, status=500, kind="server_error")

        result = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():  # the client went away, or the server is stopping: free the row
                worker.cancel(key)
                result.cancel()
            gone.cancel()
        if not result.done() or result.cancelled():
            return PlainTextResponse("", status_code=499)
        try:
            summary, _ = result.result()
        except ApiError as e:
            return error(e)
        text.finish()
        content = text.text  # every piece: nothing of it was sent yet
        reason = finish_reason(summary, text)
        entries = summary.logprobs if asked else None
        lp = logprobs_of(kind, entries, offsets.push([e.token for e in entries]) if offsets is not None and entries is not None else None)
        call = parsed.tools.read(content) if parsed.tools is not None else None
        if call is not None:
            choice = {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}, "logprobs": lp,
                      "finish_reason": "tool_calls"}
            obj = "chat.completion"
        elif kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": lp, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": lp, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                             "system_fingerprint": fingerprint, "choices": [choice], "usage": usage(summary, len(parsed.ids))})

    async def chat_completions(request):
        return await complete(request, parse_chat, "chat")

    async def completions(request):
        return await complete(request, parse_completion, "text")

    async def models(request):
        if not authorised(request):
            return error(ApiError("invalid API key", status=401, kind="authentication_error"))
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "eagle2"}]})

    async def health(request):
        # open to liveness probes, which send no key; the figures only with it
        age = worker.heartbeat_age()
        alive = worker.thread.is_alive() and age < stale_after
        body = {"status": "ok" if alive else "unhealthy"}
        if authorised(request):
            body.update({"engine_heartbeat_age_s": round(age, 3), "running": worker.running, "waiting": worker.waiting,
                         "cycles": engine.stats["cycles"]})
        return JSONResponse(body, status_code=200 if alive else 503)

    async def metrics(request):
        if not authorised(request):
            return error(ApiError("invalid API key", status=401, kind="authentication_error"))
        return PlainTextResponse(metrics_text(worker, rt.prefix_cache), media_type="text/plain; version=0.0.4")

    async def not_found(request, exc):
        return JSONResponse(ApiError(f"no route {request.method} {request.url.path}", status=404).body(), status_code=404)

    async def bad_method(request, exc):
        return JSONResponse(ApiError(f"{request.method} is not allowed on {request.url.path}", status=405).body(), status_code=405)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    middleware = [Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])] if cors else []

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.close)

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers={404: not_found, 405: bad_method})
    app.state.stopping = stopping
    return app, worker
