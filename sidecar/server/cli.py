"""`specrl serve`: run a rollout sidecar on one node.

Loads the checkpoint into an engine, serves specrl.v1 (plus health, reflection and optionally
Prometheus metrics), and shuts down gracefully on SIGTERM/SIGINT: health flips to NOT_SERVING
first, live calls get a grace period, then the server stops. Binds to loopback unless `--host`
says otherwise: whoever can push weights owns the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click

from sidecar.engine.base import Engine
from sidecar.engine.config import EngineConfig
from sidecar.serve_config import SECURITY_OPTIONS, ServeConfig
from sidecar.types import KVUsage

if typing.TYPE_CHECKING:
    from sidecar.server.process import SidecarConfig

log = logging.getLogger("specrl.serve")

SGLANG_UNAVAILABLE = "SGLang engine not available in this build: install specrl[sglang] on a GPU node"


def parse_sglang_args(pairs: tuple[str, ...]) -> dict[str, object]:
    """``KEY=VALUE`` pairs → SGLang ``ServerArgs`` keywords; VALUE is JSON when it parses, else a string."""
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(
                f"{pair!r} is not KEY=VALUE with KEY a ServerArgs field, e.g. mem_fraction_static=0.5",
                param_hint="--sglang-arg",
            )
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def load_engine(cfg: ServeConfig) -> Engine:
    """The engine `cfg.engine` describes, serving `cfg.model`; click.ClickException when it cannot be built."""
    from sidecar.engine import create_engine
    from sidecar.errors import SpecrlError

    engine, model = cfg.engine, cfg.model
    assert model is not None
    sglang_args = parse_sglang_args(cfg.sglang_args)
    if sglang_args and engine.kind != "sglang":
        raise click.BadParameter(
            f"--sglang-arg applies to --engine sglang only, not {engine.kind}", param_hint="--sglang-arg"
        )
    try:
        built = create_engine(model, engine, **({"extra_server_args": sglang_args} if sglang_args else {}))
    except ImportError as e:
        raise click.ClickException(f"{SGLANG_UNAVAILABLE} ({e})") from None
    except (SpecrlError, FileNotFoundError, ValueError) as e:
        # SpecrlError covers CheckpointError and SGLangEngineError ("install specrl[sglang] ...").
        raise click.ClickException(f"cannot start the {engine.kind} engine for {model}: {e}") from None
    return built


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One `specrl serve` option per `EngineConfig` field, generated from the field: its name
    (`kv_block_size` is --kv-block-size; `EngineConfig.OPTION_NAMES` renames), its type, its
    default and its docstring. The value an option gives lands in the `engine` section."""
    from sidecar.config_io import field_docs

    hints, docs = typing.get_type_hints(EngineConfig), field_docs(EngineConfig)
    for f in reversed(dataclasses.fields(EngineConfig)):
        name = EngineConfig.OPTION_NAMES.get(f.name, f.name)
        flag = "--" + name.replace("_", "-")
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        kind: Any = {int: click.INT, float: click.FLOAT, str: click.STRING}.get(base)
        if typing.get_origin(hint) is typing.Literal:
            kind = click.Choice(typing.get_args(hint))
        elif base is Path:
            kind = click.Path(exists=True, file_okay=False, path_type=Path)  # a directory given must be there
        decls = [f"{flag}/--no-{name.replace('_', '-')}" if base is bool else flag, name]
        command = click.option(
            *decls,
            type=None if base is bool else kind,
            default=f.default,
            show_default=f.default is not None,
            help=docs.get(f.name, ""),
        )(command)
    return command


ENGINE_OPTIONS = {EngineConfig.OPTION_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(EngineConfig)}
"""`specrl serve`'s engine options (their parameter names) -> the `engine` keys they set."""

