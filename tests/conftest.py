"""Fixtures shared by the test modules (pytest finds them here without an import).

A module takes what it names: `single_torch_thread` (usually for all its tests, through
`pytestmark = pytest.mark.usefixtures("single_torch_thread")`), the module's tiny `checkpoint`,
a real `sidecar` serving it on port 0 and a `client` of that sidecar (one each per module), a
`pair` of fresh sidecars per test, and test certificates (`pki`). Where a module needs other
weights or another sidecar, it overrides `checkpoint_seed` or `sidecar_settings` (or
`checkpoint` itself) with a fixture of the same name; everything built on them follows.

The helpers these are made of, and the oracles, are plain functions in tests/sidecar_fixtures.py;
the engines' tiny models (`tiny_config`, a `random_model`, an `aligned_model` whose draft
agrees with its target) are built in tests/sidecar/engine_fixtures.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.client.client import SidecarClient
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.server.process import Sidecar
from tests.sidecar.engine_fixtures import aligned_draft_model
from tests.sidecar_fixtures import make_checkpoint, make_pki, start_sidecar

if not torch.cuda.is_available():  # the decode kernels run in Triton's interpreter (before Triton's import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # tools/test runs one worker per core: a worker's intra-op threads get its share of the cores
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def random_model(tiny_config: ModelConfig) -> Qwen3WithMTP:
    """A random target with a random (misaligned) MTP layer."""
    return build_model(tiny_config, seed=1)


@pytest.fixture(scope="session")
def aligned_model(tiny_config: ModelConfig) -> Qwen3WithMTP:
    return aligned_draft_model(tiny_config, seed=2)


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on a 2-core box those threads' spinning
    starves the server's RPC threads (a 2 s test took 13 s), and thread start-up dominates tiny
    matrix work. Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint_seed() -> int:
    """The seed of the weights in the module's `checkpoint` (a module overrides it for others)."""
    return 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, checkpoint_seed: int) -> Path:
    """The tiny model (tests/sidecar_fixtures.tiny_config) with `weights(checkpoint_seed)`."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=checkpoint_seed)


@pytest.fixture(scope="module")
def sidecar_settings() -> dict[str, Any]:
    """start_sidecar's keyword settings of the module's `sidecar` (a module overrides it)."""
    return {}


@pytest.fixture(scope="module")
def sidecar(checkpoint: Path, sidecar_settings: dict[str, Any]) -> Iterator[Sidecar]:
    """A real sidecar (TorchEngine, port 0) serving `checkpoint`, shared by the module's tests."""
    sc = start_sidecar(checkpoint, **sidecar_settings)
    yield sc
    sc.stop(0.5)


@pytest.fixture(scope="module")
def client(sidecar: Sidecar) -> Iterator[SidecarClient]:
    """A client of the module's `sidecar` with the default configuration."""
    with SidecarClient(sidecar.address) as c:
        yield c


@pytest.fixture
def pair(checkpoint: Path) -> Iterator[tuple[Sidecar, Sidecar]]:
    """Two fresh sidecars serving `checkpoint` (a fleet), stopped after the test."""
    a, b = start_sidecar(checkpoint), start_sidecar(checkpoint)
    try:
        yield a, b
    finally:
        a.stop(0.2)
        b.stop(0.2)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (openssl CLI)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the tests marked `long` (fault scenarios and soaks beyond the default suite's budget)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`long` tests would push the default suite past its ~7 minutes on 2 cores: they run with --long."""
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long test: run with --long (e.g. tools/test --long -m long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
