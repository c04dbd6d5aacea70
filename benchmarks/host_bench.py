"""Host time per cycle: a decoding cycle's wall time minus the time inside the target's and the
draft head's forwards, i.e. what the engine itself costs around the model's arithmetic.

The timers are installed from outside (the target runner's body forward and lm_head, the head's
forward, projection and draft logits, and the cycle's `step`, each wrapped), so the same script
measures any checkout of eagle2_core, old or new, as long as those pieces can be found:

    python3 benchmarks/host_bench.py --repo /tmp/wt-old            # one checkout, one process
    python3 benchmarks/host_bench.py --repo /tmp/wt-old --ext /tmp/ext-old --repo . --ext /tmp/ext-new --rounds 3

With several --repo (or --rounds > 1) each run is a fresh process per checkout, alternating, each
with its own TORCH_EXTENSIONS_DIR (--ext, in the order of --repo), since the checkouts' C++ may
differ. Default: the embedded SmolLM2 GGUF with its shipped head and default settings, greedy,
the prompts of benchmarks/mt16.jsonl at 64 new tokens. Per cycle it reports wall, target and head
milliseconds and host = wall - target - head, as the mean over prompts of each prompt's per-cycle
figure, and the same split in the main thread's CPU time (what a shared machine's other work does
not inflate: the host part runs on this thread alone).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class Clock:
    """Wall and main-thread CPU seconds spent in wrapped regions while a cycle runs; a region
    entered inside another (a head forward calling its own draft logits) counts once, in the outer."""

    def __init__(self):
        self.in_step = False
        self.depth = 0
        self.totals: dict[str, list[float]] = {}
        self.sync = lambda: None

    def wrap(self, kind: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.in_step or self.depth:
                self.depth += bool(self.in_step)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.depth -= bool(self.in_step)
            self.depth += 1
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(kind, t0)
                self.depth -= 1
        return timed

    def wrap_step(self, fn):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            self.in_step = True
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add("step", t0)
                self.in_step = False
        return step

    def now(self) -> tuple[float, float, float]:
        self.sync()
        return time.perf_counter(), time.thread_time(), time.process_time()

    def add(self, kind: str, t0) -> None:
        t = self.totals.setdefault(kind, [0.0, 0.0, 0.0, 0])
        for i, (a, b) in enumerate(zip(self.now(), t0)):
            t[i] += a - b
        t[3] += 1

    def take(self) -> dict:
        out, self.totals = self.totals, {}
        return out


def find_method(module_names: list[str], method: str, prefer: list[str]):
    """(class, its name) of the first class having `method`, among `prefer` names first, in the
    first importable module of `module_names`; None if none has it."""
    for name in module_names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        classes = [getattr(mod, c) for c in prefer if isinstance(getattr(mod, c, None), type)]
        classes += [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__ and v not in classes]
        for cls in classes:
            if callable(getattr(cls, method, None)):
                return cls, f"{mod.__name__}.{cls.__name__}.{method}"
    return None


def install(clock: Clock, runtime) -> list[str]:
    """Wrap the cycle's step, the target's forwards and the head's; the names of what was wrapped.
    Exits with a message naming what could not be found (a renamed class or method)."""
    done = []
    step = find_method(["eagle2_core.cycle", "eagle2_core.engine", "eagle2_core.decoder"], "step", ["Cycle", "EagerCycle"])
    if step is None:
        raise SystemExit("host_bench: no class with a `step` method (one decoding cycle) in eagle2_core.cycle or .engine: "
                         "point find_method at the renamed cycle")
    cls, where = step
    setattr(cls, "step", clock.wrap_step(cls.step))
    done.append(where)
    runner = find_method(["eagle2_core.target"], "body_forward", ["TargetRunner"])
    if runner is not None:
        cls, where = runner
        cls.body_forward = clock.wrap("target", cls.body_forward)
        done.append(where)
        if callable(getattr(cls, "logits", None)):  # the target's lm_head: part of its forward
            cls.logits = clock.wrap("target", cls.logits)
            done.append(f"{where.rsplit('.', 1)[0]}.logits")
    else:  # no runner: the model's own modules (a lean body that bypasses them would go uncounted: said below)
        model = runtime.model
        body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        body.forward = clock.wrap("target", body.forward)
        lm = model.get_output_embeddings()
        lm.forward = clock.wrap("target", lm.forward)
        done += ["model body forward (no TargetRunner.body_forward found: a lean body's time would count as host)", "lm_head forward"]
    head = getattr(runtime, "head", None)
    if head is None:
        raise SystemExit("host_bench: the runtime has no `head` (no draft head loaded?): nothing to time as the head's forward")
    for name in ("forward", "draft_logits", "project"):
        if callable(getattr(head, name, None)):
            setattr(head, name, clock.wrap("head", getattr(head, name)))
            done.append(f"{type(head).__name__}.{name} (instance)")
    return done


def one_run(args) -> dict:
    """Decode every prompt with this process's eagle2_core (--repo) and return the per-cycle split."""
    repo = os.path.abspath(args.repo[0])
    sys.path.insert(0, repo)
    import torch

    core = importlib.import_module("eagle2_core")
    if not os.path.abspath(core.__file__).startswith(repo + os.sep):
        raise SystemExit(f"host_bench: eagle2_core came from {core.__file__}, not {repo} (is it installed as a package?)")
    events = importlib.import_module("eagle2_core.events")
    Runtime = importlib.import_module("eagle2_core.runtime").Runtime
    gen = events.GenerationSettings(max_new_tokens=args.max_new_tokens)
    rt = Runtime.load(None, None, gen=gen)
    dec = rt.eagle()
    clock = Clock()
    if torch.cuda.is_available() and str(getattr(rt.model, "device", "cpu")).startswith("cuda"):
        clock.sync = torch.cuda.synchronize
    wrapped = install(clock, rt)
    lines = [json.loads(ln) for ln in open(args.prompts) if ln.strip()][: args.limit or None]
    prompts = [rt.encode([{"role": "user", "content": ln.get("prompt") or ln["turns"][0]}]) for ln in lines]
    dec.generate(prompts[0], type(gen)(max_new_tokens=8))  # warm-up: first-call costs out of the figures
    clock.take()
    rows = []
    for ids in prompts:
        w0 = time.perf_counter()
        toks, summ = dec.generate(ids, gen)
        wall = time.perf_counter() - w0
        t = clock.take()
        step, target, head = (t.get(k, [0.0, 0.0, 0.0, 0]) for k in ("step", "target", "head"))
        cycles = step[3]
        if not cycles:
            raise SystemExit("host_bench: the wrapped `step` never ran: the engine no longer runs its cycles through it")
        if getattr(summ, "cycles", cycles) != cycles:
            print(f"host_bench: warning: {cycles} wrapped steps, the summary says {summ.cycles} cycles", file=sys.stderr)
        ms = lambda x: 1000 * x / cycles  # noqa: E731
        rows.append({"tokens": len(toks), "cycles": cycles, "generate_s": wall,
                     "wall": ms(step[0]), "target": ms(target[0]), "head": ms(head[0]), "host": ms(step[0] - target[0] - head[0]),
                     "cpu_wall": ms(step[1]), "cpu_target": ms(target[1]), "cpu_head": ms(head[1]),
                     "cpu_host": ms(step[1] - target[1] - head[1]), "proc_wall": ms(step[2]), "proc_host": ms(step[2] - target[2] - head[2]),
                     "target_calls": target[3] / cycles, "head_calls": head[3] / cycles})
    keys = ["wall", "target", "head", "host", "cpu_wall", "cpu_target", "cpu_head", "cpu_host", "proc_wall", "proc_host", "target_calls", "head_calls"]
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return {"repo": repo, "commit": commit + ("+dirty" if dirty else ""), "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
            "tree": str(getattr(dec, "tree", "")), "threads": torch.get_num_threads(),
            "tokens": sum(r["tokens"] for r in rows), "cycles": sum(r["cycles"] for r in rows),
            "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["generate_s"] for r in rows),
            "per_cycle_ms": {k: statistics.mean(r[k] for r in rows) for k in keys}, "wrapped": wrapped}


