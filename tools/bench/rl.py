#!/usr/bin/env python3
"""Benchmark: speculation on the demo workload, side by side with plain decoding in one run.

1. the demo (`trainer.cli.demo.run_demo`): warm-up, in-domain draft-init, two local sidecars, RL steps
   that each generate their prompts with speculation (k = 3) and again without, on the same weights
   (order alternating per step): generation speedup and RL step speedup per step;
2. a sweep of k on the same two sidecars and the demo's workload (`demo_config`'s rollout:
   8 prompts × 8 samples since 2026-11-27, 4 × 4 before; temperature 1, the draft-initialised
   policy): repeats interleaved k by k, medians, τ from the
   sidecars' raw counters — where longer drafts stop paying; plus automatic mode ("auto": the sidecars, started with
   `--speculation-auto --speculation-k max(ks)`, choose k per engine step; their first generations, untimed, are its learning
   pass), against the best static k: chosen on the same repeats (biased against auto) and held out
   (each repeat against the k fastest on the others), with 90% bootstrap intervals (tools/bench/common.py).
   `--in-process` runs the sweep on one sidecar's share of the workload in this process instead
   (no gRPC, no second engine process on the cores): the controller against the static k alone.

    specrl bench rl --out /tmp/bench-rl --repeats 5
    specrl bench rl --out /tmp/bench-rl --in-process --repeats 30   # reuses OUT/policy
    specrl bench rl --out /tmp/bench-rl --in-process --repeats 30 --ceiling 20   # + auto@costs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from sidecar.client.fleet import Fleet, derive_seed
from sidecar.engine.config import EngineConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.serve_config import ServeConfig
from sidecar.speculation.config import SpeculationControllerConfig
from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters
from tools.bench.common import (
    against_best_held_out,
    bench_clock,
    best_in_sample,
    cpu_seconds,
    device_problem,
    held_out_choices,
    median_ratio,
)
from tools.bench.cost_ceiling import TablePriced, measure_step_costs
from trainer.cli.demo import DemoConfig, run_demo
from trainer.rl.config import demo_config
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.tasks import ArithmeticTask
from trainer.tokenizer import CharTokenizer


def sweep_workload(prompts_n: int) -> tuple[list[list[int]], SamplingParams]:
    """The demo's rollout prompts (2-digit arithmetic, fixed) and sampling (temperature 1, up to
    40 tokens, stop at EOS; each generation sets its own seed)."""
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    rng = random.Random(7)
    prompts = [tok.encode(task.sample(rng, "train").prompt) for _ in range(prompts_n)]
    return prompts, SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tok.eos_id,), seed=1)


def k_sweep(
    policy: Path,
    ks: list[int],
    repeats: int,
    prompts_n: int,
    samples: int,
    rounds: int = 3,
    raw: Path | None = None,
    *,
    logs: Path,
) -> list[str]:
    """Per (repeat, k): `rounds` generations of the demo workload (fresh seeds); wall seconds of
    the trainer's fan-out and CPU seconds of both sidecar processes (robust to other tenants)."""
    prompts, warm = sweep_workload(prompts_n)
    configs: list[int | str] = [0, *ks, "auto"]
    wall: dict[int | str, list[float]] = {k: [] for k in configs}
    cpu: dict[int | str, list[float]] = {k: [] for k in configs}
    taus: dict[int | str, list[float]] = {k: [] for k in configs}
    with (
        LocalSidecars(
            policy, 2, logs, serve=ServeConfig(engine=EngineConfig(speculation_k=max(ks), speculation_auto=True))
        ) as local,
        Fleet(local.start()) as orch,
    ):
        pids = [local.pid(i) for i in range(2)]
        for n in range(rounds):  # warm the processes up; automatic mode's learning pass
            orch.generate(
                GenerationRequest(prompts=prompts, sampling=replace(warm, seed=10_000 + n), samples_per_prompt=samples)
            )
        orch.speculation_delta()
        for r in range(repeats):
            for k in wall:
                c0, w = cpu_seconds(pids), 0.0
                for n in range(rounds):
                    sampling = replace(warm, seed=100 * r + n)
                    request = GenerationRequest(
                        prompts=prompts,
                        sampling=sampling,
                        samples_per_prompt=samples,
                        speculation_k=None if k == "auto" else int(k),
                    )
                    w += orch.generate(request).seconds
                cpu[k].append(cpu_seconds(pids) - c0)
                wall[k].append(w)
                taus[k].append(orch.speculation_delta().acceptance_length)
        statuses = [client.stats().speculation for client in orch.clients]
    rows = _report(wall, cpu, taus, ks, raw, cpu_label="sidecar CPU s")
    for i, status in enumerate(statuses):
        rows.append(
            f"sidecar {i} at the end: k={status.speculation_k} ({status.reason}: {status.detail}); acceptance per position "
            + "/".join(f"{a:.2f}" for a in status.acceptance)
            + f"; guard trips {status.guard_trips}"
        )
    return rows


