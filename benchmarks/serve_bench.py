"""`eagle2 serve` under load: N `openai` clients streaming the prompts of a file at once, against one at a time.

Starts the server (a subprocess, 127.0.0.1, a free port), then streams every prompt greedily
(temperature 0) one client at a time, then with `--clients` clients at once, and reports the
aggregate tokens/s of both, their ratio, time to first token, and (with --check) whether every
answer is the one `eagle2 generate` writes for the same prompt. With --peers, the same two loads
go to the OpenAI servers users would run instead, one after the other in the same run, on the same
GGUF file, the same threads and the same chat-templated prompts:

- `llama-cpp`: llama-cpp-python's server (`python -m llama_cpp.server`), llama.cpp's own decoding of
  the file as shipped (Q4_1 blocks, 8-bit activations);
- `transformers`: `transformers serve --continuous-batching`, transformers' paged continuous
  batching on the dequantized float32 model, the same weights eagle2 decodes.

They are benchmarks, not dependencies of eagle2:

    pip install fastapi pydantic-settings sse-starlette 'starlette-context<0.4' PyYAML 'kernels<0.20'
    python benchmarks/serve_bench.py [-f benchmarks/mt16.jsonl] [--clients 8] [--tokens 96] [--check]
        [--peers llama-cpp,transformers] [-- serve options]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from batch_bench import cpu_name  # noqa: E402


def prompts_of(path: str) -> list[dict]:
    out = []
    for line in open(path, encoding="utf-8"):
        if line.strip():
            rec = json.loads(line)
            text = rec["turns"][0] if "turns" in rec else rec["prompt"]
            out.append({"id": rec.get("question_id", rec.get("id", len(out))), "prompt": text})
    return out


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "eagle2_cli", "serve", "--port", "0", "--dtype", "float32", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in proc.stderr:
        sys.stderr.write(line)
        m = re.search(r"(http://[\d.]+:\d+)/v1", line)
        if m:
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_peer(name: str, gguf: str) -> tuple[subprocess.Popen, str, str]:
    """(process, base URL, model name) of a peer server on `gguf`, once it answers /v1/models."""
    import urllib.request

    port, threads = free_port(), str(os.cpu_count() or 1)
    if name == "llama-cpp":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", threads, "--n_threads_batch", threads,
               "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port), "--verbose", "False"]
        model = gguf
    elif name == "transformers":
        model = f"{os.path.dirname(gguf)}:{os.path.basename(gguf)}"  # transformers serve's `<repo>:<file>.gguf`
        cmd = ["transformers", "serve", "--continuous-batching", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), model]
    else:
        raise SystemExit(f"--peers: unknown peer {name!r}; use llama-cpp, transformers")
    log = open(os.path.join(tempfile.gettempdir(), f"serve_bench_{name}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"{name} server exited; see {log.name}")
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=2).read()
            return proc, base, model
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} server did not start in 300 s; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_load(base: str, items: list[dict], clients: int, tokens: int, model: str = "default") -> dict:
    import openai

    todo: queue.Queue = queue.Queue()
    for it in items:
        todo.put(it)
    answers, ttft, counts = {}, [], []
    lock = threading.Lock()

    def client():
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            try:
                it = todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            first, parts, n = None, [], None
            stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": it["prompt"]}], temperature=0,
                                               max_tokens=tokens, stream=True, stream_options={"include_usage": True})
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter()
                    parts.append(ch.choices[0].delta.content)
                if ch.usage is not None:
                    n = ch.usage.completion_tokens
            with lock:
                answers[it["id"]] = "".join(parts)
                if n is None:  # a server without stream usage (llama-cpp-python) sends one token a chunk
                    n = len(parts)
                ttft.append((first or time.perf_counter()) - t0)
                counts.append(n)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "tokens": sum(counts), "wall_s": round(wall, 3), "tokens_per_s": round(sum(counts) / wall, 2),
            "mean_ttft_s": round(sum(ttft) / len(ttft), 3), "answers": answers}


def stall(base: str, prompt_tokens: int, tokens: int) -> dict:
    """A stream running while a long prompt arrives: the longest pause between its chunks."""
    import openai

    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    times: list[float] = []
    started = threading.Event()

    def runner():
        stream = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Tell me a long story about the sea."}],
                                           temperature=0, max_tokens=tokens, stream=True)
        for ch in stream:
            times.append(time.perf_counter())
            if len(times) == 5:
                started.set()

    t = threading.Thread(target=runner)
    t.start()
    started.wait(120)
    long_prompt = " ".join(["the sea is wide and the waves are high"] * (prompt_tokens // 9))
    t0 = time.perf_counter()
    c.chat.completions.create(model="default", messages=[{"role": "user", "content": long_prompt}], temperature=0, max_tokens=1)
    long_s = time.perf_counter() - t0
    t.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"max_gap_s": round(max(gaps), 3), "median_gap_s": round(sorted(gaps)[len(gaps) // 2], 4), "long_request_s": round(long_s, 3)}


def generate_answers(path: str, tokens: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.jsonl")
        single = os.path.join(d, "in.jsonl")
        with open(single, "w", encoding="utf-8") as f:  # first turns only, as the clients send them
            for it in prompts_of(path):
                f.write(json.dumps({"id": str(it["id"]), "prompt": it["prompt"]}) + "\n")
        subprocess.run([sys.executable, "-m", "eagle2_cli", "generate", "-f", single, "-o", out, "-t", "0", "--max-new-tokens", str(tokens),
                        "--dtype", "float32", "--no-progress", *extra], check=True)
        return {json.loads(x)["id"]: json.loads(x)["text"] for x in open(out, encoding="utf-8") if x.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-f", "--file", default=os.path.join(HERE, "mt16.jsonl"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--check", action="store_true", help="compare every answer with `eagle2 generate` on the same prompts")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peers", default="", help="also load these servers the same way: llama-cpp, transformers (comma-separated)")
    ap.add_argument("--stall", type=int, default=0, metavar="TOKENS",
                    help="instead: the longest pause of a running stream while a TOKENS-long prompt arrives, --prefill-chunk 0 vs 256")
    ap.add_argument("serve_args", nargs="*", help="after --: options for `eagle2 serve` (and `generate` with --check)")
    args = ap.parse_args()
    items = prompts_of(args.file)
    if args.stall:
        for chunk in ("0", "256"):
            proc, base = start_server(args.serve_args + ["--prefill-chunk", chunk])
            try:
                print(f"--prefill-chunk {chunk}: {stall(base, args.stall, 200)}", flush=True)
            finally:
                proc.terminate()
                proc.wait(120)
        return
    proc, base = start_server(args.serve_args)
    try:
        one = run_load(base, items, 1, args.tokens)
        many = run_load(base, items, args.clients, args.tokens)
    finally:
        proc.terminate()
        proc.wait(120)
    ratio = many["tokens_per_s"] / one["tokens_per_s"]
    print(f"1 client: {one['tokens_per_s']} tok/s (ttft {one['mean_ttft_s']} s); {args.clients} clients: {many['tokens_per_s']} tok/s "
          f"(ttft {many['mean_ttft_s']} s): {ratio:.2f}x")
    same = sum(one["answers"][k] == many["answers"][k] for k in one["answers"])
    print(f"answers identical between the two loads: {same}/{len(items)}")
    result = {"one": one, "many": many, "ratio": round(ratio, 3), "identical_between_loads": same}
    if args.check:
        passed = []  # --model, --draft and --batch-size (with their values) go to generate too
        for i, a in enumerate(args.serve_args):
            if a in ("--model", "-m", "--draft", "-d", "--batch-size", "-b") and i + 1 < len(args.serve_args):
                passed += [a, args.serve_args[i + 1]]
        ref = generate_answers(args.file, args.tokens, passed)
        ok = sum(ref.get(str(k)) == v for k, v in many["answers"].items())
        print(f"answers identical to `eagle2 generate`: {ok}/{len(items)}")
        result["identical_to_generate"] = ok
    peers = [p for p in args.peers.split(",") if p]
    if peers:
        from eagle2_core.loading import LoadError, resolve_model

        model = next((args.serve_args[i + 1] for i, a in enumerate(args.serve_args[:-1]) if a in ("--model", "-m")), None)
        try:
            folder, gguf = resolve_model(model)
        except LoadError as e:
            raise SystemExit(f"--peers: {e}")
        if gguf is None:
            raise SystemExit("--peers needs a GGUF target (the default model, or --model FILE.gguf after --)")
        result["peers"] = {}
        for name in peers:
            proc, base, pmodel = start_peer(name, os.path.join(folder, gguf))
            try:
                p1 = run_load(base, items, 1, args.tokens, pmodel)
                pn = run_load(base, items, args.clients, args.tokens, pmodel)
            finally:
                stop(proc)
            same = sum(pn["answers"][k] == many["answers"][k] for k in many["answers"])
            print(f"{name}: 1 client {p1['tokens_per_s']} tok/s (ttft {p1['mean_ttft_s']} s); {args.clients} clients {pn['tokens_per_s']} tok/s "
                  f"(ttft {pn['mean_ttft_s']} s): {pn['tokens_per_s'] / p1['tokens_per_s']:.2f}x; eagle2 at {args.clients} clients "
                  f"{many['tokens_per_s'] / pn['tokens_per_s']:.2f}x it; answers equal to eagle2's: {same}/{len(items)}", flush=True)
            result["peers"][name] = {"one": p1, "many": pn, "eagle2_over_peer": round(many["tokens_per_s"] / pn["tokens_per_s"], 3),
                                     "answers_equal_to_eagle2": same}
    result["machine"] = {"cpu": cpu_name(), "threads": os.cpu_count()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
