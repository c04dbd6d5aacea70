"""The KV cache of the decoding cycle (cycle.py): [B, heads, capacity, dim] per layer, one row per sequence.

Cell c of a row holds what its sequence keeps at cache index c; the cycle (not the cache)
knows each row's length. Every forward names the cells it writes (`cells`, [B, n]; or, for one
row's prefill, `row` and `cells` [n]) and how many cells attention reads (`view`); a tree's
rows are written after the row's context and the accepted path is moved into place
(`commit`, section 3 of EAGLE-2), so a rejected node costs nothing to undo. Sliding windows
are applied by the mask, so every cell is kept.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .target import text_config


class KVLayer(CacheLayerMixin):
    """K/V buffers [B, heads, capacity, dim]; rows are written at the owner's `cells` [B, n] (or,
    for one row's prefill, `row` and `cells` [n]) and attention reads the first `view` cells."""
    is_sliding = False  # every position is kept; sliding windows are applied by the mask
    is_compileable = True
    is_croppable = False  # transformers' crop drops positions of every row; ours are cropped per row (KVCache.crop)

    def __init__(self, owner: "KVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states) -> None:
        o = self.owner
        self.device = key_states.device
        self.keys = torch.zeros(o.batch, key_states.shape[1], o.capacity, key_states.shape[3], dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(o.batch, value_states.shape[1], o.capacity, value_states.shape[3], dtype=value_states.dtype, device=self.device)
        if o.static and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.keys)  # CUDA graphs must see one address on every replay
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if o.row is not None:  # one sequence's prefill into its own row
            self.keys[o.row].index_copy_(1, o.cells, key_states[0])
            self.values[o.row].index_copy_(1, o.cells, value_states[0])
            return self.keys[o.row : o.row + 1, :, : o.view], self.values[o.row : o.row + 1, :, : o.view]
        if o.start is not None:  # live mode, one row: its new cells follow a length the host knows (a slice copy)
            end = o.start + key_states.shape[2]
            self.keys[:, :, o.start : end] = key_states
            self.values[:, :, o.start : end] = value_states
        else:  # fixed mode, or rows at different lengths: each row at its own cells
            rows = torch.arange(o.batch, device=self.device)[:, None]
            # advanced indices around a slice put their dims first: [B, n, heads, dim]
            self.keys[rows, :, o.cells] = key_states.transpose(1, 2)
            self.values[rows, :, o.cells] = value_states.transpose(1, 2)
        return self.keys[:, :, : o.view], self.values[:, :, : o.view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.view, 0

    def get_seq_length(self) -> int:
        raise RuntimeError("this cache keeps its lengths per row; pass position_ids")

    def get_max_length(self) -> int:
        return self.owner.capacity


class KVCache(Cache):
    """One `KVLayer` per decoder layer, written at the same cells each forward. `static`: the
    buffers keep their addresses (fixed mode; a capacity bucket change makes new ones)."""

    def __init__(self, num_layers: int, batch: int, capacity: int, static: bool = False):
        self.batch, self.capacity, self.static = batch, capacity, static
        self.cells, self.row, self.view = None, None, capacity
        self.start = None  # live mode at batch 1: the first cell written, known on the host (cells then unused)
        super().__init__(layers=[KVLayer(self) for _ in range(num_layers)])

    def _each(self, fn) -> None:
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)
                if self.static:  # new buffers: a CUDA-graph replay reads them in place, not copied in
                    torch._dynamo.mark_static_address(layer.keys)
                    torch._dynamo.mark_static_address(layer.values)

    def commit(self, src, dst: torch.Tensor | None = None) -> None:
        """Per row b, move cells src[b] to dst[b] (the accepted path into place; the rest is
        dropped: section 3), all layers. The right side is gathered (copied) first.

        With `start` set (live mode, one row: dst = start, start + 1, ...) only the cells that are
        not in place move. A path's node indices grow with its depth (parents come first) and the
        tree is in best-first order, so the accepted path is often the tree's first nodes, already
        where it is kept: then nothing moves (the per-layer copies were a visible share of a drafting
        cycle on SmolLM2, docs/benchmarks.md). The path's padding (the root again, past the accepted nodes) need not
        move either: no cell past the committed length is read before the next forward writes it.
        With `start` set, `src` may be the one row's cells as a list (a host-side verify's; no `dst`)."""
        if self.start is not None and (isinstance(src, list) or src.device.type == "cpu"):  # (on a GPU the list would be a second sync)
            s = src if isinstance(src, list) else src[0].tolist()
            move = [i for i in range(1, len(s)) if s[i] != s[0] and s[i] != self.start + i]
            if not move:
                return
            dev = src.device if isinstance(src, torch.Tensor) else None
            frm = torch.tensor([s[i] for i in move], device=dev)
            to = torch.tensor([self.start + i for i in move], device=dev)
            for layer in self.layers:
                if layer.is_initialized:
                    for buf in (layer.keys, layer.values):
                        buf.index_copy_(2, to, buf.index_select(2, frm))
            return
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for layer in self.layers:
            if layer.is_initialized:
                for buf in (layer.keys, layer.values):
                    if self.start is not None:
                        buf[:, :, self.start : self.start + dst.shape[1]] = buf.index_select(2, src[0])
                    else:
                        buf[rows, :, dst] = buf[rows, :, src]

    def crop(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` cells; the rest are zeroed, all layers, as a fresh
        cache holds them. In place: a fixed-mode capture keeps reading the same buffers."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[row, :, length:] = 0
                layer.values[row, :, length:] = 0

    def copy_row(self, src: int, dst: int) -> None:
        """Row `dst` becomes a copy of row `src` (every cell, all layers), in place; with `crop`,
        a sequence can start from another's prefix without running it again."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]

    def take(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row `row`'s first `length` cells, per layer ([heads, length, dim] K and V): what a
        kept sequence holds (prefix.py). A copy, since the row soon holds another sequence."""
        return [(layer.keys[row, :, :length].clone(), layer.values[row, :, :length].clone())
                for layer in self.layers if layer.is_initialized]

    def put(self, row: int, kept: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Row `row`'s first `length` cells from `kept` (`take`'s copies), in place (a fixed-mode
        capture keeps reading the same buffers). Cells past `length` are left to the next forward."""
        if len(self.layers) != len(kept):
            raise ValueError(f"a kept sequence has {len(kept)} layers, this cache {len(self.layers)}")
        for layer, (k, v) in zip(self.layers, kept):
            if not layer.is_initialized:  # a fresh cycle (another engine kept it): buffers shaped as its cells
                layer.lazy_initialization(k[None], v[None])
            layer.keys[row, :, :length] = k[:, :length]
            layer.values[row, :, :length] = v[:, :length]

    def resize(self, capacity: int) -> None:
        """`capacity` cells per row: the first cells kept (all of them, or as many as fit), new ones zero."""
        def resized(t):
            new = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
            keep = min(capacity, t.shape[2])
            new[:, :, :keep] = t[:, :, :keep]
            return new
        self._each(resized)
        self.capacity = capacity

    def compact(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order: a smaller batch once rows go idle."""
        self._each(lambda t: t.index_select(0, rows))
        self.batch = int(rows.numel())

    def widen(self, batch: int) -> None:
        """Idle rows appended up to `batch` (a new run after a compacted one)."""
        self._each(lambda t: torch.cat([t, t.new_zeros(batch - t.shape[0], *t.shape[1:])]))
        self.batch = batch


def num_cache_layers(config) -> int:
    return text_config(config).num_hidden_layers
