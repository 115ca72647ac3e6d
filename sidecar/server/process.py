"""The sidecar process: engine, scheduler, servicers, security and metrics assembled into one server.

`Sidecar(engine, SidecarConfig(...)).start()` binds the gRPC server (`grpc_server.create_server`),
starts the scheduler's engine loop and the Prometheus endpoint; `stop()` drains gracefully.
`specrl serve` (`sidecar.server.cli`) builds one from the command line.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import sidecar
from sidecar.config_io import field_default
from sidecar.engine.base import Engine
from sidecar.protocol import services
from sidecar.security import SecurityConfig, TokenAuthInterceptor, check_token, server_credentials
from sidecar.serve_config import ServeConfig
from sidecar.server import metrics
from sidecar.server.grpc_server import EventLoopThread, ServerConfig, create_server
from sidecar.server.scheduler import Scheduler, SchedulerConfig
from sidecar.server.servicers import ControlService, RolloutService, WeightService
from sidecar.server.weight_receiver import TransportOffer
from sidecar.types import RequestLimits

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class SidecarConfig:
    """Everything a sidecar needs besides its engine."""

    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS and mutual TLS (`cert`, `key`, `peer_ca`); its `token_file` is read by `specrl serve`
    into `token`."""
    token: str | None = field(default=None, repr=False)
    """Bearer token every RPC but health checks must carry (kept out of repr); None: no token check."""
    metrics_port: int | None = None
    """Prometheus endpoint port (0 picks a free one); None turns it off."""
    metrics_host: str = "127.0.0.1"
    shutdown_grace_s: float = 5.0
    """How long live calls may finish after a stop is requested."""
    keep_staging: bool = field_default(ServeConfig, "keep_staging")
    """(Default: `specrl serve`'s.) Receive each weight push into the previous push's staging tensors (faster pushes; ~1x
    the model stays resident between pushes). Only for engines that copy on update (torch)."""
    transports: TransportOffer = field(default_factory=TransportOffer)
    """Weight transports offered besides the gRPC stream (shm, collective)."""

    def __post_init__(self) -> None:
        self.security.check_server()
        check_token(self.token)
        if self.limits.max_samples > self.scheduler.max_live_sequences:
            raise ValueError(
                f"limits.max_samples ({self.limits.max_samples}) exceeds scheduler.max_live_sequences "
                f"({self.scheduler.max_live_sequences}): such a request could never be admitted; lower it"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 or None (off), got {self.metrics_port}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")


class Sidecar:
    """A running specrl.v1 server around one engine: `start()`, then `stop()`."""

    def __init__(self, engine: Engine, config: SidecarConfig | None = None) -> None:
        self.config = config or SidecarConfig()
        self.scheduler = Scheduler(engine, self.config.scheduler)
        self.control = ControlService(self.scheduler, self.config.limits, sidecar.__version__)
        self.rollout = RolloutService(self.scheduler, self.config.limits)
        self.weights = WeightService(
            self.scheduler, keep_staging=self.config.keep_staging, transports=self.config.transports
        )
        servicers = [self.rollout, self.weights, self.control]
        sec = self.config.security
        self._loop = EventLoopThread()
        try:
            self.server, self.port, self.health = self._loop.run(
                create_server(
                    servicers,
                    self.config.server,
                    credentials=server_credentials(sec),
                    interceptors=[TokenAuthInterceptor(self.config.token)] if self.config.token else [],
                )
            )
        except BaseException:
            self._loop.close()
            raise
        self.metrics = metrics.SidecarMetrics(self.scheduler)
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self._started = False

    @property
    def address(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    def start(self) -> Sidecar:
        """Start serving (idempotent)."""
        if self._started:
            return self
        self._started = True
        self.scheduler.start()
        self._loop.run(self.server.start())
        if self.config.metrics_port is not None:
            self._metrics_server, self.metrics_port = self.metrics.serve(
                self.config.metrics_port, self.config.metrics_host
            )
        log.info(
            "specrl sidecar serving %s on %s (%s)%s",
            services.ROLLOUT.rsplit(".", 1)[0],
            self.address,
            "TLS" if self.config.security.cert else "plaintext",
            f", metrics on :{self.metrics_port}" if self.metrics_port is not None else "",
        )
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Flip health to NOT_SERVING, let live calls finish for the grace period, stop."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        if self._loop.loop.is_closed():
            return
        self._loop.run(self.health.enter_graceful_shutdown())  # every service reports NOT_SERVING from now on
        stopped = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop.loop)
        # Live requests may finish during the first half of the grace period; the rest then end
        # UNAVAILABLE ("retry elsewhere") while the server still runs, instead of CANCELLED when
        # the server's grace runs out.
        self.scheduler.stop(grace_s=grace / 2)
        try:
            stopped.result(grace + 5.0)
        finally:
            self._loop.close()
            self.weights.close()  # leave every collective group
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        log.info("specrl sidecar on %s stopped", self.address)

    def __enter__(self) -> Sidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
