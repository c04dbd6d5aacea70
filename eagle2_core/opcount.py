"""Counting what a decoding cycle dispatches: the CPU-side check of the GPU path.

On a GPU every aten op of a cycle is a kernel launch with host work around it, and every op
that reads a device value on the host is a synchronisation. A `TorchDispatchMode` sees each op
on any device, so the counts below, taken on a CPU, say what a GPU would launch and where it
would wait: tests assert a graph-mode cycle has the same ops whatever was accepted and no host
read outside its one designated point; `compare --json` reports the counts per cycle.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose result the host must wait for (a sync on a GPU), or whose output shape depends on data
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
              "masked_select", "equal", "is_nonzero", "_assert_async", "bincount", "histc"}


def _is_host_read(func, args, kwargs) -> str | None:
    name = func.overloadpacket.__name__
    if name in HOST_READS:
        return name
    if name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor) and "output_size" not in (kwargs or {}):
        if len(args) > 1 and isinstance(args[1], torch.Tensor) or args[0].dtype in (torch.long, torch.int):
            return "repeat_interleave(tensor repeats)"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        idx = args[1] if len(args) > 1 else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
            return f"{name}(boolean mask)"
    if name in ("copy_", "_to_copy", "to"):
        src = args[1] if name == "copy_" else args[0]
        dst_dev = args[0].device if name == "copy_" else (kwargs or {}).get("device")
        if isinstance(src, torch.Tensor) and dst_dev is not None and torch.device(dst_dev) != src.device:
            return f"{name}({src.device}->{dst_dev})"
    if name == "lift_fresh":  # a tensor made from Python data (torch.tensor(list)): a host->device copy on a GPU
        return "lift_fresh(torch.tensor from host data)"
    return None


class OpCounter(TorchDispatchMode):
    """Records every aten op dispatched while active, by stage, and the host-reading ones."""

    def __init__(self):
        super().__init__()
        self.stage = "other"
        self.designated = False
        self.ops: dict[str, list[str]] = {}
        self.host_reads: dict[str, list[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.designated:
            self.ops.setdefault(self.stage, []).append(str(func.overloadpacket.__name__))
            read = _is_host_read(func, args, kwargs)
            if read:
                self.host_reads.setdefault(self.stage, []).append(read)
        return func(*args, **(kwargs or {}))

    def staged(self, stage: str, fn, *args):
        self.stage = stage
        try:
            with self:
                return fn(*args)
        finally:
            self.stage = "other"

    def exempt(self, fn, *args):
        """The cycle's one designated host read (`cycle.Cycle.read_back`)."""
        self.designated = True
        try:
            return fn(*args)
        finally:
            self.designated = False


@contextmanager
def counting(engine, counter: OpCounter):
    """Route the engine's cycle stages (draft, verify) and its one designated read through `counter`."""
    engine.counter = counter
    if engine.cycle is not None:
        engine.cycle.counter = counter
    try:
        yield counter
    finally:
        engine.counter = None
        if engine.cycle is not None:
            engine.cycle.counter = None


def cycle_ops(decoder, prompt_ids, gen, cycles: int = 6) -> list[dict]:
    """Per steady-state cycle (the first cycle, which absorbs the prompt, is skipped): aten ops
    dispatched to draft and to verify, the host reads among them, and the tokens accepted."""
    out = []
    with counting(decoder, OpCounter()) as counter:
        stream = decoder.stream(prompt_ids, gen)
        next(stream)  # prefill
        for k, ev in enumerate(stream):
            if not hasattr(ev, "accepted"):
                break
            if k > 0:
                out.append({"accepted": ev.accepted, "draft_ops": len(counter.ops.get("draft", [])),
                            "verify_ops": len(counter.ops.get("verify", [])), "ops": dict(counter.ops),
                            "host_reads": {s: list(v) for s, v in counter.host_reads.items()}})
            counter.ops, counter.host_reads = {}, {}
            if len(out) >= cycles:
                break
        stream.close()
    return out
