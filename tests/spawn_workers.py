"""Run a test's worker function in N spawned processes that form one gloo group.

Shared by the multi-process tests (tensor-parallel Muon, the TP/DP trainer bridge). Workers join
over a TCP store on 127.0.0.1 (``trainer.policy.platform.init_distributed``) and meet at a barrier before
tearing the group down, so no rank closes its gloo pairs while a peer is still in a collective.
The parent never waits forever: a worker that hangs is killed and the test fails saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.policy import platform


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


def run_commands(
    commands: Sequence[Sequence[str]],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    envs: Sequence[dict[str, str]] | None = None,
) -> list[tuple[int, str]]:
    """Run `commands` as concurrent processes (the test's import path on PYTHONPATH, plus `env`
    and each one's `envs[i]`); returns each one's (exit code, stdout + stderr). One still running
    after `timeout_s` fails the test after every process is killed. For runs whose ranks are
    expected to exit non-zero, and for `torchrun` launches."""
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    procs = [
        subprocess.Popen(
            list(cmd),
            env={**base, **(envs[i] if envs else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, cmd in enumerate(commands)
    ]
    deadline = time.monotonic() + timeout_s
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process was still running after {timeout_s:.0f} s: {' '.join(p.args)}")
        out.append((p.returncode, text))
    return out


def python_call(function: str, *args: object) -> list[str]:
    """A command that calls `module:function(*args)` (args as strings) in a fresh interpreter."""
    module, name = function.split(":")
    call = f"import sys; from {module} import {name}; {name}(*sys.argv[1:])"
    return [sys.executable, "-c", call, *map(str, args)]
