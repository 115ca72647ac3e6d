#!/usr/bin/env python3
"""Does the demo's RL phase learn beyond noise, and does it learn the same with speculation?

Warm-up and draft-init run once (the demo's own `DemoConfig`, kept under --out and reused); then
the demo's RL phase (`trainer.rl.config.demo_config`, without its plain-decoding timing pass)
runs from that policy once per seed and arm. Each run evaluates the held-out split (greedy, the
same `eval_size` distinct problems before the first step and every `eval_every` steps, fixed
by the seed) and logs the training reward per step.

Learning (default): the demo's arm (static k = 3) per seed. Prints per seed: before ± standard
error, after ± se, change ± se (se of the change: sqrt(se_before² + se_after²), conservative
since the two are positively correlated on the same problems), and how many seeds improved
beyond 2 se.

--compare-spec: the same RL (same seeds, so the same prompts and held-out problems) in three
arms: plain decoding (k = 0), static k = 3, and automatic k (the sidecars choose 0..3 per engine
step). Runs are ordered seed by seed, arms in turn, so that load on a shared machine falls on
all arms alike. At temperature 1 a speculative run and a plain run draw different random
numbers, so they differ sample by sample and update by update: equivalence is statistical. For
each speculative arm, a paired TOST (`trainer.rl.equivalence`) of the final held-out reward
against plain at ±--margin, with its false-equivalence rate and power simulated for the seed
count and the observed spread; the generation seconds each arm spent (rollouts and refills);
and `learning_compare.png`: held-out reward (points, mean over seeds ± 1 sd) and training
reward (lines with ± 1 sd bands) against step, per arm. Finished runs are reused (a run
directory with its last step logged), so an interrupted comparison resumes; `results.json`
holds every run's curves.

    OMP_NUM_THREADS=1 specrl bench learning --out /tmp/learning --seeds 0 1 2
    OMP_NUM_THREADS=1 specrl bench learning --out /tmp/learning --compare-spec --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from sidecar.config_io import from_mapping, merge_overrides, to_mapping, yaml_load
from trainer.cli.demo import DemoConfig, demo_model_config
from trainer.rl.config import RLConfig, demo_config
from trainer.rl.equivalence import tost_operating_characteristics, tost_paired
from trainer.rl.loop import train
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import draft_init, make_model, supervised_warmup
from trainer.tokenizer import CharTokenizer

ARMS: dict[str, tuple[int, bool]] = {"plain": (0, False), "k3": (3, False), "auto": (3, True)}
"""Arm -> (rollout.speculation_k, rollout.speculation_auto); "k3" is the demo's own setting."""


def run_config(out: Path, arm: str, seed: int, args: argparse.Namespace) -> RLConfig:
    k, auto = ARMS[arm]
    cfg = demo_config(out / "policy", out / "runs" / f"{arm}_seed{seed}")
    cfg.seed = seed
    cfg.steps = args.steps
    cfg.eval_size = args.eval_size or cfg.eval_size
    cfg.rollout.measure_plain = False  # speed is measured per arm here, not side by side
    cfg.rollout.speculation_k = k
    cfg.rollout.speculation_auto = auto
    if args.overrides:
        cfg = from_mapping(RLConfig, merge_overrides(to_mapping(cfg), args.overrides))
    return cfg


def run_arm(cfg: RLConfig) -> dict[str, Any]:
    """Train (or reuse a finished run directory) and return the run's curves."""
    metrics = cfg.run_dir / "metrics.jsonl"
    stored = cfg.run_dir / "config.yaml"
    if stored.is_file() and _settings(yaml_load(stored.read_text())) != _settings(to_mapping(cfg)):
        raise SystemExit(f"{cfg.run_dir} holds a run of another configuration: delete it or choose another --out")
    rows = _rows(metrics)
    if not (rows and rows[-1].get("step") == cfg.steps):
        if metrics.exists():  # an unfinished run: start it again
            metrics.unlink()
        train(cfg, progress=False)
        rows = _rows(metrics)
    evals = [r for r in rows if "reward/eval_mean" in r]
    steps = [r for r in rows if "reward/train_mean" in r]
    return {
        "eval_step": [r["step"] for r in evals],
        "eval_mean": [r["reward/eval_mean"] for r in evals],
        "eval_stderr": [r["reward/eval_stderr"] for r in evals],
        "train_step": [r["step"] for r in steps],
        "train_mean": [r["reward/train_mean"] for r in steps],
        "response_len": [r["rollout/response_len"] for r in steps],
        "generation_s": sum(r["time/generation"] + r.get("time/refill", 0.0) for r in steps),
        "tau": statistics.mean(r["spec/acceptance_length"] for r in steps),
    }