def _report(
    wall: dict[int | str, list[float]],
    cpu: dict[int | str, list[float]],
    taus: dict[int | str, list[float]],
    ks: list[int],
    raw: Path | None,
    cpu_label: str,
    clock: str = "CPU",
) -> list[str]:
    """The sweep's table (medians) and auto against the best static k and plain (tools/bench/common.py).
    `cpu` holds the seconds of the run's main clock, named `clock` ("CPU"; "GPU wall" on CUDA)."""
    w0, c0 = statistics.median(wall[0]), statistics.median(cpu[0])
    rows = [
        f"| k | τ | wall s | wall speedup | {cpu_label} | {clock} speedup |",
        "|---|---|---|---|---|---|",
    ]
    for k in wall:
        w, c = statistics.median(wall[k]), statistics.median(cpu[k])
        rows.append(f"| {k} | {statistics.median(taus[k]):.2f} | {w:.3f} | {w0 / w:.2f}x | {c:.2f} | {c0 / c:.2f}x |")
    best = best_in_sample(cpu, ks)
    rows.append("")
    # paired: a repeat's configurations ran one after the other, so per-repeat ratios cancel drift
    rows.append(
        f"auto vs the best static k, median of per-repeat ratios [90% bootstrap interval] (> 1: auto faster): "
        f"in-sample best (k={best} by {clock}, chosen on the same repeats: biased against auto, see "
        f"tools/bench/common.py): {clock} {median_ratio(cpu[best], cpu['auto'])}, wall {median_ratio(wall[best], wall['auto'])}"
    )
    choices = Counter(held_out_choices(cpu, ks))
    rows.append(
        "held-out best (each repeat against the k fastest on the other repeats: "
        + ", ".join(f"k={k} in {n}" for k, n in choices.most_common())
        + f"): {clock} {against_best_held_out(cpu, ks, 'auto')}, "
        f"wall (k chosen by wall) {against_best_held_out(wall, ks, 'auto')}; auto against plain: {clock} "
        f"{median_ratio(cpu[0], cpu['auto'])}"
    )
    if raw is not None:
        raw.write_text(
            json.dumps({"cpu": {str(k): v for k, v in cpu.items()}, "wall": {str(k): v for k, v in wall.items()}})
        )
    return rows


