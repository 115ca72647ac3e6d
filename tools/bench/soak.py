#!/usr/bin/env python
"""Soak a local fleet of `specrl serve` sidecars: mixed traffic, weight pushes and kills for a
bounded time, checking the sidecar's invariants all the while (DESIGN.md, "Running for days").

What runs (all on 127.0.0.1, a tiny model built here, no downloads):
- 2-3 sidecars (`trainer.rl.local_sidecars`), the last one with automatic k (`--speculation-auto`);
- traffic threads sending Generate of random shapes (prompts, lengths, samples, max new tokens,
  temperature 0 or 1, k 0..3 or the sidecar's own/automatic choice); some are cancelled by the
  client mid-stream (it disconnects), some aborted by request id, some given a deadline too short
  to finish;
- a pusher: a new weight version every few seconds to every serving sidecar, dense (every element
  changes) or sparse (a few rows change; sent as deltas), over the gRPC stream or shared memory;
- a killer: every few minutes one sidecar is SIGKILLed, restarted empty on its port and brought
  to the current version before it counts as serving again;
- a monitor: resident memory, open descriptors and threads of every sidecar process (/proc), and
  the latency of GetStats/GetInfo.

Checks (each breach is a violation; the run exits 1 if there was any):
- every request ends, within its deadline plus a margin, in all its samples or in a status that
  its situation explains (UNAVAILABLE/FAILED_PRECONDITION around a kill, CANCELLED after an
  abort, DEADLINE_EXCEEDED under a short deadline, RESOURCE_EXHAUSTED when busy); none hangs;
- every sample's weight versions were committed to that sidecar, no older than the version the
  request demanded and no newer than the last push begun;
- after every push, each sidecar's served tensors (DescribeWeights checksums) equal the pushed
  ones and its version is the pushed one;
- after warm-up, each sidecar's RSS, descriptors and threads stay within a bound of their
  post-warm-up level.

    specrl bench soak --minutes 10          # progress every 30 s, a summary at the end
    specrl bench soak --short               # about a minute (CI: tests/tools/test_soak.py)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.client.transport import TransportConfig
from sidecar.engine.config import EngineConfig
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import ModelConfig
from sidecar.serve_config import ServeConfig
from sidecar.types import FinishReason, GenerationRequest, SamplingParams
from sidecar.weight_transport.tensors import tensor_crc32
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.warmup import make_model

Code = grpc.StatusCode
VOCAB = 64
GENERATE_DEADLINE_S = 60.0
"""Every Generate carries this deadline (or a shorter one); one still open this much later plus
HANG_MARGIN_S is a hang."""
HANG_MARGIN_S = 15.0
RSS_GROWTH = 1.5
"""Bounds after warm-up: RSS <= warm-up RSS x this + RSS_SLACK_MIB; fds and threads + their slack."""
RSS_SLACK_MIB = 64
FD_SLACK = 32
THREAD_SLACK = 16


@dataclass(kw_only=True)
class Settings:
    minutes: float
    sidecars: int
    traffic_threads: int
    push_every_s: float
    kill_every_s: float
    warmup_s: float
    progress_every_s: float
    seed: int


def settings(args: argparse.Namespace) -> Settings:
    if args.short:
        return Settings(
            minutes=0.75,
            sidecars=2,
            traffic_threads=3,
            push_every_s=2.0,
            kill_every_s=18.0,
            warmup_s=8.0,
            progress_every_s=10.0,
            seed=args.seed,
        )
    minutes = args.minutes
    return Settings(
        minutes=minutes,
        sidecars=args.sidecars,
        traffic_threads=4,
        push_every_s=args.push_every_s,
        kill_every_s=args.kill_every_s,
        warmup_s=min(60.0, 0.2 * minutes * 60),
        progress_every_s=30.0,
        seed=args.seed,
    )


@dataclass(kw_only=True)
class SidecarState:
    """What the soak knows of one sidecar (guarded by Soak.lock)."""

    index: int
    address: str
    incarnation: int = 0
    """Bumped on every kill: a request that spans a kill may fail UNAVAILABLE."""
    serving: bool = True
    """False from a kill until it has been brought to the current version."""
    committed: set[int] = field(default_factory=lambda: {0})
    """Versions this incarnation has committed (0: the checkpoint it starts from)."""
    begun: int = 0
    """The highest version a push to this incarnation has begun."""
    pid: int = 0
    resources: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(time, RSS KiB, fds, threads) of the current incarnation."""
    baseline: tuple[int, int, int] | None = None


