"""Fixtures of the TRL target (tools/test-trl): a tiny checkpoint, and a real `specrl serve`
process around it (the CLI a user runs, not an in-process server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.with_trl.serve import ServeProcess
from tests.with_trl.tiny_model import build_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-mtp"))


@pytest.fixture
def serve(checkpoint: Path) -> Iterator[ServeProcess]:
    """A fresh sidecar per test (weight version 0, k = 2)."""
    process = ServeProcess(checkpoint, speculation_k=2)
    try:
        yield process
    finally:
        process.stop()
