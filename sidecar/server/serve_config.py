"""`specrl serve`'s settings as one typed config: a YAML/TOML file, `--set key=value`, or options.

The command's options only select and override these fields (as `specrl train` does for
`RLConfig`), and every option's default is the field's default, so a sidecar started from a file
and one started from flags behave the same. The bearer token itself is not a field (a secret does
not belong in a file that gets copied around): give `security.token_file`, `--token` or `$SPECRL_TOKEN`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sidecar.security import SecurityConfig


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """One rollout sidecar."""

    model: Path | None = None
    """Checkpoint directory (config.json + model.safetensors); required."""
    draft: Path | None = None
    """An EAGLE-3 draft directory (SGLang/vLLM layout, `sidecar.model.eagle3_checkpoint`) served
    beside a model without MTP layers (torch engine; SGLang's EAGLE3 with --engine sglang); None:
    the model's own MTP layers, if any."""
    engine: Literal["torch", "sglang"] = "torch"
    """"torch": the embedded PyTorch engine; "sglang": SGLang (GPU nodes, the sglang extra)."""
    host: str = "127.0.0.1"
    """Bind address (loopback unless told otherwise: whoever can push weights owns the model)."""
    port: int = 50051
    """0 picks a free port (printed as `listening on HOST:PORT`)."""
    speculation_k: int = 3
    """Default draft length (0: plain decoding); with `speculation_auto`, the largest k the
    sidecar may choose."""
    speculation_auto: bool = False
    """Automatic k: the sidecar chooses k in 0..speculation_k for every engine step from its
    measured costs and acceptance (lossless; at temperature > 0 not bit-reproducible from the
    seed: requests that pin k are)."""
    max_speculation_k: int = 8
    """Largest k a request or SetSpeculation may ask for (the engine sizes its scratch for it)."""
    max_batch_size: int = 64
    """Most sequences decoded together in one engine step (rows of the torch engine's KV block
    table; the memory they take is the blocks their tokens fill)."""
    max_context: int | None = None
    """Tokens (prompt + max_new_tokens) one sequence may hold (torch engine; None: the model's
    max_position_embeddings). Longer requests, and requests whose blocks the whole KV pool could
    not hold, are refused with RESOURCE_EXHAUSTED."""
    kv_cache_gib: float | None = None
    """Memory of the torch engine's paged KV pool, allocated once (None: 90% of the free memory on
    CUDA, capped at what max_batch_size full rows need; on CPU what they need). Rows hold only the
    blocks their tokens fill, a prompt's samples share its full blocks; when the pool runs out
    mid-generation the latest admitted rows are preempted and resume later, unchanged."""
    kv_block_size: int = 16
    """Tokens a KV block holds (torch engine; a power of two, at most 256): the pool's unit of
    allocation and sharing."""
    compile: Literal["auto", "on", "off"] = "auto"
    """How the torch engine runs a decode round's forwards: "on" at fixed shapes captured as CUDA
    graphs (on a CPU run eagerly), "off" eagerly at the batch's own shapes, "auto" on for CUDA
    devices and off on CPUs (where fixed shapes only add work)."""
    draft_vocab_size: int = 0
    """Torch engine, MTP draft: score only this many token ids in the draft's output head, the most
    frequent of the sidecar's own prompts and samples, re-chosen at every weight push and every 4096
    tokens (FR-Spec; 0: the full vocabulary). Exact for any subset (q is 0 outside it); it saves
    the head's weight reads per draft token at some acceptance, and at temperature > 0 a sample
    then depends on what the sidecar generated before (see docs/engine.md)."""
    max_live_sequences: int = 4096
    """Most sequences queued or running at once; past it Generate is refused with RESOURCE_EXHAUSTED."""
    device: str = "cpu"
    """torch device: cpu, cuda, cuda:1 ..."""
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
    """Weight data planes offered besides the gRPC stream (comma-separated: shm, collective; ''
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
    a sidecar started by a trainer (`trainer.local_sidecars`) must not outlive it, even when the
    trainer is SIGKILLed and cannot tear it down. Unset: serve until signalled."""
    log_level: str = "INFO"
    """Logging level of the sidecar process (DEBUG, INFO, WARNING, ...)."""

    def __post_init__(self) -> None:
        self.security.check_server()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = free), got {self.port}")
        if self.max_speculation_k < 0:
            raise ValueError(f"max_speculation_k must be >= 0, got {self.max_speculation_k}")
        if self.speculation_k < 0:
            raise ValueError(f"speculation_k must be >= 0, got {self.speculation_k}")
        if self.speculation_k > self.max_speculation_k:
            raise ValueError(
                f"speculation_k={self.speculation_k} exceeds max_speculation_k={self.max_speculation_k}; "
                "raise max_speculation_k"
            )
        for name in ("max_batch_size", "max_live_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 or unset (off), got {self.metrics_port}")
        unknown = self.offered_transports - {"shm", "collective"}
        if unknown:
            raise ValueError(
                f"weight_transports: unknown transport(s) {sorted(unknown)}; use shm and/or collective "
                "(grpc is always offered)"
            )
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2 or unset (the model's context), got {self.max_context}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 or unset, got {self.kv_cache_gib}")
        if not 1 <= self.kv_block_size <= 256 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two in [1, 256], got {self.kv_block_size}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.compile != "auto" and self.engine != "torch":
            raise ValueError("compile chooses how the torch engine runs its forwards; SGLang runs its own")
        sized = self.max_context is not None or self.kv_cache_gib is not None or self.kv_block_size != 16
        if sized and self.engine != "torch":
            raise ValueError(
                "max_context, kv_cache_gib and kv_block_size size the torch engine's KV cache; SGLang sizes its own"
            )
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0: the full vocabulary), got {self.draft_vocab_size}")
        if self.draft_vocab_size and (self.engine != "torch" or self.draft is not None):
            raise ValueError(
                "draft_vocab_size reduces the torch engine's MTP head; SGLang and EAGLE-3 drafts (--draft) "
                "bring their own draft vocabulary: leave it at 0"
            )
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ValueError(f"parent_pid must be a process id (>= 1) or unset, got {self.parent_pid}")

    @property
    def offered_transports(self) -> set[str]:
        """The data planes named in `weight_transports` (grpc is always offered besides them)."""
        return {t.strip() for t in self.weight_transports.split(",") if t.strip()}


SECURITY_OPTIONS = ("cert", "key", "peer_ca", "token_file")
"""The `security.*` fields `specrl serve` has an option of the same name for (--cert, --key,
--peer-ca, --token-file): every `SecurityConfig` field but `tls`, a client setting
(`tests/test_fail_early.py` holds them to the fields and their defaults)."""
