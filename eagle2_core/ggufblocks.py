"""A GGUF file's linear weights as its own blocks: the bytes the block kernel reads
(csrc/products.cpp, `block_linear`), laid out as the Hugging Face model's weights are.

transformers loads a GGUF by dequantizing every tensor to float32 (gguf-py) and, for llama's
q and k projections, undoing the row permutation llama.cpp applies for its rotary layout. Both
are reproduced here on the blocks themselves: a weight row is a whole number of blocks, so the
permutation moves rows of blocks exactly as it moves rows of floats, and the block kernel then
rebuilds, from these bytes, the very float32 weights transformers holds (tested bitwise against
the loaded model).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGUF's per-layer tensor names -> the Hugging Face module names of llama-family models (Llama,
# Mistral, Qwen2, SmolLM2: the architectures whose GGUFs we load).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
OTHER_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head"}
# The types block_linear reads: GGML's type id -> (name, values per block, bytes per block), as
# gguf-py's GGMLQuantizationType and GGML_QUANT_SIZES give them (csrc/products.cpp: q_block,
# q_bytes). Reading a file of these types needs no gguf-py, whose import alone keeps memory resident.
BLOCK_SIZES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
               12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


@dataclass
class BlockWeight:
    """One weight [out, in] as GGUF blocks: `blocks` uint8 [out, row bytes], `qtype` GGML's type id.
    `mapped`: `blocks` is a view of the file's memory map; `tiled`: the same blocks interleaved for
    the int8 kernel (rowgemm.interleave), where it reads them so."""
    blocks: torch.Tensor
    qtype: int
    type_name: str
    in_features: int
    mapped: bool = False
    tiled: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, by gguf-py (what transformers holds): for the kernels that need it."""
        import gguf

        return torch.from_numpy(gguf.quants.dequantize(self.blocks.numpy(), gguf.GGMLQuantizationType(self.qtype))
                                .reshape(self.out_features, self.in_features).copy())


# Exact widenings: a block of the first type holds values the second type holds too, with the same
# scale, so the rebuilt float32 weights are the same bits (Q4_0's d * (q - 8) is Q5_0's d * (q' - 16)
# with q' = q + 8, and Q8_0's d * x with x = q - 8; Q4_1's (d * q) + m is Q5_1's with a zero fifth
# bit). A fused q/k/v whose parts were quantized to different types (Qwen2.5's Q5_0 q and k beside
# a Q8_0 v) is then one block weight of the widest, read by one product, rather than float32.
WIDER = {2: (6, 8), 6: (8,), 3: (7,)}  # type -> the types it widens into exactly


def common_type(qtypes) -> int | None:
    """The narrowest type every one of `qtypes` widens into exactly (itself included), or None."""
    qtypes = set(qtypes)
    for t in sorted({t for q in qtypes for t in (q, *WIDER.get(q, ()))}, key=lambda t: BLOCK_SIZES[t][2]):
        if all(q == t or t in WIDER.get(q, ()) for q in qtypes):
            return t
    return None


