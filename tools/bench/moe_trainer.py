#!/usr/bin/env python
"""The trainer's step on a mixture of experts against a dense model of equal active parameters, on CPU.

    specrl bench moe-trainer [--rows 8] [--seq 64] [--repeats 5] [--replay]

`specrl bench moe`'s two shapes (hidden 128, 4 layers, 8/2 heads, vocab 256; the MoE 32 experts,
top 4, expert width 128; the dense MLP 512 wide: a token multiplies the same parameters in both), no
draft, as the trainer's Megatron-core policy (`trainer.policy.Policy`: local spec, SequentialMLP
experts, allgather dispatcher, one process). One update (`Policy.train_step`: forward, backward,
Muon + AdamW) on `--rows` random sequences of `--seq` tokens; one torch thread; MoE and dense
alternate `--repeats` times after a warm-up step; printed: medians of process CPU seconds per step
and the ratio. `--replay`: the MoE replays routes (its own live choice, recorded once: the cost of
replay itself, no change of experts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sidecar.model.model import ModelConfig  # noqa: E402
from sidecar.model.moe import MoEConfig  # noqa: E402
from trainer import moe  # noqa: E402
from trainer.policy import Policy, TrainBatch  # noqa: E402

EXPERTS, TOP, WIDTH = 32, 4, 128
SHAPE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, num_nextn_predict_layers=0, intermediate_size=TOP * WIDTH)  # fmt: skip


def policies() -> dict[str, Policy]:
    experts = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=TOP, moe_intermediate_size=WIDTH, norm_topk_prob=True)
    return {
        "moe": Policy(ModelConfig.tiny(**SHAPE, architectures=["Qwen3MoeForCausalLM"], moe=experts), Policy.Config()),
        "dense": Policy(ModelConfig.tiny(**SHAPE), Policy.Config()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--replay", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.rows, args.seq), generator=gen)
    advantages = torch.randn(args.rows, generator=gen)
    built = policies()
    routes = None
    if args.replay:
        built["moe"].logprobs(tokens)
        routes = moe.last_routes(built["moe"].replay_slots, args.rows, live=True)
    times: dict[str, list[float]] = {name: [] for name in built}
    for repeat in range(args.repeats + 1):
        for name, policy in built.items():
            batch = TrainBatch(
                tokens=tokens,
                mask=torch.ones(args.rows, args.seq - 1),
                advantages=advantages,
                routes=routes if name == "moe" else None,
            )
            start = time.process_time()
            policy.train_step(batch)
            if repeat:  # the first round warms up
                times[name].append(time.process_time() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print("| rows x seq | MoE s/step | dense s/step | MoE / dense | replay |\n|---|---|---|---|---|")
    print(
        f"| {args.rows} x {args.seq} | {medians['moe']:.3f} | {medians['dense']:.3f} | "
        f"{medians['moe'] / medians['dense']:.2f}x | {'on' if args.replay else 'off'} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
