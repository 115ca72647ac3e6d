#!/usr/bin/env python
"""Where one decode round's time goes: the host's work against the device's, per compile mode.

    specrl bench gpu profile --device cuda --shape qwen3-0.6b --batches 1,16 --ks 0,3
    specrl bench gpu profile --device cpu --shape tiny                      # the path, for tests
    specrl bench gpu profile --device cuda --compile on --kernels auto,torch # fused kernels against torch's

For each (compile mode, batch, k): the engine (random bf16 weights built on the device, as
specrl bench gpu) generates a warm-up request, then `--rounds` decode rounds run under
torch.profiler. Printed per round: the wall time of `step()` (median, device synchronised), the
device time (the kernels' durations summed, CUDA only), the kernels run and the CUDA-graph
launches. A round whose wall time is near its device time is device-bound; one far above it is
host-bound (launches, Python). Output also goes to OUT/profile.json when --out is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.decode_kernels import DecodeOps
from sidecar.types import GenerationRequest, SamplingParams
from tools.bench.common import device_problem, random_model, shape_config


def profile_rounds(engine: TorchEngine, batch: int, k: int, prompt: int, rounds: int) -> dict[str, float]:
    vocab = engine.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=rounds + 8, seed=3)
    for tag in ("warm", "run"):
        engine.submit(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k, request_id=f"{tag}{batch}-{k}"))
        engine.step()  # admission (prefill)
        if tag == "warm":
            while engine.has_work():
                engine.step()
    cuda = engine.device.type == "cuda"
    walls: list[float] = []
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for i in range(rounds):
            with torch.profiler.record_function(f"round{i}"):
                t = time.perf_counter()
                engine.step()
                if cuda:
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - t)
    while engine.has_work():
        engine.step()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) for e in kernels)
    return {
        "batch": batch,
        "k": k,
        "wall_ms": 1e3 * statistics.median(walls),
        "device_ms": device_us / 1e3 / rounds,
        "kernels": len(kernels) / rounds,
        "graph_launches": sum(e.name == "cudaGraphLaunch" for e in events) / rounds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--ks", default="0,3")
    ap.add_argument("--compile", default="on,off")
    ap.add_argument("--kernels", default="auto", help="auto (the engine's choice: Triton's on CUDA) and/or torch")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if problem := device_problem(args.device):
        ap.error(problem)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = random_model(shape_config(args.shape), device)
    ks = [int(k) for k in args.ks.split(",")]
    results = []
    if bad := [k for k in args.kernels.split(",") if k not in ("auto", "torch")]:
        ap.error(f"--kernels takes auto, torch; got {bad}")
    arms = [(m, kern) for m in args.compile.split(",") for kern in args.kernels.split(",")]
    for mode, kern in arms:
        engine = TorchEngine(
            model,
            speculation_k=0,
            max_speculation_k=max(ks),
            max_batch_size=max(int(b) for b in args.batches.split(",")),
            max_context=args.prompt + args.rounds + 16,
            compile=mode,
        )
        if kern == "torch":
            engine.kernels = DecodeOps()
        for batch in (int(b) for b in args.batches.split(",")):
            for k in ks:
                r = {"compile": mode, "decode_ops": type(engine.kernels).__name__, "shape": args.shape,
                     "layers": model.config.num_hidden_layers,
                     **profile_rounds(engine, batch, k, args.prompt, args.rounds)}  # fmt: skip
                results.append(r)
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in r.items()}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
