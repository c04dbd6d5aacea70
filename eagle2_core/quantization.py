"""eagle2's weight-only 8-bit (and 4-bit) on CPUs: each weight quantized to blocks the
block kernel reads (csrc/products.cpp), its float32 values dropped.

- 8-bit (`--load-in-8bit`): per output row one float32 scale, the row's absmax / 127, and the
  row's values rounded to int8 (type ROW_I8, not a GGML type: a row is the scale's 4 bytes then
  its int8s). The kernel rebuilds each weight as `scale * q` (one float32 rounding) and feeds the
  float32 stream kernel's fixed-order sum: every product is bitwise the float32 product over the
  rebuilt weight, at every row count, so speculative decoding is exact against plain decoding of
  the 8-bit model. Activations stay float32: this is not bitsandbytes' LLM.int8 (int8
  activations with an outlier split), which a GPU keeps, and its numbers differ from it.
- 4-bit (`--load-in-4bit`): GGML's Q4_0 layout (32 values per block, an fp16 scale d = the
  block's value of largest magnitude / -8, q = round(x / d) + 8 clipped to 0..15), read by the
  Q4_0 kernel GGUF files already use: `d * (q - 8)`.

Quantized weight by weight: at most one weight's float32 temporaries beside the model.
"""
from __future__ import annotations

import torch

from .ggufblocks import BlockWeight

ROW_I8 = 100  # csrc/products.cpp's ROW_I8
Q4_0 = 2      # GGML's type id


CHUNK = 4096  # rows quantized at a time: a vocabulary-sized weight's temporaries stay small


def row_int8(w: torch.Tensor) -> BlockWeight:
    """[out, in] float weight -> its ROW_I8 blocks: [out, 4 + in] uint8 (scale, then int8 values)."""
    blocks = torch.empty(w.shape[0], 4 + w.shape[1], dtype=torch.uint8)
    for a in range(0, w.shape[0], CHUNK):
        c = w[a: a + CHUNK].detach().float()
        scale = c.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(c / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        blocks[a: a + CHUNK, :4] = scale.contiguous().view(torch.uint8).view(-1, 4)
        blocks[a: a + CHUNK, 4:] = q.view(torch.uint8)
    return BlockWeight(blocks, ROW_I8, "I8/row", w.shape[1])


def q4_0(w: torch.Tensor) -> BlockWeight:
    """[out, in] float weight (in a multiple of 32) -> GGML Q4_0 blocks: [out, in / 32 * 18] uint8."""
    if w.shape[0] > CHUNK:
        parts = [q4_0(w[a: a + CHUNK]) for a in range(0, w.shape[0], CHUNK)]
        return BlockWeight(torch.cat([b.blocks for b in parts]), Q4_0, "Q4_0", w.shape[1])
    w = w.detach().float()
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    pick = g.abs().argmax(dim=-1, keepdim=True)
    peak = g.gather(-1, pick)  # the value of largest magnitude, with its sign
    d = (peak / -8.0).to(torch.float16).float()  # the scale as stored: quantize against it
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor(g * inv + 8.5), 0, 15).to(torch.uint8)  # round half up, as ggml's (int)(x + 8.5)
    blocks = torch.empty(n, k // 32, 18, dtype=torch.uint8)
    blocks[..., :2] = d.to(torch.float16).view(torch.uint8).view(n, k // 32, 2)
    blocks[..., 2:] = q[..., :16] | (q[..., 16:] << 4)  # values j and j+16 share byte j
    return BlockWeight(blocks.view(n, -1), Q4_0, "Q4_0", k)


def quantizable(w: torch.Tensor, bits: int) -> bool:
    """Whether a weight takes this quantization (2-D floats on the CPU, rows the kernel's steps)."""
    return (w.dim() == 2 and w.is_floating_point() and w.device.type == "cpu" and w.shape[1] % (16 if bits == 8 else 32) == 0
            and w.numel() > 0)


def quantize(w: torch.Tensor, bits: int) -> BlockWeight:
    return row_int8(w) if bits == 8 else q4_0(w)


def head_blocks(head) -> int:
    """A draft head's float32 weights as 8-bit rows (ROW_I8), their float32 values dropped, on a
    CPU with eagle2's kernels. A draft step streams the head's weights as a target step streams
    the target's: SmolLM2's head (its layer, fc, and the 16,384 lm_head rows it scores) held 55 MB
    of float32, a quarter of a 4-bit target's step and a tenth of a float32 one's, every step of
    every tree (docs/benchmarks.md). The draft is only a proposal: the head's rounding
    changes which tokens are drafted, never the output (verification is the target's). The
    embedding, and the lm_head where the head scores the target's own rows, are the target's and
    stay as they are (a pruned draft vocabulary's rows are the head's copy). Returns the blocks' bytes."""
    from . import rowgemm

    if not rowgemm.have_stream():
        return 0
    weights = [m.weight for m in head.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(head, "_shared", None) and getattr(head, "draft_vocab", None) is not None:
        lm = getattr(head, "draft_lm_head", None)  # an EAGLE-1/2 head's scored rows (EAGLE-3's lm_head is a module above)
        if lm is not None:
            weights.append(lm)  # index_select made it: the head's own copy of those rows
    made = 0
    for w in weights:
        if w.dtype != torch.float32 or w.device.type != "cpu" or not quantizable(w, 8) or rowgemm.blocks_of(w) is not None:
            continue
        bw = row_int8(w)
        with torch.no_grad():
            rowgemm.make_floatless(w, bw)
        made += bw.nbytes
    return made


# -- reading a weight's floats from its safetensors file, not through the model's mapping -----
# transformers maps the checkpoint and its parameters are views of the mapping: reading every
# weight through them to quantize it would make every page of the file resident (the whole
# float32 model, the thing 8-bit is meant to spare) until the mapping goes. A weight is read
# instead from the file with plain reads, one at a time.
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def safetensors_index(folder: str) -> dict[str, tuple[str, str, list[int], int, int]]:
    """{tensor name: (file, dtype, shape, begin, end)} of a folder's safetensors checkpoint
    (single file or shards); empty where there is none."""
    import json
    import os
    import struct

    index_file = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return {}
    out = {}
    for name in files:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                begin, end = meta["data_offsets"]
                out[key] = (path, meta["dtype"], meta["shape"], 8 + n + begin, 8 + n + end)
    return out


def read_float(entry) -> torch.Tensor | None:
    """A tensor's values read from its file (float32), or None for a dtype not read here."""
    path, dtype, shape, begin, end = entry
    if dtype not in _DTYPES:
        return None
    raw = torch.empty(end - begin, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(begin)
        if f.readinto(raw.numpy()) != raw.numel():
            return None
    return raw.view(_DTYPES[dtype]).view(shape).float()
