"""The machine's cost curve, measured: verify ms for n tree rows and draft ms for k rows.

What a tree should look like depends on how a product of n rows costs against one row, and
that differs by CPU (AVX2, AVX-512, AMX), dtype, thread count, library version and GPU. So it is
measured, once per (model, dtype, device, threads, versions), in a few seconds, and cached as
JSON under the cache folder; `eagle2 tune` measures again and prints it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from . import rowgemm

# Every small size: row counts of one parity can cost more than the next larger one (oneDNN's
# few-row kernels measured 3 rows dearer than 4 and 7 dearer than 8 on an AVX2 Zen 3).
VERIFY_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
DRAFT_ROWS = (1, 2, 4, 8, 10)
LM_HEAD_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROFILE_VERSION = 4  # 2: lm_head alone by rows (decides greedy acceptance's lm_head plan and the default tree);
                     # 3: every size to 8, timed in interleaved rounds (median), so drift hits all sizes alike;
                     # 4: rowgemm's few-row products against linear by rows (row_products), measured first
CONTEXT = 64  # committed tokens in the cache while measuring: a typical short prompt


@dataclass
class CostProfile:
    key: dict
    verify_ms: dict[int, float]             # rows -> ms of one target forward over that many tree rows
    draft_ms: dict[int, float]              # rows -> ms of one draft step over that many nodes
    lm_head_ms: dict[int, float] = field(default_factory=dict)  # rows -> ms of the target's lm_head alone
    row_products: dict = field(default_factory=dict)  # {"body"|"wide": {rows: [linear ms, transposed ms]}} (rowgemm)
    measured_at: float = field(default_factory=time.time)

    def verify_table(self, n_max: int) -> torch.Tensor:
        """ms for every n = 1 .. n_max, linear between measured sizes (and beyond the last)."""
        return _table(self.verify_ms, n_max)

    def lm_head_at(self, rows: int) -> float:
        return float(_table(self.lm_head_ms, rows)[-1])

    def rows_are_cheap(self, rows: int) -> bool:
        """Whether one lm_head product over `rows` tree rows costs no more than the two-pass plan:
        the internal rows (about half a tree) and then the one leaf row where the path ends. This
        decides greedy acceptance's lm_head plan and whether a half-precision CPU target gets the
        larger default tree; it replaces every per-CPU rule (AMX or not) with the measurement."""
        if not self.lm_head_ms or rows <= 1:
            return True
        return self.lm_head_at(rows) <= self.lm_head_at(-(-rows // 2)) + self.lm_head_at(1)


    def draft_width(self, slack: float = 1.25) -> int:
        """Top-k of the per-cycle budget's expansion: the widest draft step measured that costs at
        most `slack` times the cheapest. A depth step feeds k front nodes and scores k x k
        children, so where k rows cost what one does (a GPU; a CPU's few-row products) a wide
        front is nearly free candidates, and where each row costs (bf16 without bf16 units) the
        chooser is better served by a narrow one."""
        best = min(self.draft_ms.values())
        return max(k for k, ms in self.draft_ms.items() if ms <= slack * best)

    def draft_step_ms(self, rows: int) -> float:
        xs = sorted(self.draft_ms)
        x = min(xs, key=lambda v: abs(v - rows))
        return self.draft_ms[x]

    def to_json(self) -> dict:
        d = asdict(self)
        d["verify_ms"] = {str(k): round(v, 3) for k, v in self.verify_ms.items()}
        d["draft_ms"] = {str(k): round(v, 3) for k, v in self.draft_ms.items()}
        d["lm_head_ms"] = {str(k): round(v, 3) for k, v in self.lm_head_ms.items()}
        d["row_products"] = {c: {str(k): [round(a, 3), round(b, 3)] for k, (a, b) in v.items()} for c, v in self.row_products.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostProfile":
        return cls(key=d["key"], verify_ms={int(k): float(v) for k, v in d["verify_ms"].items()},
                   draft_ms={int(k): float(v) for k, v in d["draft_ms"].items()},
                   lm_head_ms={int(k): float(v) for k, v in d.get("lm_head_ms", {}).items()}, measured_at=float(d.get("measured_at", 0)),
                   row_products={c: {int(k): [float(a), float(b)] for k, (a, b) in v.items()} for c, v in d.get("row_products", {}).items()})


def _table(points: dict[int, float], n_max: int) -> torch.Tensor:
    """ms for every n = 1 .. n_max from measured (rows -> ms), linear between and beyond them."""
    xs = sorted(points)
    ys = [points[x] for x in xs]
    out = []
    for n in range(1, n_max + 1):
        if n <= xs[0]:
            out.append(ys[0])
        elif n >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            out.append(ys[-1] + max(0.0, slope) * (n - xs[-1]))
        else:
            j = next(i for i, x in enumerate(xs) if x >= n)
            x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
            out.append(y0 + (y1 - y0) * (n - x0) / (x1 - x0))
    return torch.tensor(out, dtype=torch.float64)


def profile_key(model, head) -> dict:
    import transformers

    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    w = model.get_output_embeddings().weight
    return {"version": PROFILE_VERSION, "model": hashlib.sha1(cfg.encode()).hexdigest()[:16], "dtype": str(w.dtype).replace("torch.", ""),
            "device": str(w.device), "device_name": _device_name(w.device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "head": None if head is None else f"{getattr(head, 'kind', 'eagle2')}:{head.spec.hidden_size}:{head_draft_rows(head)}"}


def head_draft_rows(head) -> int:
    """Rows of the product that scores the draft vocabulary (the head's dominant cost on small models)."""
    w = head.lm_head.weight if getattr(head, "kind", "") == "eagle3" else head.draft_lm_head
    return int(w.shape[0])


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def _timed(fns: dict, rounds: int) -> dict:
    """Median ms of each function, timed in interleaved rounds (every function once per round),
    so that a slow stretch of a shared or throttling machine lands on all of them alike rather
    than on whichever size was being timed then."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        fn()  # warm-up
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: 1000 * sorted(t)[len(t) // 2] for k, t in times.items()}


@torch.no_grad()
def measure_profile(model, head, verify_rows=VERIFY_ROWS, draft_rows=DRAFT_ROWS, reps: int = 5) -> CostProfile:
    """Time the target's tree forward (with lm_head over every row) and one draft step."""
    from .kvcache import TreeKVCache, num_cache_layers
    from .target import TargetRunner, text_config
    from .tree import tree_from_parents

    run = TargetRunner(model)
    dev = run.device
    # First where rowgemm's transposed product pays: every timing below runs under that plan.
    row_products = measure_row_products(run, reps=reps)
    rowgemm.install_plan(row_plan(row_products))
    # Stay inside the model's context: no position at or past max_position_embeddings is run
    # (a short-context model measures fewer tree sizes; the table extrapolates beyond them).
    context = min(CONTEXT, run.max_positions // 2)
    verify_rows = [n for n in verify_rows if context + n <= run.max_positions] or [1]
    ctx = torch.randint(0, min(1000, text_config(model.config).vocab_size),
                        (max(context, max(verify_rows)),), device=dev)
    cache = TreeKVCache(num_cache_layers(model.config), context + max(verify_rows) + 8)
    run.forward(ctx[:context], torch.arange(context, device=dev), None, cache)

    def verify_fn(n):
        tree = tree_from_parents(ctx[:n].clone(), torch.arange(-1, n - 1, device=dev))  # a chain: the mask shape does not change the cost

        def one():
            h = run.forward(tree.tokens, context + tree.depth, run.tree_mask(tree, context), cache)
            run.logits(h).argmax(-1)
            cache.truncate(context)
        return one

    verify = _timed({n: verify_fn(n) for n in verify_rows}, reps)
    # lm_head alone, as acceptance applies it (rowgemm's few-row product where that is faster)
    hid = torch.randn(max(LM_HEAD_ROWS), text_config(model.config).hidden_size, device=dev, dtype=run.dtype)
    lm_head = _timed({n: (lambda n=n: run.logits(hid[:n]).argmax(-1)) for n in LM_HEAD_ROWS}, reps)
    # One draft step over k nodes, with the committed context in the head's own cache.
    from .tree import additive, appended_visible, causal_attention_bias

    dtype = head.fc.weight.dtype
    hcache = TreeKVCache(1, context + max(draft_rows) + 8)
    state = torch.zeros(1, context, head.spec.hidden_size, device=dev, dtype=dtype)
    head(ctx[:context][None], state, torch.arange(context, device=dev)[None], attention_mask=causal_attention_bias(context, 0, dtype, dev), cache=hcache)

    def draft_fn(k):
        bias = additive(appended_visible(torch.eye(k, dtype=torch.bool, device=dev), context), dtype)
        tokens = ctx[:k][None]
        pos = torch.full((1, k), context, device=dev)

        def step():
            h = head(tokens, state[:, :k], pos, attention_mask=bias, cache=hcache)
            torch.topk(torch.log_softmax(head.draft_logits(h).float(), -1), 4, dim=-1)
            hcache.truncate(context)
        return step

    draft = _timed({k: draft_fn(k) for k in draft_rows}, reps)
    return CostProfile(key=profile_key(model, head), verify_ms=verify, draft_ms=draft, lm_head_ms=lm_head, row_products=row_products)


# -- rowgemm's plan: where `W @ x.T` beats `linear`, by rows ----------------------------------
ROW_TRIALS_BODY = (1, 2, 3, 4, 6, 8, 12, 16)      # body-sized weights: linear catches up within a tree's rows
ROW_TRIALS_WIDE = (1, 2, 4, 8, 16, 32, 64)        # the lm_head: the transposed form was seen winning to 64
BODY_SAMPLE_BYTES = 128 << 20  # body weights timed per product: past the caches, streamed as a forward streams them
ROW_WIN = 0.97  # transposed counts as faster only below this share of linear's time: a tie (one row on the
                # AVX-512 Zen 5 measured 33.1 vs 33.4 ms) stays with linear rather than flip with the noise


def measure_row_products(run, reps: int = 5) -> dict:
    """{"body"|"wide": {rows: [linear ms, transposed ms]}} for this machine and model: body-sized
    weights as a run of the target's own linears (up to BODY_SAMPLE_BYTES of them, so the
    product streams from memory as in a forward), vocabulary-sized as its lm_head. Empty where
    rowgemm never applies (not float32, not a CPU). Timed in interleaved rounds like the rest."""
    w_out = run.lm_head.weight
    if w_out.device.type != "cpu" or w_out.dtype != torch.float32:
        return {}
    body, size = [], 0
    for m in run.cpu_linears:
        if m.weight.shape[0] < rowgemm.WIDE and size < BODY_SAMPLE_BYTES:
            body.append(m.weight)
            size += m.weight.numel() * 4
    groups = {"body": (body, ROW_TRIALS_BODY)}
    if w_out.shape[0] >= rowgemm.WIDE:
        groups["wide"] = ([w_out], ROW_TRIALS_WIDE)
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(max(ROW_TRIALS_WIDE), n, generator=g) for n in {w.shape[1] for ws, _ in groups.values() for w in ws}}
    out = {}
    with torch.no_grad():
        for cls, (weights, trials) in groups.items():
            if not weights:
                continue
            fns = {}
            for n in trials:
                fns[(n, 0)] = lambda n=n, ws=weights: [F.linear(inputs[w.shape[1]][:n], w) for w in ws]
                fns[(n, 1)] = lambda n=n, ws=weights: [rowgemm.transposed_product(inputs[w.shape[1]][:n], w) for w in ws]
            ms = _timed(fns, reps)
            out[cls] = {n: [ms[(n, 0)], ms[(n, 1)]] for n in trials}
    return out


def row_plan(row_products: dict) -> rowgemm.RowPlan:
    """The plan from measured (linear, transposed) pairs: one row transposed where that was
    faster (by ROW_WIN), and 2 rows up to the last size of an unbroken run of transposed wins
    from 2 (a size not measured between two wins counts as one). Vocabulary-sized weights follow
    the body's plan where the target has none (a small vocabulary)."""
    def wins(pair) -> bool:
        return pair[1] < ROW_WIN * pair[0]

    def plan(pairs: dict) -> tuple[bool, int]:
        one = 1 in pairs and wins(pairs[1])
        top = 0
        for n in sorted(k for k in pairs if k >= 2):
            if not wins(pairs[n]):
                break
            top = n
        return one, top

    if not row_products.get("body"):
        return rowgemm.RowPlan()
    body_one, body_max = plan(row_products["body"])
    wide_one, wide_max = plan(row_products["wide"]) if row_products.get("wide") else (body_one, body_max)
    return rowgemm.RowPlan(body_one, body_max, wide_one, wide_max)


def _cache_path(key: dict) -> str:
    from .loading import cache_dir

    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), "profiles", f"{digest}.json")


