"""Benchmark of a sidecar (not a test): weight push speed and memory, generate throughput/latency.

1. Weight push. A ~1 GiB float32 model (about 256M parameters, small vocabulary) is served by a
   real `specrl serve` subprocess. The full state dict is pushed over loopback with the client
   library (manifest, CRC-32-checked chunks, commit, atomic swap). In the same run, alternating
   with the pushes, the same bytes in the same chunk size are streamed to a bare gRPC server
   (a subprocess that only counts a client stream of raw bytes): the baseline of what Python
   gRPC moves over loopback. Reports medians; goal push >= 80% of the baseline throughput.
   The sidecar's peak RSS during each push is read from /proc/<pid>/status (VmHWM, reset
   through /proc/<pid>/clear_refs before the push; VmRSS polling as a fallback), against the
   goal peak <= 2.2 x model size + 256 MiB.
2. Generate. A small model (so a 2-core CPU finishes) served the same way; C concurrent
   streams (C = 1, 8, 32, 64) each send greedy one-prompt requests; reports generated tokens/s
   and p50/p99 request latency.

Usage: specrl bench sidecar [--repeats 5] [--layers 14] [--no-keep-staging] [--skip-push] [--skip-generate]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import torch

from sidecar.client.client import ClientConfig, SidecarClient
from sidecar.client.weight_sender import DEFAULT_CHUNK_BYTES
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.types import GenerationRequest, SamplingParams
from sidecar.weight_transport.tensors import tensor_bytes

MiB = 1 << 20
RAW_METHOD = "/bench.Raw/Stream"
STAGE_METHOD = "/bench.Raw/Stage"


# --- processes ------------------------------------------------------------------------------


class Served:
    """A subprocess that logs 'listening on HOST:PORT' to stderr."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        ready = threading.Event()
        self.address = ""

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if "listening on" in line and not ready.is_set():
                    self.address = line.rsplit(" ", 1)[-1].strip()
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(600) or not self.address:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-20:]))

    def status(self, key: str) -> int:
        """A /proc/<pid>/status field in bytes (VmHWM, VmRSS)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def reset_peak(self) -> bool:
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def raw_server_main() -> None:
    """The baseline: a gRPC server whose one method counts the bytes of a raw client stream."""

    def count(request_iterator, context):  # type: ignore[no-untyped-def]
        n = 0
        for chunk in request_iterator:
            n += len(chunk)
        return str(n).encode()

    def stage(request_iterator, context):  # type: ignore[no-untyped-def]
        """Like count, but copies the bytes into one fresh buffer, as a push's staging does."""
        total = int(dict(context.invocation_metadata())["x-total-bytes"])
        buffer = torch.empty(total, dtype=torch.uint8).numpy()
        n = 0
        for chunk in request_iterator:
            buffer[n : n + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            n += len(chunk)
        return str(n).encode()

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {
            "Stream": grpc.stream_unary_rpc_method_handler(count),
            "Stage": grpc.stream_unary_rpc_method_handler(stage),
        },
    )
    opts = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"raw server listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    server.wait_for_termination()


def raw_push(address: str, state: dict[str, torch.Tensor], chunk_bytes: int, method: str = RAW_METHOD) -> float:
    """Seconds to stream the state dict's bytes, chunked like a push, to the raw server."""

    def chunks():  # type: ignore[no-untyped-def]
        for t in state.values():
            view = tensor_bytes(t)
            for off in range(0, view.nbytes, chunk_bytes):
                yield view[off : off + chunk_bytes].tobytes()

    opts = [("grpc.max_send_message_length", 64 * MiB)]
    with grpc.insecure_channel(address, options=opts) as ch:
        call = ch.stream_unary(method)
        total = sum(t.numel() * t.element_size() for t in state.values())
        started = time.perf_counter()
        n = int(call(chunks(), timeout=600, metadata=(("x-total-bytes", str(total)),)))
        elapsed = time.perf_counter() - started
    assert n == sum(t.numel() * t.element_size() for t in state.values())
    return elapsed


# --- the two benchmarks ---------------------------------------------------------------------


