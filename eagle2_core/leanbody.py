"""The target's decoder body for the Llama family on CPUs, in plain tensor ops over its own weights.

Verify (EAGLE-2 section 3) is one forward of the target over a few rows, and on a CPU that
forward is memory-bound: the products want to stream the weights once and nothing else should
cost. The stock transformers forward is written for every use at once (module calls, kwargs
plumbing, attention interfaces): on SmolLM2 a large share of each forward goes outside its
products (docs/benchmarks.md). This is the same computation written once, gpt-fast
style, for the layers we recognise (Llama, Qwen2, Mistral, Qwen3: pre-norm RMSNorm, rotary
q/k, SDPA, a gated MLP):

- q/k/v are one product and gate/up one product: the layer's parameters become views into one
  fused weight each (the same values, no second copy), so the model object still works as
  before for everything else (`generate`, training, saving).
- rotary runs once over q and k together, and attention reads our cache directly.

It runs only where the model is one we recognise, on a CPU, with SDPA attention and plain
`nn.Linear` layers (no accelerate hooks, no quantized layers); everything else keeps the stock
body. `EAGLE2_BODY=stock` turns it off (tests run both). The arithmetic is the stock forward's
op for op (RMSNorm in float32, HF's rotary module, SDPA) except the order of additions inside a
fused product, as between any two product kernels (README: what "identical" means).
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from . import native, rowgemm
from .ggufblocks import BlockWeight, common_type, widen
from .rowgemm import linear_rows

LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer", "Qwen3DecoderLayer"}
NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm"}
DTYPES = (torch.float32, torch.bfloat16)
SILU = {"SiLU", "SiLUActivation"}  # torch's and transformers' names for the same function

_BODIES: "weakref.WeakKeyDictionary[torch.nn.Module, LeanBody]" = weakref.WeakKeyDictionary()


def _body_env() -> str:
    return os.environ.get("EAGLE2_BODY", "").strip().lower()


def wanted() -> bool:
    """`EAGLE2_BODY=stock` keeps the stock transformers body everywhere."""
    return _body_env() not in ("stock", "hf", "0", "off")


def heads_of(attn) -> tuple[int, int, int]:
    """(head_dim, query heads, key/value heads) of a Llama-family attention module."""
    hd = attn.head_dim
    return hd, attn.q_proj.out_features // hd, attn.k_proj.out_features // hd


def why_not(body, config) -> str | None:
    """Why the lean body cannot stand in for `body` (None: it can)."""
    if not wanted():
        return "EAGLE2_BODY=stock"
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (the lean body is SDPA's arithmetic)"
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return f"{type(body).__name__} is not a Llama-family body"
    params = list(body.parameters())
    if not params or any(p.device.type != "cpu" or p.dtype not in DTYPES for p in params):
        return "not a float32/bfloat16 model on the CPU"
    if type(body.embed_tokens) not in (torch.nn.Embedding, rowgemm.FloatlessEmbedding) or type(body.norm).__name__ not in NORMS:
        return "embedding or final norm of another kind"
    for mod in body.modules():
        if hasattr(mod, "_hf_hook") or mod._forward_pre_hooks or any(not _inert(h) for h in mod._forward_hooks.values()):
            return "a module carries hooks (accelerate offload or another tool's)"
    for layer in layers:
        if type(layer).__name__ not in LAYERS:
            return f"layer type {type(layer).__name__}"
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        lin = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(x) not in (torch.nn.Linear, rowgemm.FloatlessLinear) for x in lin):
            return "a projection that is not a plain nn.Linear (quantized?)"
        if len({x.bias is None for x in lin[:3]}) != 1 or lin[3].bias is not None or any(x.bias is not None for x in lin[4:]):
            return "biases other than on q/k/v together"
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [x for x in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)) if x is not None]
        if any(type(n).__name__ not in NORMS for n in norms):
            return "a norm of another kind"
    return None


def _inert(hook) -> bool:
    """Whether a forward hook is one of those transformers leaves on a model once it was asked for
    hidden states or attentions: they record only inside such a call of its own forward."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and "transformers" in getattr(hook, "__module__", "")


