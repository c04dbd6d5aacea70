"""eagle2 against llama.cpp on the same GGUF file and thread count, at real model sizes: peak
memory, time to a first answer, and the cost of k rows against one.

Per file and engine, back to back, each measurement in a fresh child process (so its peak RSS is
that engine's alone), with the file read once into the page cache before each child:

  - first answer: `eagle2 chat --model FILE --prompt P --max-new-tokens 16` (`python3 -m eagle2_cli`
    of the checkout --eagle2-root, this one by default) with EAGLE2_CACHE a fresh empty folder (eagle2's native kernels are built beforehand, outside the timing), against
    a child that imports llama_cpp, loads FILE and answers P with the file's chat template, 16
    tokens greedily. Seconds are the child's wall time, start to exit, for both (and its CPU time,
    user + system, which other work on a shared machine inflates less); peak RSS is the
    child's VmHWM, polled (its ru_maxrss would carry this script's own peak across the exec).
  - rows: one forward of k new tokens after a 64-token prefix with logits for all k rows, k in
    1, 2, 4, 8, 16, median of 5 interleaved rounds. llama.cpp: `Llama(logits_all=True)`, `eval` of
    the prefix, then `eval` of k tokens with the cache cut back to the prefix each time. eagle2:
    `loading.load_target(FILE)`, then `measure.measure_profile`, the very measurement behind
    `eagle2 tune`'s verify ms (the decoding cycle's tree forward and lm_head over every row, after
    a 64-token prompt, under the product plan a generation runs with).

A child that runs past --timeout or whose process tree passes --max-rss-gb resident is killed
and reported as "failed: ..." (an address-space limit would not do: both engines map the file).
eagle2's steps child reuses the converted copy its answer child left in the temporary cache,
which is removed after each file.

llama.cpp is a benchmark here, not a dependency; build it for the CPU without AMX where a VM
lists AMX it does not grant (see benchmarks/llamacpp_bench.py), e.g. on an AVX-512 Zen 4:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
      pip install --no-cache-dir llama-cpp-python==0.3.36

    python3 benchmarks/scale_bench.py --json scale.json          # the synthetic 1.7B and 8B files
    python3 benchmarks/scale_bench.py --models /work/models/synth-1.7b.gguf,/work/models/qwen2.5-coder-0.5b-instruct.gguf
    python3 benchmarks/scale_bench.py --engines llama.cpp --models /work/models/synth-8b.gguf
    python3 benchmarks/scale_bench.py --models smollm2 --rows 1,2 --reps 2   # dry run on the embedded SmolLM2
    TORCH_EXTENSIONS_DIR=/tmp/ext-old python3 benchmarks/scale_bench.py --measure answer \
      --models /work/models/synth-1.7b.gguf --eagle2-root ../old-checkout      # an older eagle2 (its own kernel build)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODELS = "/work/models/synth-1.7b.gguf,/work/models/synth-8b.gguf"
PROMPT = "Write a short poem about the sea."
MARK = "@@scale-result "  # a child's one result line on stdout, among whatever the engine prints


# -- children: each prints one MARK line of JSON -------------------------------------------------
def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def _prefix_ids(n: int, k: int) -> tuple[list[int], list[int]]:
    """The same token ids for both engines: a prefix of n and k new ones, from ordinary ids."""
    rng = random.Random(0)
    return [rng.randrange(100, 1000) for _ in range(n)], [rng.randrange(100, 1000) for _ in range(k)]


def _timed(fns: dict, reps: int) -> dict:
    """Median ms per function over interleaved rounds (after one warm-up each), so that a slow
    stretch of a shared machine lands on every row count alike."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def child_llama_answer(a) -> dict:
    t0 = time.perf_counter()
    from llama_cpp import Llama

    llm = Llama(model_path=a.file, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=512, verbose=False)
    t1 = time.perf_counter()
    out = llm.create_chat_completion(messages=[{"role": "user", "content": a.prompt}], max_tokens=a.max_new_tokens,
                                     temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    t2 = time.perf_counter()
    return {"load_s": t1 - t0, "answer_s": t2 - t1, "tokens": out["usage"]["completion_tokens"],
            "prompt_tokens": out["usage"]["prompt_tokens"], "chat_format": llm.chat_format, "vm_hwm": _vm_hwm_bytes()}


def child_llama_steps(a) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    rows = [int(r) for r in a.rows.split(",")]
    prefix, new = _prefix_ids(a.prefix, max(rows))
    t0 = time.perf_counter()
    # n_batch covers the prefix and the largest k, so each eval is one decode call
    llm = Llama(model_path=a.file, n_threads=a.threads, n_threads_batch=a.threads, n_ctx=a.prefix + max(rows) + 16,
                n_batch=max(a.prefix, max(rows)), logits_all=True, verbose=False)
    load_s = time.perf_counter() - t0
    llm.eval(prefix)

    def step(k):
        def run():
            llm.n_tokens = a.prefix  # eval drops the cache from n_tokens on: back to the prefix alone
            llm.eval(new[:k])
        return run

    ms = _timed({k: step(k) for k in rows}, a.reps)
    return {"load_s": load_s, "rows_ms": {str(k): v for k, v in ms.items()}, "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(), "vm_hwm": _vm_hwm_bytes()}


def child_eagle2_steps(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    from eagle2_core import loading, measure

    rows = tuple(int(r) for r in a.rows.split(","))
    measure.CONTEXT = a.prefix  # the committed prompt the verify runs after (64 by default, as here)
    # a large target's first answer probes only a few row counts, twice; here every count is wanted, at --reps
    if hasattr(measure, "PROBE_MS"):
        measure.PROBE_MS = float("inf")
    t0 = time.perf_counter()
    target = loading.load_target(a.file)
    from eagle2_core import runtime

    arith, _ = runtime.apply_arithmetic(target, exact=False)  # as `eagle2 chat` holds it
    load_s = time.perf_counter() - t0
    prof = measure.measure_profile(target.model, None, verify_rows=rows, reps=a.reps)
    if any(n not in prof.verify_ms for n in rows):
        raise RuntimeError(f"measured rows {sorted(prof.verify_ms)} only (the model's context is short)")
    return {"load_s": load_s, "arithmetic": arith, "rows_ms": {str(k): prof.verify_ms[k] for k in rows}, "profile_key": prof.key,
            "block_bytes": target.block_bytes, "vm_hwm": _vm_hwm_bytes()}


CHILDREN = {"llama-answer": child_llama_answer, "llama-steps": child_llama_steps, "eagle2-steps": child_eagle2_steps}


# -- the parent: children under a watch ------------------------------------------------------------
def _tree_rss(pid: int) -> int:
    """Resident bytes of pid and its descendants (a compiler or helper the engine starts counts too):
    the root's VmRSS, and each descendant's proportional share (Pss), since a forked child shows its
    parent's pages as its own until it execs."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            field, name = ("VmRSS:", "status") if p == pid else ("Pss:", "smaps_rollup")
            with open(f"/proc/{p}/{name}") as f:
                total += next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field)), 0)
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def _hwm(pid: int) -> int:
    """The process's own peak resident bytes so far (VmHWM). Not ru_maxrss: that carries the
    forking parent's peak across exec, which here would be this script's own."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:")), 0)
    except (OSError, ValueError):
        return 0


