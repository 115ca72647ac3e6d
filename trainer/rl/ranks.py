"""Who does what when several processes train, and how they stop together when one fails.

Roles (``torchrun`` starts data_parallel x tensor_parallel ranks): rank 0 talks to the sidecars,
generates, rewards, evaluates and writes the run directory, and `share`s each step's batch and
metrics; the ranks of data-parallel replica 0 walk the weight export with it (`walks_export`:
the export all-gathers tensor-parallel shards, a collective of that replica's group only); every
rank trains its replica's share.

Failure: collectives wait for every peer, so one rank that raises or dies would leave the others
blocked until the process group's timeout (minutes: the longest legitimate wait is rank 0
generating a batch). `RankWatchdog` bounds that wait. A thread on every rank beats a counter in the
rendezvous store (torchrun's, or the TCP store of ``init_distributed``) once a second and
watches the others'. A rank whose step raises records "rank r: <error>" in the store (`fail`)
before it unwinds; every other rank's watchdog reads it within a beat, prints that one message
and exits (after its cleanup callbacks: rank 0 stops its local sidecars). A rank killed outright
stops beating: its peers' collectives fail at once (its sockets close), or else its silence
exceeds ``train.rank_timeout_s``; either way the first rank to notice records it and all exit.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

from sidecar.errors import SpecrlError
from trainer.policy import platform

if TYPE_CHECKING:
    from trainer.policy.policy import Policy

log = logging.getLogger(__name__)

T = TypeVar("T")

ABORT_KEY = "specrl/watchdog/abort"
EXIT_CODE = 17
"""Exit status of a rank stopped because another rank failed (distinct from the failing rank's 1)."""


class RankFailure(SpecrlError):
    """Another rank of this run failed; the message is its error."""


def is_leader() -> bool:
    """Rank 0 of the process group, or a process without one."""
    return not dist.is_initialized() or dist.get_rank() == 0


def multi_process() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def share(obj: T) -> T:
    """Rank 0's `obj` on every rank (a broadcast when several processes train; else `obj`)."""
    if multi_process():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj


def on_leader(fn: Callable[[], T]) -> T | None:
    """Run `fn` on rank 0 only; if it raises, every rank raises it (nobody waits in a collective
    for a rank that has already given up)."""
    result: T | None = None
    error: BaseException | None = None
    if is_leader():
        try:
            result = fn()
        except Exception as e:  # handed to every rank below, then raised everywhere
            error = e
    if multi_process():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error
    return result


def join_torchrun_group() -> None:
    """Under torchrun (WORLD_SIZE > 1 in the environment), join its process group before the
    policy would otherwise make a world of one per process."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        platform.init_distributed_from_env()


def walks_export(policy: Policy) -> bool:
    """Whether this rank takes part in the weight export: rank 0 and its tensor-parallel peers
    (data-parallel replica 0); the other replicas hold the same weights and skip it."""
    from megatron.core import parallel_state

    return policy.cfg.data_parallel == 1 or parallel_state.get_data_parallel_rank() == 0


def drain_export(policy: Policy) -> None:
    """Ranks > 0 of replica 0: follow rank 0's export (its all-gathers need this rank's shard)."""
    if walks_export(policy):
        for _ in policy.export_named_tensors():
            pass


def collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed on the transport (gloo raises a plain
    RuntimeError naming itself, NCCL and the store a DistError), as when a peer process dies."""
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(w in text for w in ("gloo", "NCCL", "Connection reset", "Connection closed"))
    )


