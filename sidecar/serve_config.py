"""`specrl serve`'s settings as one typed config: a YAML/TOML file, `--set key=value`, or options.

The command's options only select and override these fields (as `specrl train` does for
`RLConfig`), and every option's default is the field's default, so a sidecar started from a file
and one started from flags behave the same. The bearer token itself is not a field (a secret does
not belong in a file that gets copied around): give `security.token_file`, `--token` or `$SPECRL_TOKEN`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from sidecar.engine.config import EngineConfig
from sidecar.security import SecurityConfig

ENGINE_KEYS = tuple(f.name for f in fields(EngineConfig))


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """One rollout sidecar."""

    model: Path | None = None
    """Checkpoint directory (config.json + model.safetensors); required."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine: its kind, device, speculation, batch and KV cache (`sidecar.engine.config`);
    each key is also an option (`engine.kv_block_size` is --kv-block-size, `engine.kind` --engine)."""
    host: str = "127.0.0.1"
    """Bind address (loopback unless told otherwise: whoever can push weights owns the model)."""
    port: int = 50051
    """0 picks a free port (printed as `listening on HOST:PORT`)."""
    max_live_sequences: int = 4096
    """Most sequences queued or running at once; past it Generate is refused with RESOURCE_EXHAUSTED."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS (`cert`, `key`), mutual TLS (`peer_ca`) and the bearer token's file (`token_file`);
    options --cert, --key, --peer-ca, --token-file."""
    metrics_port: int | None = None
    """Prometheus endpoint port on `host` (None: off)."""
    keep_staging: bool = True
    """Receive each weight push into the memory the last push left free (torch engine: the tensors
    the served ones replaced): faster pushes, but ~1x the model stays resident between pushes (the
    peak during a push is the same)."""
    weight_transports: str = "shm,collective"
    """Weight transports offered besides the gRPC stream (comma-separated: shm, collective; ''
    for grpc only). A client proves shm (same host) before using it; collective lets a client that
    may push weights make this sidecar join its torch.distributed group."""
    sparse_deltas: bool = True
    """Accept sparse delta weight pushes (weights.proto, "Sparse deltas"). Deltas are rebuilt from
    the served tensors themselves (torch engine: no extra memory); an engine that copies what it is
    pushed (SGLang) keeps the last push's tensors as the base, ~1x the model in host memory."""
    sglang_args: tuple[str, ...] = ()
    """Extra SGLang `ServerArgs` keywords as KEY=VALUE (engine sglang; VALUE parsed as JSON when
    it can be), e.g. mem_fraction_static=0.5."""
    shutdown_grace_s: float = 5.0
    """Seconds live calls get to finish on SIGTERM/SIGINT (the first half for requests to end
    normally, the rest UNAVAILABLE), before the server stops."""
    parent_pid: int | None = None
    """Shut down (gracefully) once the process with this id is no longer this sidecar's parent:
    a sidecar started by a trainer (`trainer.rl.local_sidecars`) must not outlive it, even when the
    trainer is SIGKILLed and cannot tear it down. Unset: serve until signalled."""
    log_level: str = "INFO"
    """Logging level of the sidecar process (DEBUG, INFO, WARNING, ...)."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        **{name: f"engine.{name}" for name in ENGINE_KEYS if name != "kind"},
        "engine": "engine.kind",
    }
    """Keys that moved into the `engine` section (a file that still writes them is refused with
    the new key: its settings must not silently stop applying)."""

    def __post_init__(self) -> None:
        self.security.check_server()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = free), got {self.port}")
        if self.max_live_sequences < 1:
            raise ValueError(f"max_live_sequences must be >= 1, got {self.max_live_sequences}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 or unset (off), got {self.metrics_port}")
        unknown = self.offered_transports - {"shm", "collective"}
        if unknown:
            raise ValueError(
                f"weight_transports: unknown transport(s) {sorted(unknown)}; use shm and/or collective "
                "(grpc is always offered)"
            )
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ValueError(f"parent_pid must be a process id (>= 1) or unset, got {self.parent_pid}")

    @property
    def offered_transports(self) -> set[str]:
        """The transports named in `weight_transports` (grpc is always offered besides them)."""
        return {t.strip() for t in self.weight_transports.split(",") if t.strip()}


SECURITY_OPTIONS = ("cert", "key", "peer_ca", "token_file")
"""The `security.*` fields `specrl serve` has an option of the same name for (--cert, --key,
--peer-ca, --token-file): every `SecurityConfig` field but `tls`, a client setting
(`tests/trainer/rl/test_fail_early.py` holds them to the fields and their defaults)."""