_D = ServeConfig()
"""Every option's default is the config field's default."""
_SEC = _D.security
"""The `security.*` options' defaults."""


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML/TOML with `specrl serve` settings (fields of sidecar.serve_config.ServeConfig).",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field, e.g. port=0.")
@click.option("--print-config", is_flag=True, help="Print the resolved settings (YAML) and exit.")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint directory (config.json + model.safetensors); required here or in the config.",
)
@engine_options
@click.option("--host", default=_D.host, show_default=True, help="Bind address (loopback unless told otherwise).")
@click.option("--port", type=click.IntRange(0, 65535), default=_D.port, show_default=True, help="0 picks a free port.")
@click.option("--max-live-sequences", type=click.IntRange(1), default=_D.max_live_sequences, show_default=True)
@click.option(
    "--cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=_SEC.cert,
    help="PEM server certificate chain (turns TLS on; with --key). Config key security.cert.",
)
@click.option(
    "--key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=_SEC.key,
    help="PEM private key of --cert. Config key security.key.",
)
@click.option(
    "--peer-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=_SEC.peer_ca,
    help="PEM CA bundle: clients must present a certificate it signed (mutual TLS; needs --cert). "
    "Config key security.peer_ca.",
)
@click.option("--token", default=None, help="Bearer token required on every RPC (or --token-file / $SPECRL_TOKEN).")
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=_SEC.token_file,
    help="File whose first line is the bearer token required on every RPC. Config key security.token_file.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=_D.metrics_port,
    help="Prometheus endpoint port on --host (off unless set).",
)
@click.option(
    "--keep-staging/--no-keep-staging",
    default=_D.keep_staging,
    show_default=True,
    help="Receive each weight push into the memory the last push left free (torch engine: the tensors the "
    "served ones replaced): faster pushes, but ~1x the model stays resident between pushes (the peak during "
    "a push is the same).",
)
@click.option(
    "--weight-transports",
    default=_D.weight_transports,
    show_default=True,
    help="Weight transports offered besides the gRPC stream (comma-separated: shm, collective; '' for "
    "grpc only). A client proves shm (same host) before using it; collective lets a client that may push "
    "weights make this sidecar join its torch.distributed group.",
)
@click.option(
    "--sparse-deltas/--no-sparse-deltas",
    default=_D.sparse_deltas,
    show_default=True,
    help="Accept sparse delta weight pushes (weights.proto, 'Sparse deltas'). Deltas are rebuilt from the "
    "served tensors themselves (torch engine: no extra memory); an engine that copies what it is pushed "
    "(sglang) keeps the last push's tensors as the base, ~1x the model in host memory.",
)
@click.option(
    "--sglang-arg",
    "sglang_args",
    multiple=True,
    default=_D.sglang_args,
    metavar="KEY=VALUE",
    help="Extra SGLang ServerArgs keyword (--engine sglang; repeatable; VALUE parsed as JSON when it can be), "
    "e.g. --sglang-arg mem_fraction_static=0.5 --sglang-arg max_total_tokens=4096.",
)
@click.option(
    "--shutdown-grace-s",
    type=click.FloatRange(0),
    default=_D.shutdown_grace_s,
    show_default=True,
    help="Seconds live calls get to finish on SIGTERM/SIGINT.",
)
@click.option(
    "--parent-pid",
    type=click.IntRange(1),
    default=_D.parent_pid,
    help="Shut down gracefully once process PID is no longer this sidecar's parent (it died); "
    "the trainer's local sidecars get its pid.",
)
@click.option("--log-level", default=_D.log_level, show_default=True)
@click.pass_context
def serve(
    ctx: click.Context,
    config_file: Path | None,
    overrides: tuple[str, ...],
    print_config: bool,
    model_dir: Path | None,
    token: str | None,
    **options: object,
) -> None:
    """Serve a model over specrl.v1 (a rollout sidecar)."""
    cfg = resolve_serve_config(ctx, config_file, list(overrides), model_dir, options)
    if print_config:
        import yaml

        from sidecar.config_io import to_mapping

        click.echo(yaml.safe_dump(to_mapping(cfg), sort_keys=False), nl=False)
        return
    run_sidecar(cfg, token)


def resolve_serve_config(
    ctx: click.Context,
    config_file: Path | None,
    overrides: list[str],
    model_dir: Path | None,
    options: dict[str, object],
) -> ServeConfig:
    """File, then `--set`, then the options given on the command line (not their defaults)."""
    from click.core import ParameterSource

    from sidecar.config_io import ConfigError, from_mapping, load_file, merge_overrides

    try:
        data = load_file(config_file) if config_file is not None else {}
        data = merge_overrides(data, overrides)
        for name, value in options.items():
            if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
                key = ENGINE_OPTIONS.get(name)
                where = "security" if name in SECURITY_OPTIONS else "engine" if key is not None else None
                section = data if where is None else data.setdefault(where, {})
                if not isinstance(section, dict):
                    raise ConfigError(f"{where} must be a mapping, got {section!r}")
                section[key or name] = (
                    str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
                )
        if model_dir is not None:
            data["model"] = str(model_dir)
        cfg = from_mapping(ServeConfig, data)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if cfg.model is None:
        raise click.UsageError("no model: pass --model DIR or set model in the --config file")
    if not cfg.model.is_dir():
        raise click.ClickException(f"model: checkpoint directory {cfg.model} does not exist")
    if cfg.engine.draft is not None and not cfg.engine.draft.is_dir():
        raise click.ClickException(f"engine.draft: EAGLE-3 draft directory {cfg.engine.draft} does not exist")
    return cfg