class RankWatchdog:
    """Heartbeats and the shared abort record (module docstring). A context manager: the thread
    runs while the run does; `fail` records this rank's error for the others."""

    def __init__(self, *, timeout_s: float, interval_s: float = 1.0) -> None:
        if not multi_process():
            raise RuntimeError("RankWatchdog needs a process group of more than one rank")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = timeout_s
        self.interval_s = min(interval_s, timeout_s / 4)
        self._store = dist.distributed_c10d._get_default_store()
        self._cleanups: list[Callable[[], None]] = []
        self._recorded: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specrl-rank-watchdog", daemon=True)

    def at_abort(self, fn: Callable[[], None]) -> None:
        """Call `fn` before this process exits because another rank failed (e.g. stop sidecars)."""
        self._cleanups.append(fn)

    def __enter__(self) -> RankWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)

    def fail(self, error: BaseException) -> RankFailure | None:
        """Record this rank's `error` for every rank (the first record wins). Returns the
        RankFailure to raise instead when another rank failed first (its error is the cause) or
        a dead peer was found to be the cause; None: raise `error` itself.

        A failed collective usually means a peer died: the peers whose heartbeat stops within a
        few beats are named as the cause."""
        mine = f"rank {self.rank}: {type(error).__name__}: {error}"
        diagnosed = False
        if collective_failure(error):
            silent = self.silent_peers()
            if silent:
                diagnosed = True
                mine = (
                    f"rank {', '.join(map(str, silent))} died (heartbeat stopped); rank {self.rank}'s "
                    f"collective failed: {type(error).__name__}: {error}"
                )
        self._recorded = mine
        try:
            first = self._store.compare_set(ABORT_KEY, "", mine).decode()
        except Exception:  # the store is gone with rank 0's process: nothing to record into
            first = mine
        self._linger()
        if first == mine:
            return RankFailure(mine) if diagnosed else None
        return RankFailure(f"stopped because {first}")

    def _linger(self) -> None:
        """Rank 0 may host the store (``init_distributed``; under torchrun the agent does): it
        stays two beats longer, so every other rank reads the record before the store goes."""
        if self.rank == 0:
            time.sleep(2 * self.interval_s)

    def silent_peers(self, beats: int = 3) -> list[int]:
        """Peers whose heartbeat does not move during `beats` intervals (their process is gone)."""
        try:
            before = {p: self._store.add(self._beat_key(p), 0) for p in range(self.world) if p != self.rank}
            time.sleep(beats * self.interval_s)
            return [p for p, n in before.items() if self._store.add(self._beat_key(p), 0) == n]
        except Exception:  # no store: rank 0 is gone (with the store it hosted)
            return [0]

    def _beat_key(self, rank: int) -> str:
        return f"specrl/watchdog/beat/{rank}"

    def _watch(self) -> None:
        now = time.monotonic()
        last = dict.fromkeys(range(self.world), -1)
        seen = dict.fromkeys(range(self.world), now)
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self._beat_key(self.rank), 1)
                if self._store.check([ABORT_KEY]):
                    first = self._store.get(ABORT_KEY).decode()
                    if first != self._recorded:
                        self._exit(f"stopped because {first}")
                    return  # this rank failed first: its main thread raises its own error
                now = time.monotonic()
                for peer in range(self.world):
                    if peer == self.rank:
                        continue
                    beats = self._store.add(self._beat_key(peer), 0)
                    if beats != last[peer]:
                        last[peer], seen[peer] = beats, now
                    elif now - seen[peer] > self.timeout_s:
                        message = (
                            f"rank {peer}: silent for {self.timeout_s:.0f}s (train.rank_timeout_s): its "
                            "process died or hangs; see its log"
                        )
                        self._store.compare_set(ABORT_KEY, "", message)
                        self._exit(f"stopped because {self._store.get(ABORT_KEY).decode()}")
            except Exception as e:  # the store lives with rank 0 (or torchrun's agent): it is gone
                if self._stop.is_set():
                    return
                self._exit(f"stopped because the rendezvous store is unreachable ({e}): rank 0 or its node is gone")

    def _exit(self, message: str) -> None:
        print(f"specrl train: rank {self.rank} {message}", file=sys.stderr, flush=True)
        for fn in self._cleanups:
            try:
                fn()
            except Exception as e:  # best effort: the process exits either way
                print(f"specrl train: rank {self.rank}: cleanup failed: {e}", file=sys.stderr, flush=True)
        self._linger()
        os._exit(EXIT_CODE)