def _cached(path: str, key: dict, from_json, measure, what: str, remeasure: bool = False):
    """The table cached at `path` if it was measured for `key`, else `measure()`, stored there."""
    if not remeasure and os.path.isfile(path):
        try:
            with open(path) as f:
                table = from_json(json.load(f))
            if table.key == key:
                return table, True
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"ignoring the unreadable {what} {path} ({e}); measuring again", stacklevel=2)
    table = measure()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(table.to_json(), f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a read-only cache only costs the measurement next time
    return table, False


def load_or_measure(model, head, remeasure: bool = False) -> CostProfile:
    """The cached profile for this (model, dtype, device, threads, versions), else a fresh one."""
    key = profile_key(model, head)
    prof, cached = _cached(_cache_path(key), key, CostProfile.from_json, lambda: measure_profile(model, head), "cost profile", remeasure)
    if cached:
        rowgemm.install_plan(row_plan(prof.row_products))  # a fresh measurement installed it already
    return prof


# -- batches: verify ms for B sequences x N tree nodes, draft ms for B trees (batched.py) -------
# A prompt file can run B sequences per cycle. Whether rows of other sequences are cheaper than
# rows of a bigger tree (and whether drafting pays at all at batch B) is again a property of the
# machine, so the batched cycle itself is timed on a grid of (B, N) and cached like the profile.
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
BATCH_TREES = (1, 2, 3, 4, 6)
BATCH_MAX_ROWS = 96       # the grid stops at B x N rows beyond this (extrapolated linearly)
BATCH_CONTEXT = 96        # prompt tokens per sequence while timing
BATCH_VERSION = 1


@dataclass
class BatchCosts:
    key: dict
    verify_ms: dict[tuple[int, int], float]   # (B, N) -> ms of one batched verify (N = 1: a plain batched step)
    draft_ms: dict[int, float]                # B -> ms of drafting B trees (absorb + expansion + rerank)
    depth: int = 3
    top_k: int = 2
    measured_at: float = field(default_factory=time.time)

    @property
    def batches(self) -> list[int]:
        return sorted(self.draft_ms) or sorted({b for b, _ in self.verify_ms})

    def verify(self, b: int, n: int) -> float:
        """ms for (b, n): measured, else linear in n at each measured batch size and linear in b
        between the nearest measured sizes (proportional beyond the largest)."""
        if (b, n) in self.verify_ms:
            return self.verify_ms[(b, n)]

        def at(bb):
            return float(_table({x: ms for (x0, x), ms in self.verify_ms.items() if x0 == bb}, n)[-1])
        return _between(sorted({x for x, _ in self.verify_ms}), b, at)

    def draft(self, b: int) -> float:
        if b in self.draft_ms or not self.draft_ms:
            return self.draft_ms.get(b, 0.0)
        return _between(sorted(self.draft_ms), b, lambda bb: self.draft_ms[bb])

    def to_json(self) -> dict:
        return {"key": self.key, "verify_ms": {f"{b}x{n}": round(v, 3) for (b, n), v in self.verify_ms.items()},
                "draft_ms": {str(b): round(v, 3) for b, v in self.draft_ms.items()}, "depth": self.depth, "top_k": self.top_k,
                "measured_at": self.measured_at}

    @classmethod
    def from_json(cls, d: dict) -> "BatchCosts":
        verify = {tuple(int(x) for x in k.split("x")): float(v) for k, v in d["verify_ms"].items()}
        return cls(key=d["key"], verify_ms=verify, draft_ms={int(k): float(v) for k, v in d["draft_ms"].items()},
                   depth=int(d.get("depth", 3)), top_k=int(d.get("top_k", 2)), measured_at=float(d.get("measured_at", 0)))


def _between(xs: list[int], x: int, f) -> float:
    """f at x by linear interpolation between measured xs (f(xs[0]) below, proportional above)."""
    if x <= xs[0]:
        return f(xs[0])
    if x >= xs[-1]:
        return f(xs[-1]) * x / xs[-1]
    hi = next(v for v in xs if v >= x)
    lo = max(v for v in xs if v <= x)
    return f(lo) if hi == lo else f(lo) + (f(hi) - f(lo)) * (x - lo) / (hi - lo)


def batch_key(model, head, depth: int, top_k: int) -> dict:
    return {**profile_key(model, head), "batch_version": BATCH_VERSION, "depth": depth, "top_k": top_k}


@torch.no_grad()
def measure_batch_costs(model, head, depth: int = 3, top_k: int = 2, batches=BATCH_SIZES, trees=BATCH_TREES,
                        reps: int = 3, context: int = BATCH_CONTEXT) -> BatchCosts:
    """Time the batched cycle itself (batched.BatchCycle) at every (B, N) of the grid up to
    BATCH_MAX_ROWS rows: B random prompts of `context` tokens are admitted, then cycles are timed
    in interleaved rounds (median), drafting once per cycle where N > 1."""
    from .batched import BatchCycle, Slot
    from .events import GenerationSettings, StopChecker, Summary

    from .target import context_length

    run_max = context_length(model.config)
    context = max(1, min(context, run_max // 2))
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    trees = [n for n in trees if n == 1 or head is not None]
    verify, draft = {}, {}
    for b in batches:
        sizes = [n for n in trees if b * n <= BATCH_MAX_ROWS or n == 1]
        if not sizes:
            continue
        n_top = max(sizes)
        cyc = BatchCycle(model, head if n_top > 1 else None, None, b, n_top, depth, top_k, capacity=context + 8 * (reps + 1) * len(sizes) + 8)
        try:
            g = GenerationSettings(max_new_tokens=8 * (reps + 1) * len(sizes) + 8, eos_token_ids=())
            for i in range(b):
                ids = torch.randint(0, min(vocab, 1000), (context,), generator=gen).tolist()
                cyc.admit(i, ids, Slot(key=i, stop=StopChecker(g, None, set(), 1 << 30, context), summary=Summary()), lambda lg: int(lg.argmax(-1)[0]))
            times = {n: ([], []) for n in sizes}
            for r in range(reps + 1):
                for n in sizes:
                    cyc.n_max, cyc.speculative = n, n > 1
                    cyc.step()
                    if r:  # round 0 warms up
                        times[n][0].append(cyc.last["draft_s"])
                        times[n][1].append(cyc.last["verify_s"])
            for n in sizes:
                verify[(b, n)] = 1000 * sorted(times[n][1])[len(times[n][1]) // 2]
            spec = [n for n in sizes if n > 1]
            if spec:
                d = sorted(x for n in spec for x in times[n][0])
                draft[b] = 1000 * d[len(d) // 2]
            else:
                draft[b] = 0.0
        finally:
            cyc.close()
    return BatchCosts(key=batch_key(model, head, depth, top_k), verify_ms=verify, draft_ms=draft, depth=depth, top_k=top_k)


def load_or_measure_batch(model, head, depth: int = 3, top_k: int = 2, remeasure: bool = False) -> BatchCosts:
    """The cached batch grid for this (model, head, dtype, device, threads, versions, tree shape)."""
    key = batch_key(model, head, depth, top_k)
    return _cached(_cache_path(key).replace(".json", "-batch.json"), key, BatchCosts.from_json,
                   lambda: measure_batch_costs(model, head, depth, top_k), "batch cost table", remeasure)[0]
