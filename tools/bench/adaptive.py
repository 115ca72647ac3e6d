#!/usr/bin/env python
"""Adaptive speculation (automatic k) against plain decoding and every static k, in one run.

    specrl bench adaptive [--model DIR] [--batches 1,4,16,64] [--ks 1,2,3,5] [--max-speculation-k 5]
                            [--temperatures 0,1] [--new-tokens 64,64,48,32] [--repeats 3]
                            [--device cpu|cuda]

The model is `specrl bench engine`'s (built into --model on first use: a Qwen3-shaped 12-layer
target with its "bigram" MTP draft). For each temperature and batch size B, the same prompts are
generated with k = 0 (plain), each static k (pinned per request) and automatic mode, the
configurations interleaved and their order rotated per repeat; process CPU seconds (robust to
other tenants of a shared machine; with `--device cuda`, wall seconds with the device synchronised
around each timed run, `common.bench_clock`); each speedup is the median over `--repeats` of the ratio
within one repeat (paired: the configurations of a repeat ran next to each other), auto's with the
90% bootstrap interval over the repeats; "auto / best static" pairs auto with the faster of plain
and the best static k in each repeat, that k chosen on the same repeats ("in-sample": biased
against auto, the winner's curse) and, per repeat, on the other repeats ("held out", with its
interval; tools/bench/common.py). Each repeat samples with its own seed (4, 5, ...; the learning
pass 3), the same for every configuration: at temperature > 0 a pinned k reproduces its
sequences from the seed, so with one seed for all repeats a static k's figure rode on two fixed
sequences' acceptance (at temperature 1, batch 1, static k = 3 had tau 1.96 on seed 3 and
1.96-2.67 on seeds 4-10), while automatic mode's sequences change with its k choices
(BENCHMARKS.md at ca4d93b, "Adaptive speculation", fifth session).

Automatic mode runs on its own engine over the same model (so it learns only from its own steps,
never from the static runs), one engine per temperature, kept across batch sizes like a
long-running sidecar. Its first pass over each batch size is the learning pass (plain measured
first, then probes): reported separately as "first pass", not in the medians.

Prints per (temperature, B): tok/s of plain, speedup of each static k and of auto, auto over the
best static k, auto's tau, and the share of decode steps at each k (with the reasons).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.engine.torch_engine import TorchEngine
from sidecar.speculation.config import RowState, SpeculationControllerConfig, SpeculationDecision
from sidecar.speculation.controller import SpeculationController
from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters
from tools.bench.common import (
    BENCH_CONFIG,
    against_best_held_out,
    bench_clock,
    device_problem,
    ensure_bench_checkpoint,
    median_ratio,
    subcommand,
)


class CountingPolicy(SpeculationController):
    """The production controller, counting its decisions (k, reason) for the report."""

    def __init__(self, config: SpeculationControllerConfig) -> None:
        super().__init__(config)
        self.counts: Counter[tuple[int, str]] = Counter()

    def decide(
        self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None
    ) -> SpeculationDecision:
        d = super().decide(batch, tokens_left, rows)
        self.counts[(d.k, d.reason)] += 1
        return d


def run(
    engine: TorchEngine, batches: list[list[list[int]]], sp: SamplingParams, k: int | None
) -> tuple[float, SpeculationCounters]:
    """Generate each batch of prompts in turn (k None: the engine's automatic mode); seconds on
    the engine device's benchmark clock (`common.bench_clock`), counters."""
    clock, _ = bench_clock(engine.device)
    before = SpeculationCounters()
    before.add(engine.stats()[-1].counters)
    start = clock()
    for prompts in batches:
        samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k))
        assert sum(len(s.token_ids) for s in samples) == len(prompts) * sp.max_new_tokens
    return clock() - start, engine.stats()[-1].counters.minus(before)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


SUBCOMMANDS = {"controller": "adaptive_controller", "sim": "adaptive_sim", "settle": "adaptive_settle"}


