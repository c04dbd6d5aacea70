"""A preallocated KV cache that transformers models use as their own `Cache`.

The stock forward writes into it through `Cache.update`; we add the two operations speculative
decoding needs: `keep` (compact the accepted tree nodes in place, drop the rest) and `truncate`.
Appends copy into a preallocated buffer (amortised O(1) per token, no per-step concatenation);
attention reads a view of the filled prefix, so its cost follows the real length.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .target import text_config


class TreeKVLayer(CacheLayerMixin):
    is_sliding = False  # we keep every position; sliding windows are applied by the attention mask
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.keys = torch.empty(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.empty(b, h, self.capacity, value_states.shape[-1], dtype=value_states.dtype, device=key_states.device)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = new_cap

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Move entries start+index[i] to start+i and cut the cache after them."""
        if not self.is_initialized:
            return
        m = index.numel()
        src = index.to(self.keys.device) + start
        # Gather first (index_select copies), so overlapping source/destination ranges are safe.
        self.keys[:, :, start : start + m] = self.keys.index_select(2, src)
        self.values[:, :, start : start + m] = self.values.index_select(2, src)
        self.length = start + m


class TreeKVCache(Cache):
    """One `TreeKVLayer` per decoder layer; `capacity` is a first guess and grows if exceeded."""

    def __init__(self, num_layers: int, capacity: int = 1024):
        super().__init__(layers=[TreeKVLayer(capacity) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Keep only the accepted tree nodes (paper section 3: discard rejected branches)."""
        for layer in self.layers:
            layer.keep(start, index)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.length = min(layer.length, length)


def num_cache_layers(config) -> int:
    return text_config(config).num_hidden_layers


class StaticKVLayer(CacheLayerMixin):
    """Fixed-capacity K/V buffers written at device-side slots (the GPU path, issue 16).

    Nothing here reads a device value on the host: the caller sets `slots` (a long tensor, one
    cache slot per input row) before each forward, `update` scatters the new rows there with
    `index_copy_` and returns the whole buffers, and the attention mask (built from a
    device-side length, `graphcycle.py`) hides every slot that is not context or an ancestor. The
    buffers never move or change shape, so a captured graph can keep reading them.
    """
    is_sliding = False
    is_compileable = True
    is_croppable = False

    def __init__(self, capacity: int, owner: "StaticKVCache"):
        super().__init__()
        self.capacity = capacity
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.keys = torch.zeros(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(b, h, self.capacity, value_states.shape[-1], dtype=value_states.dtype, device=key_states.device)
        if not torch.compiler.is_compiling():
            # cudagraphs must see the same addresses on every replay (not "mutation on input")
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.owner.slots, key_states)
        self.values.index_copy_(2, self.owner.slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_seq_length(self) -> int:
        raise RuntimeError("a static cache keeps its length on the device; pass position_ids")

    def get_max_length(self) -> int:
        return self.capacity

    def commit(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.is_initialized:
            # gather first (index_select copies): source and destination slots may overlap
            self.keys.index_copy_(2, dst, self.keys.index_select(2, src))
            self.values.index_copy_(2, dst, self.values.index_select(2, src))


class StaticKVCache(Cache):
    """One `StaticKVLayer` per decoder layer, all written at the same `slots` each forward."""

    def __init__(self, num_layers: int, capacity: int, device):
        self.capacity = capacity
        self.slots = torch.arange(1, device=device)
        super().__init__(layers=[StaticKVLayer(capacity, self) for _ in range(num_layers)])

    def commit(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the accepted tree rows (slots `src`) to their context slots `dst`, all layers."""
        for layer in self.layers:
            layer.commit(src, dst)
