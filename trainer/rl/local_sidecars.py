"""Local sidecars: `specrl serve` subprocesses on this machine, for single-node runs and the demo.

Each sidecar is a real process (the same binary a cluster runs), bound to loopback on port 0;
its address is read from the `listening on HOST:PORT` line it prints once serving, with a
deadline. Output goes to a log file in the run directory. Teardown is graceful (SIGTERM, which
`specrl serve` answers by draining), then SIGKILL after a grace period; a sidecar whose trainer
died without tearing it down (SIGKILL, OOM) stops by itself within seconds (`serve --parent-pid`).
Each is started from one serve config (`ServeConfig`, the trainer's `sidecars.serve`), written to
the log directory beside its log: what a run config says there reaches the engine as written.
`restart(i)` brings a dead sidecar back on its old port (the fleet pushes it the current weights
before use). With a
`token`, each sidecar requires it (given in its environment as $SPECRL_TOKEN, never in argv).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sidecar.config_io import write_yaml
from sidecar.errors import SpecrlError
from sidecar.security import TOKEN_ENV
from sidecar.serve_config import ServeConfig

log = logging.getLogger(__name__)
_LISTENING = re.compile(r"listening on (\S+:\d+)")


class SidecarStartError(SpecrlError):
    """A local sidecar exited or did not announce its address in time."""


@dataclass(kw_only=True, slots=True)
class _Proc:
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path


class LocalSidecars:
    """N `specrl serve` subprocesses serving `model`; a context manager that tears them down."""

    def __init__(
        self,
        model: Path,
        count: int,
        log_dir: Path,
        *,
        serve: ServeConfig | None = None,
        devices: tuple[str, ...] | list[str] | None = None,
        threads: int = 1,
        startup_timeout_s: float = 120.0,
        token: str | None = None,
    ) -> None:
        """`serve`: what every sidecar serves with (`specrl serve --config`; default `ServeConfig()`),
        its model, address and parent set here; `devices`: one torch device for all sidecars, or
        one per sidecar (default: `serve.engine.device`)."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.model = Path(model)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.serve = serve or ServeConfig()
        self.threads = threads
        self.startup_timeout_s = startup_timeout_s
        self.devices = list(devices or [self.serve.engine.device])
        self._token = token
        """Bearer token the sidecars require (passed in their environment, never on the command line)."""
        self._procs: list[_Proc | None] = [None] * count
        self._launches = 0

    def config_of(self, i: int, port: int = 0) -> ServeConfig:
        """What sidecar `i` serves with: `serve` on this model, loopback `port`, its device, and this
        process as the parent it must not outlive (a SIGKILLed trainer cannot tear it down)."""
        return dataclasses.replace(
            self.serve,
            model=self.model,
            host="127.0.0.1",
            port=port,
            parent_pid=os.getpid(),
            engine=dataclasses.replace(self.serve.engine, device=self.devices[i % len(self.devices)]),
        )

    def start(self) -> list[str]:
        """Launch all sidecars (in parallel) and wait until each announces its address."""
        pending = [self._launch(i) for i in range(len(self._procs))]
        for i, (process, log_path) in enumerate(pending):
            self._procs[i] = _Proc(process=process, address=self._wait_address(process, log_path), log_path=log_path)
        log.info("local sidecars: %s", ", ".join(self.addresses))
        return self.addresses

    @property
    def addresses(self) -> list[str]:
        return [p.address for p in self._procs if p is not None]

    def pid(self, i: int) -> int:
        proc = self._procs[i]
        if proc is None:
            raise ValueError(f"local sidecar {i} is not running")
        return proc.process.pid

    def _launch(self, i: int, port: int = 0) -> tuple[subprocess.Popen[bytes], Path]:
        self._launches += 1
        log_path = self.log_dir / f"sidecar{i}.{self._launches}.log"
        config_path = self.log_dir / f"sidecar{i}.{self._launches}.yaml"
        write_yaml(self.config_of(i, port), config_path)
        cmd = [sys.executable, "-c", "from trainer.cli.main import main; main()", "serve", "--config", str(config_path)]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        env.pop(TOKEN_ENV, None)  # exactly the token the trainer sends, not whatever the shell had
        if self._token is not None:
            env[TOKEN_ENV] = self._token
        with log_path.open("wb") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return process, log_path

    def _wait_address(self, process: subprocess.Popen[bytes], log_path: Path) -> str:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            match = _LISTENING.search(text)
            if match:
                return match.group(1)
            if process.poll() is not None:
                raise SidecarStartError(
                    f"local sidecar exited with code {process.returncode} before serving; its log {log_path}:\n"
                    + text[-2000:]
                )
            time.sleep(0.1)
        process.kill()
        raise SidecarStartError(
            f"local sidecar did not print 'listening on' within {self.startup_timeout_s:.0f}s; see {log_path}"
        )

    def kill(self, i: int) -> None:
        """Kill sidecar i at once (SIGKILL): a crash, for fault-handling tests."""
        proc = self._procs[i]
        if proc is not None:
            proc.process.kill()
            proc.process.wait(timeout=30)

    def restart(self, i: int) -> str:
        """Start sidecar i again (after a crash) on its old port, so clients reconnect as they are."""
        proc = self._procs[i]
        port = int(proc.address.rsplit(":", 1)[1]) if proc is not None else 0
        self.stop(i)
        process, log_path = self._launch(i, port)
        self._procs[i] = _Proc(process=process, address=self._wait_address(process, log_path), log_path=log_path)
        return self._procs[i].address  # type: ignore[union-attr]

    def stop(self, i: int, grace_s: float = 10.0) -> None:
        """SIGTERM (graceful drain), then SIGKILL after `grace_s`."""
        proc = self._procs[i]
        self._procs[i] = None
        if proc is None or proc.process.poll() is not None:
            return
        proc.process.send_signal(signal.SIGTERM)
        try:
            proc.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("sidecar %s ignored SIGTERM for %.0fs; killing it", proc.address, grace_s)
            proc.process.kill()
            proc.process.wait(timeout=30)

    def close(self) -> None:
        for i in range(len(self._procs)):
            self.stop(i)

    def __enter__(self) -> LocalSidecars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
