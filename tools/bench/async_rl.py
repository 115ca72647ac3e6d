#!/usr/bin/env python3
"""Step time of the demo's RL phase at policy lag 0 and 1, with and without speculation.

Runs the demo's RL configuration (`trainer.rl.config.demo_config`, no plain-decoding pass, no
evaluations) from one policy in four arms — `rollout.max_policy_lag` 0 and 1 × `speculation_k`
0 and 3 — `--repeats` times, arms in a rotating order so that load on a shared machine falls on
all alike, and prints per arm the median over steps (the first step of each run left out: at
lag 1 it has nothing to overlap) of: the step time, the whole generation (with refills), the
part of it the trainer waited for (all of it at lag 0), training (with log-probs), the weight
push, and how long the producer waited for weights. Then the projection for a deployment where
the sidecars do not share the trainer's cores: a lag-1 step costs max(generation, the rest) +
what cannot overlap, from each lag-0 arm's own phase times.

    OMP_NUM_THREADS=1 specrl bench async --policy DEMO/policy --out /tmp/async
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

from trainer.rl.config import RLConfig, demo_config
from trainer.rl.loop import train

ARMS = [(0, 0), (0, 3), (1, 0), (1, 3)]
"""(max_policy_lag, speculation_k)."""


def arm_config(policy: Path, run_dir: Path, lag: int, k: int, steps: int) -> RLConfig:
    cfg = demo_config(policy, run_dir)
    cfg.steps = steps
    cfg.eval_every = 0
    cfg.rollout.measure_plain = False
    cfg.rollout.speculation_k = k
    cfg.rollout.max_policy_lag = lag
    return cfg


def phases(history: list[dict[str, float]]) -> dict[str, float]:
    """Per-step medians of the phases, the first step left out."""
    rows = history[1:] or history

    def med(f: Any) -> float:
        return statistics.median(f(m) for m in rows)

    return {
        "step": med(lambda m: m["time/step"]),
        "generation": med(lambda m: m["time/generation"] + m["time/refill"]),
        "waited": med(lambda m: m["time/wait_generation"] + m["time/stale_regeneration"]),
        "train": med(lambda m: m["time/train"] + m["time/logprobs"]),
        "sync": med(lambda m: m["time/weight_push"]),
        "gated": med(lambda m: m["time/wait_weights"]),
        "lag": max(m["rollout/policy_lag_max"] for m in history),
        "tau": med(lambda m: m["spec/acceptance_length"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, required=True, help="the demo's policy (specrl demo --out D: D/policy)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each run is left out)")
    torch.set_num_threads(1)
    results: dict[str, list[dict[str, float]]] = {f"lag{lag}_k{k}": [] for lag, k in ARMS}
    for rep in range(args.repeats):
        order = ARMS[rep % len(ARMS) :] + ARMS[: rep % len(ARMS)]
        for lag, k in order:
            name = f"lag{lag}_k{k}"
            run_dir = args.out / f"{name}_rep{rep}"
            shutil.rmtree(run_dir, ignore_errors=True)
            history = train(arm_config(args.policy, run_dir, lag, k, args.steps), progress=False)
            results[name].append(phases(history))
            print(
                f"{name} repeat {rep}: " + ", ".join(f"{k2} {v:.2f}" for k2, v in results[name][-1].items()), flush=True
            )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in results.items()
    }
    base = summary["lag0_k0"]["step"]
    print(
        "\n| lag | k | step s | vs lag 0 k 0 | generation s | waited for s | train + log-probs s | push s | producer waited for weights s | max lag | τ |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lag, k in ARMS:
        s = summary[f"lag{lag}_k{k}"]
        print(
            f"| {lag} | {k} | {s['step']:.2f} | {base / s['step']:.2f}x | {s['generation']:.2f} | {s['waited']:.2f} | "
            f"{s['train']:.2f} | {s['sync']:.2f} | {s['gated']:.2f} | {s['lag']:.0f} | {s['tau']:.2f} |"
        )
    print("\nProjection with the sidecars on cores of their own (from each lag-0 arm's phases):")
    for k in (0, 3):
        s = summary[f"lag0_k{k}"]
        rest = s["step"] - s["generation"]
        overlapped = max(s["generation"], rest)
        print(
            f"  k = {k}: synchronous {s['step']:.2f} s = generation {s['generation']:.2f} + rest {rest:.2f}; "
            f"lag 1 ~ max(generation, rest) = {overlapped:.2f} s ({s['step'] / overlapped:.2f}x); "
            f"generation exposed {max(0.0, s['generation'] - rest):.2f} s"
        )


if __name__ == "__main__":
    main()
