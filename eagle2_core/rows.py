"""The rows of a cycle (cycle.py) and their caches: each row's sequence on the host (`Slot`),
every row's state on the device (`RowState`), the target's and the head's KV caches, and the
row bookkeeping that admission, release, compaction and widening do to them (`Rows`)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from . import rowgemm
from .kvcache import KVCache


def bucket(n: int, least: int = 64) -> int:
    """The power of two >= n (and >= least): fixed mode's capacity and batch buckets."""
    return max(least, 1 << (max(1, n) - 1).bit_length())


@dataclass
class Slot:
    """One sequence in a row of the batch, on the host: its stop checks, processors, sampling, statistics."""
    key: object
    stop: object
    procs: object = None     # sampling.TargetProcessors: generation_config's processors, warpers included
    prompt: list = field(default_factory=list)
    seed: int = 0            # sampling: one uniform per output position from (seed, position)
    tokens: list = field(default_factory=list)   # emitted tokens (the root of the next cycle is the last)
    summary: object = None
    started: float = 0.0
    logprobs: int | None = None  # top alternatives per token when each token's log-probability is asked for (None: not)
    new_logprobs: list | None = None  # the last prefill's or cycle's tokens' logprobs.TokenLogprob, for the engine to take

    @property
    def host_side(self) -> bool:
        """Whether verifying this row needs host-side steps (processors, sampling, logprobs): never captured."""
        return self.logprobs is not None or (self.procs is not None and (self.procs.active or self.procs.sampling))


