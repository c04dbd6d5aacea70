"""Data parallelism for `eagle2 train` under the launchers users already have.

`accelerate launch --multi_gpu --num_processes N` (or `torchrun --nproc_per_node N`, or a
multi-node launch) starts N copies of the same command with RANK / WORLD_SIZE set; each copy
extracts its share of the feature shards, trains on its share of every batch, and the replicas
stay identical by averaging gradients after each backward. There is no launcher of our own and
no wrapper around the head: one all-reduce per step, of a flat buffer holding every gradient and
the step's token count, so the step is the one a single process would take over the whole batch.
On CPU-only machines the processes talk through gloo; on GPUs through NCCL.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class ProcessGroupError(ValueError):
    """The launcher asked for several processes and they could not join up (one line for the
    user: `eagle2 train` reports ValueErrors as such)."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def share(self, items: list) -> list:
        """This process's share of a list (every size-th item, from its rank)."""
        return items[self.rank :: self.size]


def world(device: str | torch.device | None = None) -> World:
    """The process group this run is part of, started from the launcher's environment if needed."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ProcessGroupError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None
    if size <= 1:
        return World()
    # A launcher asked for `size` processes: training alone would give each of them the whole
    # data and N heads written over each other, so a group that cannot form stops the run.
    if not dist.is_available():
        raise ProcessGroupError(f"WORLD_SIZE={size} but this torch has no torch.distributed; "
                                "run without the launcher or install a torch with distributed support")
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    backend = "nccl" if on_gpu else "gloo"
    try:
        dist.init_process_group(backend)
    except Exception as e:  # noqa: BLE001 - missing MASTER_ADDR, a refused port, a timeout: all end the run here
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ProcessGroupError(f"WORLD_SIZE={size} but the {backend} process group could not be formed "
                                f"(rank {os.environ.get('RANK', '?')}, MASTER_ADDR={os.environ.get('MASTER_ADDR', 'unset')}, "
                                f"MASTER_PORT={os.environ.get('MASTER_PORT', 'unset')}): {first}") from None
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def sync_gradients(w: World, params: list[torch.Tensor], tokens: float, extras: list[float]) -> tuple[float, list[float]]:
    """Replace each replica's gradients by the token-weighted mean over all replicas.

    Each process's loss is a mean over its own `tokens`; weighting its gradient by that count
    and dividing by the total gives the gradient of the mean over the whole batch. `extras`
    (e.g. the loss times tokens, the step time) are summed along in the same all-reduce.
    Returns (total tokens, summed extras). A process with no rows in this batch adds zeros.
    """
    if w.size == 1:
        return tokens, extras
    dev = params[0].device
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() * tokens for p in params]
    flat = torch.cat(grads + [torch.tensor([tokens, *extras], dtype=grads[0].dtype, device=dev)])
    dist.all_reduce(flat)
    total = float(flat[-len(extras) - 1])
    start = 0
    for p in params:
        n = p.numel()
        g = flat[start : start + n].view_as(p) / max(total, 1.0)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        start += n
    return total, flat[-len(extras):].tolist() if extras else []


def check_replicas_agree(w: World, params: list[torch.Tensor]) -> None:
    """After training, every replica must hold the same head (a missed sync would show here)."""
    if w.size == 1:
        return
    # NCCL gathers device tensors, gloo host ones
    dev = params[0].device if dist.get_backend() == "nccl" else torch.device("cpu")
    local = torch.stack([p.detach().double().sum() for p in params]).to(dev)
    everyone = [torch.zeros_like(local) for _ in range(w.size)]
    dist.all_gather(everyone, local)
    if not all(torch.allclose(e, everyone[0], rtol=1e-6, atol=1e-6) for e in everyone):
        raise RuntimeError("data-parallel replicas of the head diverged; gradients were not synchronised")
