"""The machine's cost model: what a verify of n tree rows, a draft step over k nodes and a
batched cycle cost here, as measured (measure.py), and the choices made from them.

What a tree should look like depends on how a product of n rows costs against one row, and
that differs by CPU (AVX2, AVX-512, AMX), dtype, thread count, library version and GPU. So it is
measured, once per (model, dtype, device, threads, versions), in a few seconds, and cached as
JSON under the cache folder; `eagle2 tune` measures again and prints it. This module holds the
tables, their keys and the pure decisions on them (rowgemm's product plan, the batch-size plan);
the timing itself, which runs the decoding cycle, is measure.py's, a module above the cycle.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field

import torch

from . import leanbody, native, rowgemm
from .treesettings import BATCH_DEPTH, BATCH_TOP_K

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
    quick: bool = False                     # the quick probes only (measure.py), not the whole grid

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
        if not self.draft_ms:  # measured with no head: nothing to widen
            return 1
        best = min(self.draft_ms.values())
        return max(k for k, ms in self.draft_ms.items() if ms <= slack * best)

    def draft_step_ms(self, rows: int) -> float:
        """ms of one head step over `rows` nodes (0 where no head was measured: head-free sources draft on the host)."""
        if not self.draft_ms:
            return 0.0
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
                   stream_floor_ms=d.get("stream_floor_ms"), weight_bytes=int(d.get("weight_bytes", 0)), quick=bool(d.get("quick", False)))


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
            "body": _body_label(TargetRunner(model)), "kernels": native.source_digest(), "arithmetic": rowgemm.arithmetic(),
            "blocks": sorted({b.type_name for b in map(rowgemm.blocks_of, model.parameters()) if b is not None})
                      + (["floatless"] if any(map(rowgemm.floatless, model.parameters())) else []),
            "head": None if head is None else f"{getattr(head, 'kind', 'eagle2')}:{head.spec.hidden_size}:{head_draft_rows(head)}"
                                              + (":blocks" if any(map(rowgemm.floatless, head.parameters())) else "")}


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


# -- rowgemm's plan: which kernel each product takes, by weight shape and rows ---------------
PRODUCT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # rows timed (rowgemm.ROW_BUCKETS between them follow the next one up)
PACK_HINTS = (1, 16)          # oneDNN packings tried per shape; the plan keeps one (no second packing per row count)
SAMPLE_BYTES = 64 << 20       # weights of a shape timed per product: past the caches, streamed as a forward streams them
ROW_WIN = 0.97  # another kernel replaces linear only below this share of linear's time: a near tie (docs/benchmarks.md)
                # stays with linear rather than flip with the noise
PACK_WIN = 0.75  # a packing is a second float32 copy of its weight, kept for the process: the plan runs one only
                 # where it takes at most this share of the best unpacked kernel's time: a small gain on
                 # a prefill's rows alone (SmolLM2's draft head, docs/benchmarks.md) does not pay for a copy
                 # that pushes a chat past its memory target


def product_weights(model, head) -> list[torch.Tensor]:
    """Every weight our forwards put through rowgemm: the target's CPU linears (body and
    lm_head) and the draft head's (with the fused q/k/v and gate/up its native draft step reads),
    each once (a tied lm_head is the embedding's tensor)."""
    from .target import TargetRunner

    run = TargetRunner(model)
    ws = run.lean.weights() if run.lean is not None else [m.weight for m in run.cpu_linears]
    if type(run.lm_head) in rowgemm.PLAIN_LINEARS:
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


def product_plan(products: dict, packing: bool = True) -> rowgemm.ProductPlan:
    """The plan from measured kernels: per shape, the one packing hint that does best over all
    row counts (by the sum of its ratios to the fastest), then per row count the fastest of
    linear, transposed, stream, block (GGUF weights) and that packing, linear keeping ties (ROW_WIN) and the
    packing taken only where it clearly pays for its memory (PACK_WIN). Row buckets not timed
    follow the next timed count up. Packings are timed only where they ran; whether they run in
    this process is asked only of a plan that takes one (the probe loads oneDNN: rowgemm.have_packed)."""
    kernels, hints = {}, {}
    for key, by_rows in products.items():
        rows = sorted(by_rows)
        packed = sorted({k for r in rows for k in by_rows[r] if k.startswith("packed@")}) if packing else []
        best = {r: min(by_rows[r].values()) for r in rows}
        hint = min(packed, key=lambda k: sum(by_rows[r][k] / best[r] for r in rows)) if packed else None
        chosen = {}
        for r in rows:
            t = by_rows[r]
            cands = {k: t[k] for k in ("transposed", "stream", "block") if k in t}
            unpacked = [v for k, v in t.items() if not k.startswith("packed")]
            if hint and (not unpacked or t[hint] < PACK_WIN * min(unpacked)):
                cands["packed"] = t[hint]
            name = min(cands, key=cands.get)
            chosen[r] = name if "linear" not in t or cands[name] < ROW_WIN * t["linear"] else "linear"  # blocks only: no linear
        kernels[key] = {b: chosen[next((r for r in rows if r >= b), rows[-1])] for b in rowgemm.ROW_BUCKETS}
        if hint and "packed" in kernels[key].values():
            hints[key] = int(hint.split("@")[1])
    if hints and not rowgemm.have_packed():
        return product_plan(products, packing=False)
    return rowgemm.ProductPlan(kernels, hints)


def packing_spread(products: dict, plan: rowgemm.ProductPlan) -> dict[str, float]:
    """Per packed shape, how far its one packing is from the best packing at any row count
    (1.05 = 5% slower somewhere): whether one packing serves all row counts."""
    out = {}
    for key, hint in plan.pack_hint.items():
        out[key] = max(t[f"packed@{hint}"] / min(v for k, v in t.items() if k.startswith("packed@")) for t in products[key].values())
    return out


# -- batches: verify ms for B sequences x N tree nodes, draft ms for B trees (cycle.Cycle) ----------
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
    depth: int = BATCH_DEPTH                  # the trees' expansion the grid was measured at
    top_k: int = BATCH_TOP_K
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
                   depth=int(d.get("depth", BATCH_DEPTH)), top_k=int(d.get("top_k", BATCH_TOP_K)), measured_at=float(d.get("measured_at", 0)))


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

