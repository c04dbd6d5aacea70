"""What one long request leaves behind in `eagle2 serve`: short requests' time and the server's
resident memory before and after a request with a large max_tokens.

Starts the server (a subprocess, 127.0.0.1, a free port, the given batch size), times `--short`
8-token completions one after another (the median), reads the server's VmRSS, sends one request
with `--long` max_tokens (4096, or 10**9, which the server clamps to the context), waits a second
for the engine to go idle, then times the short requests and reads VmRSS again. The prefix cache's own gauge (/metrics)
splits the change into what it keeps on purpose, within --prefix-cache-mb, and the rest.

    python3 benchmarks/serve_kv_bench.py [--batch-size 16] [--long 4096] [--json out.json] [-- serve options]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from batch_bench import cpu_name  # noqa: E402
from serve_bench import start_server, stop  # noqa: E402


def vm_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def post(base: str, body: dict, route: str = "/v1/completions") -> dict:
    req = urllib.request.Request(base + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def kept_mb(base: str) -> float:
    """Megabytes the prefix cache says it holds (eagle2_prefix_cache_bytes in /metrics; 0 without one)."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("eagle2_prefix_cache_bytes "):
                return float(line.split()[1]) / 2**20
    return 0.0


def short_times(base: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        post(base, {"prompt": f"Count with me: {i}, {i + 1},", "max_tokens": 8, "temperature": 0})
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--long", type=int, default=4096, help="max_tokens of the long request")
    ap.add_argument("--short", type=int, default=7, help="8-token requests timed before and after")
    ap.add_argument("--json", default=None)
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args(argv)
    proc, base = start_server(["--batch-size", str(args.batch_size), *args.serve_args])
    try:
        short_times(base, 2)  # warm-up: first-request costs are not what is measured
        before = short_times(base, args.short)
        rss0, kept0 = vm_rss_mb(proc.pid), kept_mb(base)
        t0 = time.perf_counter()
        # a chat request: the instruct model answers at length (a bare completion prompt may end at once)
        r = post(base, {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper, chapter by chapter."}],
                        "max_tokens": args.long, "temperature": 0}, "/v1/chat/completions")
        long_s = time.perf_counter() - t0
        time.sleep(1.0)
        after = short_times(base, args.short)
        rss1, kept1 = vm_rss_mb(proc.pid), kept_mb(base)
    finally:
        stop(proc)
    res = {"cpu": cpu_name(), "batch_size": args.batch_size, "long_max_tokens": args.long,
           "long_tokens": r["usage"]["completion_tokens"], "long_s": round(long_s, 2),
           "short_before_s": round(statistics.median(before), 4), "short_after_s": round(statistics.median(after), 4),
           "ratio": round(statistics.median(after) / statistics.median(before), 3),
           "rss_before_mb": round(rss0), "rss_after_mb": round(rss1), "rss_delta_mb": round(rss1 - rss0),
           # what the prefix cache keeps on purpose (bounded by --prefix-cache-mb), and the rest
           "prefix_cache_delta_mb": round(kept1 - kept0), "rss_delta_less_prefix_cache_mb": round(rss1 - rss0 - (kept1 - kept0))}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
