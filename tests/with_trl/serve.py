"""A real `specrl serve` child process (the CLI a user runs), for the TRL tests and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

STARTUP_S = 120.0


class ServeProcess:
    """`specrl serve` in a child process; `address` once it listens."""

    def __init__(self, checkpoint: Path, speculation_k: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        specrl = Path(sys.executable).with_name("specrl")  # the console script a user runs
        cmd = [str(specrl), "serve", "--model", str(checkpoint), "--port", "0"]
        cmd += ["--speculation-k", str(speculation_k), "--log-level", "WARNING"]
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
