"""Transport security and caller authentication of a sidecar.

Whoever can push weights owns the model, so a sidecar binds to loopback unless told otherwise
and can require, independently:
- TLS (server certificate and key) and mutual TLS (a client CA: callers must present a
  certificate it signed), through gRPC's own `ssl_server_credentials`;
- a bearer token on every RPC (metadata `authorization: Bearer <token>`), checked by a server
  interceptor in constant time; a call without it, or with a wrong one, ends UNAUTHENTICATED
  before it reaches any servicer.

Decision: the standard health service (`grpc.health.v1.Health`) stays open without a token, so
load balancers and orchestrator probes (which carry no credentials) can check liveness; it
reveals nothing but SERVING/NOT_SERVING. Everything else, reflection included, needs the token.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
TOKEN_ENV = "SPECRL_TOKEN"


@dataclass(kw_only=True, slots=True)
class SecurityConfig:
    """Server-side TLS files and bearer token; all optional."""

    tls_cert: Path | None = None
    """PEM certificate chain of the server; with tls_key, turns TLS on."""
    tls_key: Path | None = None
    """PEM private key of the server."""
    tls_client_ca: Path | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    token: str | None = None
    """Bearer token every RPC but health checks must carry; None: no token check."""

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both for TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs TLS: also set tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a readable file")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ValueError("token must be a non-empty string without whitespace (or None for no token)")


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """gRPC server credentials for `config`; None means plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    key = Path(config.tls_key).read_bytes()
    cert = Path(config.tls_cert).read_bytes()
    if config.tls_client_ca is None:
        return grpc.ssl_server_credentials([(key, cert)])
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=Path(config.tls_client_ca).read_bytes(), require_client_auth=True
    )


def channel_credentials(
    *, root_ca: Path | None = None, client_cert: Path | None = None, client_key: Path | None = None
) -> grpc.ChannelCredentials:
    """Client TLS credentials: the CA that signed the server (None: system roots), and for
    mutual TLS the client's own certificate and key."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together: set both for mutual TLS, or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(root_ca).read_bytes() if root_ca else None,
        private_key=Path(client_key).read_bytes() if client_key else None,
        certificate_chain=Path(client_cert).read_bytes() if client_cert else None,
    )


def read_token(token: str | None = None, token_file: Path | None = None) -> str | None:
    """The bearer token from an explicit value, a file (first line), or $SPECRL_TOKEN."""
    if token and token_file:
        raise ValueError("give the token either directly or as a file, not both")
    if token_file is not None:
        value = Path(token_file).read_text().strip()
        if not value:
            raise ValueError(f"token file {token_file} is empty")
        return value
    return token or os.environ.get(TOKEN_ENV) or None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health checks unless it carries `authorization: Bearer <token>`
    (an interceptor of the sidecar's `grpc.aio` server)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def _authorised(self, details: grpc.HandlerCallDetails) -> tuple[bool, str]:
        values = [v for k, v in (details.invocation_metadata or ()) if k == "authorization"]
        if not values:
            return False, "missing bearer token: send metadata 'authorization: Bearer <token>'"
        given = values[0].encode() if isinstance(values[0], str) else values[0]
        if not hmac.compare_digest(given, self._expected):
            return False, "wrong bearer token: check the token the sidecar was started with"
        return True, ""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        ok, why = self._authorised(handler_call_details)
        handler = await continuation(handler_call_details)
        if ok or handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return handler
        return _refusing_handler(handler, why)


def _refusing_handler(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
