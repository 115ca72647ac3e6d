"""Creating a gRPC server that speaks specrl.v1, with health checking and reflection.

`create_server(servicers, config) -> (server, port)` is separate from running it (the gRPC
examples' pattern), so tests bind port 0 and talk to the real server over loopback.
Besides the specrl.v1 services, every server answers the standard `grpc.health.v1.Health`
service (overall and per service) and server reflection, so `grpcurl` and load balancers
work out of the box.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sidecar.protocol import services

MiB = 1 << 20


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Where and how the gRPC server listens."""

    host: str = "127.0.0.1"
    """Bind address; loopback unless told otherwise (whoever can push weights owns the model)."""
    port: int = 0
    """TCP port; 0 picks a free one (create_server returns it)."""
    max_workers: int = 64
    """Threads serving RPCs (each live Generate stream holds one)."""
    max_message_mib: int = 64
    """Largest single message in either direction."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 picks a free port), got {self.port}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.max_message_mib < 1:
            raise ValueError(f"max_message_mib must be >= 1, got {self.max_message_mib}")


def create_server(
    servicers: Sequence[object],
    config: ServerConfig,
    *,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build (not start) a server hosting `servicers` plus health and reflection.

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
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="specrl-rpc"),
        options=options,
        interceptors=list(interceptors),
    )
    names = [services.register(s, server) for s in servicers]
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    port = (
        server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    )
    if port == 0:
        raise OSError(f"could not bind {address}; is the port in use or the host not local?")
    return server, port, health_servicer