def _cpu_busy() -> tuple[float, float]:
    """(busy, elapsed) CPU seconds over all cores since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(v[:8])
    return (total - v[3] - v[4]) / hz, total / hz


def busy_cores(seconds: float = 1.0) -> float:
    """Cores kept busy by everything on the machine over the next `seconds`."""
    b0, t0 = _cpu_busy()
    time.sleep(seconds)
    b1, t1 = _cpu_busy()
    return (b1 - b0) / max(1e-9, t1 - t0) * os.cpu_count()


def wait_for_quiet(max_wait: float, cores: float) -> float:
    """Wait (up to max_wait s) until the others' load falls below `cores` busy cores: timings on a
    machine shared with builds and tests mean little otherwise. Returns the last reading."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_cores(2.0)
        if busy < cores or time.monotonic() >= deadline:
            return busy
        time.sleep(5)


def watch(cmd: list[str], env: dict, timeout: float, max_rss: float, cwd: str | None = None) -> dict:
    """Run cmd in a session of its own; kill that session past `timeout` s or `max_rss` bytes.
    Returns wall seconds, the child's peak RSS (polled VmHWM) and the polled peak of its tree, the
    cores the rest of the machine kept busy meanwhile, rc, the MARK result and the output's tail
    (or why it failed)."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    b0, c0 = _cpu_busy()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True, cwd=cwd)
    peak, hwm, why, status, ru = 0, 0, None, None, None
    while True:
        # wait4 rather than Popen.wait: its rusage is this child's CPU time alone
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        hwm = max(hwm, _hwm(proc.pid))
        peak = max(peak, _tree_rss(proc.pid))
        elapsed = time.perf_counter() - t0
        if why is None and peak > max_rss:
            why = f"RSS passed {max_rss / 1e9:.0f} GB after {elapsed:.0f} s"
        elif why is None and elapsed > timeout:
            why = f"timeout after {timeout:.0f} s"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            pid, status, ru = os.wait4(proc.pid, 0)
            break
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    b1, c1 = _cpu_busy()
    others = max(0.0, (b1 - b0) - (ru.ru_utime + ru.ru_stime)) / max(1e-9, c1 - c0) * os.cpu_count()
    proc.returncode = os.waitstatus_to_exitcode(status)
    try:  # helpers left behind in the child's session (the session is ours alone)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    result = next((json.loads(ln[len(MARK):]) for ln in stdout.splitlines() if ln.startswith(MARK)), None)
    if why is None and proc.returncode != 0:
        last = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] or [f"signal {-proc.returncode}"]
        why = f"exit {proc.returncode}: {last[0][:160]}"
    if result and result.get("vm_hwm"):
        hwm = max(hwm, result["vm_hwm"])  # the child's own last word, past the final poll
    return {"wall_s": wall, "peak_rss": hwm, "tree_rss_peak": peak, "cpu_s": ru.ru_utime + ru.ru_stime, "others_cores": others,
            "rc": proc.returncode, "result": result,
            "failed": why, "stdout_tail": stdout[-600:], "stderr_tail": stderr[-600:]}


def warm_page_cache(path: str) -> float:
    """Read the file once, so neither engine's first load pays for the disk."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t0


