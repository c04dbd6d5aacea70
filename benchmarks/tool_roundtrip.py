"""A tool call round trip with the official `openai` SDK against `eagle2 serve`.

Starts `python3 -m eagle2_cli serve` on a free port (the default model unless --model says
otherwise), offers one function, `get_weather(location, unit)`, and runs:

  1. tool_choice "required": the call is read from `message.tool_calls`, its arguments checked
     against the function's schema (jsonschema); the tool's answer goes back as a `tool` message
     and the model gives a final text answer;
  2. the same call streamed: one tool_calls delta, finish_reason tool_calls, the same call;
  3. tool_choice "auto", and tool_choice naming the function, once each.

Prints each answer and a line per check; exits 1 when a check fails.

    python3 benchmarks/tool_roundtrip.py [--model M] [--port N] [--url http://host:port]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather at a place.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "A city, e.g. Paris", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False}}}
QUESTION = "What is the weather like in Paris today, in celsius?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eagle2_cli", "serve", "--port", str(port)] + (["--model", model] if model else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit("the server did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--url", default=None, help="a server already running (nothing is started)")
    args = ap.parse_args()

    import jsonschema
    from openai import OpenAI

    proc = None
    url = args.url
    if url is None:
        port = args.port or free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(args.model, port)
    failed = []

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failed.append(what)

    try:
        t0 = time.time()
        wait_ready(url, proc)
        print(f"server ready at {url} in {time.time() - t0:.1f} s")
        client = OpenAI(base_url=url + "/v1", api_key="none")
        params = WEATHER["function"]["parameters"]
        messages = [{"role": "user", "content": QUESTION}]

        # 1. required: a call, validated, answered, then a final text answer
        t = time.time()
        r = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=96, temperature=0)
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        print(f"\n[required] {time.time() - t:.2f} s, finish_reason={choice.finish_reason}")
        for c in calls:
            print(f"  {c.id} {c.function.name}({c.function.arguments})")
        check(choice.finish_reason == "tool_calls" and len(calls) == 1 and choice.message.content is None,
              "required: one tool call, content null, finish_reason tool_calls")
        call = calls[0] if calls else None
        ok = call is not None and call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        check(ok, "required: id call_..., type function, name get_weather")
        try:
            jsonschema.validate(json.loads(call.function.arguments), params)
            check(True, "required: arguments valid against the schema")
        except Exception as e:  # noqa: BLE001
            check(False, f"required: arguments valid against the schema ({e})")
        if call is not None:
            messages += [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})}]
            t = time.time()
            r2 = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER], tool_choice="none",
                                                max_tokens=64, temperature=0)
            final = r2.choices[0]
            cached = r2.usage.prompt_tokens_details.cached_tokens if r2.usage.prompt_tokens_details else None
            print(f"\n[after the tool's answer] {time.time() - t:.2f} s, finish_reason={final.finish_reason}, "
                  f"{cached} of {r2.usage.prompt_tokens} prompt tokens restored from the kept prefix\n  {final.message.content!r}")
            check(bool(final.message.content) and not final.message.tool_calls, "round trip: a final text answer")

        # 2. the same call, streamed
        stream = client.chat.completions.create(model="default", messages=messages[:1], tools=[WEATHER], tool_choice="required",
                                                max_tokens=96, temperature=0, stream=True)
        deltas, reasons = [], []
        for ev in stream:
            d = ev.choices[0].delta if ev.choices else None
            if d is not None and d.tool_calls:
                deltas.extend(d.tool_calls)
            if ev.choices and ev.choices[0].finish_reason:
                reasons.append(ev.choices[0].finish_reason)
        print(f"\n[required, streamed] {len(deltas)} tool_calls delta(s), finish_reason={reasons}")
        same = len(deltas) == 1 and call is not None and deltas[0].index == 0 and deltas[0].function.name == call.function.name \
            and deltas[0].function.arguments == call.function.arguments and deltas[0].id.startswith("call_")
        check(same and reasons == ["tool_calls"], "streamed: one delta with the same call, then finish_reason tool_calls")

        # 3. auto, and a named function
        for label, tc in (("auto", "auto"), ("named", {"type": "function", "function": {"name": "get_weather"}})):
            t = time.time()
            r = client.chat.completions.create(model="default", messages=messages[:1], tools=[WEATHER], tool_choice=tc,
                                               max_tokens=96, temperature=0)
            ch = r.choices[0]
            print(f"\n[{label}] {time.time() - t:.2f} s, finish_reason={ch.finish_reason}")
            if ch.message.tool_calls:
                c = ch.message.tool_calls[0]
                print(f"  {c.id} {c.function.name}({c.function.arguments})")
                try:
                    jsonschema.validate(json.loads(c.function.arguments), params)
                    valid = True
                except Exception:  # noqa: BLE001
                    valid = False
                check(valid and ch.finish_reason == "tool_calls", f"{label}: a call with valid arguments")
            else:
                print(f"  text: {ch.message.content!r}")
                check(label == "auto" and ch.finish_reason in ("stop", "length"), f"{label}: text (auto may answer in text)")

        # 4. a bad request: tool_choice naming an unknown function
        from openai import BadRequestError

        try:
            client.chat.completions.create(model="default", messages=messages[:1], tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "nope"}})
            check(False, "unknown function: 400")
        except BadRequestError as e:
            print(f"\n[unknown function] 400: {e.body}")
            err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
            check(err.get("param") == "tool_choice", "unknown function: 400 naming tool_choice")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"\n{len(failed)} check(s) failed" if failed else "\nall checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
