#!/usr/bin/env python3
"""Does the demo's RL phase improve the held-out reward, beyond noise, over several seeds?

Warm-up and draft-init run once (the demo's own `DemoConfig`); then the demo's RL phase
(`trainer.rl_config.demo_config`) runs once per seed from the same policy, evaluating the
held-out split (greedy, `--eval-size` problems, the same problems before and after within a seed)
before the first and after the last step. Prints per seed: before ± standard error, after ± se,
change ± se (se of the change: sqrt(se_before² + se_after²), conservative since the two are
positively correlated on the same problems), and a summary: how many seeds improved beyond 2 se.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_learning.py --out /tmp/learning --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from sidecar.config_io import from_mapping, merge_overrides, to_mapping
from trainer.demo import DemoConfig, demo_model_config
from trainer.rl_config import RLConfig, demo_config
from trainer.rl_loop import train
from trainer.tasks import ArithmeticTask
from trainer.tokenizer import CharTokenizer
from trainer.warmup import draft_init, make_model, supervised_warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=DemoConfig().rl_steps)
    parser.add_argument("--eval-size", type=int, default=None, help="default: the demo's")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the demo's RL config (as `specrl train --set`)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    demo = DemoConfig()
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    out: Path = args.out
    if not (out / "policy" / "config.json").is_file():
        t = time.perf_counter()
        make_model(out / "init", demo_model_config(demo.layers), seed=0)
        supervised_warmup(out / "init", out / "warm", task, tok, demo.warmup)
        draft_init(out / "warm", out / "policy", task, tok, demo.draft_init)
        print(f"warm-up + draft-init: {time.perf_counter() - t:.0f} s", flush=True)
    results = []
    for seed in args.seeds:
        cfg = demo_config(out / "policy", out / f"run_seed{seed}_{len(list(out.glob('run_seed*')))}")
        cfg.seed = seed
        cfg.steps = args.steps
        cfg.eval_every = args.steps
        cfg.eval_size = args.eval_size or cfg.eval_size
        cfg.rollout.measure_plain = False  # speed is not measured here
        if args.overrides:
            cfg = from_mapping(RLConfig, merge_overrides(to_mapping(cfg), args.overrides))
        t = time.perf_counter()
        train(cfg, progress=False)
        rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "reward/eval_mean" in r]
        before, after = evals[0], evals[-1]
        b, a = before["reward/eval_mean"], after["reward/eval_mean"]
        se = math.hypot(before["reward/eval_stderr"], after["reward/eval_stderr"])
        results.append((seed, b, before["reward/eval_stderr"], a, after["reward/eval_stderr"], a - b, se))
        print(
            f"seed {seed}: {b:.3f} ± {before['reward/eval_stderr']:.3f} -> {a:.3f} ± {after['reward/eval_stderr']:.3f}"
            f"  change {a - b:+.3f} ± {se:.3f}  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    changes = [r[5] for r in results]
    beyond = sum(r[5] > 2 * r[6] for r in results)
    worse = sum(r[5] < -2 * r[6] for r in results)
    print(
        f"\n{len(results)} seeds, {args.steps} RL steps, eval size {cfg.eval_size}, overrides {args.overrides}: "
        f"mean change "
        f"{statistics.mean(changes):+.3f} (seed-to-seed std {statistics.pstdev(changes):.3f}); improved beyond 2 se: "
        f"{beyond}; worse beyond 2 se: {worse}; positive: {sum(c > 0 for c in changes)}"
    )


if __name__ == "__main__":
    main()
