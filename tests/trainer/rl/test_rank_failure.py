"""A rank that fails or dies stops every rank of the run with one error, long before the process
group's own timeout.

Three real processes (gloo, a 900 s process-group timeout) meet in a collective that rank 1
never joins: it raises, or it is SIGKILLed. Oracles: the exit codes and the one line each rank
prints, and that all of them ended before the test's deadline, a fraction of the 900 s a gloo
collective would otherwise wait. The end-to-end case (rank 0 failing mid-push in the RL loop)
is in tests/trainer/rl/test_rl_multiprocess.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from tests.spawn_workers import python_call, run_commands
from trainer.policy import platform
from trainer.rl.ranks import EXIT_CODE, RankWatchdog

WORLD = 3
GROUP_TIMEOUT_S = 900.0  # what a collective would wait for a dead peer without the watchdog
DEADLINE_S = 120.0  # imports and group setup take most of it on a loaded 2-core box


def _worker(rank_arg: str, port: str, mode: str) -> None:
    torch.set_num_threads(1)
    rank = int(rank_arg)
    platform.init_distributed(rank=rank, world_size=WORLD, port=int(port), timeout_s=GROUP_TIMEOUT_S)
    with RankWatchdog(timeout_s=10.0) as watchdog:
        try:
            dist.barrier()
            if rank == 1 and mode == "raise":
                raise RuntimeError("injected failure on rank 1")
            if rank == 1 and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(4))  # waits for rank 1, which never comes
        except BaseException as e:
            first = watchdog.fail(e)
            if first is not None:
                raise first from e
            raise
    print("finished without noticing rank 1", flush=True)


def _run(mode: str) -> list[tuple[int, str]]:
    port = platform.free_port()
    return run_commands(
        [python_call("tests.trainer.rl.test_rank_failure:_worker", r, port, mode) for r in range(WORLD)],
        timeout_s=DEADLINE_S,
    )


@pytest.mark.slow
def test_a_rank_that_raises_stops_every_rank_with_its_error() -> None:
    (c0, o0), (c1, o1), (c2, o2) = _run("raise")
    assert c1 == 1 and "RuntimeError: injected failure on rank 1" in o1, o1
    for code, text in ((c0, o0), (c2, o2)):
        assert code == EXIT_CODE, text
        assert "stopped because rank 1: RuntimeError: injected failure on rank 1" in text, text
        assert "finished without noticing" not in text


@pytest.mark.slow
def test_a_killed_rank_stops_every_rank_naming_it() -> None:
    (c0, o0), (c1, _), (c2, o2) = _run("kill")
    assert c1 == -signal.SIGKILL
    for code, text in ((c0, o0), (c2, o2)):
        assert code != 0 and "finished without noticing" not in text, text
        assert "rank 1 died" in text or "rank 1: silent" in text, text
