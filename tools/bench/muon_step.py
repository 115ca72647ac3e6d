#!/usr/bin/env python3
"""Optimizer step time of Muon + AdamW over AdamW alone, on the demo-sized model's parameters.

The model is only its parameter tensors: a small Qwen3-like decoder (hidden 256, 4 layers, vocab
512, intermediate 768, 4 query heads and 2 key/value heads of dim 64, untied head), with random
gradients. Muon's extra cost is the Newton–Schulz iteration on every hidden matrix; AdamW alone is
the baseline the ratio is taken against. The two optimizers are timed side by side, alternating
within each repeat, and the medians of the repeats are reported (machines here are noisy).

    specrl bench muon --threads 1     # CPU, one thread
    specrl bench muon --device cuda   # on a GPU node
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
from torch import nn

from muon import HybridOptimizer, HybridOptimizerConfig, NewtonSchulzConfig, build_optimizer


def demo_parameters(
    device: torch.device, *, hidden: int = 256, layers: int = 4, vocab: int = 512, ffn: int = 768
) -> list[tuple[str, nn.Parameter]]:
    """Hugging Face Qwen3 names and shapes (see the checkpoint naming contract), random values and grads."""
    heads, kv_heads, head_dim = 4, 2, 64
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    g = torch.Generator().manual_seed(0)
    named = []
    for name, shape in shapes.items():
        param = nn.Parameter(0.02 * torch.randn(shape, generator=g).to(device))
        param.grad = torch.randn(shape, generator=g).to(device)
        named.append((name, param))
    return named


def newton_schulz_flops(rows: int, cols: int, *, steps: int) -> int:
    """Matmul FLOPs of one orthogonalisation: per step X·Xᵀ, G·G and (bG + cG²)·X on the small side."""
    small, large = min(rows, cols), max(rows, cols)
    return steps * (2 * small * small * large + 2 * small**3 + 2 * small * small * large)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(opt: HybridOptimizer, steps: int, device: torch.device) -> float:
    """Seconds per optimizer step, averaged over ``steps`` consecutive steps."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync(device)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per optimizer (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per repeat")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    named = demo_parameters(device)
    optimizers = {"AdamW alone": build_optimizer(named, HybridOptimizerConfig(), route=lambda n, p: "adamw")}
    for label, ns in [
        ("Muon+AdamW (quintic x5, fp32)", NewtonSchulzConfig()),
        ("Muon+AdamW (Polar Express x5, fp32)", NewtonSchulzConfig(schedule="polar_express")),
        ("Muon+AdamW (quintic x5, bf16)", NewtonSchulzConfig(dtype="bfloat16")),
    ]:
        optimizers[label] = build_optimizer(named, HybridOptimizerConfig(newton_schulz=ns))
    muon_names = set(optimizers["Muon+AdamW (quintic x5, fp32)"].muon_names)
    n_muon = len(muon_names)
    ns_gflop = sum(newton_schulz_flops(*p.shape, steps=5) for n, p in named if n in muon_names) / 1e9
    print(
        f"{sum(p.numel() for _, p in named) / 1e6:.2f}M parameters, {n_muon} Muon matrices "
        f"({ns_gflop:.1f} GFLOP of Newton-Schulz matmuls per step); "
        f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}",
        flush=True,
    )
    for opt in optimizers.values():  # warm-up: allocate state, first-call overheads
        time_steps(opt, 2, device)
    times: dict[str, list[float]] = {label: [] for label in optimizers}
    for r in range(args.repeats):
        for label, opt in optimizers.items():  # side by side: every variant once per repeat
            times[label].append(time_steps(opt, args.steps, device))
        print(f"  repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    base = statistics.median(times["AdamW alone"])
    print("| optimizer | median step (ms) | ratio vs AdamW alone |\n|---|---|---|")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"| {label} | {median * 1e3:.2f} | {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
