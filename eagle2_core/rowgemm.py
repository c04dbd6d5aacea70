"""`x @ weight.T` for the handful of rows a draft tree puts through a product, at memory speed.

Speculative decoding turns one-row products (a plain decoding step) into few-row ones: the
verify pass has one row per tree node, each draft step one row per expanded node. EAGLE-2's
dynamic tree (section 4) pays only where a few more rows cost little more than one, and on CPUs
the default `F.linear` is far from that: fp32 GEMM goes to MKL, whose few-row paths ran at a
fraction of the memory's bandwidth on AMD EPYCs (docs/benchmarks.md). torch itself ships
faster kernels for the same product, so which one runs is a *plan*, measured per machine:

- `linear`: `F.linear`, what Hugging Face `generate` runs.
- `transposed`: `W @ x.T`, a tall-skinny product that streams W once (MKL's other path).
- `packed`: oneDNN's linear on a weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight`, the op inductor's weight prepacking emits). Private ops:
  probed at first use (`have_packed`); the plan never offers them where they are missing or fail.
- `stream`: our own kernel (csrc/products.cpp, built for the machine by native.py): the weight
  streamed once in its own layout (no copy), the next block prefetched while a tile of up to 24
  accumulators computes on the current one; each output's sum in a
  fixed order, so a row's result does not depend on the other rows. Offered where the build
  works and the weight fits it (contiguous, rows a multiple of 16 values, 32 in bfloat16).

The plan (`ProductPlan`) gives a kernel per weight shape, dtype and row bucket, measured by
the cost profile (measure.measure_products) and installed here; every packing is made once, at
load (`prepare`), with one packing per weight whatever the rows. Until a plan is installed every
product is `linear`. `EAGLE2_KERNEL=linear|transposed|packed` forces one kernel everywhere
(tests run each in turn; also a way to rule kernels out when chasing a difference).

Only the order of the additions changes, as it does between any one-row and multi-row product
(README: what "identical" means). GPUs, other dtypes and training keep `linear`.
"""
from __future__ import annotations

import functools
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import native

KERNELS = ("linear", "transposed", "packed", "stream", "block")  # "int8" is the arithmetic's, never the plan's
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a product of r rows follows the first bucket >= r
DTYPES = (torch.float32, torch.bfloat16)


def _probe_packed() -> bool:
    """Whether this torch build has oneDNN's packed linear and it runs (a private op may go)."""
    try:
        mk = torch.ops.mkldnn
        if not (torch.backends.mkldnn.is_available() and hasattr(mk, "_reorder_linear_weight") and hasattr(mk, "_linear_pointwise")):
            return False
        w = torch.randn(8, 16)
        x = torch.randn(2, 16)
        got = mk._linear_pointwise(x, mk._reorder_linear_weight(w, 2), None, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w), rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - any failure means: not offered
        return False


def have_packed() -> bool:
    """Whether `packed` is offered here: probed at the first ask, not at import. The probe runs
    oneDNN, whose code pages stay resident once touched and a plan without packed products never needs."""
    got = globals().get("HAVE_PACKED")
    if got is None:
        got = globals()["HAVE_PACKED"] = _probe_packed()
    return got


def __getattr__(name: str):
    if name == "HAVE_PACKED":  # `rowgemm.HAVE_PACKED`: the probe's answer, made on first read
        return have_packed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def have_stream() -> bool:
    """Whether our streaming kernel is built here (native.py; building it on first ask)."""
    return native.module() is not None


def stream_fits(weight: torch.Tensor) -> bool:
    """Whether the streaming kernel takes this weight (its layout and row length)."""
    step = 16 if weight.dtype == torch.float32 else 32
    return eligible(weight) and weight.is_contiguous() and weight.shape[1] % step == 0


def _offered(kernel: str) -> bool:
    return kernel in KERNELS and (kernel != "packed" or have_packed()) and (kernel not in ("stream", "block") or have_stream())


def shape_key(weight: torch.Tensor) -> str:
    """The plan's key of a weight: "out x in dtype", e.g. "576x1536 float32", and its GGUF block
    type where blocks of it are at hand ("576x1536 float32 Q4_1": each type measures apart)."""
    bw = blocks_of(weight)
    return _key(weight.shape[0], weight.shape[1], weight.dtype, bw.type_name if bw is not None else "")