def child_cmd(kind: str, file: str, a) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", kind, "--models", file, "--threads", str(a.threads),
            "--rows", a.rows, "--reps", str(a.reps), "--prefix", str(a.prefix), "--prompt", a.prompt,
            "--max-new-tokens", str(a.max_new_tokens)]


def run_engine(engine: str, file: str, a, env: dict, cache: str) -> dict:
    limit = a.max_rss_gb * 1e9
    rec = {}
    for what in ("answer", "steps"):
        if what not in a.measure:
            continue
        warm_page_cache(file)
        e = dict(env)
        if engine == "eagle2":
            e["EAGLE2_CACHE"] = cache  # empty for the answer; the steps child then finds its converted copy
            # the checkout's own CLI (an installed `eagle2` may be another one's)
            cmd = ([sys.executable, "-m", "eagle2_cli", "chat", "--model", file, "--prompt", a.prompt, "--max-new-tokens",
                    str(a.max_new_tokens)] + a.chat_args.split()
                   if what == "answer" else child_cmd("eagle2-steps", file, a))
        else:
            cmd = child_cmd(f"llama-{what}", file, a)
        before = wait_for_quiet(a.quiet_wait, a.quiet_cores) if a.quiet_wait else busy_cores()
        print(f"  {engine} {what} (others busy: {before:.1f} cores) ...", end="", flush=True, file=sys.stderr)
        r = watch(cmd, e, a.timeout, limit, cwd=a.eagle2_root if engine == "eagle2" else None)  # `-m` and `-c` put the cwd first on the path
        r["others_cores_before"] = before
        if what == "answer" and engine == "eagle2" and not r["failed"] and not r["stdout_tail"].strip():
            r["failed"] = "no answer printed"
        if what == "steps" and not r["failed"] and not r["result"]:
            r["failed"] = "no result line"
        done = f"{r['wall_s']:.1f} s, {r['peak_rss'] / 1e9:.2f} GB, others busy {r['others_cores']:.1f} cores meanwhile"
        print(f" {'failed: ' + r['failed'] if r['failed'] else done}", file=sys.stderr, flush=True)
        rec[what] = r
    return rec


