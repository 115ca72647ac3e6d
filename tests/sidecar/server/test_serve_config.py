"""One engine config from the trainer's run config to a local sidecar's engine, with one default a key.

Oracles: a real `specrl serve` subprocess started from a run config (its KV pool reports the block
size the run config set, over GetStats); the `EngineConfig` dataclass itself (every `specrl serve`
engine option's default is its field's, and the generated configuration reference shows that same
default); the keys that moved are refused with their new place, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sidecar.config_io import ConfigError, from_mapping
from sidecar.engine.config import EngineConfig
from sidecar.serve_config import ServeConfig
from sidecar.server.cli import ENGINE_OPTIONS, sidecar_config
from tests.sidecar_fixtures import greedy_request, make_checkpoint
from trainer.cli.commands import resolve_config
from trainer.cli.main import main
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.run_setup import local_serve_config

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import gen_config_docs  # noqa: E402


def test_a_run_config_setting_reaches_a_local_sidecars_engine(tmp_path: Path) -> None:
    from sidecar.client.client import SidecarClient

    model = make_checkpoint(tmp_path / "ckpt")
    cfg = resolve_config(
        None,
        [
            f"model={model}",
            "sidecars.serve.engine.kv_block_size=32",
            "sidecars.serve.engine.compile=off",
            "rollout.speculation_k=2",
        ],
    )
    serve = local_serve_config(cfg)
    assert serve.engine.kv_block_size == 32 and serve.engine.speculation_k == 2
    with LocalSidecars(model, 1, tmp_path / "logs", serve=serve, startup_timeout_s=180) as local:
        (address,) = local.start()
        with SidecarClient(address) as client:
            client.generate(greedy_request(n=4))
            kv = client.stats().kv
            info = client.info()
    assert kv.block_size == 32 and kv.blocks_total > 0
    assert info.engine.speculation_k == 2
    written = next((tmp_path / "logs").glob("sidecar0.*.yaml")).read_text()
    assert "kv_block_size: 32" in written and "compile: 'off'" in written


def test_every_engine_option_has_the_one_default_of_its_field() -> None:
    params = {p.name: p for p in main.commands["serve"].params}
    reference = {key: default for key, default, _ in gen_config_docs.rows(ServeConfig, ServeConfig())}
    for f in dataclasses.fields(EngineConfig):
        option = next(name for name, key in ENGINE_OPTIONS.items() if key == f.name)
        assert params[option].default == f.default, f.name
        assert reference[f"engine.{f.name}"] == gen_config_docs.shown(f.default), f.name
    assert set(ENGINE_OPTIONS.values()) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert ServeConfig().engine == EngineConfig()


def test_every_serve_option_has_the_one_default_of_its_field() -> None:
    """The serve config's own options (and its security section's) beside the engine's: the CLI
    default is the field's, and the generated reference shows that same default."""
    from sidecar.security import SecurityConfig

    params = {p.name: p for p in main.commands["serve"].params}
    reference = {key: default for key, default, _ in gen_config_docs.rows(ServeConfig, ServeConfig())}
    sections = [(ServeConfig, ""), (SecurityConfig, "security.")]
    checked = []
    for cls, prefix in sections:
        for f in dataclasses.fields(cls):
            if f.name not in params or f.default is dataclasses.MISSING:
                continue  # `engine`, `security`: sections (above); `model`: the --model argument
            assert params[f.name].default == f.default, f.name
            assert reference[f"{prefix}{f.name}"] == gen_config_docs.shown(f.default), f.name
            checked.append(f.name)
    assert {"port", "keep_staging", "weight_transports", "shutdown_grace_s", "token_file"} <= set(checked)


def test_the_sidecar_config_defaults_are_the_serve_configs() -> None:
    """A `Sidecar` built in Python (no `specrl serve`) gets the defaults `specrl serve` has: its
    config's settings that the serve config also holds are derived from the serve config's."""
    from sidecar.server.process import SidecarConfig

    derived, plain = sidecar_config(ServeConfig(), token=None), SidecarConfig()
    shared = {f.name for f in dataclasses.fields(SidecarConfig)} & {f.name for f in dataclasses.fields(ServeConfig)}
    assert {"keep_staging", "shutdown_grace_s", "metrics_port"} <= shared
    for name in sorted(shared - {"security"}):
        assert getattr(derived, name) == getattr(plain, name), name