@functools.lru_cache(maxsize=None)
def _key(out_features: int, in_features: int, dtype: torch.dtype, blocks: str = "") -> str:
    # cached: every product of every forward asks, and a handful of shapes exist
    return f"{out_features}x{in_features} {str(dtype).replace('torch.', '')}" + (f" {blocks}" if blocks else "")


def bucket(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= rows), ROW_BUCKETS[-1])


@dataclass(frozen=True)
class ProductPlan:
    """{shape key: {row bucket: kernel}} and, per shape that packs, the row count its one
    packing was made for (oneDNN's batch-size hint). `everywhere`: one kernel for every shape
    and row count instead (EAGLE2_KERNEL; tests force each kernel in turn)."""
    kernels: dict = field(default_factory=dict)
    pack_hint: dict = field(default_factory=dict)
    everywhere: str | None = None

    def kernel(self, rows: int, weight: torch.Tensor) -> str:
        if self.everywhere:
            return self.everywhere
        by_rows = self.kernels.get(shape_key(weight))
        return by_rows.get(bucket(rows), "linear") if by_rows else "linear"

    def packs(self, key: str) -> bool:
        if self.everywhere:
            return self.everywhere == "packed"
        return any(k == "packed" for k in self.kernels.get(key, {}).values())

    def describe(self) -> str:
        """One line per shape: which kernel at which rows ("1-4 packed, 6-64 linear")."""
        if self.everywhere:
            return f"{self.everywhere} everywhere (forced)"
        lines = []
        for key, by_rows in sorted(self.kernels.items()):
            spans, start = [], None
            rows = sorted(by_rows)
            for i, r in enumerate(rows):
                start = r if start is None else start
                if i + 1 == len(rows) or by_rows[rows[i + 1]] != by_rows[r]:
                    spans.append(f"{start}{'' if start == r else f'-{r}'} {by_rows[r]}")
                    start = None
            lines.append(f"{key}: {', '.join(spans)}")
        return "\n".join(lines) or "linear everywhere (nothing measured)"

    def to_json(self) -> dict:
        return {"kernels": {k: {str(r): v for r, v in by.items()} for k, by in self.kernels.items()}, "pack_hint": dict(self.pack_hint)}

    @classmethod
    def from_json(cls, d: dict) -> "ProductPlan":
        """A stored plan; a choice this machine cannot run reads as linear (a private op gone, no build)."""
        kernels = {k: {int(r): (v if _offered(v) else "linear") for r, v in by.items()}
                   for k, by in (d or {}).get("kernels", {}).items()}
        return cls(kernels, {k: int(v) for k, v in (d or {}).get("pack_hint", {}).items()})


def forced(kernel: str) -> ProductPlan:
    """A plan that takes `kernel` for every shape and row count."""
    if kernel not in KERNELS:
        raise ValueError(f"EAGLE2_KERNEL: unknown kernel {kernel!r}; choose from {', '.join(KERNELS)} or measured")
    if kernel == "packed" and not have_packed():
        raise ValueError("EAGLE2_KERNEL=packed: this torch build has no oneDNN packed linear")
    if kernel in ("stream", "block") and not have_stream():
        raise ValueError(f"EAGLE2_KERNEL={kernel}: eagle2's native code is {native.status()}")
    return ProductPlan(everywhere=kernel)


def env_forced() -> ProductPlan | None:
    name = os.environ.get("EAGLE2_KERNEL", "").strip().lower()
    return forced(name) if name and name != "measured" else None


PLAN: ProductPlan = ProductPlan()  # nothing measured yet: `linear` everywhere
EPOCH = 0  # bumped whenever packings are made or dropped: choices cached from them are stale
# id(weight) -> (weak reference to it, its _version when packed, the packing): made by `prepare`
# only, never on the fly, so a temporary weight (a dtype cast) cannot make a packing per call.
# The weak reference tells a reused id from the weight it was made for.
_PACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


# id(weight) -> (weak reference to it, its _version, ggufblocks.BlockWeight): GGUF blocks that
# hold exactly this float32 weight (loading attaches them for GGUF targets; the block kernel
# rebuilds the weight's bits from them). Kept beside the weight, as packings are.
_BLOCKS: dict[int, tuple[weakref.ref, int, object]] = {}