@dataclass
class RowState:
    """Every row's decoding state on the device, row b's at index b of each field: what a draft,
    a verify and a commit read and write. A row's sequence on the host is its `Slot`; this is
    the part the captured functions see, so it stays tensors. Pending pairs (f_t, x_{t+1}) are
    the accepted path's tokens and target features that the head has not absorbed yet."""
    seq_len: torch.Tensor        # [B] tokens in the target's cache
    root: torch.Tensor           # [B] the next tree's root: the target's last token, not yet in its cache
    head_len: torch.Tensor       # [B] pairs in the head's cache (its length)
    n_new: torch.Tensor          # [B] pending pairs (accepted + 1); >= 1 even idle: a draft gathers at n_new - 1
    active: torch.Tensor         # [B] bool: the row holds a sequence
    new_tokens: torch.Tensor     # [B, width] the pending pairs' tokens
    new_features: torch.Tensor | None = None  # [B, width, F] their features, made at the first admission

    @classmethod
    def empty(cls, batch: int, width: int, device) -> "RowState":
        z = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(seq_len=z.clone(), root=z.clone(), head_len=z.clone(), n_new=z + 1,
                   active=torch.zeros(batch, dtype=torch.bool, device=device),
                   new_tokens=torch.zeros(batch, width, dtype=torch.long, device=device))

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows, in this order (`Rows.compact`)."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                setattr(self, f.name, t.index_select(0, rows))

    def widen(self, extra: int) -> None:
        """`extra` idle rows appended (`Rows.widen`)."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                fill = (t.new_ones if f.name == "n_new" else t.new_zeros)(extra, *t.shape[1:])
                setattr(self, f.name, torch.cat([t, fill]))


class Rows:
    """B rows: their slots, their state, the target's cache and (when a head drafts) the head's,
    sized together. Live mode grows and shrinks the buffers with the rows; fixed mode keeps
    power-of-two buckets, since captured cycles read the buffers in place."""

    def __init__(self, run, batch: int, capacity: int, width: int, margin: int, *, fixed: bool, cache_layers: int,
                 head_cache: bool):
        self.run, self.batch, self.width, self.margin, self.fixed = run, batch, width, margin, fixed
        self.capacity = self._capacity(capacity)
        self.cache = KVCache(cache_layers, batch, self.capacity, static=fixed)
        self.hcache = KVCache(1, batch, self.capacity, static=fixed) if head_cache else None
        self.state = RowState.empty(batch, width, run.device)
        self.slots: list[Slot | None] = [None] * batch
        self.host_len = [0] * batch  # mirrors of seq_len from the read-back, for the live view

    def _capacity(self, need: int) -> int:
        need = need + self.margin
        return bucket(need) if self.fixed else need

    @property
    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.slots)

    def busy_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is not None]

    def reset(self) -> None:
        """Every row free; idle rows keep their lengths (their cells stay inside the view)."""
        st = self.state
        self.slots = [None] * self.batch
        st.active.zero_()
        st.seq_len.zero_()
        self.host_len = [0] * self.batch
        if st.new_tokens.shape[1] != self.width:  # a run that went plain left one-token rows
            st.new_tokens = torch.zeros(self.batch, self.width, dtype=torch.long, device=self.run.device)

    def ensure_capacity(self, need: int) -> None:
        """Room for `need` cells per row and one tree past them. Live mode doubles: growing by
        what each cycle adds would copy every buffer every cycle."""
        cap = self._capacity(min(need, self.run.max_positions))
        if cap > self.capacity:
            cap = cap if self.fixed else max(cap, 2 * self.capacity)
            self._resize(cap)

    def _resize(self, cap: int) -> None:
        for c in (self.cache, self.hcache):
            if c is not None:
                c.resize(cap)
        self.capacity = cap

    def fit(self) -> None:
        """Live mode: shrink the buffers once the busy rows need a quarter of them or less (a long
        sequence left, or the run ended), to twice what they need, so that one long request does
        not make every later cycle copy, widen and hold its cells. Fixed mode keeps its bucket:
        captured cycles read these buffers in place."""
        if self.fixed:
            return
        want = self._capacity(min(max((self.host_len[i] + 1 for i, s in enumerate(self.slots) if s is not None), default=0),
                                  self.run.max_positions))
        if self.capacity > 4 * want:
            st = self.state
            for i, s in enumerate(self.slots):
                if s is None:  # an idle row still runs in every forward, at its own cells: from cell 0 it needs no room
                    st.seq_len[i], st.head_len[i], st.n_new[i], self.host_len[i] = 0, 0, 1, 0
            self._resize(2 * want)
            rowgemm.trim_heap()  # the long rows' step temporaries were freed to the C heap, which keeps them resident

    def occupy(self, b: int, slot: Slot, n: int, root: int) -> None:
        """Row b holds `slot`, whose prompt of `n` tokens is in the target's cache."""
        st = self.state
        st.seq_len[b], st.root[b], st.active[b] = n, root, True
        self.host_len[b] = n
        self.slots[b] = slot

    def release(self, b: int) -> Slot:
        slot, self.slots[b] = self.slots[b], None
        self.state.active[b] = False
        return slot

    def take(self, b: int, ids: list[int]):
        """Row b's cells as a kept sequence (prefix.Kept) of `ids`: as many as the target's cache
        holds, and the head's cell t holding (f_t, x_{t+1}), at most len - 1 of its absorbed cells."""
        from .prefix import Kept

        length = min(self.host_len[b], len(ids))
        head, head_len = None, 0
        if self.hcache is not None and self.hcache.layers[0].is_initialized:
            head_len = max(0, min(int(self.state.head_len[b]), length - 1))
            head = self.hcache.take(b, head_len)
        return Kept(tuple(ids[:length]), self.cache.take(b, length), head, head_len)

    def compact(self, keep: list[int]) -> None:
        """Keep only rows `keep` (busy ones, and in fixed mode idle ones up to the batch bucket)."""
        rows = torch.tensor(keep, dtype=torch.long, device=self.run.device)
        for c in (self.cache, self.hcache):
            if c is not None:
                c.compact(rows)
        self.state.keep(rows)
        self.slots = [self.slots[i] for i in keep]
        self.host_len = [self.host_len[i] for i in keep]
        self.batch = len(keep)

    def widen(self, batch: int) -> None:
        """Back to `batch` rows for a new run (after `compact`): the shapes captured before stay valid."""
        extra = batch - self.batch
        for c in (self.cache, self.hcache):
            if c is not None:
                c.widen(batch)
        self.state.widen(extra)
        self.slots += [None] * extra
        self.host_len += [0] * extra
        self.batch = batch

    def span(self, extra: int) -> int:
        """Cells attention reads when `extra` rows follow each row's context: the whole bucket in
        fixed mode (one shape), else the longest live row plus those rows."""
        return self.capacity if self.fixed else min(self.capacity, max(self.host_len) + extra)

    def observe(self, scores, path) -> None:
        """Calibration evidence for compare's table (section 3): each drafted node's path
        probability and whether it was accepted."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        # paths are padded with the root (column 0, dropped below), so one scatter marks each row's path
        on = torch.zeros(len(busy), scores.shape[1], dtype=torch.float, device=scores.device).scatter_(1, path[busy], 1.0)
        probs = scores[busy, 1:].exp()
        for j, i in enumerate(busy):
            self.slots[i].summary.record_confidence(probs[j], on[j, 1:])