def _settings(mapping: dict[str, Any]) -> dict[str, Any]:
    """A resolved run config as YAML would read it back, without where the run directory lies."""
    plain = yaml_load(yaml.safe_dump(mapping))
    plain.pop("run_dir", None)
    return plain


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prepare_policy(out: Path) -> None:
    """The demo's warm-up and draft-init, once per --out."""
    if (out / "policy" / "config.json").is_file():
        return
    demo = DemoConfig()
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    t = time.perf_counter()
    make_model(out / "init", demo_model_config(demo.layers), seed=0)
    supervised_warmup(out / "init", out / "warm", task, tok, demo.warmup)
    draft_init(out / "warm", out / "policy", task, tok, demo.draft_init)
    print(f"warm-up + draft-init: {time.perf_counter() - t:.0f} s", flush=True)


def change(run: dict[str, Any]) -> tuple[float, float]:
    """Final minus first held-out reward, and its (conservative) standard error."""
    se = math.hypot(run["eval_stderr"][0], run["eval_stderr"][-1])
    return run["eval_mean"][-1] - run["eval_mean"][0], se


def learning(out: Path, args: argparse.Namespace) -> None:
    results = []
    for seed in args.seeds:
        t = time.perf_counter()
        run = run_arm(run_config(out, "k3", seed, args))
        d, se = change(run)
        b, a = run["eval_mean"][0], run["eval_mean"][-1]
        results.append((d, se))
        print(
            f"seed {seed}: {b:.3f} ± {run['eval_stderr'][0]:.3f} -> {a:.3f} ± {run['eval_stderr'][-1]:.3f}"
            f"  change {d:+.3f} ± {se:.3f} ({d / se:.1f} se)  held-out by step "
            + " ".join(f"{s}:{m:.2f}" for s, m in zip(run["eval_step"], run["eval_mean"], strict=True))
            + f"  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    changes = [d for d, _ in results]
    print(
        f"\n{len(results)} seeds, {args.steps} RL steps, eval size {args.eval_size or demo_config(out, out).eval_size}, "
        f"overrides {args.overrides}: mean change {statistics.mean(changes):+.3f} (seed-to-seed std "
        f"{statistics.pstdev(changes):.3f}); improved beyond 2 se: {sum(d > 2 * se for d, se in results)}; "
        f"worse beyond 2 se: {sum(d < -2 * se for d, se in results)}; positive: {sum(d > 0 for d in changes)}"
    )


def compare_spec(out: Path, args: argparse.Namespace) -> None:
    runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            t = time.perf_counter()
            run = runs[arm][seed] = run_arm(run_config(out, arm, seed, args))
            d, se = change(run)
            print(
                f"{arm:>5} seed {seed}: held-out {run['eval_mean'][0]:.3f} -> {run['eval_mean'][-1]:.3f} "
                f"({d:+.3f} ± {se:.3f}); generation {run['generation_s']:.1f} s; τ {run['tau']:.2f} "
                f"({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
            (out / "results.json").write_text(
                json.dumps({a: {str(s): r for s, r in v.items()} for a, v in runs.items()})
            )
    print()
    print(summarize(runs, args.margin, args.alpha))
    plot_compare(runs, out / "learning_compare.png")
    print(f"\nplot: {out / 'learning_compare.png'}; curves: {out / 'results.json'}")


def summarize(runs: dict[str, dict[int, dict[str, Any]]], margin: float, alpha: float) -> str:
    """Per arm: final held-out reward and generation seconds; TOST of each arm against plain."""
    lines = ["arm    seeds  final held-out (mean ± sd over seeds)  gain  generation s/run  vs plain"]
    plain = runs.get("plain", {})
    for arm, by_seed in runs.items():
        finals = [r["eval_mean"][-1] for r in by_seed.values()]
        gains = [change(r)[0] for r in by_seed.values()]
        gen = [r["generation_s"] for r in by_seed.values()]
        ratio = [plain[s]["generation_s"] / r["generation_s"] for s, r in by_seed.items() if s in plain]
        lines.append(
            f"{arm:<6} {len(finals):>5}  {statistics.mean(finals):.3f} ± {_sd(finals):.3f}"
            f"{'':<22}{statistics.mean(gains):+.3f}  {statistics.mean(gen):>15.1f}  "
            + (f"{statistics.median(ratio):.2f}x faster (median per seed)" if arm != "plain" and ratio else "")
        )
    for arm, by_seed in runs.items():
        if arm == "plain":
            continue
        seeds = sorted(set(by_seed) & set(plain))
        if len(seeds) < 2:
            lines.append(f"{arm} vs plain: {len(seeds)} paired seed(s); TOST needs at least 2")
            continue
        diffs = [by_seed[s]["eval_mean"][-1] - plain[s]["eval_mean"][-1] for s in seeds]
        result = tost_paired(diffs, margin, alpha)
        lines.append(f"{arm} vs plain, final held-out reward, paired by seed: {result.describe()}")
        sd = statistics.stdev(diffs)
        if sd > 0:
            lines.append("  " + tost_operating_characteristics(len(seeds), sd, margin, alpha).describe())
    return "\n".join(lines)


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def plot_compare(runs: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, trained) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for i, (arm, by_seed) in enumerate(runs.items()):
        if not by_seed:
            continue
        color = f"C{i}"
        label = f"{arm} ({len(by_seed)} seeds)"
        first = next(iter(by_seed.values()))
        xs = first["eval_step"]
        ys = [[r["eval_mean"][j] for r in by_seed.values()] for j in range(len(xs))]
        mean = [statistics.mean(y) for y in ys]
        sd = [_sd(y) for y in ys]
        offset = (i - 1) * 0.25  # side by side at each evaluation
        held.errorbar([x + offset for x in xs], mean, yerr=sd, fmt="o-", capsize=3, color=color, label=label)
        xs = first["train_step"]
        ys = [[r["train_mean"][j] for r in by_seed.values()] for j in range(len(xs))]
        mean = [statistics.mean(y) for y in ys]
        sd = [_sd(y) for y in ys]
        trained.plot(xs, mean, color=color, label=label)
        trained.fill_between(
            xs,
            [m - s for m, s in zip(mean, sd, strict=True)],
            [m + s for m, s in zip(mean, sd, strict=True)],
            color=color,
            alpha=0.2,
        )
    held.set_title("Held-out reward (greedy), mean ± 1 sd over seeds")
    trained.set_title("Training reward (T = 1), mean ± 1 sd over seeds")
    for ax in (held, trained):
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=DemoConfig().rl_steps)
    parser.add_argument("--eval-size", type=int, default=None, help="default: the demo's")
    parser.add_argument("--compare-spec", action="store_true", help="plain vs static k vs automatic k (see above)")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS), help="with --compare-spec")
    parser.add_argument("--margin", type=float, default=0.05, help="TOST equivalence margin (absolute reward)")
    parser.add_argument("--alpha", type=float, default=0.05, help="TOST level of each one-sided test")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the demo's RL config (as `specrl train --set`)",
    )
    args = parser.parse_args()
    if args.compare_spec and "plain" not in args.arms:
        parser.error("--compare-spec compares against plain decoding: keep 'plain' in --arms")
    if not args.margin > 0:
        parser.error(f"--margin must be > 0, got {args.margin}")
    torch.set_num_threads(1)
    prepare_policy(args.out)
    (compare_spec if args.compare_spec else learning)(args.out, args)


if __name__ == "__main__":
    main()
