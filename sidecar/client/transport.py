"""Choosing a transport per sidecar, on the sending side, with the reason said.

A sidecar lists the transports it offers (DescribeWeights); the sender tries them best first
and keeps the first that works for this pair, else stays on the gRPC stream:
1. shm, if configured and offered, and the sidecar proves it shares this host and user: it must
   read back a random nonce the sender wrote into a fresh private region (PrepareTransport).
   A sidecar elsewhere, or one that only claims the transport, cannot.
2. collective, if the run config sets it up (`CollectiveConfig`) and the sidecar offers it: a
   two-rank group, this process rank 0 serving the rendezvous store, the sidecar rank 1.
3. grpc: always.
A transport that fails mid-push is dropped (`TransportSession.drop`); the next push
negotiates again, so a broken group is rebuilt rather than reused.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sidecar.client.weight_sender import CollectiveSender, ShmSender, TransportSender
from sidecar.types import CollectiveRendezvous, PreparedTransport, ShmProbe, WeightTransport
from sidecar.weight_transport import collective, shm

log = logging.getLogger(__name__)

Prepare = Callable[[ShmProbe | CollectiveRendezvous, float], PreparedTransport]
"""The PrepareTransport call to one sidecar: (request, timeout seconds) -> answer."""


@dataclass(kw_only=True, slots=True)
class CollectiveConfig:
    """How the sender sets up collective groups (the run config's `collective` section)."""

    host: str
    """An address of this (the sending) host that the sidecars can reach: the rendezvous store's."""
    backend: str = "gloo"
    """"gloo" (CPU tensors) or "nccl" (CUDA tensors, one GPU per rank)."""
    timeout_s: float = 30.0
    """Bound on joining the group and on every broadcast."""
    bucket_bytes: int = collective.DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.backend not in collective.BACKENDS:
            raise ValueError(f"collective.backend must be one of {collective.BACKENDS}, got {self.backend!r}")
        if not self.host:
            raise ValueError("collective.host must name an address of the sending host the sidecars can reach")
        if self.timeout_s <= 0:
            raise ValueError(f"collective.timeout_s must be > 0, got {self.timeout_s}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"collective.bucket_bytes must be > 0, got {self.bucket_bytes}")


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """Which transports a sender may use (grpc always)."""

    shm: bool = True
    """Use shared memory with sidecars that prove they share this host."""
    collective: CollectiveConfig | None = None
    """Set up a collective group with sidecars that offer it; None: never."""
    probe_timeout_s: float = 10.0
    """Bound on the shm probe call."""

    def __post_init__(self) -> None:
        if self.probe_timeout_s <= 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")


@dataclass(kw_only=True, slots=True)
class TransportChoice:
    """The transport chosen for one sidecar, and why (fallbacks say what failed)."""

    transport: WeightTransport
    reason: str


@dataclass(kw_only=True, slots=True)
class TransportSession:
    """One sidecar's negotiated transport on the sending side (kept across pushes)."""

    config: TransportConfig = field(default_factory=TransportConfig)
    choice: TransportChoice | None = None
    sender: TransportSender | None = None

    def negotiate(self, address: str, offered: Iterable[WeightTransport], prepare: Prepare) -> TransportChoice:
        """Keep the current choice, or pick the best transport that works now."""
        if self.choice is not None:
            return self.choice
        offered = set(offered)
        why: list[str] = []
        if self.config.shm:
            if WeightTransport.SHM not in offered:
                why.append("shm: not offered by the sidecar")
            else:
                try:
                    self.sender = _prove_shm(self.config, prepare)
                    self.choice = TransportChoice(
                        transport=WeightTransport.SHM, reason="same host and user proven by a shared-memory nonce"
                    )
                    return self.choice
                except Exception as e:
                    why.append(f"shm: {e}")
        if self.config.collective is not None:
            if WeightTransport.COLLECTIVE not in offered:
                why.append("collective: not offered by the sidecar")
            else:
                try:
                    self.sender = _build_group(self.config.collective, prepare)
                    self.choice = TransportChoice(
                        transport=WeightTransport.COLLECTIVE,
                        reason=f"{self.config.collective.backend} group via {self.config.collective.host}",
                    )
                    return self.choice
                except Exception as e:
                    why.append(f"collective: {e}")
        else:
            why.append("collective: not configured")
        self.choice = TransportChoice(transport=WeightTransport.GRPC, reason="; ".join(why))
        if self.config.shm or self.config.collective is not None:
            log.warning("weight pushes to %s fall back to grpc: %s", address, self.choice.reason)
        return self.choice

    def drop(self, why: str) -> None:
        """Forget the transport after it failed; the next push negotiates again."""
        if self.choice is not None and self.choice.transport is not WeightTransport.GRPC:
            log.warning("dropping the %s transport: %s", self.choice.transport.value, why)
        self.close()

    def close(self) -> None:
        if isinstance(self.sender, ShmSender):
            self.sender.region.close()
        elif isinstance(self.sender, CollectiveSender):
            self.sender.group.close()
        self.sender = None
        self.choice = None


def _prove_shm(config: TransportConfig, prepare: Prepare) -> ShmSender:
    probe, nonce = shm.write_probe()
    try:
        answer = prepare(ShmProbe(region=probe.name), config.probe_timeout_s)
    finally:
        probe.close()
    if answer.shm_nonce != nonce:
        raise RuntimeError("the sidecar read other bytes than the probe's nonce (not this host's /dev/shm)")
    return ShmSender(shm.ShmRegion())


def _build_group(config: CollectiveConfig, prepare: Prepare) -> CollectiveSender:
    group_id = secrets.token_hex(8)
    store = collective.serve_store(config.host, 2, config.timeout_s)
    request = CollectiveRendezvous(
        group_id=group_id,
        backend=config.backend,
        host=config.host,
        port=store.port,
        rank=1,
        world_size=2,
        timeout_s=config.timeout_s,
    )
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrl-rendezvous") as pool:
        answer = pool.submit(prepare, request, config.timeout_s + 10.0)
        try:
            group = collective.join_group(
                group_id=group_id,
                backend=config.backend,
                host=config.host,
                port=store.port,
                rank=0,
                world_size=2,
                timeout_s=config.timeout_s,
                store=store,
            )
        except Exception:
            answer.cancel()
            raise
        try:
            answer.result(timeout=config.timeout_s + 15.0)
        except Exception:
            group.close()
            raise
    return CollectiveSender(group, config.bucket_bytes)
