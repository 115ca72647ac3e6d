"""Benchmark (not a test): control-plane latency of a sidecar while many Generate streams are open.

A sidecar around a tiny model is served by a subprocess whose `sidecar` package comes from a
given source tree (`--src`, repeatable: e.g. a checkout of `main` and this branch), so two
implementations are measured by the same client, alternating round by round (A, B, A, B, ...)
on one machine. Per round and source tree:

- `paused`: the sidecar is paused, N streams are opened (they are admitted but cannot finish),
  then health Check, GetInfo, GetStats and Abort are each called once with a 5 s deadline.
- `generating`: N streams each generate `--new-tokens` greedy tokens; 0.3 s later the same four
  calls are made while the engine works.

Reports the median latency per call over the rounds ("timeout" when the 5 s deadline expired
in the majority of rounds) and how many of the N streams the server had admitted.

Usage: specrl bench control-plane --src /path/to/main --src . [--streams 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import sidecar.protocol.convert as convert
from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import control_pb2, rollout_pb2
from sidecar.types import GenerationRequest, SamplingParams

CALL_DEADLINE_S = 5.0
CALLS = ("health", "GetInfo", "GetStats", "Abort")

SERVE = r"""
import sys, time
from pathlib import Path
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.engine.torch_engine import TorchEngine
from sidecar.server.scheduler import SchedulerConfig
from sidecar.server.grpc_server import ServerConfig
from sidecar.server.servicers import Sidecar, SidecarConfig
from sidecar.types import RequestLimits

ckpt, streams = Path(sys.argv[1]), int(sys.argv[2])
config = ModelConfig.tiny(max_position_embeddings=512)
if not (ckpt / "config.json").exists():
    save_checkpoint(ckpt, config, model_state_dict(build_model(config, seed=0)))
engine = TorchEngine.from_checkpoint(ckpt, speculation_k=2, max_batch_size=streams + 8)
sc = Sidecar(engine, SidecarConfig(
    server=ServerConfig(port=0),
    limits=RequestLimits(max_prompts=4, max_samples=4, max_prompt_tokens=64, max_new_tokens=500),
    scheduler=SchedulerConfig(max_live_sequences=streams + 8),
    shutdown_grace_s=0.5,
)).start()
print(sc.port, flush=True)
sys.stdin.read()  # until the parent closes our stdin
sc.stop(0.5)
"""


def timed_call(fn) -> float | None:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    try:
        fn()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return None
        raise
    return time.perf_counter() - start


def measure(port: int, streams: int, scenario: str, new_tokens: int) -> tuple[dict[str, float | None], int]:
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as control_ch, grpc.insecure_channel(address) as stream_ch:
        control = services.ControlStub(control_ch)
        rollout = services.RolloutStub(control_ch)
        health = health_pb2_grpc.HealthStub(control_ch)
        if scenario == "paused":
            control.Pause(control_pb2.PauseRequest(), timeout=CALL_DEADLINE_S)
        n = new_tokens if scenario == "generating" else 4
        calls = [
            services.RolloutStub(stream_ch).Generate(
                convert.generation_request_to_pb(
                    GenerationRequest(
                        prompts=[[3, 1, 4]],
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=n),
                        request_id=f"s{i}",
                    )
                ),
                timeout=120.0,
            )
            for i in range(streams)
        ]
        time.sleep(0.3 if scenario == "generating" else 1.0)
        latencies = {
            "health": timed_call(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=CALL_DEADLINE_S)),
            "GetInfo": timed_call(lambda: control.GetInfo(control_pb2.GetInfoRequest(), timeout=CALL_DEADLINE_S)),
            "GetStats": timed_call(lambda: control.GetStats(control_pb2.GetStatsRequest(), timeout=CALL_DEADLINE_S)),
            "Abort": timed_call(
                lambda: rollout.Abort(rollout_pb2.AbortRequest(request_id="s0"), timeout=CALL_DEADLINE_S)
            ),
        }
        admitted = -1  # unknown: GetStats did not answer
        with contextlib.suppress(grpc.RpcError):
            stats = control.GetStats(control_pb2.GetStatsRequest(), timeout=CALL_DEADLINE_S)
            admitted = stats.queued_sequences + stats.running_sequences
        for call in calls:
            call.cancel()
        if scenario == "paused":
            with contextlib.suppress(grpc.RpcError):
                control.Resume(control_pb2.ResumeRequest(), timeout=30)
    return latencies, admitted


def serve(src: Path, ckpt: Path, streams: int) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(ckpt), str(streams)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=src,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", type=Path, required=True, help="source tree holding sidecar/")
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=400)
    args = ap.parse_args()
    results: dict[tuple[str, str], list[tuple[dict[str, float | None], int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny"
        for r in range(args.rounds):
            for src in args.src:
                for scenario in ("paused", "generating"):
                    proc, port = serve(src, ckpt, args.streams)
                    try:
                        got = measure(port, args.streams, scenario, args.new_tokens)
                    finally:
                        assert proc.stdin is not None
                        proc.stdin.close()
                        try:
                            proc.wait(30)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                    results.setdefault((str(src), scenario), []).append(got)
                    print(f"round {r} {src} {scenario}: {got}", file=sys.stderr, flush=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)")
    print(f"{args.streams} open streams, {args.rounds} rounds, median latency in ms (deadline {CALL_DEADLINE_S} s)")
    print(f"{'source':<40} {'scenario':<11} {'admitted':>8} " + " ".join(f"{c:>9}" for c in CALLS))
    for (src, scenario), runs in results.items():
        cells = []
        for c in CALLS:
            values = [lat[c] for lat, _ in runs]
            done = [v for v in values if v is not None]
            cells.append("timeout" if len(done) * 2 <= len(values) else f"{1000 * statistics.median(done):.1f}")
        admitted = statistics.median(a for _, a in runs)
        print(f"{src:<40} {scenario:<11} {admitted:>8.0f} " + " ".join(f"{c:>9}" for c in cells))


if __name__ == "__main__":
    main()