def attach_blocks(weight: torch.Tensor, blocks) -> None:
    """Record that `blocks` (ggufblocks.BlockWeight) dequantize to `weight`'s exact values."""
    _BLOCKS[id(weight)] = (weakref.ref(weight), weight._version, blocks)


def blocks_of(weight: torch.Tensor):
    """The GGUF blocks of this very weight, or None (another tensor, or changed since)."""
    got = _BLOCKS.get(id(weight))
    if got is None or got[0]() is not weight or got[1] != weight._version:
        return None
    return got[2]


# -- weights held only as blocks (no resident float32 copy) ---------------------------
# A weight whose blocks are all that is kept: its tensor becomes a stand-in of the same shape and
# dtype over one NaN (stride 0, no storage to speak of), so shapes, devices and dtypes read as
# before while any product that missed the blocks comes out NaN rather than plausible. Every
# product of ours takes the block kernel for it; a module outside our forwards (Hugging Face
# `generate`, the divergence measurements) rebuilds the float32 weight in scratch and runs
# `F.linear` over it: the very values transformers holds, so `generate` keeps its own bits.
_FLOATLESS: dict[int, weakref.ref] = {}


def stand_in(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] tensor without the memory: one NaN, expanded."""
    return torch.full((1, 1), float("nan")).expand(rows, cols)


def make_floatless(weight: torch.Tensor, blocks) -> None:
    """Drop `weight`'s float32 values (a Parameter keeps its identity: its data becomes a stand-in)
    and keep `blocks`, which rebuild them, as its only copy."""
    if not _is_stand_in(weight):
        weight.data = stand_in(*weight.shape)
    _FLOATLESS[id(weight)] = weakref.ref(weight)
    attach_blocks(weight, blocks)


def make_floatful(weight: torch.Tensor) -> None:
    """Undo make_floatless: the float32 values rebuilt from the blocks (kept beside them)."""
    if floatless(weight):
        weight.data = rebuilt(weight).clone()
    _FLOATLESS.pop(id(weight), None)


def _is_stand_in(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (0, 0) and weight.numel() > 1


def floatless(weight: torch.Tensor) -> bool:
    """Whether `weight` is held only as blocks (make_floatless)."""
    got = _FLOATLESS.get(id(weight))
    return got is not None and got() is weight and _is_stand_in(weight)


REBUILD = {"seconds": 0.0}  # time spent rebuilding float32 weights for modules outside our forwards
_SCRATCH: dict = {}  # "buf": the float32 scratch rebuilt weights live in, kept while `rebuild_scratch` is open


@contextmanager
def rebuild_scratch():
    """Keep one scratch buffer for rebuilt weights inside the block (a `generate` call rebuilds every
    weight every step), freed after it."""
    depth = _SCRATCH.get("depth", 0)
    _SCRATCH["depth"] = depth + 1
    try:
        yield
    finally:
        _SCRATCH["depth"] = depth
        if depth == 0 and _SCRATCH.pop("buf", None) is not None:
            trim_heap()


def rebuilt(weight: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 values of a floatless weight (its rows [a, b) where given), rebuilt from its
    blocks (bitwise gguf-py's dequantization for GGUF types; scale * q for eagle2's 8-bit)."""
    import time

    bw = blocks_of(weight)
    t0 = time.perf_counter()
    blocks = bw.blocks if rows is None else bw.blocks[rows[0]: rows[1]]
    n = blocks.shape[0] * bw.in_features
    out = None
    if _SCRATCH.get("depth"):
        buf = _SCRATCH.get("buf")
        if buf is None or buf.numel() < n:
            buf = _SCRATCH["buf"] = torch.empty(n)
        out = buf[:n].view(blocks.shape[0], bw.in_features)
    w = native.module().block_rows(blocks, bw.qtype, bw.in_features, None, out)
    REBUILD["seconds"] += time.perf_counter() - t0
    return w


CHUNK_ROWS = 2048  # a rebuilt weight of more rows runs F.linear in chunks of these, where that keeps its bits
_CHUNKS_KEEP_BITS: dict[tuple[int, int], bool] = {}


