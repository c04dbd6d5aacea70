"""A GGUF file's linear weights as its own blocks (issue 41): the bytes the block kernel reads
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
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # what block_linear reads


@dataclass
class BlockWeight:
    """One weight [out, in] as GGUF blocks: `blocks` uint8 [out, row bytes], `qtype` GGML's type id."""
    blocks: torch.Tensor
    qtype: int
    type_name: str
    in_features: int

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
    import gguf

    reader = gguf.GGUFReader(path)
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    out: dict[str, BlockWeight] = {}
    other: dict[str, str] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        type_name = t.tensor_type.name
        if type_name not in BLOCK_TYPES:
            other[name] = type_name
            continue
        n_in, n_out = int(t.shape[0]), int(t.shape[1])  # GGUF lists the fastest dimension first
        rows = np.asarray(t.data).reshape(n_out, -1)
        if arch == "llama" and ".attn_q." in t.name:
            rows = unpermute_rows(rows, num_heads)
        elif arch == "llama" and ".attn_k." in t.name:
            rows = unpermute_rows(rows, num_kv_heads)
        out[name] = BlockWeight(torch.from_numpy(np.ascontiguousarray(rows).copy()), int(t.tensor_type), type_name, n_in)
    return out, other
