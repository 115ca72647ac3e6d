"""Creating a gRPC server that speaks specrl.v1, with health checking and reflection.

The server is a `grpc.aio` server: every call is a coroutine on one asyncio event loop, so an
open `Generate` stream costs no thread and health checks, GetInfo and Abort answer promptly
however many streams are open (a thread-pool server held one thread per stream and starved
the control plane at 64 streams). Work that blocks — the scheduler's step boundary, weight
staging — is awaited (`asyncio.wrap_future`) or runs in a worker thread (`asyncio.to_thread`).

`create_server(servicers, config) -> (server, port, health)` is separate from running it (the
gRPC examples' pattern), so tests bind port 0 and talk to the real server over loopback. It
must run on the loop that serves; `EventLoopThread` gives synchronous code (the CLI, tests,
the trainer's local sidecars) such a loop on a thread of its own. Besides the specrl.v1
services, every server answers the standard `grpc.health.v1.Health` service (overall and per
service) and server reflection, so `grpcurl` and load balancers work out of the box.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar.protocol import services

MiB = 1 << 20
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Where and how the gRPC server listens."""

    host: str = "127.0.0.1"
    """Bind address; loopback unless told otherwise (whoever can push weights owns the model)."""
    port: int = 0
    """TCP port; 0 picks a free one (create_server returns it)."""
    max_message_mib: int = 64
    """Largest single message in either direction."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 picks a free port), got {self.port}")
        if self.max_message_mib < 1:
            raise ValueError(f"max_message_mib must be >= 1, got {self.max_message_mib}")


async def create_server(
    servicers: Sequence[object],
    config: ServerConfig,
    *,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build (not start) an aio server hosting `servicers` plus health and reflection, on the
    running event loop.

    Returns the server, the bound port, and the health servicer (to flip services to
    NOT_SERVING during shutdown or while a model is unavailable).
    """
    options = [
        ("grpc.max_send_message_length", config.max_message_mib * MiB),
        ("grpc.max_receive_message_length", config.max_message_mib * MiB),
        ("grpc.so_reuseport", 0),
        # A fixed receive window: bounds what gRPC buffers ahead of a weight push's staging
        # (with BDP probing it grows with the link and adds to the push's peak memory).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 16 * MiB),
    ]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    names = [services.register(s, server) for s in servicers]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    try:
        port = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as e:  # grpc.aio raises where the thread server returned 0
        raise OSError(f"could not bind {address} ({e}); is the port in use or the host not local?") from None
    if port == 0:
        raise OSError(f"could not bind {address}; is the port in use or the host not local?")
    return server, port, health_servicer


class EventLoopThread:
    """An asyncio event loop running on its own daemon thread, for synchronous owners of an
    aio server: `run(coro)` executes a coroutine there and returns its result."""

    def __init__(self, name: str = "specrl-grpc") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop; block until it finishes (or raise its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run a plain function on the loop's thread (for objects that bind to the loop)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper(), timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop (cancelling what still runs on it) and join its thread (idempotent)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
