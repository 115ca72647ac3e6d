#!/usr/bin/env python
"""Engine step time, this checkout against another one, side by side in one run.

    specrl bench engine step [--model DIR] [--against /path/to/other/checkout] [--batches 1,16,64]
                        [--ks 0,3] [--new-tokens 48] [--repeats 3] [--temperature 1]

Generates with `TorchEngine.generate` (one torch thread, CPU) at each batch size B and draft
length k, and prints CPU milliseconds per round and generated tokens per CPU second. With
`--against`, every measurement runs in turn in a subprocess of this checkout and of the other one
(alternating, `--repeats` times, medians), so both see the same load on a shared machine; the
table then gives both and their ratio. The model: `--model` (a checkpoint directory, e.g. the
demo's trained policy `.demo/policy`), or by default the demo's shape (trainer/cli/demo.py: 24 layers
of width 128, vocab 99, one MTP layer) with random weights made to speculate (`aligned_draft`:
plain decoding's cost does not depend on the weights' values; speculation's does, through
acceptance).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(model_dir: str, batches: list[int], ks: list[int], new_tokens: int, temperature: float) -> dict[str, float]:
    """In this process: {"B/k": [ms per round, tokens per CPU second]} (after one warm-up call each)."""
    import torch

    torch.set_num_threads(1)
    from sidecar.engine import torch_engine
    from sidecar.engine.torch_engine import TorchEngine

    build_model = torch_engine.build_model  # the checkout's own, whichever module holds it
    from sidecar.types import GenerationRequest, SamplingParams

    if model_dir:
        engine = TorchEngine.from_checkpoint(model_dir, speculation_k=0, max_speculation_k=max(ks), max_batch_size=64)
    else:
        from trainer.cli.demo import demo_model_config

        model = build_model(demo_model_config(24), seed=0)
        aligned_draft(model)
        engine = TorchEngine(model, speculation_k=0, max_speculation_k=max(ks))
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[float]] = {}
    for b in batches:
        prompts = torch.randint(0, vocab, (b, 16), generator=gen).tolist()
        for k in ks:
            sp = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=1, stop_at_eos=False)
            engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k))  # warm-up
            start = time.process_time()
            samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k))
            seconds = time.process_time() - start
            rounds = max(s.counters.verify_steps for s in samples)
            tokens = sum(len(s.token_ids) for s in samples)
            out[f"{b}/{k}"] = [seconds / rounds * 1e3, tokens / seconds]
    return out  # type: ignore[return-value]


def aligned_draft(model, eps: float = 0.02) -> None:  # type: ignore[no-untyped-def]
    """Make random weights speculate like a trained pair: the trunk nearly a bigram model (residual
    branches scaled by eps), its MTP layer the same bigram by construction (as the engine tests'
    `aligned_draft_model`), so acceptance is high but not perfect."""
    import torch

    h = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(eps)
            for name, p in layer.mlp.named_parameters():  # a dense MLP's down_proj, or every expert's
                if name.endswith("down_proj.weight"):
                    p.mul_(eps)
        for mtp in model.mtp.layers:
            mtp.eh_proj.weight.zero_()
            mtp.eh_proj.weight[:, :h] = torch.eye(h)
            mtp.self_attn.o_proj.weight.zero_()
            for name, p in mtp.mlp.named_parameters():
                if name.endswith("down_proj.weight"):
                    p.zero_()


def child(checkout: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import importlib.util as u; "
        "spec = u.spec_from_file_location('b', sys.argv[2]); m = u.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(json.dumps(m.measure(sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6]), "
        "float(sys.argv[7]))))"
    )
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [
        sys.executable,
        "-c",
        code,
        str(checkout),
        str(Path(__file__).resolve()),
        str(args.model or ""),
        json.dumps(args.batches),
        json.dumps(args.ks),
        str(args.new_tokens),
        str(args.temperature),
    ]
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"measurement in {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--against", type=Path, default=None, help="another checkout (e.g. a git worktree of main)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    sides = [ROOT] + ([args.against.resolve()] if args.against else [])
    runs: dict[Path, list[dict[str, list[float]]]] = {side: [] for side in sides}
    for r in range(args.repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            runs[side].append(child(side, args))
            print(f"repeat {r + 1}/{args.repeats}: {side} done", file=sys.stderr, flush=True)
    keys = list(runs[ROOT][0])

    def med(side: Path, key: str, i: int) -> float:
        return statistics.median(run[key][i] for run in runs[side])

    if args.against:
        print("| B | k | ms/round (this) | ms/round (other) | tok/s (this) | tok/s (other) | tok/s ratio |")
        print("|---|---|---|---|---|---|---|")
    else:
        print("| B | k | ms/round | tok/s |")
        print("|---|---|---|---|")
    for key in keys:
        b, k = key.split("/")
        this = (med(ROOT, key, 0), med(ROOT, key, 1))
        if args.against:
            other = (med(sides[1], key, 0), med(sides[1], key, 1))
            print(
                f"| {b} | {k} | {this[0]:.2f} | {other[0]:.2f} | {this[1]:.0f} | {other[1]:.0f} "
                f"| {this[1] / other[1]:.2f}x |"
            )
        else:
            print(f"| {b} | {k} | {this[0]:.2f} | {this[1]:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
