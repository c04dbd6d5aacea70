"""Kept sequences (a prefix cache): finished requests' KV, looked up by token ids.

A request that asks to be kept leaves, when it ends, a copy of its row's target KV and draft-head
KV under the token ids those cells hold (`Kept`). A later request whose ids start with a kept
sequence's ids restores the longest common prefix instead of prefilling it again (engine.py
decides how much, cycle.py's `admit` restores and runs the rest). Matching is by token ids, never
by text: the same text can encode to other ids, and a cache entry is only valid for its own ids.

Memory is bounded: entries are copies (a row of the cycle is soon another sequence's), counted
in bytes against a budget, and the least recently used go first. An entry whose ids are a prefix
of a newer entry's is dropped when the newer one is kept (a conversation keeps one entry, its
latest turn). No terminal code, no decoding: a store of tensors.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

DEFAULT_BUDGET_MB = 1024  # about 22k tokens of SmolLM2-135M (46 KB a token), 2k of a 7B (0.5 MB a token)


def default_budget_mb() -> float:
    """DEFAULT_BUDGET_MB, or an eighth of this machine's memory where that is less."""
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):  # not every platform says
        return DEFAULT_BUDGET_MB
    return min(DEFAULT_BUDGET_MB, total / 8)


def common_prefix(a, b) -> int:
    """The number of leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    # one vectorised comparison: conversations run to thousands of ids, and every admit scans the store
    x = torch.as_tensor(a[:n], dtype=torch.long)
    y = torch.as_tensor(b[:n], dtype=torch.long)
    diff = (x != y).nonzero()
    return n if diff.numel() == 0 else int(diff[0, 0])


@dataclass
class Kept:
    """One kept sequence: `ids` (the tokens of the target's valid cells), the target's K/V per layer
    ([heads, len(ids), dim] each), and the head's first `head_len` cells (None: none kept, e.g. a
    run that stopped drafting). Head cell t holds the pair (f_t, x_{t+1}), so head_len < len(ids)."""
    ids: tuple[int, ...]
    target: list[tuple[torch.Tensor, torch.Tensor]]
    head: list[tuple[torch.Tensor, torch.Tensor]] | None
    head_len: int
    nbytes: int = field(init=False)

    def __post_init__(self):
        tensors = [t for kv in self.target + (self.head or []) for t in kv]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Kept sequences under a byte budget, least recently used evicted first. Thread-safe: a
    server's handlers read its statistics while the engine thread adds and looks up."""

    def __init__(self, budget_mb: float | None = None):
        self.budget = int((default_budget_mb() if budget_mb is None else budget_mb) * 2**20)
        self.entries: OrderedDict[tuple[int, ...], Kept] = OrderedDict()
        self.bytes = 0
        self.queries = self.hits = self.reused_tokens = self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, ids) -> tuple[Kept | None, int]:
        """The kept sequence sharing the longest prefix with `ids`, and that length (0: none).
        The one found becomes the most recently used."""
        best, length = None, 0
        with self._lock:
            self.queries += 1
            for entry in self.entries.values():
                n = common_prefix(entry.ids, ids)
                if n > length:
                    best, length = entry, n
            if best is not None:
                self.entries.move_to_end(best.ids)
        return best, length

    def record_hit(self, reused: int) -> None:
        """A lookup that the engine used: `reused` cells were restored, not prefilled."""
        with self._lock:
            if reused > 0:
                self.hits += 1
                self.reused_tokens += reused

    def add(self, entry: Kept) -> bool:
        """Keep `entry`; False when it alone exceeds the budget (then nothing changes)."""
        if entry.nbytes > self.budget or not entry.ids:
            return False
        with self._lock:
            # entries that are prefixes of this one are covered by it: drop them
            for ids in [k for k in self.entries if len(k) <= len(entry.ids) and entry.ids[: len(k)] == k]:
                self._drop(ids)
            self.entries[entry.ids] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.budget:
                self._drop(next(iter(self.entries)))
                self.evictions += 1
        return True

    def _drop(self, ids) -> None:
        entry = self.entries.pop(ids)
        self.bytes -= entry.nbytes

    def discard(self, ids) -> None:
        """Drop the entries whose ids are a prefix of `ids`."""
        ids = tuple(ids)
        with self._lock:
            for k in [k for k in self.entries if ids[: len(k)] == k]:
                self._drop(k)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.bytes = 0

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.entries), "bytes": self.bytes, "budget_bytes": self.budget, "queries": self.queries,
                    "hits": self.hits, "reused_tokens": self.reused_tokens, "evictions": self.evictions}