def cpu_name() -> str:
    try:
        from batch_bench import cpu_name as name

        return name()
    except Exception:  # noqa: BLE001 (a label only)
        import platform

        return platform.processor() or platform.machine()


def alternate(args) -> None:
    """Each checkout in its own process, alternating, `rounds` times; a table at the end."""
    if args.ext and len(args.ext) != len(args.repo):
        raise SystemExit("host_bench: give one --ext per --repo (or none)")
    results = {r: [] for r in args.repo}
    for k in range(args.rounds):
        order = args.repo if k % 2 == 0 else args.repo[::-1]  # alternate which checkout runs first
        for repo in order:
            env = dict(os.environ)
            if args.ext:
                env["TORCH_EXTENSIONS_DIR"] = args.ext[args.repo.index(repo)]
            cmd = [sys.executable, os.path.abspath(__file__), "--repo", repo, "--prompts", args.prompts,
                   "-n", str(args.max_new_tokens), "--limit", str(args.limit), "--json-line"]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo)
            line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
            if p.returncode or line is None:
                raise SystemExit(f"host_bench: the run of {repo} failed:\n{p.stderr[-3000:]}")
            res = json.loads(line)
            results[repo].append(res)
            c = res["per_cycle_ms"]
            print(f"round {k + 1} {res['commit']:>14}: wall {c['wall']:.2f} target {c['target']:.2f} head {c['head']:.2f} "
                  f"host {c['host']:.2f} ms/cycle | cpu wall {c['cpu_wall']:.2f} host {c['cpu_host']:.2f} | {res['cycles']} cycles, {res['tokens_per_s']:.1f} tok/s",
                  flush=True)
    print(f"\nCPU: {cpu_name()}; {results[args.repo[0]][0]['prompts']} prompts "
          f"of {args.prompts}, {args.max_new_tokens} new tokens; mean (min-max) over {args.rounds} rounds, ms per cycle")
    print(f"{'commit':>14} | {'wall':>17} | {'target':>17} | {'head':>17} | {'host':>17} | {'cpu wall':>17} | {'cpu host':>17} | tok/s")
    for repo, runs in results.items():
        cells = []
        for k in ("wall", "target", "head", "host", "cpu_wall", "cpu_host"):
            v = [r["per_cycle_ms"][k] for r in runs]
            cells.append(f"{statistics.mean(v):6.2f} ({min(v):.2f}-{max(v):.2f})")
        print(f"{runs[0]['commit']:>14} | " + " | ".join(cells) + f" | {statistics.mean(r['tokens_per_s'] for r in runs):.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "rounds": results}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", help="a checkout whose eagle2_core to measure (repeat to compare; default: this one)")
    ap.add_argument("--ext", action="append", help="TORCH_EXTENSIONS_DIR for the --repo of the same rank")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", default=os.path.join(HERE, "mt16.jsonl"))
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.repo = args.repo or [os.path.dirname(HERE)]
    args.prompts = os.path.abspath(args.prompts)
    sys.path.insert(0, HERE)
    if len(args.repo) > 1 or args.rounds > 1:
        return alternate(args)
    res = one_run(args)
    if args.json_line:
        print(json.dumps(res))
        return
    c = res["per_cycle_ms"]
    print(f"{res['commit']} ({res['repo']}), CPU {cpu_name()}, tree {res['tree']}")
    print(f"{res['prompts']} prompts x {res['max_new_tokens']} tokens: {res['cycles']} cycles, {res['tokens_per_s']:.1f} tok/s")
    print(f"per cycle (mean over prompts): wall {c['wall']:.2f} ms = target {c['target']:.2f} + head {c['head']:.2f} + host {c['host']:.2f}")
    print(f"main-thread CPU per cycle: {c['cpu_wall']:.2f} ms = target {c['cpu_target']:.2f} + head {c['cpu_head']:.2f} + host {c['cpu_host']:.2f}")
    print(f"process CPU per cycle (all threads): {c['proc_wall']:.2f} ms, outside the forwards {c['proc_host']:.2f}")
    print(f"forwards per cycle: target {c['target_calls']:.2f}, head {c['head_calls']:.2f}; wrapped: {', '.join(res['wrapped'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