def chunks_keep_bits(in_features: int, tail: int) -> bool:
    """Whether `F.linear` over chunks of CHUNK_ROWS rows (and a last one of `tail`) gives, on this
    machine, the very bits of one `F.linear` over the whole weight: each output is its own dot
    product, so a BLAS may well, but nothing promises it (MKL here keeps them for chunks of 2048
    or 4096 rows and not for chunks of 7281). Measured once per (row length, tail) on a random weight of
    two chunks and the tail, at 1, 3 and 8 input rows."""
    got = _CHUNKS_KEEP_BITS.get((in_features, tail))
    if got is None:
        g = torch.Generator().manual_seed(0)
        n = 2 * CHUNK_ROWS + tail
        w = torch.randn(n, in_features, generator=g)
        got = True
        for m in (1, 3, 8):
            x = torch.randn(1, m, in_features, generator=g)
            whole = F.linear(x, w)
            got = got and torch.equal(whole, torch.cat([F.linear(x, w[i: i + CHUNK_ROWS]) for i in range(0, n, CHUNK_ROWS)], -1))
        _CHUNKS_KEEP_BITS[(in_features, tail)] = got
        del w, x, whole
        trim_heap()
    return got


def chunked(weight: torch.Tensor) -> bool:
    """Whether `rebuilt_linear` multiplies this weight a chunk of rows at a time. Loading asks it
    of every floatless weight, so that the check's own memory (a random weight of two chunks and
    its products) is taken while the model's working memory is not,
    rather than on top of the first `generate`'s."""
    out_f, in_f = weight.shape
    return out_f > 2 * CHUNK_ROWS and chunks_keep_bits(in_f, out_f % CHUNK_ROWS)