def bench_push(
    workdir: Path, layers: int, repeats: int, chunk_bytes: int, keep_staging: bool = False
) -> dict[str, object]:
    config = ModelConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=2048,
        num_nextn_predict_layers=1,
    )
    state = model_state_dict(build_model(config, seed=0))
    size = sum(t.numel() * t.element_size() for t in state.values())
    ckpt = workdir / "push-model"
    save_checkpoint(ckpt, config, state)
    print(f"push model: {sum(t.numel() for t in state.values()) / 1e6:.0f}M params, {size / MiB:.0f} MiB", flush=True)
    specrl = str(Path(sys.executable).parent / "specrl")
    extra = ["--keep-staging" if keep_staging else "--no-keep-staging"]
    sidecar = Served([specrl, "serve", "--model", str(ckpt), "--port", "0", "--log-level", "WARNING", *extra])
    raw = Served([sys.executable, __file__, "--raw-server"])
    push_s: list[float] = []
    raw_s: list[float] = []
    stage_s: list[float] = []
    peaks: list[int] = []
    try:
        client = SidecarClient(sidecar.address, ClientConfig(push_timeout_s=900))
        for i in range(repeats):
            raw_s.append(raw_push(raw.address, state, chunk_bytes))
            stage_s.append(raw_push(raw.address, state, chunk_bytes, STAGE_METHOD))
            new = {n: t + 0.001 * (i + 1) for n, t in state.items()}  # different bytes every push
            exact = sidecar.reset_peak()
            base_rss = sidecar.status("VmRSS")
            peak_poll = [base_rss]
            done = threading.Event()

            def poll(done: threading.Event, peak_poll: list[int]) -> None:
                while not done.wait(0.01):
                    peak_poll.append(sidecar.status("VmRSS"))

            poller = threading.Thread(target=poll, args=(done, peak_poll), daemon=True)
            poller.start()
            started = time.perf_counter()
            result = client.push_weights(new, i + 1, chunk_bytes=chunk_bytes)
            push_s.append(time.perf_counter() - started)
            done.set()
            poller.join()
            peaks.append(max(sidecar.status("VmHWM") if exact else 0, *peak_poll))
            del new
            assert result.version == i + 1 and result.bytes_received == size
            print(
                f"  push {i + 1}: {push_s[-1]:.2f}s (receive {result.receive_seconds:.2f}s, apply "
                f"{result.apply_seconds:.2f}s), raw {raw_s[-1]:.2f}s, raw+stage {stage_s[-1]:.2f}s, peak RSS {peaks[-1] / MiB:.0f} MiB "
                f"(before {base_rss / MiB:.0f} MiB)",
                flush=True,
            )
        client.close()
    finally:
        sidecar.stop()
        raw.stop()
    push_med, raw_med = statistics.median(push_s), statistics.median(raw_s)
    pair_ratio = statistics.median(r / p for r, p in zip(raw_s, push_s, strict=True))
    budget = 2.2 * size + 256 * MiB
    return {
        "model_mib": size / MiB,
        "push_gib_s": size / push_med / (1 << 30),
        "raw_gib_s": size / raw_med / (1 << 30),
        "stage_gib_s": size / statistics.median(stage_s) / (1 << 30),
        "stage_ratio": statistics.median(stage_s) / push_med,
        "ratio": raw_med / push_med,
        "pair_ratio": pair_ratio,
        "best_ratio": min(raw_s) / min(push_s),
        "peak_mib": max(peaks) / MiB,
        "budget_mib": budget / MiB,
        "peak_over_model": max(peaks) / size,
    }


def bench_generate(workdir: Path, concurrency: list[int], requests_per_stream: int, new_tokens: int) -> list[dict]:  # type: ignore[type-arg]
    config = ModelConfig.tiny(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4, max_position_embeddings=512
    )
    ckpt = workdir / "gen-model"
    save_checkpoint(ckpt, config, model_state_dict(build_model(config, seed=1)))
    specrl = str(Path(sys.executable).parent / "specrl")
    sidecar = Served(
        [specrl, "serve", "--model", str(ckpt), "--port", "0", "--speculation-k", "2", "--max-batch-size", "64",
         "--log-level", "WARNING"]
    )  # fmt: skip
    rows = []
    try:
        client = SidecarClient(sidecar.address)
        client.generate(GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(temperature=0, max_new_tokens=4)))
        for c in concurrency:
            latencies: list[float] = []
            tokens = [0]
            lock = threading.Lock()
            before = client.stats().total

            def stream(worker: int, lock: threading.Lock, latencies: list[float], tokens: list[int]) -> None:
                for r in range(requests_per_stream):
                    prompt = [(worker * 7 + r * 3) % 500 + 1, (worker + r) % 400 + 2, 5]
                    request = GenerationRequest(
                        prompts=[prompt], sampling=SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
                    )
                    t0 = time.perf_counter()
                    samples = client.generate(request)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                        tokens[0] += sum(len(s.token_ids) for s in samples)

            started = time.perf_counter()
            threads = [threading.Thread(target=stream, args=(w, lock, latencies, tokens)) for w in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            delta = client.stats().total.minus(before)
            latencies.sort()
            row = {
                "streams": c,
                "tokens_s": tokens[0] / wall,
                "p50_s": latencies[len(latencies) // 2],
                "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                "tau": delta.acceptance_length,
            }
            rows.append(row)
            print(
                f"  {c:3d} streams: {row['tokens_s']:.0f} tok/s, p50 {row['p50_s']:.3f}s, p99 {row['p99_s']:.3f}s, "
                f"tau {row['tau']:.2f}",
                flush=True,
            )
        client.close()
    finally:
        sidecar.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=14, help="trunk layers of the push model (14: ~1 GiB)")
    parser.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / MiB)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-push", action="store_true")
    parser.add_argument(
        "--no-keep-staging", action="store_true", help="serve with --no-keep-staging (fresh staging per push)"
    )
    parser.add_argument("--skip-generate", action="store_true")
    args = parser.parse_args()
    if args.raw_server:
        raw_server_main()
        return
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench-sidecar-") as tmp:
        if not args.skip_push:
            r = bench_push(Path(tmp), args.layers, args.repeats, int(args.chunk_mib * MiB), not args.no_keep_staging)
            print(
                f"PUSH model {r['model_mib']:.0f} MiB: push {r['push_gib_s']:.2f} GiB/s vs raw gRPC "
                f"{r['raw_gib_s']:.2f} GiB/s = {100 * r['ratio']:.0f}% of baseline (goal >= 80%; median of "
                f"per-pair ratios {100 * r['pair_ratio']:.0f}%, best vs best {100 * r['best_ratio']:.0f}%); "
                f"raw stream that also stages into fresh memory {r['stage_gib_s']:.2f} GiB/s "
                f"(push = {100 * r['stage_ratio']:.0f}% of it); "
                f"peak RSS {r['peak_mib']:.0f} MiB = {r['peak_over_model']:.2f} x model "
                f"(goal <= {r['budget_mib']:.0f} MiB)"
            )
        if not args.skip_generate:
            bench_generate(
                Path(tmp), [int(c) for c in args.concurrency.split(",")], args.requests_per_stream, args.new_tokens
            )


if __name__ == "__main__":
    main()