def for_model(body, config) -> "LeanBody | None":
    """The lean body of `body` (made once per body: its fused weights are the model's own), or None."""
    if not wanted():
        return None
    lean = _BODIES.get(body)  # checked once: later calls may come while the engine's own hooks are on
    if lean is None and why_not(body, config) is None:
        lean = _BODIES[body] = LeanBody(body, config)
    return lean


def stacked(ts: list[torch.Tensor]) -> torch.Tensor:
    """`ts` stacked by rows into one tensor, each of `ts` then a view into it (same values, same
    shapes: no second copy once the old storage goes)."""
    fused = torch.cat([t.detach() for t in ts])
    off = 0
    for t in ts:
        t.data = fused[off: off + t.shape[0]]
        off += t.shape[0]
    return fused


def _fuse(linears: list[torch.nn.Linear], parts: bool = True) -> tuple[torch.Tensor | list, torch.Tensor | None]:
    """One weight (and bias) for several linears read by the same input, their rows stacked; the
    linears' parameters become views into it (`stacked`). Made once per body (`for_model` keeps it).
    `parts`: weights held as blocks only stay apart, a list of them (`parts_product`)."""
    if parts and all(rowgemm.floatless(m.weight) for m in linears):
        # blocks only (views of a GGUF file's map): one product per part, each in its own type; a
        # fused copy would hold every block twice in memory (the copy and the mapped pages it read)
        with torch.no_grad():
            bias = stacked([m.bias for m in linears]) if linears[0].bias is not None else None
        return [m.weight for m in linears], bias
    blocks = [rowgemm.blocks_of(m.weight) for m in linears]  # a GGUF target's blocks
    if all(b is not None for b in blocks) and len({b.qtype for b in blocks}) > 1:
        common = common_type(b.qtype for b in blocks)  # parts of several types: widened exactly where one holds them all
        if common is not None:
            blocks = [widen(b, common) for b in blocks]
    same_type = all(b is not None for b in blocks) and len({b.qtype for b in blocks}) == 1
    if same_type:  # one block weight for the fused product, the parts' blocks views into it (no second copy)
        fused_blocks = torch.cat([b.blocks for b in blocks])
        off, parts = 0, []
        for b in blocks:
            parts.append(BlockWeight(fused_blocks[off: off + b.out_features], b.qtype, b.type_name, b.in_features))
            off += b.out_features
        fused_bw = BlockWeight(fused_blocks, blocks[0].qtype, blocks[0].type_name, blocks[0].in_features)
        blocks = parts
    if same_type and all(rowgemm.floatless(m.weight) for m in linears):  # blocks only: the fused weight too
        with torch.no_grad():
            weight = rowgemm.stand_in(sum(m.weight.shape[0] for m in linears), linears[0].weight.shape[1])
            off = 0
            for m, b in zip(linears, blocks):
                m.weight.data = weight[off: off + m.weight.shape[0]]
                off += m.weight.shape[0]
                rowgemm.make_floatless(m.weight, b)
            bias = stacked([m.bias for m in linears]) if linears[0].bias is not None else None
        rowgemm.make_floatless(weight, fused_bw)
        return weight, bias
    with torch.no_grad():
        for m in linears:  # blocks of several types (or some without): the fused product reads floats
            if rowgemm.floatless(m.weight):
                m.weight.data = rowgemm.rebuilt(m.weight).clone()
        weight = stacked([m.weight for m in linears])
        bias = stacked([m.bias for m in linears]) if linears[0].bias is not None else None
    if all(b is not None for b in blocks):
        for m, b in zip(linears, blocks):  # the parts are views now: their blocks still hold their values
            rowgemm.attach_blocks(m.weight, b)
        if same_type:  # rows of blocks stack as rows of floats do
            rowgemm.attach_blocks(weight, fused_bw)
    return weight, bias


