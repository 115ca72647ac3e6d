"""Transport security and caller authentication of a sidecar.

Whoever can push weights owns the model, so a sidecar binds to loopback unless told otherwise
and can require, independently:
- TLS (`cert` and `key`) and mutual TLS (`peer_ca`: callers must present a certificate it
  signed), through gRPC's own `ssl_server_credentials`;
- a bearer token on every RPC (metadata `authorization: Bearer <token>`), checked by a server
  interceptor in constant time; a call without it, or with a wrong one, ends UNAUTHENTICATED
  before it reaches any servicer.

Decision: the standard health service (`grpc.health.v1.Health`) stays open without a token, so
load balancers and orchestrator probes (which carry no credentials) can check liveness; it
reveals nothing but SERVING/NOT_SERVING. Everything else, reflection included, needs the token.

Both ends are configured by one `SecurityConfig`, with the same names at both.
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
    """TLS and the bearer token of one end of a specrl connection: a sidecar (`specrl serve`'s
    `security.*`, `--cert` ...) or a client of one (the trainer's `sidecars.security.*`, the verl
    plugin's `security.*`, `ClientConfig.security`). The same field means the same thing at both
    ends; where an end reads it differently, the field says so.

    The token itself is never a field: a config gets written to run directories and copied
    around. It is read from `token_file`, or else from $SPECRL_TOKEN (`read_token`). Files are
    looked for when the end starts (`check_files`), not when the config is built: a config names
    files on the machine that runs it."""

    token_file: Path | None = None
    """File whose first line is the bearer token; unset: $SPECRL_TOKEN if set, else no token. A
    sidecar requires it on every RPC but health checks; a client sends it with every call."""
    cert: Path | None = None
    """This end's PEM certificate (chain), with `key`: a sidecar's server certificate (turns TLS
    on), or the certificate a client presents for mutual TLS."""
    key: Path | None = None
    """The PEM private key of `cert` (set both or neither)."""
    peer_ca: Path | None = None
    """PEM CA bundle the other end's certificate must be signed by. A client: the CA of the
    sidecars' certificates (turns TLS on). A sidecar: clients must present a certificate it
    signed (mutual TLS; needs `cert`)."""
    tls: bool = False
    """A client: TLS verified by the system roots when `peer_ca` is unset (implied by `peer_ca` and
    `cert`). Not a sidecar setting: a sidecar serves TLS exactly when `cert` is set."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together (this end's certificate and its key): set both or neither")

    @property
    def client_uses_tls(self) -> bool:
        """Whether a client with these settings connects over TLS."""
        return self.tls or self.peer_ca is not None or self.cert is not None

    def check_server(self) -> None:
        """The checks that apply to a sidecar's settings (ValueError naming the `security.*` key)."""
        if self.tls:
            raise ValueError(
                "security.tls is a client setting: a sidecar serves TLS exactly when security.cert and "
                "security.key are set (--cert, --key); unset security.tls"
            )
        if self.peer_ca is not None and self.cert is None:
            raise ValueError(
                "security.peer_ca (mutual TLS: clients must present a certificate it signed) needs TLS: "
                "also set security.cert and security.key (--cert, --key)"
            )

    def check_files(self, where: str) -> None:
        """ValueError naming `{where}.{field}` when a file it names is not on this machine."""
        for name in ("token_file", "cert", "key", "peer_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{where}.{name}: {path} is not a readable file on this machine")

    def read_token(self, given: str | None = None) -> str | None:
        """The bearer token: `given` (e.g. `--token`), else `token_file`'s, else $SPECRL_TOKEN, else None."""
        return read_token(given, self.token_file)


def check_token(token: str | None) -> None:
    """ValueError unless `token` is None (no token) or a non-empty string without whitespace."""
    if token is not None and (not token or any(c.isspace() for c in token)):
        raise ValueError("the bearer token must be a non-empty string without whitespace (or none for no token)")


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """gRPC server credentials of a sidecar with `config`; None means plaintext."""
    config.check_server()
    if config.cert is None or config.key is None:
        return None
    key = Path(config.key).read_bytes()
    cert = Path(config.cert).read_bytes()
    if config.peer_ca is None:
        return grpc.ssl_server_credentials([(key, cert)])
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=Path(config.peer_ca).read_bytes(), require_client_auth=True
    )


def channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials | None:
    """gRPC channel credentials of a client with `config` (the sidecars' CA, or the system roots
    when `peer_ca` is unset; `cert` and `key` for mutual TLS); None means plaintext."""
    if not config.client_uses_tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(config.peer_ca).read_bytes() if config.peer_ca else None,
        private_key=Path(config.key).read_bytes() if config.key else None,
        certificate_chain=Path(config.cert).read_bytes() if config.cert else None,
    )


def read_token(token: str | None = None, token_file: Path | None = None) -> str | None:
    """The bearer token from an explicit value, a file (first line), or $SPECRL_TOKEN."""
    if token and token_file:
        raise ValueError("give the token either directly or as a file (token_file), not both")
    if token_file is not None:
        lines = Path(token_file).read_text().strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"token file {token_file} is empty")
        return lines[0].strip()
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