def main(argv: list[str] | None = None) -> int:
    merged = subcommand(argv, SUBCOMMANDS, "specrl bench adaptive")
    if merged is not None:
        return merged
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands (each with its own --help): controller (the controller's own cost per call), sim (the\ncontroller simulated on measured per-k costs), settle (how fast the acceptance estimate follows a push)",
    )
    ap.add_argument("--model", type=Path, default=Path("/tmp/specrl-bench-engine-model"))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ks", default="1,2,3,5")
    ap.add_argument("--max-speculation-k", type=int, default=5, help="automatic mode's largest k")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--new-tokens", default="64,64,48,32", help="per batch size")
    ap.add_argument("--min-prompts", type=int, default=2, help="small batches run in turn over this many prompts")
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--device", default="cpu", help="the engines' device (cuda: timed by wall clock, synchronised; cpu: CPU time)"
    )
    args = ap.parse_args(argv)
    if problem := device_problem(args.device):
        ap.error(problem)
    torch.set_num_threads(1)
    ensure_bench_checkpoint(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    news = [int(n) for n in args.new_tokens.split(",")]
    news = news * len(batches) if len(news) == 1 else news[: len(batches)]
    static = TorchEngine.from_checkpoint(
        args.model,
        device=args.device,
        speculation_k=0,
        max_speculation_k=max(*ks, args.max_speculation_k),
        max_batch_size=max(batches),
    )
    model = static.model
    configs: list[int | str] = [0, *ks, "auto"]
    header = (
        "| T | B | plain tok/s | "
        + " | ".join(f"k={k}" for k in ks)
        + " | auto [90% CI] | auto / best static, in-sample | auto / best static, held out [90% CI] "
        "| auto first pass | auto tau | auto's k (share of steps) |"
    )
    lines = [header, "|---" * (9 + len(ks)) + "|"]
    print(f"device: {_device_name(static.device)}; clock: {bench_clock(static.device)[1]} seconds", flush=True)
    print(header, flush=True)
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        policy = CountingPolicy(SpeculationControllerConfig(max_speculation_k=args.max_speculation_k))
        auto = TorchEngine(
            model,
            speculation_k=args.max_speculation_k,
            max_speculation_k=max(*ks, args.max_speculation_k),
            max_batch_size=max(batches),
        )
        auto.set_speculation_controller(policy)
        gen = torch.Generator().manual_seed(1)
        for batch, new in zip(batches, news, strict=True):
            sp = SamplingParams(temperature=temperature, max_new_tokens=new, seed=3)
            rounds = max(1, -(-args.min_prompts // batch))
            prompts = [
                torch.randint(0, BENCH_CONFIG.vocab_size, (batch, args.prompt_length), generator=gen).tolist()
                for _ in range(rounds)
            ]
            run(static, prompts[:1], SamplingParams(temperature=temperature, max_new_tokens=4), 1)  # warm up
            tokens = rounds * batch * new
            first_seconds, _ = run(auto, prompts, sp, None)  # automatic mode's learning pass at this batch
            policy.counts.clear()
            times: dict[int | str, list[float]] = {c: [] for c in configs}
            auto_counters = SpeculationCounters()
            for r in range(args.repeats):
                order = configs[r % len(configs) :] + configs[: r % len(configs)]
                sp_r = SamplingParams(temperature=temperature, max_new_tokens=new, seed=sp.seed + 1 + r)
                for c in order:
                    seconds, counters = run(
                        auto if c == "auto" else static, prompts, sp_r, None if c == "auto" else int(c)
                    )
                    times[c].append(seconds)
                    if c == "auto":
                        auto_counters.add(counters)
            # paired: each repeat's configurations ran next to each other, so per-repeat ratios
            # cancel the machine's drift between repeats; medians over the repeats
            speedup = {c: statistics.median(p / t for p, t in zip(times[0], times[c], strict=True)) for c in configs}
            rate = {c: tokens / statistics.median(times[c]) for c in configs}
            best = max(ks, key=lambda k: speedup[k])
            against_best = statistics.median(
                min(p, b) / a for p, b, a in zip(times[0], times[best], times["auto"], strict=True)
            )
            # the best static k chosen without the repeat it is compared on (tools/bench/common.py)
            held_out = against_best_held_out(times, ks, "auto", reference=lambda c, i, t=times: min(t[0][i], t[c][i]))
            against_plain = median_ratio(times[0], times["auto"])
            steps = sum(policy.counts.values())
            by_k: Counter[int] = Counter()
            for (k, _), n in policy.counts.items():
                by_k[k] += n
            reasons = Counter(reason for (_, reason), n in policy.counts.items() for _ in range(n))
            share = ", ".join(f"k={k} {n / steps:.0%}" for k, n in sorted(by_k.items()))
            why = "/".join(f"{reason} {n / steps:.0%}" for reason, n in reasons.most_common())
            if not steps:
                share, why = "k=0 throughout", "rows admitted without a draft: measured plain is best"
            row = (
                f"| {temperature:g} | {batch} | {rate[0]:.1f} | "
                + " | ".join(f"{speedup[k]:.2f}x" for k in ks)
                + f" | **{speedup['auto']:.2f}x** [{against_plain.low:.2f}, {against_plain.high:.2f}] "
                f"| {against_best:.2f} (best: k={best if speedup[best] > 1 else 0}) "
                f"| **{held_out.median:.2f}** [{held_out.low:.2f}, {held_out.high:.2f}] "
                f"| {tokens / first_seconds / rate[0]:.2f}x | {auto_counters.acceptance_length:.2f} | {share} ({why}) |"
            )
            lines.append(row)
            print(row, flush=True)
    print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