def prepare_eagle2(env: dict, root: str) -> str | None:
    """Build (or find) eagle2's native kernels outside any timing: the first answer is timed with
    the kernels built, as on every run after the first on a machine."""
    code = "from eagle2_core import native, leanbody; native.module(); leanbody.native_loop(); print(native.status())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800, cwd=root)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


# -- the report --------------------------------------------------------------------------------
def _fmt_fail(r: dict | None) -> str | None:
    if r is None:
        return "not run"
    return f"failed: {r['failed']}" if r.get("failed") else None


def summarize(models: list[dict], rows: list[int]) -> list[dict]:
    """One flat record per (file, engine): the figures the table prints."""
    out = []
    for m in models:
        lc = m["engines"].get("llama.cpp", {}).get("steps") or {}
        lc_one = (lc.get("result") or {}).get("rows_ms", {}).get("1") if not lc.get("failed") else None
        for engine, rec in m["engines"].items():
            ans, st = rec.get("answer"), rec.get("steps")
            row = {"file": m["file"], "size_gb": m["bytes"] / 1e9, "engine": engine}
            row["peak_rss_gb"] = None if _fmt_fail(ans) else ans["peak_rss"] / 1e9
            row["first_answer_s"] = None if _fmt_fail(ans) else ans["wall_s"]
            row["first_answer_cpu_s"] = None if _fmt_fail(ans) else ans["cpu_s"]
            row["answer_failed"] = _fmt_fail(ans)
            if engine == "llama.cpp" and ans and ans.get("result"):
                row["answer_tokens"] = ans["result"]["tokens"]
                row["load_plus_answer_s"] = ans["result"]["load_s"] + ans["result"]["answer_s"]
            elif engine == "eagle2" and ans:
                got = re.search(r"tokens\s+(\d+)\s+verify", ans["stderr_tail"])  # the chat summary's token count
                row["answer_tokens"] = int(got.group(1)) if got else None
            row["steps_failed"] = _fmt_fail(st)
            ms = None if row["steps_failed"] else {int(k): v for k, v in st["result"]["rows_ms"].items()}
            row["rows_ms"] = ms
            row["steps_peak_rss_gb"] = None if row["steps_failed"] else st["peak_rss"] / 1e9
            row["others_cores"] = {w: round(r["others_cores"], 2) for w, r in rec.items()}
            if ms:
                row["one_row_ms"] = ms[1]
                row["rows_in_own_one_row"] = {k: ms[k] / ms[1] for k in rows if k != 1}
                row["rows_in_llamacpp_one_row"] = {k: ms[k] / lc_one for k in rows} if lc_one else None
            out.append(row)
    return out


