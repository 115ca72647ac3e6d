"""`specrl serve`: run a rollout sidecar on one node.

Loads the checkpoint into an engine, serves specrl.v1 (plus health, reflection and optionally
Prometheus metrics), and shuts down gracefully on SIGTERM/SIGINT: health flips to NOT_SERVING
first, live calls get a grace period, then the server stops. Binds to loopback unless `--host`
says otherwise: whoever can push weights owns the model.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from sidecar.engine.base import Engine

log = logging.getLogger("specrl.serve")

SGLANG_UNAVAILABLE = "SGLang engine not available in this build: install specrl[sglang] on a GPU node"


def load_engine(engine: str, model: Path, *, device: str, spec_k: int, max_spec_k: int, max_batch_size: int) -> Engine:
    """The engine serving `model` (an Engine); click.ClickException when it cannot be built."""
    from sidecar.engine import create_engine
    from sidecar.errors import SpecrlError

    try:
        return create_engine(
            engine,
            model,
            device=device,
            speculation_k=spec_k,
            max_speculation_k=max_spec_k,
            max_batch_size=max_batch_size,
        )
    except ImportError as e:
        raise click.ClickException(f"{SGLANG_UNAVAILABLE} ({e})") from None
    except (SpecrlError, FileNotFoundError, ValueError) as e:
        # SpecrlError covers CheckpointError and SGLangEngineError ("install specrl[sglang] ...").
        raise click.ClickException(f"cannot start the {engine} engine for {model}: {e}") from None


@click.command()
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint directory (config.json + model.safetensors).",
)
@click.option("--engine", type=click.Choice(["torch", "sglang"]), default="torch", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless told otherwise).")
@click.option("--port", type=click.IntRange(0, 65535), default=50051, show_default=True, help="0 picks a free port.")
@click.option("--spec-k", type=click.IntRange(0), default=3, show_default=True, help="Default draft length (0: off).")
@click.option("--max-spec-k", type=click.IntRange(0), default=8, show_default=True)
@click.option("--max-batch-size", type=click.IntRange(1), default=64, show_default=True)
@click.option("--max-live-sequences", type=click.IntRange(1), default=4096, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="torch device: cpu, cuda, cuda:1 ...")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Server PEM chain.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Server PEM key.")
@click.option(
    "--tls-client-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="CA bundle clients must be signed by (mutual TLS).",
)
@click.option("--token", default=None, help="Bearer token required on every RPC (or --token-file / $SPECRL_TOKEN).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Prometheus endpoint port on --host (off unless set).",
)
@click.option(
    "--keep-staging/--no-keep-staging",
    default=True,
    show_default=True,
    help="Receive each weight push into the last push's staging memory (torch engine): faster pushes, "
    "but ~1x the model stays resident between pushes (the peak during a push is the same).",
)
@click.option(
    "--weight-transports",
    default="shm,collective",
    show_default=True,
    help="Weight data planes offered besides the gRPC stream (comma-separated: shm, collective; '' for "
    "grpc only). A client proves shm (same host) before using it; collective lets a client that may push "
    "weights make this sidecar join its torch.distributed group.",
)
@click.option(
    "--weight-deltas/--no-weight-deltas",
    default=True,
    show_default=True,
    help="Accept sparse delta weight pushes (weights.proto, 'Sparse deltas'). Keeps the last push's tensors "
    "as the base to rebuild from: no extra memory with --keep-staging (the base is the kept staging), "
    "else ~1x the model in host memory.",
)
@click.option("--grace", type=click.FloatRange(0), default=5.0, show_default=True, help="Shutdown grace seconds.")
@click.option("--log-level", default="INFO", show_default=True)
def serve(
    model_dir: Path,
    engine: str,
    host: str,
    port: int,
    spec_k: int,
    max_spec_k: int,
    max_batch_size: int,
    max_live_sequences: int,
    device: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    token: str | None,
    token_file: Path | None,
    metrics_port: int | None,
    keep_staging: bool,
    weight_transports: str,
    weight_deltas: bool,
    grace: float,
    log_level: str,
) -> None:
    """Serve a model over specrl.v1 (a rollout sidecar)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sidecar.scheduler import SchedulerConfig
    from sidecar.security import SecurityConfig, read_token
    from sidecar.server import ServerConfig
    from sidecar.service import Sidecar, SidecarConfig
    from sidecar.types import RequestLimits
    from sidecar.weight_sync.memory import prefer_mmap_for_large_buffers
    from sidecar.weight_sync.receiver import DataPlaneConfig

    prefer_mmap_for_large_buffers()  # weight pushes then return their staging memory at once

    offered = {t.strip() for t in weight_transports.split(",") if t.strip()}
    if offered - {"shm", "collective"}:
        raise click.BadParameter(
            f"unknown transport(s) {sorted(offered - {'shm', 'collective'})}; use shm and/or collective "
            "(grpc is always offered)",
            param_hint="--weight-transports",
        )
    try:
        security = SecurityConfig(
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
            token=read_token(token, token_file),
        )
        config = SidecarConfig(
            server=ServerConfig(host=host, port=port),
            scheduler=SchedulerConfig(max_live_sequences=max_live_sequences),
            limits=RequestLimits(max_samples=min(4096, max_live_sequences)),
            security=security,
            metrics_port=metrics_port,
            metrics_host=host,
            keep_staging=keep_staging and engine == "torch",
            data_planes=DataPlaneConfig(shm="shm" in offered, collective="collective" in offered, deltas=weight_deltas),
            shutdown_grace_s=grace,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if host not in ("127.0.0.1", "::1", "localhost") and security.token is None and security.tls_client_ca is None:
        log.warning("binding %s without a token or mutual TLS: anyone who reaches it can push weights", host)
    eng = load_engine(
        engine, model_dir, device=device, spec_k=spec_k, max_spec_k=max_spec_k, max_batch_size=max_batch_size
    )
    try:
        sidecar = Sidecar(eng, config)
    except OSError as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; shutting down (grace %.1fs)", signal.Signals(signum).name, grace)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sidecar.start()
    click.echo(f"specrl sidecar listening on {sidecar.address}", err=True)
    while not stop.wait(timeout=1.0):  # ends on SIGTERM/SIGINT
        pass
    sidecar.stop(grace)