def rebuilt_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` over a floatless weight's rebuilt floats: what transformers computes with the
    float32 weight resident. A large weight (a vocabulary's lm_head) is rebuilt and multiplied a
    chunk of rows at a time where that keeps the bits (chunks_keep_bits): its whole float32 copy
    would be the largest thing in memory."""
    out_f, step = weight.shape[0], CHUNK_ROWS
    if not chunked(weight):
        return F.linear(x, rebuilt(weight).to(x.dtype), bias)
    return torch.cat([F.linear(x, rebuilt(weight, (a, min(out_f, a + step))).to(x.dtype), None if bias is None else bias[a: a + step])
                      for a in range(0, out_f, step)], -1)


def floatless_rows(weight: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """A weight for a product over some of `weight`'s rows (all: None), keeping its blocks: a
    floatless weight gives a floatless one (its rows of blocks), a weight with blocks its float rows
    with those blocks attached, any other its rows (`index_select`)."""
    bw = blocks_of(weight)
    if bw is None:
        return weight.detach() if index is None else weight.detach().index_select(0, index).contiguous()
    from .ggufblocks import BlockWeight

    sub = bw if index is None else BlockWeight(bw.blocks.index_select(0, index.to(bw.blocks.device)).contiguous(), bw.qtype,
                                                bw.type_name, bw.in_features)
    if floatless(weight):
        out = stand_in(sub.out_features, sub.in_features)
        make_floatless(out, sub)
        return out
    out = weight.detach() if index is None else weight.detach().index_select(0, index).contiguous()
    attach_blocks(out, sub)
    return out


@contextmanager
def float32_weights():
    """Inside the block every weight held as blocks only has its float32 values back (rebuilt,
    bitwise the dequantized weights) and the plan is the float32 stream kernel everywhere:
    eagle2's float32 path, beside the blocks, in the same process (`compare --against
    plain-float32`). After it the weights are blocks only again. Costs the float32 model's
    memory while it lasts (the fused q/k/v and gate/up twice)."""
    ws = [w for w in (ref() for ref in list(_FLOATLESS.values())) if w is not None and floatless(w)]
    kept = [(w, blocks_of(w)) for w in ws]
    try:
        with torch.no_grad():
            for w, bw in kept:
                w.data = native.module().block_rows(bw.blocks, bw.qtype, bw.in_features, None, None)
                attach_blocks(w, bw)
        with using_plan(forced("stream")), using_arithmetic("exact"):
            yield
    finally:
        with torch.no_grad():
            for w, bw in kept:
                make_floatless(w, bw)
        trim_heap()


def float_rows(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The float values of some rows of `weight`, rebuilt from its blocks if it is held as blocks only."""
    if not floatless(weight):
        return weight.detach().index_select(0, index)
    bw = blocks_of(weight)
    return native.module().block_rows(bw.blocks, bw.qtype, bw.in_features, index, None)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing):
    after the load's many medium allocations (blocks read, stacked, dropped floats) the freed
    ones would otherwise stay resident."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class FloatlessLinear(nn.Linear):
    """An `nn.Linear` whose weight is held as blocks only: outside our forwards (which read the
    blocks through `linear_rows`) it runs `F.linear` over the rebuilt float32 weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if floatless(self.weight):
            return rebuilt_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class FloatlessEmbedding(nn.Embedding):
    """An `nn.Embedding` whose table is held as blocks only: a lookup rebuilds just the rows asked for
    (the same floats `F.embedding` would copy out of the float32 table)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not floatless(self.weight):
            return super().forward(ids)
        bw = blocks_of(self.weight)
        rows = native.module().block_rows(bw.blocks, bw.qtype, bw.in_features, ids.reshape(-1), None)
        return rows.view(*ids.shape, bw.in_features)


_EMBEDDING_KINDS: dict[type, type] = {}


def floatless_embedding_kind(cls: type) -> type:
    """The Floatless kind of an embedding class: FloatlessEmbedding for `nn.Embedding`, and for a
    subclass (Gemma 3 scales its lookup) the subclass over FloatlessEmbedding, so its own forward's
    `super().forward` rebuilds the rows (loading.drop_floats checks that it does)."""
    if cls is nn.Embedding:
        return FloatlessEmbedding
    if cls not in _EMBEDDING_KINDS:
        _EMBEDDING_KINDS[cls] = type(f"Floatless{cls.__name__}", (cls, FloatlessEmbedding), {})
    return _EMBEDDING_KINDS[cls]


# -- the arithmetic of the products over blocks -------------------------------------------------
# "exact": a block weight's product is bitwise the float32 product over its dequantized values
# (the model transformers loads). "int8": each activation row is quantized to 8 bits once per
# product and multiplied in integers (csrc/int8.cpp), as llama.cpp does, several times cheaper
# per row; every product then takes a row-invariant kernel (int8 over blocks, the float32 stream
# kernel over float weights), so a row's result is the same whatever the other rows and speculation
# stays bitwise equal to plain decoding in that arithmetic. Process-wide: one target per process.
ARITHMETICS = ("int8", "exact")
ARITHMETIC = {"name": "exact"}


def int8_known(qtype: int) -> bool:
    """Whether the int8 kernel takes this block type (built here and written for it)."""
    mod = native.module()
    return mod is not None and hasattr(mod, "int8_type_known") and bool(mod.int8_type_known(qtype))


def have_int8() -> bool:
    """Whether int8 kernels are built here (native code with csrc/int8.cpp)."""
    mod = native.module()
    return mod is not None and hasattr(mod, "int8_linear")


TILED = 256  # qtype | TILED: the int8 kernel reads the weight's interleaved copy (csrc/int8.cpp)


def _int8_operand(bw) -> tuple[int, torch.Tensor]:
    """(type code, tensor) the int8 kernel reads for these blocks: the interleaved copy where there is one."""
    return (bw.qtype | TILED, bw.tiled) if bw.tiled is not None else (bw.qtype, bw.blocks)


def interleave(model: nn.Module) -> int:
    """Give every block weight of `model` that the int8 kernel reads interleaved here (K-quants
    under AVX-512, a multiple of 16 rows) its interleaved copy, once; the file's pages behind the
    original are handed back to the page cache (a mapped view is read again only by the exact
    kernel, `generate`'s rebuilt floats or an embedding look-up). Bytes interleaved. Either
    layout gives the same bits, so this may come after products have run (chat's first answer)."""
    global EPOCH
    mod = native.module()
    if mod is None or not hasattr(mod, "int8_interleaves"):
        return 0
    done = 0
    seen: set[int] = set()
    for w in model.parameters():
        bw = blocks_of(w)
        if bw is None or id(bw) in seen or bw.tiled is not None or bw.blocks.shape[0] % 16 or not mod.int8_interleaves(bw.qtype):
            continue
        seen.add(id(bw))
        bw.tiled = mod.int8_interleave(bw.blocks, bw.qtype)
        done += bw.blocks.numel()
        if bw.mapped:
            _drop_pages(bw.blocks)
    if done:
        EPOCH += 1  # the native loop's cached operands still name the file's layout
    return done


def _drop_pages(t: torch.Tensor) -> None:
    """madvise(DONTNEED) over the whole pages of a view of a private, unwritten file mapping: they
    leave this process's resident set and come back from the file if read again."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    page = mmap.PAGESIZE
    start = (t.data_ptr() + page - 1) // page * page
    end = (t.data_ptr() + t.numel()) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


def set_arithmetic(name: str) -> None:
    global EPOCH
    if name not in ARITHMETICS:
        raise ValueError(f"unknown arithmetic {name!r}; choose from {', '.join(ARITHMETICS)}")
    if name == "int8" and not have_int8():
        raise ValueError(f"int8 arithmetic needs eagle2's native kernels, which are {native.status()}")
    if ARITHMETIC["name"] != name:
        ARITHMETIC["name"] = name
        EPOCH += 1  # the native loop's cached kernel choices are stale


def arithmetic() -> str:
    return ARITHMETIC["name"]


@contextmanager
def using_arithmetic(name: str):
    """`name` inside the block only (tests; `compare` running both)."""
    before = arithmetic()
    set_arithmetic(name)
    try:
        yield
    finally:
        set_arithmetic(before)


def install_plan(plan: ProductPlan) -> None:
    """Make `plan` the one every product follows (measure.load_or_measure calls this);
    EAGLE2_KERNEL, where set, wins over any measured plan."""
    global PLAN
    PLAN = env_forced() or plan


@contextmanager
def using_plan(plan: ProductPlan):
    """`plan` inside the block only (tests; measuring under a trial plan)."""
    global PLAN
    before, PLAN = PLAN, plan
    try:
        yield
    finally:
        PLAN = before


def eligible(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2


def pack(weight: torch.Tensor, hint: int = 16) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` for its linear, made for `hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)


def prepare(weights, plan: ProductPlan | None = None) -> int:
    """Pack, once, every weight whose shape the plan runs packed (at load: the cost profile
    installs the plan, then the runtime calls this). Returns the bytes the packings of `weights`
    hold: a second copy of those weights, which `eagle2 tune` states."""
    global EPOCH
    plan, EPOCH = plan or PLAN, EPOCH + 1
    for k in [k for k, (ref, _, _) in _PACKED.items() if ref() is None]:  # weights that are gone
        del _PACKED[k]
    weights = list(weights)
    for w in weights:
        if not (plan.packs(shape_key(w)) and eligible(w) and have_packed()) or floatless(w):
            _PACKED.pop(id(w), None)
        elif _packed_of(w) is None:
            with torch.no_grad():
                _PACKED[id(w)] = (weakref.ref(w), w._version, pack(w, plan.pack_hint.get(shape_key(w), 16)))
    return packed_bytes(weights)


def packed_bytes(weights) -> int:
    seen = {id(w): w for w in weights if _packed_of(w) is not None}
    return sum(w.numel() * w.element_size() for w in seen.values())


def release() -> None:
    """Forget every packing."""
    global EPOCH
    EPOCH += 1
    _PACKED.clear()


def _packed_of(weight: torch.Tensor) -> torch.Tensor | None:
    got = _PACKED.get(id(weight))
    if got is None or got[0]() is not weight or got[1] != weight._version:  # another tensor, or changed in place (training)
        return None
    return got[2]


def kernel_for(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The kernel a product of `x` with `weight` takes: the plan's, where it applies (CPU,
    float32/bfloat16, inference, a packing at hand for `packed`), else `linear`."""
    # A captured cycle (graph mode, `--compile`) cannot trace the packing look-up (an opaque
    # oneDNN tensor found by id): it runs `linear` there, and inductor prepacks weights its own way.
    return _kernel(x.numel() // max(1, x.shape[-1]), x.dtype, x.requires_grad, weight)


def _kernel(rows: int, dtype: torch.dtype, input_grad: bool, weight: torch.Tensor) -> str:
    if torch.compiler.is_compiling() or not eligible(weight) or dtype != weight.dtype:
        return "linear"
    if torch.is_grad_enabled() and (weight.requires_grad or input_grad):
        return "linear"  # training keeps linear's backward
    if ARITHMETIC["name"] == "int8" and dtype == torch.float32 and have_stream():
        # one arithmetic at every row count: int8 over blocks, else the row-invariant float32 stream
        bw = blocks_of(weight)
        if bw is not None and int8_known(bw.qtype):
            return "int8"
        if floatless(weight):
            return "block"
        return "stream" if stream_fits(weight) else "linear"
    if dtype == torch.float32 and floatless(weight) and have_stream():
        return "block"  # its blocks are all there is
    k = PLAN.kernel(rows, weight)
    if k == "block" and (dtype != torch.float32 or blocks_of(weight) is None):
        k = "stream"  # forced everywhere: the weights without blocks stream their floats
    if (k == "packed" and _packed_of(weight) is None) or (k in ("stream", "block") and not (stream_fits(weight) and have_stream())):
        return "linear"
    return k


KERNEL_CODES = {"packed": 0, "linear": 1, "transposed": 2, "stream": 3}  # leanbody's native loop takes the kernel as a code
BLOCK_CODE = 16  # + the GGML type: the block kernel over the weight's GGUF blocks (csrc/layers.cpp)
INT8_CODE = 1024  # + the GGML type: the int8 kernel over the weight's blocks (csrc/int8.cpp)


def product_choice(rows: int, weight: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(kernel code, the tensor it reads) for a product of `rows` rows with `weight`: the plan's
    kernel as `kernel_for` picks it, with the packing for `packed` (leanbody's native loop)."""
    k = _kernel(rows, weight.dtype, False, weight)
    if k == "int8":
        code, t = _int8_operand(blocks_of(weight))
        return INT8_CODE + code, t
    if k == "block":
        bw = blocks_of(weight)
        return BLOCK_CODE + bw.qtype, bw.blocks
    return (0, _packed_of(weight)) if k == "packed" else (KERNEL_CODES[k], weight)


def transposed_product(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x2 @ weight.T` for a 2-D `x2` as `(weight @ x2.T).T`, laid out as `linear` lays it out."""
    return torch.mm(weight, x2.t()).t().contiguous()  # contiguous: the next op reads along features


def packed_product(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `F.linear(x, weight, bias)` (up to rounding), by the plan's kernel."""
    k = kernel_for(x, weight)
    if k == "linear":
        if floatless(weight):  # a gradient through it (training), or another dtype: over the rebuilt floats
            return rebuilt_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if k == "stream":
        return native.module().stream_linear(x, weight, bias)
    if k == "block":
        bw = blocks_of(weight)
        return native.module().block_linear(x, bw.blocks, bw.qtype, bias)
    if k == "int8":
        code, t = _int8_operand(blocks_of(weight))
        return native.module().int8_linear(x, t, code, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if k == "packed":
        out = packed_product(x2, _packed_of(weight), bias)
    else:
        out = transposed_product(x2, weight)
        if bias is not None:
            out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class RowLinear(nn.Linear):
    """An `nn.Linear` whose forward is `linear_rows`: same parameters, same state_dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias)


PLAIN_LINEARS = (nn.Linear, RowLinear, FloatlessLinear)  # the linears our forwards may route through linear_rows


def plain_linears(module: nn.Module) -> list[nn.Linear]:
    """The module's own `nn.Linear` layers (not quantized or other subclasses, which keep their forward)."""
    return [m for m in module.modules() if type(m) in PLAIN_LINEARS]


def make_row_linears(module: nn.Module) -> nn.Module:
    """Turn a module we own (the draft head) into one whose plain linears use `linear_rows`."""
    for m in plain_linears(module):
        m.__class__ = RowLinear
    return module


@contextmanager
def row_linears(linears: list[nn.Linear]):
    """Route a model we do not own (the target) through `linear_rows` only inside the block, so
    the model object is unchanged for everything else, Hugging Face `generate` included."""
    try:
        for m in linears:
            m.forward = RowLinear.forward.__get__(m)
        yield
    finally:  # also after Ctrl-C mid-forward: the model must not keep our forward
        for m in linears:
            m.__dict__.pop("forward", None)
