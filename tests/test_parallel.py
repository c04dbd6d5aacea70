"""The data-parallel pieces of `eagle2 train` in two real gloo processes: the process group the
launcher's environment forms (world size 2, one rank each, disjoint shares of the data), the
token-weighted gradient average, and the end-of-training check that fails when replicas diverge."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# imported here, before the fork, so the children inherit it (importing eagle2_core in each child
# took about 12 s of this test's 16 s on 2 cores)
from eagle2_core.train.parallel import check_replicas_agree, sync_gradients, world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    w = world("cpu")
    results[f"world{rank}"] = (w.rank, w.size, dist.is_initialized() and dist.get_world_size())
    results[f"share{rank}"] = w.share(list(range(7)))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)       # rank 0: g, rank 1: 2g
    tokens = [10.0, 30.0][rank]
    total, (extra,) = sync_gradients(w, [p], tokens, [float(rank + 1)])
    results[f"grad{rank}"] = p.grad.tolist()
    results[f"total{rank}"] = total
    results[f"extra{rank}"] = extra
    q = torch.nn.Parameter(torch.ones(2))
    check_replicas_agree(w, [q])                               # equal replicas pass
    q.data += rank                                             # now they differ
    try:
        check_replicas_agree(w, [q])
        results[f"caught{rank}"] = False
    except RuntimeError:
        results[f"caught{rank}"] = True
    dist.destroy_process_group()


def test_token_weighted_average_and_divergence_check():
    # fork, not spawn: the children start from this process with torch and eagle2_core already
    # imported. The process group itself is formed by `world()` from the environment, as under
    # a launcher.
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), results), nprocs=2, join=True, start_method="fork")
        results = dict(results)
    # one process group of two, each process its own rank (two single-process runs would show
    # size 1, rank 0 twice)
    assert results["world0"] == (0, 2, 2) and results["world1"] == (1, 2, 2)
    # disjoint shares that together are the whole list
    assert results["share0"] == [0, 2, 4, 6] and results["share1"] == [1, 3, 5]
    # (10 * g + 30 * 2g) / 40 = 1.75 g on both replicas
    for r in (0, 1):
        assert results[f"grad{r}"] == [1.75, 3.5, 5.25]
        assert results[f"total{r}"] == 40.0 and results[f"extra{r}"] == 3.0
        assert results[f"caught{r}"] is True
