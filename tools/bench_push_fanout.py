#!/usr/bin/env python3
"""Benchmark (not a test): the trainer's weight fan-out, streamed against gathered, in one run.

`Fleet.push_weights` either gathers the whole export into a dict and pushes that to every
sidecar (no `names`), or, given the export order, streams each tensor to all sidecars at once
(`names`, what the RL loop does). This pushes the same weights to N local `specrl serve`
processes both ways, alternating, and reports per mode the median wall time and the trainer's
extra peak memory during the push (VmHWM, reset through /proc/self/clear_refs before each push,
minus VmRSS before it). The source clones each tensor as it is exported, like the trainer's
bridge does.

    .venv/bin/python tools/bench_push_fanout.py --hidden 512 --layers 8 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from sidecar.client.fleet import Fleet
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import ModelConfig
from trainer.local_sidecars import LocalSidecars
from trainer.warmup import make_model


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: a random model of --hidden/--layers)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--sidecars", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "model"
            h = args.hidden
            make_model(
                model,
                ModelConfig.tiny(
                    vocab_size=1024,
                    hidden_size=h,
                    intermediate_size=3 * h,
                    num_hidden_layers=args.layers,
                    num_attention_heads=max(1, h // 64),
                    num_key_value_heads=max(1, h // 128),
                    head_dim=64,
                    num_nextn_predict_layers=1,
                ),
                seed=0,
            )
        _, tensors = load_checkpoint(model)
        names = list(tensors)
        mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20

        def source() -> Iterator[tuple[str, torch.Tensor]]:
            return ((n, tensors[n].clone()) for n in names)

        can_reset = _reset_peak()
        seconds: dict[str, list[float]] = {"gathered": [], "streamed": []}
        extra: dict[str, list[float]] = {"gathered": [], "streamed": []}
        with LocalSidecars(model, args.sidecars, Path(tmp) / "logs") as local, Fleet(local.start()) as orch:
            version = orch.start_version()
            for _ in range(args.repeats):
                for mode in ("gathered", "streamed"):
                    _reset_peak()
                    before = _status_kib("VmRSS")
                    seconds[mode].append(
                        orch.push_weights(source, version, names=names if mode == "streamed" else None).seconds
                    )
                    extra[mode].append((_status_kib("VmHWM") - before) / 1024)
                    version += 1
    print(f"model {mib:.0f} MiB ({len(names)} tensors), {args.sidecars} local sidecars, {args.repeats} repeats")
    print("| mode | median s | MiB/s per sidecar | trainer extra peak MiB |")
    print("|---|---|---|---|")
    for mode in ("gathered", "streamed"):
        s = statistics.median(seconds[mode])
        peak = f"{statistics.median(extra[mode]):.0f}" if can_reset else "n/a (no clear_refs)"
        print(f"| {mode} | {s:.3f} | {mib / s:.0f} | {peak} |")


if __name__ == "__main__":
    main()