def print_table(flat: list[dict], rows: list[int], header: str) -> None:
    ks = "/".join(str(k) for k in rows if k != 1)
    print(header)
    print(f"| file (size) | engine | peak RSS | first answer | one-row step | {ks} rows, in its own one-row steps | "
          f"{'/'.join(map(str, rows))} rows, in llama.cpp's one-row steps | others' load, cores (answer / rows) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in flat:
        name = f"{os.path.basename(r['file'])} ({r['size_gb']:.2f} GB)"
        rss = r["answer_failed"] or f"{r['peak_rss_gb']:.2f} GB"
        first = "" if r["answer_failed"] else (f"{r['first_answer_s']:.1f} s (CPU {r['first_answer_cpu_s']:.1f} s)"
                                               + (f" ({r['answer_tokens']} tokens)" if r.get("answer_tokens") else ""))
        if r["steps_failed"]:
            one, own, lc = r["steps_failed"], "", ""
        else:
            one = f"{r['one_row_ms']:.1f} ms"
            own = " / ".join(f"{v:.2f}" for v in r["rows_in_own_one_row"].values())
            lc = " / ".join(f"{v:.2f}" for v in r["rows_in_llamacpp_one_row"].values()) if r["rows_in_llamacpp_one_row"] else ""
        load = " / ".join(f"{v:.1f}" for v in r.get("others_cores", {}).values())
        print(f"| {name} | {r['engine']} | {rss} | {first} | {one} | {own} | {lc} | {load} |")


def resolve(name: str) -> str:
    if name.lower() in ("smollm2", "default"):
        from eagle2_core.loading import smollm2_gguf_path

        return smollm2_gguf_path()
    return os.path.abspath(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated GGUF files ('smollm2': the embedded one)")
    ap.add_argument("--engines", default="llama.cpp,eagle2", help="which engines, in this order per file")
    ap.add_argument("--measure", default="answer,steps", help="answer (RSS, first answer), steps (row costs), or both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16", help="k new tokens per forward (1 is the one-row step)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds; the median is kept")
    ap.add_argument("--prefix", type=int, default=64, help="tokens in the cache before the k rows")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--chat-args", default="", help="extra arguments for `eagle2 chat`, e.g. --no-baseline")
    ap.add_argument("--eagle2-root", default=os.path.dirname(HERE), help="the checkout whose eagle2 is measured (default: this one)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per child before it is killed")
    ap.add_argument("--max-rss-gb", type=float, default=20, help="resident GB of a child's process tree before it is killed")
    ap.add_argument("--quiet-wait", type=float, default=0, help="before each child, wait up to this many seconds for the "
                    "rest of the machine to fall below --quiet-cores busy cores (0: start at once)")
    ap.add_argument("--quiet-cores", type=float, default=0.3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.child:
        a.file = a.models
        print(MARK + json.dumps(CHILDREN[a.child](a)), flush=True)
        return 0

    sys.path.insert(0, HERE)
    from batch_bench import cpu_name

    if "1" not in a.rows.split(","):
        a.rows = "1," + a.rows  # every ratio is in units of the one-row step
    rows = sorted({int(r) for r in a.rows.split(",")})
    a.rows = ",".join(map(str, rows))
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    root = a.eagle2_root = os.path.abspath(a.eagle2_root)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    files = [resolve(m.strip()) for m in a.models.split(",") if m.strip()]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # the engine measured is the working tree's: say so where it differs from the commit
    if subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "eagle2_core", "eagle2_cli"],
                      capture_output=True, text=True).stdout.strip():
        commit += " with uncommitted edits"
    eagle2_prep = prepare_eagle2(env, root) if "eagle2" in engines else None
    if eagle2_prep:
        print(f"eagle2's native kernels did not build ({eagle2_prep}); its figures are those of the fallback paths", file=sys.stderr)
    models = []
    for file in files:
        if not os.path.isfile(file):
            print(f"{file}: no such file; skipped", file=sys.stderr)
            continue
        print(f"{file} ({os.path.getsize(file) / 1e9:.2f} GB)", file=sys.stderr, flush=True)
        m = {"file": file, "bytes": os.path.getsize(file), "engines": {}}
        for engine in engines:
            cache = tempfile.mkdtemp(prefix="eagle2-scale-cache-")
            try:
                m["engines"][engine] = run_engine(engine, file, a, env, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)  # an 8B float32 copy is 32 GB of disk
        models.append(m)
    flat = summarize(models, rows)
    machine = cpu_name()
    header = (f"\nmachine: {machine}; {now}; eagle2 at {commit or '?'}; {a.threads} threads for both engines; "
              f"rows after a {a.prefix}-token prefix, median of {a.reps}; first answer: {a.max_new_tokens} tokens, child wall time, "
              "eagle2 with an empty EAGLE2_CACHE")
    print_table(flat, rows, header)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine, "date": now, "commit": commit, "threads": a.threads, "prompt": a.prompt,
                       "max_new_tokens": a.max_new_tokens, "rows": rows, "reps": a.reps, "prefix": a.prefix,
                       "chat_args": a.chat_args, "eagle2_native": eagle2_prep or "built", "summary": flat, "raw": models}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
