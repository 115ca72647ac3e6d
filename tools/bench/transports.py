"""Benchmark of the weight transports (not a test): grpc, shm and collective (gloo) against a
plain single-threaded memcpy of the same bytes, all in one run.

A ~1 GiB float32 model (the push model of specrl bench sidecar) is served by a real
`specrl serve --keep-staging` subprocess. Each round, in a rotating order, this process
(the sender) 1. copies the model's bytes into one preallocated buffer with numpy (one thread:
the memcpy a perfect single-copy transport could not beat), then pushes the whole state dict
as a new version 2. over the gRPC stream, 3. through shared memory, 4. over a two-rank gloo
group on loopback; each push is timed from the call to the sidecar serving the new version
(so it includes the receiver's checksum and the atomic swap into the engine's parameters).
Peak RSS of both processes per push: VmHWM from /proc/<pid>/status after resetting it through
/proc/<pid>/clear_refs (the shm region is a memfd both processes map: its pages count in each
process's RSS, one physical copy).
Reports medians; goal: shm >= 4 GiB/s or >= 50% of memcpy.

With `--fanout MODEL_DIR` it measures instead what the RL loop's push costs at a small model's
size (per-push fixed costs, not bytes): the trainer's streamed fan-out (`Fleet.push_weights`
with the export order) of MODEL_DIR's weights to N local `specrl serve` processes, over grpc and
over shm, alternating, and one client's push with the sidecar's receive/apply split.

Usage: specrl bench transports [--repeats 3] [--layers 14]
       specrl bench transports --fanout DEMO_OUT/init [--sidecars 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from sidecar.client.client import ClientConfig, SidecarClient
from sidecar.client.transport import CollectiveConfig, TransportConfig
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.weight_transport.tensors import tensor_bytes
from tools.bench.sidecar_generate import Served

MiB, GiB = 1 << 20, 1 << 30


def peak_rss(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def reset_peak(pid: int | str) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def memcpy(state: dict[str, torch.Tensor], out: np.ndarray) -> float:
    started = time.perf_counter()
    at = 0
    for t in state.values():
        view = tensor_bytes(t)
        np.copyto(out[at : at + view.nbytes], view)
        at += view.nbytes
    return time.perf_counter() - started


def bench_fanout(model: Path, sidecars: int, repeats: int) -> None:
    """Small-model push: the fleet's streamed fan-out over grpc and shm, alternating."""
    from sidecar.client.fleet import Fleet
    from sidecar.client.transport import TransportSession
    from sidecar.model.checkpoint import load_checkpoint
    from trainer.rl.local_sidecars import LocalSidecars

    _, state = load_checkpoint(model)
    size = sum(t.numel() * t.element_size() for t in state.values())
    names = list(state)
    print(f"model {model}: {len(state)} tensors, {size / MiB:.1f} MiB; {sidecars} sidecars", flush=True)
    modes = {"grpc": TransportConfig(shm=False), "shm": TransportConfig()}
    wall: dict[str, list[float]] = {k: [] for k in modes}
    split: dict[str, list[tuple[float, float, float]]] = {k: [] for k in modes}
    with (
        tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp,
        LocalSidecars(model, sidecars, Path(tmp) / "logs") as local,
        Fleet(local.start()) as orch,
    ):
        sessions = {k: {c.address: TransportSession(config=cfg) for c in orch.clients} for k, cfg in modes.items()}
        version = orch.start_version()
        for r in range(repeats):
            for k in list(modes)[r % 2 :] + list(modes)[: r % 2]:
                for c in orch.clients:
                    c.transport_session = sessions[k][c.address]
                    c.negotiate_transport()  # once per mode and sidecar, outside the timed pushes
                wall[k].append(orch.push_weights(lambda: state.items(), version, names=names).seconds)
                version += 1
                c = orch.clients[0]  # one client alone: the sidecar's share
                started = time.perf_counter()
                result = c.push_weights(state, version)
                split[k].append((time.perf_counter() - started, result.receive_seconds, result.apply_seconds))
                assert result.transport.value == k
                orch.version = version
                version += 1
        for by_address in sessions.values():
            for session in by_address.values():
                session.close()
    print(f"\n{'path':<6} {'fan-out push ms':>16} {'one client ms':>14} {'receive ms':>11} {'apply ms':>9}")
    for k in modes:
        one, rec, app = (statistics.median(x) * 1000 for x in zip(*split[k], strict=True))
        print(f"{k:<6} {statistics.median(wall[k]) * 1000:>16.1f} {one:>14.1f} {rec:>11.1f} {app:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fanout", type=Path, help="checkpoint directory: measure the small-model fan-out instead")
    parser.add_argument("--sidecars", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=14, help="trunk layers of the push model (14: ~1 GiB)")
    parser.add_argument("--bucket-mib", type=int, default=64, help="collective bucket size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the sidecar subprocess too
    if args.fanout is not None:
        bench_fanout(args.fanout, args.sidecars, args.repeats)
        return
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    config = ModelConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=2048,
        num_nextn_predict_layers=1,
    )
    state = model_state_dict(build_model(config, seed=0))
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"model: {len(state)} tensors, {size / MiB:.0f} MiB float32", flush=True)
    transports = {
        "grpc": TransportConfig(shm=False),
        "shm": TransportConfig(),
        "collective": TransportConfig(
            shm=False, collective=CollectiveConfig(host="127.0.0.1", timeout_s=300, bucket_bytes=args.bucket_mib * MiB)
        ),
    }
    with tempfile.TemporaryDirectory(prefix="bench-transports-") as tmp:
        ckpt = Path(tmp) / "model"
        save_checkpoint(ckpt, config, state)
        specrl = str(Path(sys.executable).parent / "specrl")
        sidecar = Served(
            [specrl, "serve", "--model", str(ckpt), "--port", "0", "--log-level", "WARNING", "--keep-staging"]
        )
        seconds: dict[str, list[float]] = {k: [] for k in ["memcpy", *transports]}
        rss: dict[str, list[tuple[int, int]]] = {k: [] for k in seconds}
        parts: dict[str, list[tuple[float, float]]] = {k: [] for k in seconds}
        out = np.empty(size, dtype=np.uint8)
        out.fill(0)  # fault the destination in once, as a reused buffer would be
        clients = {
            k: SidecarClient(sidecar.address, ClientConfig(push_timeout_s=900, transports=c))
            for k, c in transports.items()
        }
        try:
            version = 0
            for k, c in clients.items():  # warm-up push per plane: negotiation, staging, region
                version += 1
                result = c.push_weights(state, version)
                assert result.transport.value == k, (k, c.transport_session.choice)
                print(f"warm-up {k}: {c.transport_session.choice}", flush=True)
            order = ["memcpy", *transports]
            for r in range(args.repeats):
                for k in order[r % len(order) :] + order[: r % len(order)]:
                    reset_peak("self")
                    reset_peak(sidecar.proc.pid)
                    if k == "memcpy":
                        seconds[k].append(memcpy(state, out))
                    else:
                        version += 1
                        started = time.perf_counter()
                        result = clients[k].push_weights(state, version)
                        seconds[k].append(time.perf_counter() - started)
                        assert result.transport.value == k and result.bytes_received == size
                        parts[k].append((result.receive_seconds, result.apply_seconds))
                    rss[k].append((peak_rss("self"), peak_rss(sidecar.proc.pid)))
                    print(f"  round {r + 1} {k}: {seconds[k][-1]:.3f}s", flush=True)
        finally:
            for c in clients.values():
                c.close()
            sidecar.stop()
    base = statistics.median(seconds["memcpy"])
    print(
        f"\n{'path':<11} {'median s':>9} {'GiB/s':>7} {'% memcpy':>9} {'sender peak RSS':>16} {'sidecar peak RSS':>17}"
    )
    for k, s in seconds.items():
        med = statistics.median(s)
        sender = max(a for a, _ in rss[k]) / MiB
        side = max(b for _, b in rss[k]) / MiB
        print(
            f"{k:<11} {med:>9.3f} {size / med / GiB:>7.2f} {100 * base / med:>8.0f}% "
            f"{sender:>12.0f} MiB {side:>13.0f} MiB"
            + (
                f" {statistics.median(a for a, _ in parts[k]):>10.3f} {statistics.median(b for _, b in parts[k]):>8.3f}"
                if parts[k]
                else ""
            )
        )
    from sidecar.weight_transport import checksum

    print(
        f"model {size / MiB:.0f} MiB; CRC-32 by {checksum.crc32.__module__}; goal: shm >= 4 GiB/s or >= 50% of memcpy"
    )


if __name__ == "__main__":
    main()