def _values32(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 32-value type's blocks [n, bytes] -> (d bytes [n, 2], integer values [n, 32] as the
    type stores them (before its offset), m bytes [n, 2] or None)."""
    if qtype in (2, 3):  # d (m), 16 bytes of nibbles: value j low, value j + 16 high
        qs = raw[:, -16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16)
    else:  # Q5: d (m), 4 bytes of fifth bits (bit j for value j), 16 bytes of nibbles
        qs = raw[:, -16:]
        qh = raw[:, -20:-16].copy().view("<u4")[:, 0]
        high = (qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        q = (np.concatenate([qs & 15, qs >> 4], axis=1) | (high << 4)).astype(np.int16)
    return raw[:, 0:2], q, (raw[:, 2:4] if qtype in (3, 7) else None)


def widen(bw: BlockWeight, qtype: int) -> BlockWeight:
    """`bw` in the wider type `qtype` (WIDER), the same rebuilt weights to the bit."""
    if qtype == bw.qtype:
        return bw
    if qtype not in WIDER.get(bw.qtype, ()):
        raise ValueError(f"{bw.type_name} does not widen exactly into {BLOCK_SIZES[qtype][0]}")
    name, _, nbytes = BLOCK_SIZES[qtype]
    raw = bw.blocks.numpy().reshape(-1, BLOCK_SIZES[bw.qtype][2])
    d, q, m = _values32(raw, bw.qtype)
    offset = {2: 8, 6: 16, 3: 0}[bw.qtype]  # the stored value minus this is the integer multiplying d
    out = np.empty((raw.shape[0], nbytes), dtype=np.uint8)
    out[:, 0:2] = d
    if qtype == 8:  # Q8_0: d, then 32 signed bytes
        out[:, 2:] = (q - offset).astype(np.int8).view(np.uint8)
    else:  # Q5_0 (from Q4_0: q + 8, so that q' - 16 = q - 8) or Q5_1 (from Q4_1: the same q)
        head = 2
        if m is not None:
            out[:, 2:4] = m
            head = 4
        q5 = q + (16 - offset if qtype == 6 else 0)
        bits = ((q5 >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        out[:, head: head + 4] = np.bitwise_or.reduce(bits, axis=1).astype("<u4")[:, None].view(np.uint8)
        out[:, head + 4:] = ((q5[:, :16] & 15) | ((q5[:, 16:] & 15) << 4)).astype(np.uint8)
    blocks = torch.from_numpy(out.reshape(bw.out_features, -1))
    return BlockWeight(blocks, qtype, name, bw.in_features)


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for what we do not map."""
    parts = gguf_name.split(".")
    if parts[-1] != "weight":
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    if len(parts) == 2 and parts[0] in OTHER_NAMES:
        return f"{OTHER_NAMES[parts[0]]}.weight"
    return None


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order of a q or k projection (transformers does the same to
    the dequantized floats): rows are moved whole, so blocks move as their floats do."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def read_blocks(path: str, num_heads: int, num_kv_heads: int) -> tuple[dict[str, BlockWeight], dict[str, str]]:
    """The file's 2-D weights of the block types, by Hugging Face name, and {name: type} of the
    mapped 2-D weights of other types (those stay dequantized: `tune` says which)."""
    out: dict[str, BlockWeight] = {}
    other: dict[str, str] = {}
    # Our own reading of the header (tensor_infos) and of each tensor's bytes straight into its
    # tensor: gguf-py's reader parses every metadata value into numpy objects (every string of the
    # tokenizer's: a large peak, part of it never given back to the system)
    # and reads through a memory map whose touched pages count as resident.
    with open(path, "rb") as f:
        arch, tensors, data_start = tensor_infos(f)
        for gname, dims, qtype, offset in tensors:
            name = hf_name(gname)
            if name is None or len(dims) != 2:
                continue
            if qtype not in BLOCK_SIZES:
                other[name] = _type_name(qtype)
                continue
            type_name, block, nbytes = BLOCK_SIZES[qtype]
            n_in, n_out = dims  # GGUF lists the fastest dimension first
            blocks = torch.empty(n_out, n_in // block * nbytes, dtype=torch.uint8)
            f.seek(data_start + offset)
            if f.readinto(blocks.numpy()) != blocks.numel():
                raise ValueError(f"{path}: tensor {gname} is cut short")
            if arch == "llama" and ".attn_q." in gname:
                blocks = torch.from_numpy(np.ascontiguousarray(unpermute_rows(blocks.numpy(), num_heads)))
            elif arch == "llama" and ".attn_k." in gname:
                blocks = torch.from_numpy(np.ascontiguousarray(unpermute_rows(blocks.numpy(), num_kv_heads)))
            out[name] = BlockWeight(blocks, qtype, type_name, n_in)
    return out, other


def _type_name(qtype: int) -> str:
    """GGML's name of a type id (F16, Q2_K, ...), for the weights that stay dequantized."""
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


# GGUF's metadata value types: fixed sizes by type id (8 is a string, 9 an array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_infos(f) -> tuple[str, list[tuple[str, tuple[int, ...], int, int]], int]:
    """(general.architecture, [(name, dims, GGML type, offset in the data)], where the data starts)
    from a GGUF file's header (version 2 or 3), skipping every other metadata value unparsed."""
    import struct

    def u32():
        return struct.unpack("<I", f.read(4))[0]

    def u64():
        return struct.unpack("<Q", f.read(8))[0]

    def text():
        return f.read(u64()).decode("utf-8", "replace")

    def skip(vtype):
        if vtype == 8:
            f.seek(u64(), 1)
        elif vtype == 9:
            inner, count = u32(), u64()
            if inner in _SIZES:
                f.seek(_SIZES[inner] * count, 1)
            else:
                for _ in range(count):
                    skip(inner)
        elif vtype in _SIZES:
            f.seek(_SIZES[vtype], 1)
        else:
            raise ValueError(f"unknown GGUF metadata type {vtype}")

    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    version = u32()
    if version < 2:
        raise ValueError(f"GGUF version {version} is not read here")
    n_tensors, n_kv = u64(), u64()
    arch, alignment = "", 32
    for _ in range(n_kv):
        key, vtype = text(), u32()
        if key == "general.architecture" and vtype == 8:
            arch = text()
        elif key == "general.alignment" and vtype in (4, 5):
            alignment = u32()
        else:
            skip(vtype)
    tensors = []
    for _ in range(n_tensors):
        name = text()
        dims = tuple(u64() for _ in range(u32()))
        qtype, offset = u32(), u64()
        tensors.append((name, dims, qtype, offset))
    data_start = -(-f.tell() // alignment) * alignment
    return arch, tensors, data_start
