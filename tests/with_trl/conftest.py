"""Fixtures of the TRL target (tools/test-trl): a tiny checkpoint, and a real `specrl serve`
process around it (the CLI a user runs, not an in-process server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.with_trl.tiny_model import build_tiny_checkpoint

STARTUP_S = 120.0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-mtp"))


class ServeProcess:
    """`specrl serve` in a child process; `address` once it listens."""

    def __init__(self, checkpoint: Path, spec_k: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        specrl = Path(sys.executable).with_name("specrl")  # the console script a user runs
        cmd = [str(specrl), "serve", "--model", str(checkpoint), "--port", "0"]
        cmd += ["--spec-k", str(spec_k), "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + STARTUP_S
        lines = []
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "listening on" in line:
                self.address = line.rsplit(" ", 1)[1].strip()
                return
        self.proc.kill()
        raise RuntimeError("specrl serve did not start:\n" + "".join(lines))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def serve(checkpoint: Path) -> Iterator[ServeProcess]:
    """A fresh sidecar per test (weight version 0, k = 2)."""
    process = ServeProcess(checkpoint, spec_k=2)
    try:
        yield process
    finally:
        process.stop()