def test_the_run_configs_k_defaults_to_the_engines() -> None:
    """`rollout.speculation_k` (what the trainer asks of every sidecar) has no default of its own."""
    from trainer.rl.config import RLConfig

    assert RLConfig(model=Path("m")).rollout.speculation_k == EngineConfig().speculation_k
    assert local_serve_config(RLConfig(model=Path("m"))).engine.speculation_k == EngineConfig().speculation_k


def test_serve_options_land_in_the_engine_section(tmp_path: Path) -> None:
    args = ["--engine", "torch", "--kv-block-size", "64", "--compile", "on", "--no-speculation-auto"]
    out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), *args, "--print-config"])
    assert out.exit_code == 0, out.output
    assert re.search(r"engine:\n  kind: torch\n", out.output)
    assert "  kv_block_size: 64\n" in out.output and "  compile: 'on'\n" in out.output


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"kv_block_size": 32}, "kv_block_size is now engine.kv_block_size"),
        ({"speculation_k": 2}, "speculation_k is now engine.speculation_k"),
        ({"engine": "sglang"}, "engine is now engine.kind"),
    ],
)
def test_a_serve_key_that_moved_names_its_new_place(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        from_mapping(ServeConfig, data)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("sidecars.max_batch_size=2", "sidecars.max_batch_size is now sidecars.serve.engine.max_batch_size"),
        ("sidecars.engine=sglang", "sidecars.engine is now sidecars.serve.engine.kind"),
        ("sidecars.weight_sync.shm=0", "weight_sync is now sidecars.weight_transport"),  # glossary: refused here
        ("sidecars.serve.kv_block_size=32", "sidecars.serve.kv_block_size is now sidecars.serve.engine.kv_block_size"),
        ("sidecars.serve.engine.speculation_k=5", "set rollout.speculation_k instead"),
        ("sidecars.serve.engine.device=cuda", "set sidecars.devices instead"),
        ("sidecars.serve.port=7000", "port is the trainer's to set"),
    ],
)
def test_a_run_config_key_that_moved_or_is_the_trainers_is_refused(override: str, needle: str) -> None:
    with pytest.raises(click.ClickException, match=re.escape(needle)):
        resolve_config(None, ["model=.", override])


def test_the_sidecar_around_the_engine_is_derived_from_the_serve_config() -> None:
    serve = ServeConfig(
        host="0.0.0.0",
        port=7001,
        max_live_sequences=100,
        metrics_port=9100,
        keep_staging=True,
        weight_transports="shm",
        sparse_deltas=False,
        shutdown_grace_s=1.5,
    )
    got = sidecar_config(serve, token="t0ken")
    assert (got.server.host, got.server.port) == ("0.0.0.0", 7001)
    assert got.scheduler.max_live_sequences == 100 and got.limits.max_samples == 100
    assert (got.metrics_port, got.metrics_host, got.token) == (9100, "0.0.0.0", "t0ken")
    assert got.keep_staging is True and got.shutdown_grace_s == 1.5
    assert (got.transports.shm, got.transports.collective, got.transports.sparse_deltas) == (True, False, False)
    # SGLang copies what it is pushed: nothing to keep staged
    sglang = dataclasses.replace(serve, engine=EngineConfig(kind="sglang"))
    assert sidecar_config(sglang, token=None).keep_staging is False


def test_the_renamed_sparse_deltas_key_names_its_new_spelling() -> None:
    from trainer.rl.config import WeightTransportConfig

    with pytest.raises(ConfigError, match="deltas is now sparse_deltas"):
        from_mapping(WeightTransportConfig, {"deltas": True})
    assert from_mapping(WeightTransportConfig, {"sparse_deltas": True}).sparse_deltas