def warm_up(eng: Engine) -> None:
    """Capture the engine's common decode shapes before serving (the torch engine with CUDA graphs;
    nothing elsewhere), with a progress bar on stderr."""
    run = getattr(eng, "warm_up", None)
    if run is None:
        return
    from tqdm import tqdm

    bar: tqdm | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="warm-up: decode rounds", unit="shape", file=sys.stderr)
        bar.update(done - bar.n)

    started = time.perf_counter()
    captured = run(progress)
    if bar is not None:
        bar.close()
        from sidecar.model.decode_kernels import DecodeKernels

        how = (
            "fused Triton kernels" if isinstance(getattr(eng, "kernels", None), DecodeKernels) else "torch's operators"
        )
        log.info(
            "warm-up: %d CUDA graphs captured in %.1f s; decode rounds run %s",
            captured,
            time.perf_counter() - started,
            how,
        )


def kv_pool_line(kv: KVUsage) -> str | None:
    """The KV pool's size in one line, or None for an engine that pages no KV itself (SGLang)."""
    if kv.blocks_total <= 0:
        return None
    return f"KV cache: {kv.blocks_total} blocks of {kv.block_size} tokens ({kv.blocks_total * kv.block_size} tokens)"


def sidecar_config(cfg: ServeConfig, token: str | None) -> SidecarConfig:
    """What the sidecar around the engine takes from `cfg` (all of it but the model and the
    engine section), with the bearer token already read."""
    from sidecar.server.grpc_server import ServerConfig
    from sidecar.server.process import SidecarConfig
    from sidecar.server.scheduler import SchedulerConfig
    from sidecar.server.weight_receiver import TransportOffer
    from sidecar.types import RequestLimits

    offered = cfg.offered_transports
    return SidecarConfig(
        server=ServerConfig(host=cfg.host, port=cfg.port),
        scheduler=SchedulerConfig(max_live_sequences=cfg.max_live_sequences),
        limits=RequestLimits(max_samples=min(4096, cfg.max_live_sequences)),
        security=cfg.security,
        token=token,
        metrics_port=cfg.metrics_port,
        metrics_host=cfg.host,
        keep_staging=cfg.keep_staging and cfg.engine.kind == "torch",  # SGLang copies what it is pushed
        transports=TransportOffer(
            shm="shm" in offered, collective="collective" in offered, sparse_deltas=cfg.sparse_deltas
        ),
        shutdown_grace_s=cfg.shutdown_grace_s,
    )


def run_sidecar(cfg: ServeConfig, token: str | None = None) -> None:
    """Serve `cfg.model` until SIGTERM/SIGINT."""
    assert cfg.model is not None
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sidecar.server.memory import prefer_mmap_for_large_buffers
    from sidecar.server.process import Sidecar

    prefer_mmap_for_large_buffers()  # weight pushes then return their staging memory at once

    host, grace = cfg.host, cfg.shutdown_grace_s
    try:
        security = cfg.security
        security.check_files("security")
        config = sidecar_config(cfg, security.read_token(token))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if host not in ("127.0.0.1", "::1", "localhost") and config.token is None and security.peer_ca is None:
        log.warning("binding %s without a token or mutual TLS: anyone who reaches it can push weights", host)
    eng = load_engine(cfg)
    pool = kv_pool_line(eng.kv_usage())
    if pool is not None:
        log.info("%s", pool)
    warm_up(eng)
    try:
        sidecar = Sidecar(eng, config)
    except OSError as e:
        eng.close()  # an SGLang engine holds processes of its own
        raise click.ClickException(str(e)) from None
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; shutting down (grace %.1fs)", signal.Signals(signum).name, grace)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sidecar.start()
    click.echo(f"specrl sidecar listening on {sidecar.address}", err=True)
    while not stop.wait(timeout=1.0):  # ends on SIGTERM/SIGINT, or when the parent is gone
        if cfg.parent_pid is not None and os.getppid() != cfg.parent_pid:
            log.warning("parent process %d is gone; shutting down (grace %.1fs)", cfg.parent_pid, grace)
            break
    try:
        sidecar.stop(grace)
    finally:
        eng.close()
