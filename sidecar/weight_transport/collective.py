"""The `collective` transport: tensor bytes broadcast over a torch.distributed group.

The sender is rank 0 and hosts the rendezvous store (a `TCPStore`); each sidecar joins as the
rank the control plane tells it (`PrepareTransport`). The group is a standalone process group
built from that store (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU: the same code), so
it never touches a process's default group (a Megatron trainer has its own). Every wait is
bounded by the group's timeout: joining, and each broadcast.

Tensors are broadcast in manifest order, packed into buckets of at most `bucket_bytes`
(consecutive small tensors share one broadcast: at the demo's size per-call costs dominate, not
bytes); a tensor larger than a bucket is broadcast alone, straight from its own bytes into the
receiver's staging buffer. Both sides derive the same buckets from the manifest (`plan_buckets`).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sidecar.errors import InvalidRequestError, TransportUnavailableError
from sidecar.types import TensorSpec

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
DEFAULT_BUCKET_BYTES = 64 << 20


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Tensor indices per bucket, in manifest order: consecutive tensors while they fit in
    `bucket_bytes`; a larger tensor alone. Empty tensors ride along (0 bytes)."""
    if bucket_bytes <= 0:
        raise InvalidRequestError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        n = spec.wire_length
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


@dataclass(kw_only=True, slots=True)
class CollectiveGroup:
    """One member's handle on a broadcast group."""

    group_id: str
    backend: str
    rank: int
    world_size: int
    timeout_s: float
    pg: Any
    """A standalone c10d backend (ProcessGroupGloo / ProcessGroupNCCL), not a registered group."""
    store: dist.Store
    host: str
    port: int

    @property
    def device(self) -> torch.device:
        """Where broadcast buffers live: the current GPU for NCCL, the CPU for gloo."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, buffer: torch.Tensor, what: str) -> None:
        """Broadcast `buffer` from rank 0 (send on rank 0, receive into it elsewhere), waiting at
        most the group's timeout. TransportUnavailableError if a peer is gone or too slow."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            work = self.pg.broadcast([buffer], opts)
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # gloo raises RuntimeError for a closed peer or a timeout
            raise TransportUnavailableError(
                f"collective group {self.group_id!r} failed while broadcasting {what}: {e}; "
                "the group is dropped, prepare a new one (or push over grpc)"
            ) from None

    def close(self) -> None:
        """Release the group (its sockets and threads)."""
        try:
            shutdown = getattr(self.pg, "shutdown", None)
            if shutdown is not None:
                shutdown()
        except Exception as e:  # best effort: the group may already be broken
            log.debug("closing collective group %s: %s", self.group_id, e)


def join_group(
    *,
    group_id: str,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: dist.Store | None = None,
) -> CollectiveGroup:
    """Build this process's member of a group (rank 0 passes the store it serves). Blocks until
    every rank has joined or `timeout_s` passed (TransportUnavailableError)."""
    if backend not in BACKENDS:
        raise InvalidRequestError(f"collective backend {backend!r} is not one of {BACKENDS}")
    if not 0 <= rank < world_size or world_size < 2:
        raise InvalidRequestError(
            f"rank {rank} of world size {world_size} is out of range (need 0 <= rank < size, size >= 2)"
        )
    if timeout_s <= 0:
        raise InvalidRequestError(f"collective timeout_seconds must be > 0, got {timeout_s}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"specrl/{group_id}", store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    except (RuntimeError, ValueError, TimeoutError, dist.DistError) as e:
        raise TransportUnavailableError(
            f"collective group {group_id!r} ({backend}, rank {rank} of {world_size}, store {host}:{port}) did not "
            f"form within {timeout_s:g}s: {e}"
        ) from None
    return CollectiveGroup(
        group_id=group_id,
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        pg=pg,
        store=store,
        host=host,
        port=port,
    )


def serve_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of `host` (`.port` says which)."""
    return dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


class GroupRegistry:
    """The groups a sidecar has joined, by id (thread-safe). A group whose broadcast failed is
    dropped; one whose push failed otherwise is retired."""

    def __init__(self) -> None:
        self._groups: dict[str, CollectiveGroup] = {}
        self._retired: list[CollectiveGroup] = []
        self._lock = threading.Lock()

    def add(self, group: CollectiveGroup) -> None:
        """Register a joined group; this closes the retired groups (their senders have moved on
        to this new group, or away)."""
        with self._lock:
            old = self._groups.pop(group.group_id, None)
            self._groups[group.group_id] = group
            done, self._retired = self._retired, []
        for g in [*done, *([old] if old is not None else [])]:
            g.close()

    def retire(self, group_id: str) -> None:
        """Take a group out of use now (a push naming it gets UNAVAILABLE) and close it at the
        next `add` or `close`: after a failed push, whose sender drops its end once it has the
        sidecar's verdict. Closing this end at once would reset a bucket the sender may still be
        broadcasting, and the sender would report that transport error instead of the verdict."""
        with self._lock:
            group = self._groups.pop(group_id, None)
            if group is not None:
                self._retired.append(group)

    def get(self, group_id: str) -> CollectiveGroup:
        with self._lock:
            group = self._groups.get(group_id)
        if group is None:
            raise TransportUnavailableError(
                f"this sidecar has no collective group {group_id!r} (never prepared, or dropped after a failure); "
                "call PrepareTransport(collective) again or push over grpc"
            )
        return group

    def drop(self, group_id: str) -> None:
        with self._lock:
            group = self._groups.pop(group_id, None)
        if group is not None:
            group.close()

    def close(self) -> None:
        with self._lock:
            groups, self._groups = [*self._groups.values(), *self._retired], {}
            self._retired = []
        for g in groups:
            g.close()