def parts_product(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_rows` over a fused weight, or over the parts of one kept apart (`_fuse`), their
    outputs side by side: each output is its own dot product, so the same values either way."""
    if not isinstance(weight, list):
        return linear_rows(x, weight, bias)
    out = torch.cat([linear_rows(x, w) for w in weight], -1)
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """Llama's RMSNorm, op for op (float32 inside, the weight applied in the input's dtype). In
    float32 torch's own `rms_norm` is the same arithmetic in one call (bitwise equal: tested)."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


# -- the native layer loop ---------------------------------------------------------------------
# The same layers in C++ (csrc/layers.cpp, built by native.py): what remains of a forward once
# Python is out of it. It serves the decoding cycle's forwards in live mode (one sequence, or
# several at their own cells) and, in int8, every prompt's prefill; no EAGLE-3 layer capture. Each
# product takes the plan's kernel, as in the Python loop. Where the build fails the Python loop runs.


def native_loop():
    """The built native module (its `layers`), or None (no build here, or `EAGLE2_BODY=python`)."""
    return None if _body_env() == "python" else native.module()


def native_status() -> str:
    """One line for `tune`: whether the native layer loop runs here."""
    if _body_env() == "python":
        return "Python layer loop (EAGLE2_BODY=python)"
    return "native layer loop" if native.module() is not None else f"Python layer loop ({native.status()})"


# -- the draft head's layer through the same native loop -------------------------------------------
# A draft step (EAGLE-2 section 4.1: one head forward per tree level) is one decoder layer over a
# few rows, then the draft lm_head. Through the stock transformers layer it cost SmolLM2's head well over
# the time its weights take to stream (docs/benchmarks.md): the same native loop runs it, one layer with no
# input norm and no final norm (EAGLE's head has neither). Its q/k/v and gate/up are read as one
# product each from a fused weight whose views the head's parameters become, as the target body's
# do (no second copy of the head's weights; its checkpoint format and training are
# untouched), made once and again only when a parameter is updated or replaced.
_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_NO_NORM = torch.empty(0)


def head_weights(head) -> list[torch.Tensor]:
    """The fused copies the native draft step reads (qkv, gate_up), made here if due: what the
    product plan measures and packs beside the head's own weights. Empty where it does not apply."""
    got = _head_fused(head) if native_loop() is not None else None
    return [got[1], got[3]] if got else []


def _head_fused(head):
    layers = getattr(head, "layers", None)
    if layers is None or len(layers) != 1 or not wanted():
        return None
    layer = layers[0]
    if type(layer).__name__ not in LAYERS or type(layer.input_layernorm).__name__ != "Identity" \
            or getattr(layer.self_attn, "q_norm", None) is not None or type(layer.mlp.act_fn).__name__ not in SILU:
        return None
    a, m = layer.self_attn, layer.mlp
    lins = [a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj]
    w0 = a.q_proj.weight
    if w0.device.type != "cpu" or w0.dtype not in DTYPES or any(type(x) not in (torch.nn.Linear, rowgemm.RowLinear) for x in lins):
        return None
    def key():
        return tuple((x.weight.data_ptr(), x.weight._version) for x in lins) + tuple(
            (x.bias.data_ptr(), x.bias._version) for x in lins[:3] if x.bias is not None)

    got = _HEADS.get(head)
    if got is None or got[0] != key():
        qkv, bias = _fuse(lins[:3], parts=False)  # a head held as blocks (quantization.head_blocks) fuses its blocks
        gate_up, _ = _fuse(lins[3:], parts=False)
        got = _HEADS[head] = (key(), qkv, bias, gate_up)
    return got


def head_layer(head, x: torch.Tensor, position_embeddings, mask, cache) -> torch.Tensor | None:
    """The head's one layer over `x` [1, m, H] through the native loop, writing its K/V at the
    cache's cells, or None where this step is not one it serves (then the stock layer runs):
    one sequence whose new cells are one run after the context (a draft step in live mode), no
    gradient, not captured or fixed (a fixed cycle reads nothing back to the host), a native build
    at hand."""
    # our KVCache only (training and other callers pass transformers' caches): live, one row, cells known
    if x.shape[0] != 1 or getattr(cache, "static", True) or getattr(cache, "row", 0) is not None or torch.is_grad_enabled() \
            or torch.compiler.is_compiling() or not isinstance(mask, torch.Tensor) or not cache.layers[0].is_initialized:
        return None
    cells = cache.cells
    if cells is None or cells.dim() != 2 or cells.device.type != "cpu":
        return None
    m = x.shape[1]
    start = int(cells[0, 0])
    if not torch.equal(cells[0], torch.arange(start, start + m)):
        return None
    fused = _head_fused(head)
    loop = native_loop() if fused is not None else None
    if loop is None or x.dtype != fused[1].dtype:
        return None
    _, qkv, qkv_bias, gate_up = fused
    layer = head.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    codes = []
    tensors = []
    for w in (qkv, a.o_proj.weight, gate_up, mlp.down_proj.weight):
        code, t = rowgemm.product_choice(m, w)
        codes.append(code)
        tensors.append(t)
    cos, sin = position_embeddings
    hd, nh, nkv = heads_of(a)
    c = cache.layers[0]
    return loop.layers(x, cos[:, :, None], signed_sine(sin)[:, :, None], mask, [tensors[0]], [qkv_bias] if qkv_bias is not None else [],
                       [tensors[1]], [tensors[2]], [tensors[3]], codes, [], [_NO_NORM], [layer.post_attention_layernorm.weight], _NO_NORM,
                       layer.post_attention_layernorm.variance_epsilon, [c.keys], [c.values], [start], int(cache.view), nh, nkv, hd, a.scaling)


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """The rotary sine with its first half negated: `rotary` then needs no negation."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as x * cos + roll(x, d/2) * signed sine: bitwise the same
    (a sign moves from one factor to the other), three ops fewer per layer."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


# Rows of a prompt's prefill per native forward (`LeanBody.__call__`): a product unpacks each weight
# block once for all its rows, so more rows cost less each, and the loop's work buffers, kept
# between forwards, grow with them (docs/benchmarks.md).
PREFILL_ROWS = 256


class LeanBody:
    def __init__(self, body, config):
        self.body = body
        a0 = body.layers[0].self_attn
        self.head_dim, self.n_heads, self.n_kv = heads_of(a0)
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        self.layers = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj])
            gate_up, _ = _fuse([m.gate_proj, m.up_proj])
            self.layers.append((layer, qkv, qkv_bias, gate_up))
        rowgemm.trim_heap()  # the parts' blocks, now views into the fused ones, were copies until here
        # the native loop is written for SiLU gates and no per-head q/k norms (Qwen3 takes the Python loop)
        self.native_ok = all(getattr(layer.self_attn, "q_norm", None) is None and type(layer.mlp.act_fn).__name__ in SILU
                             for layer in body.layers)
        self._packs: dict = {}  # row bucket -> (plan, epoch, products) for the native loop
        # what the native loop reads besides the products, fixed for the model's life
        self._qkv_bias = [b for _, _, b, _ in self.layers] if self.layers[0][2] is not None else []
        self._norms = ([lay.input_layernorm.weight for lay, *_ in self.layers], [lay.post_attention_layernorm.weight for lay, *_ in self.layers])

    def _products(self, rows: int):
        """Every product's (kernel code, tensor) at this row count, by kind (qkv, o, gate_up,
        down): the plan's choice, as the Python loop's `linear_rows` would make it."""
        key = rowgemm.bucket(rows)
        got = self._packs.get(key)
        if got is None or got[0] is not rowgemm.PLAN or got[1] != rowgemm.EPOCH:
            tensors, codes, counts = [[], [], [], []], [], []
            for layer, qkv, _, gate_up in self.layers:
                for kind, w in zip(tensors, (qkv, layer.self_attn.o_proj.weight, gate_up, layer.mlp.down_proj.weight)):
                    parts = w if isinstance(w, list) else [w]  # a fused weight kept as parts (_fuse)
                    for part in parts:
                        code, t = rowgemm.product_choice(rows, part)
                        kind.append(t)
                        codes.append(code)
                    counts.append(len(parts))
            got = self._packs[key] = (rowgemm.PLAN, rowgemm.EPOCH, (tensors, codes, counts))
        return got[2]

    def _native(self, b, n, mask, cache, layers, dtype):
        """(the native loop, the packings, each sequence's first new cell), where this forward is one it serves."""
        if not self.native_ok or layers or isinstance(mask, dict) or not hasattr(cache, "row") \
                or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None, None, None
        if not cache.layers[0].is_initialized:
            if cache.row is None or rowgemm.arithmetic() != "int8":
                return None, None, None
            # a fresh cache's first prefill: its buffers, as the Python loop's first K/V write would make them
            z = torch.zeros(1, self.n_kv, 1, self.head_dim, dtype=dtype)
            for layer in cache.layers:
                layer.lazy_initialization(z, z)
        if cache.row is not None:
            # One prompt's prefill into its own row (cycle.admit), in int8 only: there the native
            # loop makes a prompt row's bits those of the same token decoded, verified or prefilled
            # in any other chunking, as its products already are; exact keeps the ATen attention,
            # bitwise transformers' prefill.
            if b != 1 or rowgemm.arithmetic() != "int8" or not self._fused_fits(n, mask, cache, dtype) or cache.cells.dim() != 1:
                return None, None, None
            starts = [int(cache.cells[0])]
            if not torch.equal(cache.cells, starts[0] + torch.arange(n)):
                return None, None, None
        elif b == 1 and cache.start is not None:
            starts = [int(cache.start)]
        elif b > 1 and self._fused_fits(n, mask, cache, dtype) and not cache.static and cache.cells.shape == (b, n):
            # Several sequences (live mode): each row's new cells run on from its own length. The
            # native loop attends row by row in key order, so a row's bits are its own whatever
            # its batch-mates and its tree, as at batch 1 (the ATen form's SDPA sums by lanes,
            # which a longer view or a tree's layout regroups).
            starts = cache.cells[:, 0].tolist()
            if not torch.equal(cache.cells, cache.cells[:, :1] + torch.arange(n)):
                return None, None, None
        else:
            return None, None, None
        loop = native_loop()
        return (loop, self._products(b * n), starts) if loop is not None else (None, None, None)

    @staticmethod
    def _fused_fits(n, mask, cache, dtype) -> bool:
        """Whether csrc/layers.cpp's float32 loops (not its one-sequence ATen form) take a forward of n rows per sequence."""
        return dtype == torch.float32 and isinstance(mask, torch.Tensor) and mask.dtype == torch.float32 and mask.dim() == 4 \
            and mask.shape[-2:] == (n, cache.view) and cache.cells is not None and cache.cells.device.type == "cpu" \
            and cache.layers[0].keys.is_contiguous() and cache.layers[0].values.is_contiguous()

    def weights(self) -> list[torch.Tensor]:
        """Every weight this body's products read (the fused ones as fused): what the product plan measures and packs."""
        out = []
        for layer, qkv, _, gate_up in self.layers:
            for w in (qkv, layer.self_attn.o_proj.weight, gate_up, layer.mlp.down_proj.weight):
                out += w if isinstance(w, list) else [w]
        return out

    def __call__(self, tokens, positions, mask, cache, seen: dict | None = None, layers: tuple[int, ...] | None = None):
        """Final-norm hidden states [B, n, H] of `tokens` at `positions` ([B, n]) on `cache`
        (kvcache.KVCache: each layer's `update` writes the new K/V and returns what to attend),
        `mask` additive [B, 1, n, view]; the residual stream entering each of `layers` goes to
        `seen` (EAGLE-3's features, section 3.2 of its paper)."""
        b, n = tokens.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        body = self.body
        h = body.embed_tokens(tokens)
        cos, sin = body.rotary_emb(h, positions)
        cos, sin = cos[:, :, None], signed_sine(sin)[:, :, None]  # [B, n, 1, hd]: over q's and k's heads alike
        native, products, starts = self._native(b, n, mask, cache, layers, h.dtype)
        if native is not None:
            layer0 = self.layers[0][0]
            row = cache.row  # a prefill: that row of the cache is the one sequence's
            keys = [c.keys if row is None else c.keys[row: row + 1] for c in cache.layers]
            values = [c.values if row is None else c.values[row: row + 1] for c in cache.layers]

            def rows(a: int, e: int, view: int, products) -> torch.Tensor:
                (qkv, o, gate_up, down), codes, counts = products
                return native.layers(h[:, a:e], cos[:, a:e], sin[:, a:e], mask[:, :, a:e, :view], qkv, self._qkv_bias, o, gate_up, down,
                                     codes, counts, *self._norms, body.norm.weight, layer0.input_layernorm.variance_epsilon, keys, values,
                                     [s + a for s in starts], view, nh, nkv, hd, layer0.self_attn.scaling)

            if row is None or n <= PREFILL_ROWS:
                return rows(0, n, int(cache.view), products)
            # A long prompt a chunk of rows at a time, each reading the cells up to its own last
            # (its mask is causal: the later ones are masked, and a masked key changes no bit of
            # the native attention's sums), so the loop's work buffers, kept between forwards, stay
            # a chunk's size.
            return torch.cat([rows(a, min(n, a + PREFILL_ROWS), starts[0] + min(n, a + PREFILL_ROWS), self._products(min(n - a, PREFILL_ROWS)))
                              for a in range(0, n, PREFILL_ROWS)], 1)
        want = set(layers or ())
        for i, (layer, qkv_w, qkv_b, gate_up) in enumerate(self.layers):
            if i in want:
                seen[i] = h
            a, m = layer.self_attn, layer.mlp
            x = rms_norm(h, layer.input_layernorm)
            qkv = parts_product(x, qkv_w, qkv_b).view(b, n, nh + 2 * nkv, hd)
            q, k, v = qkv.split((nh, nkv, nkv), dim=2)
            if getattr(a, "q_norm", None) is not None:  # Qwen3: per-head norms before rotary
                q, k = rms_norm(q, a.q_norm), rms_norm(k, a.k_norm)
                qk = torch.cat((q, k), 2)
            else:
                qk = qkv[:, :, : nh + nkv]
            qk = rotary(qk, cos, sin)  # on q and k at once
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)
            keys, values = cache.layers[i].update(k, v.transpose(1, 2))
            mk = mask[self.layer_types[i]] if isinstance(mask, dict) else mask  # hybrid windows (Qwen2 max_window_layers)
            if n == 1 and nkv < nh:  # one query: its heads of a group as the group's rows (no repeated K/V)
                o = F.scaled_dot_product_attention(q.reshape(b, nkv, nh // nkv, hd), keys, values, attn_mask=mk, scale=a.scaling)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mk, scale=a.scaling, enable_gqa=nkv < nh)
            o = o.reshape(b, nh, n, hd).transpose(1, 2).reshape(b, n, nh * hd)
            h = h + linear_rows(o, a.o_proj.weight)
            x = rms_norm(h, layer.post_attention_layernorm)
            g, u = parts_product(x, gate_up).chunk(2, -1)
            h = h + linear_rows(m.act_fn(g) * u, m.down_proj.weight)
        return rms_norm(h, body.norm)