def k_sweep_in_process(
    policy: Path,
    ks: list[int],
    repeats: int,
    prompts_n: int,
    samples: int,
    rounds: int = 3,
    raw: Path | None = None,
    ceiling: int = 0,
    device: str = "cpu",
) -> list[str]:
    """The sweep's workload as one of its two sidecars gets it, in this process: no gRPC, no
    second engine process competing for the cores, so what is left is the controller against the
    static k. The fleet sends sidecar 0 prompts 0, 2, ... (round-robin), one Generate per prompt
    with a seed derived from (request seed, prompt); they are submitted together here. Static k
    and auto run on two engines over one model (auto learns only from its own steps);
    configurations interleaved, their order rotated per repeat; CPU seconds of this process.
    `ceiling` > 0: first measure the workload's step costs per (batch, k) over that many
    generations of each static k, then sweep a third engine, "auto@costs", whose controller prices
    its steps from that table (`tools/bench/cost_ceiling.py`): what auto loses to its cost estimates.
    `device` "cuda": the engines run there, timed by synchronised wall clock (`common.bench_clock`)."""
    prompts, warm = sweep_workload(prompts_n)
    mine = list(range(0, prompts_n, 2))
    static = TorchEngine.from_checkpoint(policy, device=device, speculation_k=0, max_speculation_k=max(ks))
    clock, clock_name = bench_clock(static.device)
    auto = TorchEngine(static.model, speculation_k=max(ks), max_speculation_k=max(ks), speculation_auto=True)

    def generate(engine: TorchEngine, seed: int, k: int | None) -> None:
        for p in mine:
            engine.submit(
                GenerationRequest(
                    prompts=[prompts[p]],
                    sampling=replace(warm, seed=derive_seed(seed, p)),
                    samples_per_prompt=samples,
                    speculation_k=k,
                    request_id=f"{seed}/p{p}",
                )
            )
        done = 0
        while done < len(mine) * samples:
            done += len(engine.step())

    engines = {"auto": auto}
    if ceiling:  # one more engine: it measures the table, then runs on it
        ceil = TorchEngine(static.model, speculation_k=max(ks), max_speculation_k=max(ks), speculation_auto=True)
        table = measure_step_costs(ceil, lambda engine, seed: generate(engine, seed, None), [0, *ks], ceiling)
        ceil.set_speculation_controller(TablePriced(SpeculationControllerConfig(max_speculation_k=max(ks)), table))
        engines["auto@costs"] = ceil
    for n in range(rounds):  # automatic mode's learning pass
        for engine in engines.values():
            generate(engine, 10_000 + n, None)
    configs: list[int | str] = [0, *ks, *engines]
    wall: dict[int | str, list[float]] = {k: [] for k in configs}
    cpu: dict[int | str, list[float]] = {k: [] for k in configs}
    taus: dict[int | str, list[float]] = {k: [] for k in configs}
    for r in range(repeats):
        for k in configs[r % len(configs) :] + configs[: r % len(configs)]:
            engine = engines.get(str(k), static)
            before = SpeculationCounters()
            before.add(engine.stats()[-1].counters)
            c0, w0 = clock(), time.perf_counter()
            for n in range(rounds):
                generate(engine, 100 * r + n, None if k in engines else int(k))
            cpu[k].append(clock() - c0)
            wall[k].append(time.perf_counter() - w0)
            taus[k].append(engine.stats()[-1].counters.minus(before).acceptance_length)
    rows = _report(wall, cpu, taus, ks, raw, cpu_label=f"{clock_name} s", clock=clock_name)
    if ceiling:
        best = best_in_sample(cpu, ks)
        rows.append(
            f"auto on the measured costs (a ceiling: the table was measured on this workload, {ceiling} "
            f"generations per k) against the best static k held out: {clock_name} "
            f"{against_best_held_out(cpu, ks, 'auto@costs')} (in-sample k={best}: "
            f"{median_ratio(cpu[best], cpu['auto@costs'])}); auto against it: {clock_name} "
            f"{median_ratio(cpu['auto@costs'], cpu['auto'])}"
        )
    status = auto.speculation_status()
    rows.append(
        f"auto at the end: k={status.speculation_k} ({status.reason}: {status.detail}); guard trips {status.guard_trips}"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rl-steps", type=int, default=DemoConfig().rl_steps)
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep-only", action="store_true", help="Reuse OUT/policy from an earlier run; only sweep k.")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="Sweep one sidecar's share of the workload in this process instead of on two sidecars (implies --sweep-only).",
    )
    ap.add_argument(
        "--raw", type=Path, help="Also write the sweep's per-repeat seconds here (JSON: cpu/wall -> k -> list)."
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="With --in-process: the engines' device (cuda: timed by synchronised wall clock instead of CPU time).",
    )
    ap.add_argument(
        "--ceiling",
        type=int,
        default=0,
        metavar="N",
        help="With --in-process: also sweep auto priced by the workload's step costs, measured first over N "
        "generations per static k (tools/bench/cost_ceiling.py): what auto loses to its own cost estimates.",
    )
    args = ap.parse_args()
    if args.ceiling < 0 or (args.ceiling and not args.in_process):
        ap.error("--ceiling N takes N >= 1 generations per k and needs --in-process")
    if args.device != "cpu" and not args.in_process:
        ap.error("--device runs the in-process sweep on that device and needs --in-process (sidecars take --device)")
    if problem := device_problem(args.device):
        ap.error(problem)
    torch.set_num_threads(1)
    if not (args.sweep_only or args.in_process):
        report = run_demo(args.out, DemoConfig(rl_steps=args.rl_steps))
        print(report.render())
        print()
    ks = [int(k) for k in args.ks.split(",")]
    if not (args.out / "policy" / "config.json").is_file():
        ap.error(
            f"no policy checkpoint in {args.out / 'policy'}: run once without --sweep-only/--in-process to train it"
        )
    rollout = demo_config(args.out / "policy", args.out / "run").rollout
    sweep_fn = (
        partial(k_sweep_in_process, ceiling=args.ceiling, device=args.device)
        if args.in_process
        else partial(k_sweep, logs=args.out / "sweep-logs")
    )
    sweep = sweep_fn(
        args.out / "policy",
        ks,
        args.repeats,
        rollout.prompts_per_step,
        rollout.samples_per_prompt,
        raw=args.raw,
    )
    print("\n".join(sweep))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("\n" + next((ln for ln in cpu.splitlines() if "Model name" in ln), "cpu: unknown"))
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name(torch.device(args.device))}")


if __name__ == "__main__":
    main()
