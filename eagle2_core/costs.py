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

from . import atomic, leanbody, rowgemm

# Every small size: row counts of one parity can cost more than the next larger one (oneDNN's
# few-row kernels measured 3 rows dearer than 4 and 7 dearer than 8 on an AVX2 Zen 3).
VERIFY_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
DRAFT_ROWS = (1, 2, 4, 8, 10)
LM_HEAD_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROFILE_VERSION = 8  # 2: lm_head alone by rows (decides greedy acceptance's lm_head plan and the default tree);
                     # 3: every size to 8, timed in interleaved rounds (median), so drift hits all sizes alike;
                     # 4: rowgemm's few-row products against linear by rows (row_products), measured first;
                     # 5: every kernel (linear, transposed, oneDNN packed) per weight shape and rows (products),
                     #    and the time to stream the weights once (stream_floor_ms)
                     # 7: our streaming kernel among them (rowgemm `stream`, native.py)
                     # 8: the streaming kernel prefetches the next weights while a tile computes (other costs)
CONTEXT = 64  # committed tokens in the cache while measuring: a typical short prompt


@dataclass
class CostProfile:
    key: dict
    verify_ms: dict[int, float]             # rows -> ms of one target forward over that many tree rows
    draft_ms: dict[int, float]              # rows -> ms of one draft step over that many nodes
    lm_head_ms: dict[int, float] = field(default_factory=dict)  # rows -> ms of the target's lm_head alone
    products: dict = field(default_factory=dict)  # {shape key: {rows: {kernel: ms}}} (rowgemm's candidates)
    stream_floor_ms: float | None = None    # reading every target weight once: what no verify can beat
    weight_bytes: int = 0                   # the target's weights, read by every forward
    measured_at: float = field(default_factory=time.time)

    @property
    def plan(self):
        """rowgemm's product plan from the measured kernels (product_plan)."""
        return product_plan(self.products)

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
        d["products"] = {c: {str(k): {kn: round(ms, 3) for kn, ms in v.items()} for k, v in by.items()} for c, by in self.products.items()}
        d["plan"] = self.plan.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostProfile":
        return cls(key=d["key"], verify_ms={int(k): float(v) for k, v in d["verify_ms"].items()},
                   draft_ms={int(k): float(v) for k, v in d["draft_ms"].items()},
                   lm_head_ms={int(k): float(v) for k, v in d.get("lm_head_ms", {}).items()}, measured_at=float(d.get("measured_at", 0)),
                   products={c: {int(k): {kn: float(ms) for kn, ms in v.items()} for k, v in by.items()} for c, by in d.get("products", {}).items()},
                   stream_floor_ms=d.get("stream_floor_ms"), weight_bytes=int(d.get("weight_bytes", 0)))


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

    from .target import TargetRunner

    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    w = model.get_output_embeddings().weight
    return {"version": PROFILE_VERSION, "model": hashlib.sha1(cfg.encode()).hexdigest()[:16], "dtype": str(w.dtype).replace("torch.", ""),
            "device": str(w.device), "device_name": _device_name(w.device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "body": _body_label(TargetRunner(model)),
            "head": None if head is None else f"{getattr(head, 'kind', 'eagle2')}:{head.spec.hidden_size}:{head_draft_rows(head)}"}


def _body_label(run) -> str:
    """Which target body the costs were measured on: the stock forward, the lean body's Python
    layer loop, or its native loop (built here on first use: leanbody.native_loop)."""
    if run.lean is None:
        return "stock"
    return "lean, native loop" if run.lean.native_ok and leanbody.native_loop() is not None else "lean"


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
    from .engine import Cycle, Slot
    from .events import GenerationSettings, StopChecker
    from .target import TargetRunner, text_config
    from .tree import batch_trees
    from .treesettings import TreeSettings

    run = TargetRunner(model)
    dev = run.device
    # First which kernel each product takes (rowgemm.py): every timing below runs under that plan,
    # with its packings made, as a generation will run.
    weights = product_weights(model, head)
    # EAGLE2_KERNEL forces one kernel: there is nothing to choose, so nothing to time
    products = {} if rowgemm.env_forced() else measure_products(weights, reps=reps)
    rowgemm.install_plan(product_plan(products))
    rowgemm.prepare(weights)
    stream, weight_bytes = stream_reader(model)
    # Stay inside the model's context: no position at or past max_position_embeddings is run
    # (a short-context model measures fewer tree sizes; the table extrapolates beyond them).
    context = min(CONTEXT, run.max_positions // 2)
    verify_rows = [n for n in verify_rows if context + n <= run.max_positions] or [1]
    ctx = torch.randint(0, min(1000, text_config(model.config).vocab_size),
                        (max(context, max(verify_rows)),), device=dev)
    # The engine's own cycle at batch 1, one random prompt of `context` tokens admitted: the
    # verify and the draft step below are the very functions a generation runs.
    cyc = Cycle(run, head, TreeSettings(total_tokens=2, depth=1, top_k=max(draft_rows)), 1, context + max(verify_rows) + 8)
    stop = StopChecker(GenerationSettings(max_new_tokens=8, eos_token_ids=()), None, set(), 1 << 30, context)
    with cyc.session():
        cyc.admit(0, ctx[:context].tolist(), Slot(key=0, stop=stop), lambda logits: 0)

        def verify_fn(n):
            depth, anc = batch_trees(torch.arange(-1, n - 1, device=dev)[None], n - 1)  # a chain: the mask shape does not change the cost

            def one():
                hidden, _ = cyc._forward(ctx[None, :n], depth, anc, cyc.seq_len)  # rewrites the same slots each time
                run.logits(hidden[0]).argmax(-1)
            return one

        # The stream floor in the same interleaved rounds as the verifies: on a VM whose speed
        # drifts by a fifth within minutes, their ratio is only meaningful measured side by side.
        verify = _timed({n: verify_fn(n) for n in verify_rows} | ({"floor": stream} if stream else {}), reps)
        floor_ms = verify.pop("floor", None)
        # lm_head alone, as acceptance applies it (the product plan's kernel)
        hid = torch.randn(max(LM_HEAD_ROWS), text_config(model.config).hidden_size, device=dev, dtype=run.dtype)
        lm_head = _timed({n: (lambda n=n: run.logits(hid[:n]).argmax(-1)) for n in LM_HEAD_ROWS}, reps)
        # One draft step over k nodes, with the prompt in the head's own cache.
        front = torch.zeros(1, max(draft_rows), head.spec.hidden_size, device=dev, dtype=head.fc.weight.dtype)

        def draft_fn(k):
            visible = torch.eye(k, dtype=torch.bool, device=dev)[None]

            def step():
                _, logp = cyc._head_step(ctx[None, :k], front[:, :k], cyc.head_len, 0, visible, cyc._view(k))
                torch.topk(logp, 4, dim=-1)
            return step

        draft = _timed({k: draft_fn(k) for k in draft_rows}, reps)
    return CostProfile(key=profile_key(model, head), verify_ms=verify, draft_ms=draft, lm_head_ms=lm_head, products=products,
                       stream_floor_ms=floor_ms, weight_bytes=weight_bytes)


# -- rowgemm's plan: which kernel each product takes, by weight shape and rows ---------------
PRODUCT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # rows timed (rowgemm.ROW_BUCKETS between them follow the next one up)
PACK_HINTS = (1, 16)          # oneDNN packings tried per shape; the plan keeps one (no second packing per row count)
SAMPLE_BYTES = 64 << 20       # weights of a shape timed per product: past the caches, streamed as a forward streams them
ROW_WIN = 0.97  # another kernel replaces linear only below this share of linear's time: a tie (one row on the
                # AVX-512 Zen 5 measured 33.1 vs 33.4 ms) stays with linear rather than flip with the noise


def product_weights(model, head) -> list[torch.Tensor]:
    """Every weight our forwards put through rowgemm: the target's CPU linears (body and
    lm_head) and the draft head's (with the fused q/k/v and gate/up its native draft step reads),
    each once (a tied lm_head is the embedding's tensor)."""
    from .target import TargetRunner

    run = TargetRunner(model)
    ws = run.lean.weights() if run.lean is not None else [m.weight for m in run.cpu_linears]
    if type(run.lm_head) is torch.nn.Linear:
        ws.append(run.lm_head.weight)
    if head is not None:
        ws += [m.weight for m in rowgemm.plain_linears(head)] + leanbody.head_weights(head)  # + its native step's fused copies
        try:  # an EAGLE-1/2 head scores with the target's lm_head (pruned or not) once bound to it
            extra = head.lm_head.weight if getattr(head, "kind", "") == "eagle3" else head.draft_lm_head
        except (AttributeError, TypeError):  # not bound to a target yet
            extra = None
        if isinstance(extra, torch.Tensor):
            ws.append(extra)
    seen, out = set(), []
    for w in ws:
        if id(w) not in seen and rowgemm.eligible(w):
            seen.add(id(w))
            out.append(w)
    return out


def measure_products(weights: list[torch.Tensor], rows=PRODUCT_ROWS, reps: int = 5) -> dict:
    """{shape key: {rows: {kernel: ms}}} for this machine: each distinct weight shape timed as a
    run of the model's own weights of that shape (up to SAMPLE_BYTES, so the product streams
    from memory as in a forward), by every kernel offered here: `linear`, `transposed`, `stream` where
    our native build exists and the shape fits it, and `packed@H` for each packing hint H where
    oneDNN's packed linear exists. Empty on GPUs."""
    groups: dict[str, list[torch.Tensor]] = {}
    for w in weights:
        if rowgemm.eligible(w):
            group = groups.setdefault(rowgemm.shape_key(w), [])
            if sum(x.numel() * x.element_size() for x in group) < SAMPLE_BYTES:
                group.append(w.detach())
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.no_grad():
        for key, ws in groups.items():
            x = torch.randn(max(rows), ws[0].shape[1], generator=g).to(ws[0].dtype)
            fns = {}
            for n in rows:
                fns[(n, "linear")] = lambda n=n, ws=ws: [F.linear(x[:n], w) for w in ws]
                fns[(n, "transposed")] = lambda n=n, ws=ws: [rowgemm.transposed_product(x[:n], w) for w in ws]
            if rowgemm.stream_fits(ws[0]) and rowgemm.have_stream():
                stream = rowgemm.native.module().stream_linear
                for n in rows:
                    fns[(n, "stream")] = lambda n=n, ws=ws: [stream(x[:n], w) for w in ws]
            if rowgemm.HAVE_PACKED:
                for h in PACK_HINTS:
                    ps = [rowgemm.pack(w, h) for w in ws]
                    for n in rows:
                        fns[(n, f"packed@{h}")] = lambda n=n, ps=ps: [rowgemm.packed_product(x[:n], p) for p in ps]
            ms = _timed(fns, reps)
            out[key] = {n: {k: t for (m, k), t in ms.items() if m == n} for n in rows}
    return out


def product_plan(products: dict) -> rowgemm.ProductPlan:
    """The plan from measured kernels: per shape, the one packing hint that does best over all
    row counts (by the sum of its ratios to the fastest), then per row count the fastest of
    linear, transposed, stream and that packing, linear keeping ties (ROW_WIN). Row buckets not timed
    follow the next timed count up."""
    kernels, hints = {}, {}
    for key, by_rows in products.items():
        rows = sorted(by_rows)
        packed = sorted({k for r in rows for k in by_rows[r] if k.startswith("packed@")}) if rowgemm.HAVE_PACKED else []
        best = {r: min(by_rows[r].values()) for r in rows}
        hint = min(packed, key=lambda k: sum(by_rows[r][k] / best[r] for r in rows)) if packed else None
        chosen = {}
        for r in rows:
            t = by_rows[r]
            cands = {k: t[k] for k in ("transposed", "stream") if k in t} | ({"packed": t[hint]} if hint else {})
            name = min(cands, key=cands.get)
            chosen[r] = name if cands[name] < ROW_WIN * t["linear"] else "linear"
        kernels[key] = {b: chosen[next((r for r in rows if r >= b), rows[-1])] for b in rowgemm.ROW_BUCKETS}
        if hint and "packed" in kernels[key].values():
            hints[key] = int(hint.split("@")[1])
    return rowgemm.ProductPlan(kernels, hints)


def packing_spread(products: dict, plan: rowgemm.ProductPlan) -> dict[str, float]:
    """Per packed shape, how far its one packing is from the best packing at any row count
    (1.05 = 5% slower somewhere): whether one packing serves all row counts."""
    out = {}
    for key, hint in plan.pack_hint.items():
        out[key] = max(t[f"packed@{hint}"] / min(v for k, v in t.items() if k.startswith("packed@")) for t in products[key].values())
    return out


def stream_reader(model):
    """(a function reading every target weight once, their bytes): each weight summed, a pure
    streaming read. A verify cannot beat it; how close verify gets is what the kernels are worth.
    The function is None off the CPU."""
    ps = {id(p): p for p in model.parameters()}
    ws = [p.detach() for p in ps.values() if p.is_floating_point()]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    if not ws or ws[0].device.type != "cpu":
        return None, nbytes
    return (lambda: [w.sum() for w in ws]), nbytes


def measure_stream_floor(model, reps: int = 5) -> tuple[float | None, int]:
    """(ms to read every target weight once, their bytes), timed alone."""
    fn, nbytes = stream_reader(model)
    return (_timed({"stream": fn}, reps)["stream"] if fn else None), nbytes


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
        atomic.clean_stale(path)
        atomic.write_text(path, json.dumps(table.to_json(), indent=1))  # two runs measuring at once: the last one wins, whole
    except OSError:
        pass  # a read-only cache only costs the measurement next time
    return table, False


def load_or_measure(model, head, remeasure: bool = False) -> CostProfile:
    """The cached profile for this (model, dtype, device, threads, versions), else a fresh one."""
    key = profile_key(model, head)
    prof, cached = _cached(_cache_path(key), key, CostProfile.from_json, lambda: measure_profile(model, head), "cost profile", remeasure)
    if cached:
        rowgemm.install_plan(prof.plan)  # a fresh measurement installed it already
        rowgemm.prepare(product_weights(model, head))
    return prof


# -- batches: verify ms for B sequences x N tree nodes, draft ms for B trees (engine.Cycle) ---------
# A prompt file can run B sequences per cycle. Whether rows of other sequences are cheaper than
# rows of a bigger tree (and whether drafting pays at all at batch B) is again a property of the
# machine, so the batched cycle itself is timed on a grid of (B, N) and cached like the profile.
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
BATCH_TREES = (1, 2, 3, 4, 6)
BATCH_MAX_ROWS = 96       # the grid stops at B x N rows beyond this (extrapolated linearly)
BATCH_CONTEXT = 96        # prompt tokens per sequence while timing
BATCH_VERSION = 2  # 2: timed on the one engine's cycle


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
    """Time the engine's cycle itself (engine.Cycle) at every (B, N) of the grid up to
    BATCH_MAX_ROWS rows: B random prompts of `context` tokens are admitted, then cycles are timed
    in interleaved rounds (median), drafting once per cycle where N > 1."""
    from .engine import Cycle, Slot
    from .events import GenerationSettings, StopChecker, Summary
    from .target import TargetRunner, context_length
    from .treesettings import TreeSettings

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
        cyc = Cycle(TargetRunner(model), head if n_top > 1 else None, TreeSettings(total_tokens=max(2, n_top), depth=depth, top_k=top_k), b,
                    context + 8 * (reps + 1) * len(sizes) + 8)
        with cyc.session():
            g = GenerationSettings(max_new_tokens=8 * (reps + 1) * len(sizes) + 8, eos_token_ids=())
            for i in range(b):
                ids = torch.randint(0, min(vocab, 1000), (context,), generator=gen).tolist()
                cyc.admit(i, ids, Slot(key=i, stop=StopChecker(g, None, set(), 1 << 30, context), summary=Summary()), lambda lg: int(lg.argmax(-1)[0]))
            times = {n: ([], []) for n in sizes}
            for r in range(reps + 1):
                for n in sizes:
                    cyc.n_max, cyc.speculative = n, n > 1 and cyc.hcache is not None
                    pairs = cyc.new_tokens
                    cyc.step()
                    if n == 1:  # a plain cycle leaves one-token rows; timing needs the next draft's shapes, not its pairs
                        cyc.new_tokens = pairs
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
    return BatchCosts(key=batch_key(model, head, depth, top_k), verify_ms=verify, draft_ms=draft, depth=depth, top_k=top_k)


def load_or_measure_batch(model, head, depth: int = 3, top_k: int = 2, remeasure: bool = False) -> BatchCosts:
    """The cached batch grid for this (model, head, dtype, device, threads, versions, tree shape)."""
    key = batch_key(model, head, depth, top_k)
    return _cached(_cache_path(key).replace(".json", "-batch.json"), key, BatchCosts.from_json,
                   lambda: measure_batch_costs(model, head, depth, top_k), "batch cost table", remeasure)[0]


# -- how many rows a prompt file gets: the batch size from the grid above ---------------------------

def prior_expected(head, n_max: int) -> list[float]:
    """Expected tokens per cycle for trees of 1 .. n_max nodes before any cycle is seen: a chain
    from the head's own evaluation (metadata `eval.acceptance_by_depth`), 1 for a random head, and
    a cautious guess otherwise. Only the batch-size plan uses it; cycles then choose trees by the
    draft's calibrated confidence."""
    meta = getattr(head, "metadata", None) or {}
    if head is None or meta.get("random"):
        return [1.0] * n_max
    rates = (meta.get("eval") or {}).get("acceptance_by_depth") or [0.5, 0.3, 0.2]
    out, reach = [1.0], 1.0
    for n in range(2, n_max + 1):
        if n - 1 <= len(rates):
            reach *= rates[n - 2]
            out.append(out[-1] + reach)
        else:
            out.append(out[-1] + 0.02)  # extra siblings: little, but not nothing
    return out


def plan(costs, n_prompts: int, prior: list[float], batch: int | None = None, tree: int | None = None):
    """(batch size, tree size, estimated tok/s table {(B, N): tok/s}) maximising tokens per second
    over the measured batch sizes up to the number of prompts (`batch` pins B) and trees 1 (plain)
    .. len(prior) (`tree` pins N): tok/s = B x E(N) / (verify(B, N) + draft(B) if N > 1)."""
    sizes = [b for b in costs.batches if b <= max(1, n_prompts)] or [1]
    if batch is not None:
        sizes = [batch]
    trees = [tree] if tree is not None else list(range(1, len(prior) + 1))
    table = {}
    for b in sizes:
        for n in trees:
            ms = costs.verify(b, n) + (costs.draft(b) if n > 1 else 0.0)
            table[(b, n)] = 1000.0 * b * prior[min(n, len(prior)) - 1] / ms
    best = max(table, key=table.get)
    return best[0], best[1], table
