"""Measuring the machine's costs (costs.py's tables) by running what a generation runs.

The cost profile times the decoding cycle's own verify and draft step (cycle.Cycle, at batch
1), every product kernel rowgemm may choose, and a read of every weight; the batch grid times
whole cycles at every (B, N). Each is cached per (model, head, dtype, device, threads,
versions). Above the cycle, below the engine: the engine measures on first need
(`load_or_measure`), and nothing here imports the engine.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings

import torch
import torch.nn.functional as F

from . import atomic, rowgemm
from .costs import (BATCH_CONTEXT, BATCH_MAX_ROWS, BATCH_SIZES, BATCH_TREES, CONTEXT, DRAFT_ROWS, LM_HEAD_ROWS, PACK_HINTS,
                    PRODUCT_ROWS, SAMPLE_BYTES, VERIFY_ROWS, BatchCosts, CostProfile, batch_key, product_plan, product_weights,
                    profile_key)
from .cycle import Cycle, Slot
from .events import GenerationSettings, StopChecker, Summary
from .target import TargetRunner, context_length, text_config
from .tree import batch_trees
from .treesettings import BATCH_DEPTH, BATCH_TOP_K, TreeSettings


PROBE_MS = 3000  # what the whole verify grid may take when asked for; past it, QUICK_* sizes
QUICK_VERIFY_ROWS = (1, 4, 16)
QUICK_DRAFT_ROWS = (1, 4, 10)
QUICK_CONTEXT = 4  # the prompt the quick probes verify after: its prefill is the probes' one warm-up


RECHECK_ROUNDS = 2  # further rounds of quick probes whose single timings contradict each other
RECHECK_SLACK = 1.25  # how far single timings may stray from the row counts' order before they are rechecked


def _timed(fns: dict, rounds: int, warm: bool = True, recheck: bool = False) -> dict:
    """Median ms of each function, timed in interleaved rounds (every function once per round),
    so that a slow stretch of a shared or throttling machine lands on all of them alike rather
    than on whichever size was being timed then. `warm` False: no warm-up call of each (the
    quick probes, whose caller warmed the path once). `recheck` (the quick probes, keyed by row
    count): where the timings contradict each other (`implausible`), RECHECK_ROUNDS more rounds
    and the least of each function's timings."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values() if warm else ():
        fn()  # warm-up
    times = {k: [] for k in fns}

    def timed_rounds(n):
        for _ in range(n):
            for k, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[k].append(time.perf_counter() - t0)

    timed_rounds(rounds)
    ms = {k: 1000 * sorted(t)[len(t) // 2] for k, t in times.items()}
    if recheck and implausible(ms):
        timed_rounds(RECHECK_ROUNDS)
        # other work on the machine only adds to a timing: the least is the one it touched least
        ms = {k: 1000 * min(t) for k, t in times.items()}
    return ms


def implausible(ms: dict) -> bool:
    """Whether timings keyed by row count contradict each other beyond RECHECK_SLACK: more rows
    taking less time than fewer, or more than their multiple of it (a forward's cost grows at
    most in proportion to its rows). A burst of other work during one single timing shows so."""
    sizes = sorted(k for k in ms if isinstance(k, int))
    return any(ms[m] > RECHECK_SLACK * ms[n] or ms[n] > RECHECK_SLACK * (n / m) * ms[m] for m, n in zip(sizes, sizes[1:]))


@torch.no_grad()
def measure_profile(model, head, verify_rows=VERIFY_ROWS, draft_rows=DRAFT_ROWS, reps: int = 5, quick: bool = False) -> CostProfile:
    """Time the target's tree forward (with lm_head over every row) and one draft step.

    `quick`: the few probes a first answer starts from (QUICK_* sizes, one timing each, the
    least of three where they contradict each other, after a prompt of QUICK_CONTEXT tokens, no
    stream floor), which the per-cycle budget then refines from the cycles' own timings (budget.BudgetChooser); `eagle2 tune` measures the whole grid."""
    run = TargetRunner(model)
    dev = run.device
    # First which kernel each product takes (rowgemm.py): every timing below runs under that plan,
    # with its packings made, as a generation will run.
    weights = product_weights(model, head)
    # EAGLE2_KERNEL forces one kernel: there is nothing to choose, so nothing to time
    # In int8 every product's kernel is fixed by the arithmetic (rowgemm._kernel): nothing to choose either
    products = {} if rowgemm.env_forced() or rowgemm.arithmetic() == "int8" else measure_products(weights, reps=reps)
    rowgemm.install_plan(product_plan(products))
    rowgemm.prepare(weights)
    stream, weight_bytes = stream_reader(model)
    # Stay inside the model's context: no position at or past max_position_embeddings is run
    # (a short-context model measures fewer tree sizes; the table extrapolates beyond them).
    context = min(QUICK_CONTEXT if quick else CONTEXT, run.max_positions // 2)
    if quick:
        verify_rows = [n for n in QUICK_VERIFY_ROWS if n in verify_rows] or [1]
        draft_rows = [k for k in QUICK_DRAFT_ROWS if k in draft_rows] or list(draft_rows)[:1]
        reps, stream = 1, None
    verify_rows = [n for n in verify_rows if context + n <= run.max_positions] or [1]
    ctx = torch.randint(0, min(1000, text_config(model.config).vocab_size),
                        (max(context, max(verify_rows)),), device=dev)
    # The decoding cycle itself at batch 1, one random prompt of `context` tokens admitted: the
    # verify and the draft step below are the very functions a generation runs.
    cyc = Cycle(run, head, TreeSettings(total_tokens=2, depth=1, top_k=max(draft_rows)), 1, context + max(verify_rows) + 8)
    stop = StopChecker(GenerationSettings(max_new_tokens=8, eos_token_ids=()), None, set(), 1 << 30, context)
    with cyc.session():
        cyc.admit(0, ctx[:context].tolist(), Slot(key=0, stop=stop), lambda logits: 0)

        def verify_fn(n):
            depth, anc = batch_trees(torch.arange(-1, n - 1, device=dev)[None], n - 1)  # a chain: the mask shape does not change the cost

            def one():
                cyc.verifier.tree_argmax(ctx[None, :n], depth, anc, cyc.rows.state.seq_len)  # rewrites the same cells each time
            return one

        # The stream floor in the same interleaved rounds as the verifies: on a VM whose speed
        # drifts within minutes, their ratio is only meaningful measured side by side.
        # A large target is probed at a few sizes (the table interpolates between them): the whole
        # grid would cost minutes before a first answer (a large target's verify is slow even at one row)
        lm_rows = LM_HEAD_ROWS
        if quick:
            lm_rows = tuple(n for n in LM_HEAD_ROWS if n in QUICK_VERIFY_ROWS)
        elif _timed({1: verify_fn(1)}, 1)[1] * len(verify_rows) * (reps + 1) > PROBE_MS:
            lm_rows = tuple(n for n in LM_HEAD_ROWS if n in QUICK_VERIFY_ROWS)
            verify_rows = [n for n in QUICK_VERIFY_ROWS if n in verify_rows] or [1]
            draft_rows = [k for k in QUICK_DRAFT_ROWS if k in draft_rows] or list(draft_rows)[:1]
            reps, stream = 2, None  # the stream floor (tune's figure) reads every weight: not before a first answer
        verify = _timed({n: verify_fn(n) for n in verify_rows} | ({"floor": stream} if stream else {}), reps, warm=not quick, recheck=quick)
        floor_ms = verify.pop("floor", None)
        # lm_head alone, as acceptance applies it (the product plan's kernel)
        hid = torch.randn(max(LM_HEAD_ROWS), text_config(model.config).hidden_size, device=dev, dtype=run.dtype)
        lm_head = _timed({n: (lambda n=n: run.logits(hid[:n]).argmax(-1)) for n in lm_rows}, reps, warm=not quick, recheck=quick)
        # One draft step over k nodes, with the prompt in the head's own cache (none without a head:
        # head-free sources draft on the host, and the chooser learns that time from real cycles).
        if head is None:
            return CostProfile(key=profile_key(model, head), verify_ms=verify, draft_ms={}, lm_head_ms=lm_head, products=products,
                               stream_floor_ms=floor_ms, weight_bytes=weight_bytes, quick=quick)
        front = torch.zeros(1, max(draft_rows), head.spec.hidden_size, device=dev, dtype=head.fc.weight.dtype)

        def draft_fn(k):
            visible = torch.eye(k, dtype=torch.bool, device=dev)[None]

            def step():
                _, logp = cyc.drafter.head_step(ctx[None, :k], front[:, :k], cyc.rows.state.head_len, 0, visible, cyc.rows.span(k))
                torch.topk(logp, 4, dim=-1)
            return step

        draft = _timed({k: draft_fn(k) for k in draft_rows}, reps, warm=not quick, recheck=quick)
    return CostProfile(key=profile_key(model, head), verify_ms=verify, draft_ms=draft, lm_head_ms=lm_head, products=products,
                       stream_floor_ms=floor_ms, weight_bytes=weight_bytes, quick=quick)


def measure_products(weights: list[torch.Tensor], rows=PRODUCT_ROWS, reps: int = 5) -> dict:
    """{shape key: {rows: {kernel: ms}}} for this machine: each distinct weight shape timed as a
    run of the model's own weights of that shape (up to SAMPLE_BYTES, so the product streams
    from memory as in a forward), by every kernel offered here: `linear`, `transposed`, `stream` where
    our native build exists and the shape fits it, and `packed@H` for each packing hint H where
    oneDNN's packed linear exists. Empty on GPUs."""
    groups: dict[str, list[torch.Tensor]] = {}
    blocks: dict[str, list] = {}  # the same weights' GGUF blocks, where they have them (a detached tensor has none)
    floatless: set[str] = set()  # shapes whose weights are held as blocks only
    for w in weights:
        if rowgemm.eligible(w):
            key = rowgemm.shape_key(w)
            group = groups.setdefault(key, [])
            if sum(x.numel() * x.element_size() for x in group) < SAMPLE_BYTES:
                group.append(w.detach())
                blocks.setdefault(key, []).append(rowgemm.blocks_of(w))
                if rowgemm.floatless(w):
                    floatless.add(key)
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.no_grad():
        for key, ws in groups.items():
            x = torch.randn(max(rows), ws[0].shape[1], generator=g).to(ws[0].dtype)
            fns = {}
            if key in floatless:  # held as blocks only: the block kernel is the one choice (timed for the table)
                block = rowgemm.native.module().block_linear
                for n in rows:
                    fns[(n, "block")] = lambda n=n, bws=blocks[key]: [block(x[:n], b.blocks, b.qtype) for b in bws]
                ms = _timed(fns, reps)
                out[key] = {n: {k: t for (m, k), t in ms.items() if m == n} for n in rows}
                continue
            for n in rows:
                fns[(n, "linear")] = lambda n=n, ws=ws: [F.linear(x[:n], w) for w in ws]
                fns[(n, "transposed")] = lambda n=n, ws=ws: [rowgemm.transposed_product(x[:n], w) for w in ws]
            if rowgemm.stream_fits(ws[0]) and rowgemm.have_stream():
                stream = rowgemm.native.module().stream_linear
                for n in rows:
                    fns[(n, "stream")] = lambda n=n, ws=ws: [stream(x[:n], w) for w in ws]
            bws = blocks[key]
            if all(b is not None for b in bws) and rowgemm.have_stream() and ws[0].dtype == torch.float32:
                block = rowgemm.native.module().block_linear
                for n in rows:
                    fns[(n, "block")] = lambda n=n, bws=bws: [block(x[:n], b.blocks, b.qtype) for b in bws]
            if rowgemm.HAVE_PACKED:
                for h in PACK_HINTS:
                    ps = [rowgemm.pack(w, h) for w in ws]
                    for n in rows:
                        fns[(n, f"packed@{h}")] = lambda n=n, ps=ps: [rowgemm.packed_product(x[:n], p) for p in ps]
            ms = _timed(fns, reps)
            out[key] = {n: {k: t for (m, k), t in ms.items() if m == n} for n in rows}
    return out


def stream_reader(model):
    """(a function reading every target weight once, their bytes): each weight summed, a pure
    streaming read. A verify cannot beat it; how close verify gets is what the kernels are worth.
    The function is None off the CPU."""
    ps = {id(p): p for p in model.parameters()}
    # a weight held as blocks only (rowgemm.make_floatless) is read as its blocks: its resident bytes
    ws = [rowgemm.blocks_of(p).blocks if rowgemm.floatless(p) else p.detach() for p in ps.values() if p.is_floating_point()]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    if not ws or ws[0].device.type != "cpu":
        return None, nbytes
    return (lambda: [w.sum() for w in ws]), nbytes


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


def load_or_measure(model, head, remeasure: bool = False, quick: bool = False) -> CostProfile:
    """The cached profile for this (model, dtype, device, threads, versions), else a fresh one:
    the whole grid, or with `quick` (what a command measures before its first answer) the quick
    probes alone (measure_profile). Either kind, once cached, serves both."""
    key = profile_key(model, head)
    prof, cached = _cached(_cache_path(key), key, CostProfile.from_json, lambda: measure_profile(model, head, quick=quick),
                           "cost profile", remeasure)
    if cached:
        rowgemm.install_plan(prof.plan)  # a fresh measurement installed it already
        rowgemm.prepare(product_weights(model, head))
    return prof


@torch.no_grad()
def measure_batch_costs(model, head, depth: int = BATCH_DEPTH, top_k: int = BATCH_TOP_K, batches=BATCH_SIZES, trees=BATCH_TREES,
                        reps: int = 3, context: int = BATCH_CONTEXT) -> BatchCosts:
    """Time the decoding cycle itself (cycle.Cycle) at every (B, N) of the grid up to
    BATCH_MAX_ROWS rows: B random prompts of `context` tokens are admitted, then cycles are timed
    in interleaved rounds (median), drafting once per cycle where N > 1."""
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
                    last = cyc.step_at_size(n)
                    if r:  # round 0 warms up
                        times[n][0].append(last["draft_s"])
                        times[n][1].append(last["verify_s"])
            for n in sizes:
                verify[(b, n)] = 1000 * sorted(times[n][1])[len(times[n][1]) // 2]
            spec = [n for n in sizes if n > 1]
            if spec:
                d = sorted(x for n in spec for x in times[n][0])
                draft[b] = 1000 * d[len(d) // 2]
            else:
                draft[b] = 0.0
    return BatchCosts(key=batch_key(model, head, depth, top_k), verify_ms=verify, draft_ms=draft, depth=depth, top_k=top_k)


def load_or_measure_batch(model, head, depth: int = BATCH_DEPTH, top_k: int = BATCH_TOP_K, remeasure: bool = False) -> BatchCosts:
    """The cached batch grid for this (model, head, dtype, device, threads, versions, tree shape)."""
    key = batch_key(model, head, depth, top_k)
    return _cached(_cache_path(key).replace(".json", "-batch.json"), key, BatchCosts.from_json,
                   lambda: measure_batch_costs(model, head, depth, top_k), "batch cost table", remeasure)[0]


