"""Run a test's worker function in N spawned processes that form one gloo group.

Shared by the multi-process tests (tensor-parallel Muon, the TP/DP trainer bridge). Workers join
over a TCP store on 127.0.0.1 (``trainer.platform.init_distributed``) and meet at a barrier before
tearing the group down, so no rank closes its gloo pairs while a peer is still in a collective.
The parent never waits forever: a worker that hangs is killed and the test fails saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer import platform


def spawn(worker: Callable[..., None], args: tuple[Any, ...], *, nprocs: int, timeout_s: float = 180.0) -> None:
    """Call ``worker(rank, port, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    A worker that raises or dies fails the test (torch reports which rank and why); one still
    running after ``timeout_s`` is killed and the test fails.
    """
    ctx = mp.start_processes(
        worker, args=(platform.free_port(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"{nprocs} workers of {worker.__name__} did not finish within {timeout_s:.0f} s")


def join_group(rank: int, world_size: int, port: int) -> None:
    """The worker side: join the gloo group that ``spawn`` set up."""
    platform.init_distributed(rank=rank, world_size=world_size, port=port)


def leave_group() -> None:
    """The worker side, on success: wait for every rank, then destroy the groups."""
    dist.barrier()
    platform.teardown()