class Soak:
    def __init__(self, cfg: Settings, root: Path) -> None:
        self.cfg = cfg
        self.root = root
        self.rng = random.Random(cfg.seed)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.samples = 0
        self.pushes: Counter[str] = Counter()
        self.kills = 0
        self.latency: dict[str, list[float]] = {"GetStats": [], "GetInfo": []}
        self.version = 1
        self.weights: dict[str, torch.Tensor] = {}
        self.names: list[str] = []
        self.trend: dict[int, list[str]] = {}
        self.started = time.monotonic()

    # ---- setup -------------------------------------------------------------------------------
    def start(self) -> None:
        model = make_model(
            self.root / "model",
            ModelConfig.tiny(vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True),
            seed=self.cfg.seed,
        )
        _, self.weights = load_checkpoint(model)
        logs = self.root / "logs"
        fixed = self.cfg.sidecars - 1
        self.fleets = [
            LocalSidecars(
                model,
                fixed,
                logs,
                serve=ServeConfig(engine=EngineConfig(speculation_k=3, max_batch_size=16)),
                startup_timeout_s=180,
            ),
            LocalSidecars(
                model,
                1,
                logs / "auto",
                serve=ServeConfig(engine=EngineConfig(speculation_k=3, speculation_auto=True, max_batch_size=16)),
                startup_timeout_s=180,
            ),
        ]
        self.slots = [(f, i) for f in self.fleets for i in range(len(f._procs))]
        addresses = [a for f in self.fleets for a in f.start()]
        self.sidecars = [SidecarState(index=n, address=a) for n, a in enumerate(addresses)]
        for s in self.sidecars:
            fleet, i = self.slots[s.index]
            s.pid = fleet.pid(i)
        self.push_locks = [threading.Lock() for _ in self.sidecars]
        self.grpc_clients = [self._client(a, shm=False, sparse_deltas=True) for a in addresses]
        self.shm_clients = [self._client(a, shm=True, sparse_deltas=False) for a in addresses]
        for s in self.sidecars:  # version 1 everywhere before traffic starts
            self._push_one(s, self.version, self.shm_clients[s.index], "initial")

    @staticmethod
    def _client(address: str, *, shm: bool, sparse_deltas: bool) -> SidecarClient:
        return SidecarClient(
            address,
            ClientConfig(
                timeout_s=10.0,
                retries=1,
                transports=TransportConfig(shm=shm),
                sparse_deltas=sparse_deltas,
                generate_timeout_s=GENERATE_DEADLINE_S,
            ),
        )

    def close(self) -> None:
        for c in self.grpc_clients + self.shm_clients:
            c.close()
        for f in self.fleets:
            f.close()

    def violation(self, what: str) -> None:
        with self.lock:
            self.violations.append(f"[{time.monotonic() - self.started:6.1f}s] {what}")
        print(f"VIOLATION: {what}", file=sys.stderr, flush=True)

    # ---- weights -----------------------------------------------------------------------------
    def _next_weights(self, sparse: bool) -> None:
        """Change the weights: every element (dense) or a few rows of a few tensors (sparse)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.version)
        names = list(self.weights)
        chosen = [names[int(i)] for i in torch.randperm(len(names), generator=g)[:3]] if sparse else names
        for name in chosen:
            t = self.weights[name].clone()
            if sparse and t.dim() >= 1:
                rows = torch.randperm(t.shape[0], generator=g)[: max(1, t.shape[0] // 16)]
                t[rows] += 1e-3 * torch.randn(t[rows].shape, generator=g)
            else:
                t += 1e-3 * torch.randn(t.shape, generator=g)
            self.weights[name] = t

    def _push_one(self, s: SidecarState, version: int, client: SidecarClient, kind: str) -> bool:
        """Push the current weights as `version` to `s` and check what it serves afterwards."""
        with self.push_locks[s.index]:
            with self.lock:
                incarnation = s.incarnation
                s.begun = max(s.begun, version)
            weights = dict(self.weights)
            try:
                specs, _ = client.describe_weights()
                result = client.push_weights([(sp.name, weights[sp.name]) for sp in specs], version, specs=specs)
            except SidecarCallError as e:
                with self.lock:
                    killed = s.incarnation != incarnation or not s.serving
                if killed or e.code in (Code.UNAVAILABLE, Code.CANCELLED):  # killed under the push
                    self.pushes["interrupted"] += 1
                    return False
                self.violation(f"push of version {version} to sidecar {s.index} failed: {e}")
                return False
            with self.lock:
                if s.incarnation == incarnation:
                    s.committed.add(version)
            full = sum(t.numel() * t.element_size() for t in weights.values())
            sent = "delta" if result.bytes_received < full else "full"
            self.pushes[f"{kind}/{sent}/{result.transport.name.lower()}"] += 1
            self._check_served(s, client, version, weights, incarnation)
            return True

    def _check_served(
        self, s: SidecarState, client: SidecarClient, version: int, weights: dict[str, torch.Tensor], incarnation: int
    ) -> None:
        """The served tensors are the pushed ones (checksums) and the served version is `version`."""
        try:
            specs, served = client.describe_weights(include_checksums=True)
        except SidecarCallError as e:
            with self.lock:
                if s.incarnation != incarnation:
                    return
            self.violation(f"sidecar {s.index}: DescribeWeights after the push of version {version} failed: {e}")
            return
        if served != version:
            self.violation(f"sidecar {s.index} serves version {served} right after committing {version}")
            return
        wrong = [sp.name for sp in specs if sp.crc32 and sp.crc32 != tensor_crc32(weights[sp.name])]
        unknown = sum(1 for sp in specs if not sp.crc32)
        if wrong or unknown:
            self.violation(
                f"sidecar {s.index} at version {version}: {len(wrong)} tensors differ from the push "
                f"({wrong[:3]}), {unknown} without a checksum"
            )

    def pusher(self) -> None:
        n = 0
        while not self.stop.wait(self.cfg.push_every_s):
            n += 1
            sparse = n % 2 == 0
            with self.lock:
                self.version += 1
                version = self.version
                self._next_weights(sparse)
                targets = [s for s in self.sidecars if s.serving]
            for s in targets:
                client = self.grpc_clients[s.index] if sparse or n % 3 == 0 else self.shm_clients[s.index]
                self._push_one(s, version, client, "sparse" if sparse else "dense")

    # ---- kills -------------------------------------------------------------------------------
    def killer(self) -> None:
        n = 0
        while not self.stop.wait(self.cfg.kill_every_s):
            s = self.sidecars[n % len(self.sidecars)]
            n += 1
            fleet, i = self.slots[s.index]
            with self.push_locks[s.index], self.lock:  # not mid-push: a push interrupted is its own case
                s.serving = False
                s.incarnation += 1
            fleet.kill(i)
            with self.lock:
                self.kills += 1
            if self.stop.is_set():
                return
            address = fleet.restart(i)
            if address != s.address:
                self.violation(f"sidecar {s.index} came back on {address}, not {s.address}")
                return
            with self.lock:
                s.committed, s.begun, s.pid = {0}, 0, fleet.pid(i)
                s.resources, s.baseline = [], None
                version = self.version
            for c in (self.grpc_clients[s.index], self.shm_clients[s.index]):
                c.delta_base.forget()  # the restarted sidecar has none of the pushed versions
                # out of gRPC's reconnect backoff from the kill before the sidecar serves again: a
                # channel still in it fails calls fast ("Connection refused") though the sidecar is up
                with contextlib.suppress(grpc.FutureTimeoutError):
                    grpc.channel_ready_future(c.channel).result(timeout=10)
            # brought to the current version before it serves (a push may land meanwhile: again)
            for _ in range(5):
                self._push_one(s, version, self.shm_clients[s.index], "rejoin")
                with self.lock:
                    if max(s.committed) == self.version:
                        s.serving = True
                        break
                    version = self.version
            else:
                self.violation(f"sidecar {s.index} could not be brought to version {self.version} after its restart")

    # ---- traffic -----------------------------------------------------------------------------
    def traffic(self, worker: int) -> None:
        rng = random.Random(self.cfg.seed * 7919 + worker)
        n = 0
        while not self.stop.is_set():
            n += 1
            with self.lock:
                live = [s for s in self.sidecars if s.serving]
            if not live:
                time.sleep(0.1)
                continue
            s = rng.choice(live)
            self.one_request(s, rng, f"soak-{worker}-{n}")

    def one_request(self, s: SidecarState, rng: random.Random, rid: str) -> None:
        prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(rng.randint(1, 4))]
        samples = rng.randint(1, 3)
        k = rng.choice([None, 0, 1, 2, 3])
        sampling = SamplingParams(
            temperature=rng.choice([0.0, 1.0]), max_new_tokens=rng.randint(4, 24), seed=rng.randrange(1 << 30)
        )
        mode = rng.choices(["full", "disconnect", "abort", "short_deadline"], weights=[70, 12, 10, 8])[0]
        with self.lock:
            if not s.serving:  # killed since it was chosen
                return
            incarnation, floor = s.incarnation, max(s.committed)
        request = GenerationRequest(
            prompts=prompts,
            sampling=sampling,
            samples_per_prompt=samples,
            request_id=rid,
            min_weight_version=floor,
            speculation_k=k,
        )
        deadline = 0.05 if mode == "short_deadline" else GENERATE_DEADLINE_S
        client = self.grpc_clients[s.index]
        got = []
        start = time.monotonic()
        aborter = None
        if mode == "abort":
            aborter = threading.Timer(rng.uniform(0.0, 0.3), self._abort, (client, rid))
            aborter.start()
        try:
            stream = client.stream_generate(request, timeout_s=deadline)
            try:
                for sample in stream:
                    got.append(sample)
                    if mode == "disconnect":
                        break  # the client goes away mid-stream
            finally:
                stream.close()  # type: ignore[attr-defined]
            outcome = self._judge_samples(s, incarnation, floor, request, got, mode)
        except SidecarCallError as e:
            outcome = self._judge_error(s, incarnation, e, mode)
        finally:
            if aborter is not None:
                aborter.cancel()
        took = time.monotonic() - start
        if took > deadline + HANG_MARGIN_S:
            self.violation(f"{rid} to sidecar {s.index} took {took:.1f}s, past its {deadline:.2f}s deadline")
        with self.lock:
            self.outcomes[outcome] += 1
            self.samples += len(got)

    @staticmethod
    def _abort(client: SidecarClient, rid: str) -> None:
        with contextlib.suppress(SidecarCallError):  # the sidecar may be gone: the request's outcome says so
            client.abort(rid)

    def _judge_samples(
        self, s: SidecarState, incarnation: int, floor: int, request: GenerationRequest, got: list, mode: str
    ) -> str:
        with self.lock:
            committed, begun, same = set(s.committed), s.begun, s.incarnation == incarnation
        for sample in got:
            versions = {sample.weight_version, sample.last_weight_version}
            if not same:
                continue  # the sidecar was killed and restarted: its history started again
            if sample.weight_version < floor or sample.last_weight_version > max(begun, floor):
                self.violation(
                    f"{request.request_id}: sample at versions {sorted(versions)} from sidecar {s.index} "
                    f"outside [{floor}, {begun}]"
                )
            elif not versions <= committed | {begun}:
                self.violation(f"{request.request_id}: version(s) {sorted(versions - committed)} never committed")
        if mode == "disconnect":
            return "disconnected"
        aborted = any(x.finish_reason is FinishReason.ABORT for x in got)
        expected = len(request.prompts) * request.samples_per_prompt
        if len(got) != expected:
            if same:
                self.violation(
                    f"{request.request_id} ({mode}): stream ended with {len(got)} of {expected} samples, no error"
                )
            return "lost_to_kill"
        if aborted and mode != "abort":
            self.violation(f"{request.request_id}: a sample was aborted though nobody aborted it")
        return "aborted" if aborted else "complete"

    def _judge_error(self, s: SidecarState, incarnation: int, e: SidecarCallError, mode: str) -> str:
        with self.lock:
            killed = s.incarnation != incarnation or not s.serving
        code = e.code
        if killed and code in (Code.UNAVAILABLE, Code.FAILED_PRECONDITION, Code.CANCELLED):
            return f"killed/{code.name}"
        if mode == "short_deadline" and code == Code.DEADLINE_EXCEEDED:
            return "deadline_exceeded"
        if mode == "abort" and code in (Code.CANCELLED, Code.ABORTED):
            return f"aborted/{code.name}"
        if code == Code.RESOURCE_EXHAUSTED:
            return "busy"
        self.violation(f"sidecar {s.index}: {mode} request failed unexpectedly: {e}")
        return f"unexpected/{code.name}"

    # ---- monitoring --------------------------------------------------------------------------
    def monitor(self) -> None:
        rng = random.Random(self.cfg.seed + 1)
        next_resources = time.monotonic()
        while not self.stop.wait(0.2):
            with self.lock:
                live = [s for s in self.sidecars if s.serving]
            if live:
                s = rng.choice(live)
                client = self.shm_clients[s.index]
                for name, call in (("GetStats", client.stats), ("GetInfo", client.info)):
                    t = time.perf_counter()
                    try:
                        call()
                    except SidecarCallError as e:
                        with self.lock:
                            if s.serving:
                                self.violation(f"sidecar {s.index}: {name} failed while serving: {e}")
                        continue
                    with self.lock:
                        self.latency[name].append(time.perf_counter() - t)
            if time.monotonic() >= next_resources:
                next_resources += 2.0
                self._sample_resources()

    def _sample_resources(self) -> None:
        now = time.monotonic() - self.started
        for s in self.sidecars:
            with self.lock:
                pid, serving = s.pid, s.serving
            reading = read_proc(pid) if serving else None
            if reading is None:
                continue
            with self.lock:
                if s.pid != pid:
                    continue
                s.resources.append((now, *reading))
                warm = [r for r in s.resources if r[0] >= s.resources[0][0] + self.cfg.warmup_s]
                if s.baseline is None and warm:
                    s.baseline = warm[0][1:]
                base = s.baseline
            if base is None:
                continue
            rss, fds, threads = reading
            if rss > base[0] * RSS_GROWTH + RSS_SLACK_MIB * 1024:
                self.violation(f"sidecar {s.index}: RSS {rss // 1024} MiB, after warm-up {base[0] // 1024} MiB")
            if fds > base[1] + FD_SLACK:
                self.violation(f"sidecar {s.index}: {fds} open descriptors, after warm-up {base[1]}")
            if threads > base[2] + THREAD_SLACK:
                self.violation(f"sidecar {s.index}: {threads} threads, after warm-up {base[2]}")

    def progress(self) -> str:
        with self.lock:
            done = sum(self.outcomes.values())
            serving = sum(s.serving for s in self.sidecars)
            res = [s.resources[-1] for s in self.sidecars if s.resources]
        rss = "/".join(f"{r[1] // 1024}" for r in res)
        return (
            f"[{time.monotonic() - self.started:6.0f}s] requests {done} samples {self.samples} "
            f"pushes {sum(self.pushes.values())} (version {self.version}) kills {self.kills} "
            f"serving {serving}/{len(self.sidecars)} RSS MiB {rss} violations {len(self.violations)}"
        )

    # ---- the run -----------------------------------------------------------------------------
    def guarded(self, target: Callable[..., None], *args: object) -> Callable[[], None]:
        """`target(*args)`, with an exception that ends it counted as a violation: a worker that
        dies (a restart that fails, a bug) would otherwise leave a quieter soak that still passes."""

        def run() -> None:
            try:
                target(*args)
            except Exception as e:
                self.violation(f"thread {threading.current_thread().name} died: {type(e).__name__}: {e}")

        return run

    def run(self) -> int:
        self.start()
        self.started = time.monotonic()
        threads = [
            threading.Thread(target=self.guarded(self.traffic, w), name=f"traffic{w}", daemon=True)
            for w in range(self.cfg.traffic_threads)
        ]
        threads += [
            threading.Thread(target=self.guarded(self.pusher), name="pusher", daemon=True),
            threading.Thread(target=self.guarded(self.killer), name="killer", daemon=True),
            threading.Thread(target=self.guarded(self.monitor), name="monitor", daemon=True),
        ]
        for t in threads:
            t.start()
        end = self.started + self.cfg.minutes * 60
        next_progress = self.started + self.cfg.progress_every_s
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_progress:
                next_progress += self.cfg.progress_every_s
                print(self.progress(), flush=True)
        self.stop.set()
        join_by = time.monotonic() + GENERATE_DEADLINE_S + HANG_MARGIN_S + 60.0  # a restart may be under way
        for t in threads:
            t.join(max(0.1, join_by - time.monotonic()))
            if t.is_alive():
                self.violation(f"thread {t.name} did not stop by the end of the run (a hang)")
        self._check_final()
        print(self.summary(), flush=True)
        return 1 if self.violations else 0

    def _check_final(self) -> None:
        """Every serving sidecar ends at the last version it committed, with the pushed weights."""
        for s in self.sidecars:
            with self.lock:
                if not s.serving:
                    continue
                version = max(s.committed)
            if version == self.version:
                self._check_served(s, self.shm_clients[s.index], version, self.weights, s.incarnation)
        if not self.outcomes:
            self.violation("no request was made")

    def summary(self) -> str:
        lines = [f"soak summary: {self.cfg.minutes:g} min, {len(self.sidecars)} sidecars (the last with automatic k)"]
        total = sum(self.outcomes.values())
        lines.append(
            f"  requests {total}, samples {self.samples}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        )
        lines.append(
            f"  pushes {sum(self.pushes.values())} (last version {self.version}): "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.pushes.items()))
        )
        lines.append(f"  kills {self.kills} (each followed by a restart and a catch-up push)")
        for s in self.sidecars:
            r = [x for x in s.resources if s.baseline is None or x[0] >= s.resources[0][0] + self.cfg.warmup_s]
            if len(r) >= 2:
                lines.append(
                    f"  sidecar {s.index} (last incarnation, after warm-up, {r[-1][0] - r[0][0]:.0f}s): "
                    f"RSS {r[0][1] // 1024} -> {r[-1][1] // 1024} MiB (max {max(x[1] for x in r) // 1024}), "
                    f"fds {r[0][2]} -> {r[-1][2]}, threads {r[0][3]} -> {r[-1][3]}"
                )
        for name, values in self.latency.items():
            if values:
                q = statistics.quantiles(values, n=100) if len(values) >= 2 else values * 99
                lines.append(
                    f"  {name}: n {len(values)}, p50 {1e3 * q[49]:.1f} ms, p99 {1e3 * q[98]:.1f} ms, "
                    f"max {1e3 * max(values):.1f} ms"
                )
        lines.append(f"  violations {len(self.violations)}")
        lines += [f"    {v}" for v in self.violations[:20]]
        return "\n".join(lines)


def read_proc(pid: int) -> tuple[int, int, int] | None:
    """(RSS KiB, open descriptors, threads) of `pid` from /proc; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), fds, int(fields["Threads"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=10.0, help="how long traffic runs (default 10)")
    p.add_argument("--short", action="store_true", help="the CI mode: 2 sidecars, ~45 s of traffic, one kill")
    p.add_argument("--sidecars", type=int, default=3, choices=(2, 3), help="sidecars in the fleet (default 3)")
    p.add_argument("--push-every-s", type=float, default=3.0, help="seconds between weight pushes (default 3)")
    p.add_argument("--kill-every-s", type=float, default=120.0, help="seconds between sidecar kills (default 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, default=None, help="keep the model and sidecar logs in this directory")
    args = p.parse_args(argv)
    if not args.minutes > 0:
        p.error("--minutes must be > 0")
    torch.set_num_threads(1)
    cfg = settings(args)
    print(
        f"soak: {cfg.sidecars} sidecars for {cfg.minutes:g} min; a push every {cfg.push_every_s:g}s, "
        f"a kill every {cfg.kill_every_s:g}s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="specrl-soak-") as tmp:
        root = args.keep or Path(tmp)
        soak = Soak(cfg, root)
        try:
            return soak.run()
        finally:
            soak.close()


if __name__ == "__main__":
    sys.exit(main())
