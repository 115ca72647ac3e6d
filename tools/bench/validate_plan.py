#!/usr/bin/env python
"""`specrl plan`'s model against measurement: the demo's per-step generation and step times, with
and without speculation, and the ordering of k in `specrl bench rl`'s sweep.

    specrl bench validate-plan --run OUT/run --costs /tmp/demo-costs.json [--sweep RAW.json]

Inputs, all measured, none fitted to the times they predict:
- costs: a cost table of the demo's policy measured by the engine (`specrl bench cost-table`):
  seconds per decode round per (batch, k), prefill, the fleet's fixed cost per generation;
- per step, from the run's metrics.jsonl: the step's response-length percentiles and acceptance
  per draft position (what the sidecars counted), its refill rounds and prompts;
- the rest of a step (log-probs, training, weight push): the median of the *other* steps
  (leave-one-out: the step's own time is never an input to its prediction).
Predicted per step: generation at the run's k and at k = 0, the refill rounds at k, and the step
(generation + refill + rest); the trainer's plain step is the plain generation plus the same rest.
With `--sweep` (`specrl bench rl --raw`: per repeat, three generations of the workload per k on two
sidecars), each k's time is predicted from the cost table's own workload record (acceptance and
lengths at the largest k), and the predicted ordering of k is set against the measured one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from tools.bench.cost_table import ENGINES, MAX_BATCH, PROMPTS, SAMPLES
from trainer.planning.cost_table import TableCosts, load_costs
from trainer.planning.inputs import read_run_metrics, step_acceptance, step_lengths
from trainer.planning.step_model import (
    Acceptance,
    EngineSplit,
    EngineWorkload,
    LengthDistribution,
    generation,
    simulate_engine,
)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else 0.0


def order_statistics(row: dict, n: int) -> list[int]:
    """The step's n response lengths, read back from its logged percentiles (exact at them, linear
    between): the batch this step actually generated, not draws from its distribution."""
    qs = sorted(
        (float(k.rsplit("_q", 1)[1]), float(v)) for k, v in row.items() if k.startswith("rollout/response_len_q")
    )
    pct = [100.0 * i / (n - 1) for i in range(n)] if n > 1 else [50.0]
    return [max(round(float(np.interp(p, [q for q, _ in qs], [v for _, v in qs]))), 1) for p in pct]


def rows_generation(
    engine_rows: list[list[int]],
    acc: Acceptance | None,
    k: int,
    costs: TableCosts,
    prompt_tokens: int,
    reps: int,
    seed: int,
) -> np.ndarray:
    """Per replication, the slowest engine's seconds for these exact rows (plus the fleet's fixed cost)."""
    runs = []
    for e, rows in enumerate(engine_rows):
        work = EngineWorkload(
            rows=len(rows), lengths=LengthDistribution.fixed(1), prompt_tokens=prompt_tokens, max_batch_size=MAX_BATCH,
            row_lengths=tuple(rows),
        )  # fmt: skip
        runs.append(simulate_engine(work, acc if k else None, k, costs, reps, seed + 17 * e).seconds)
    return np.max(np.vstack(runs), axis=0) + costs.request_seconds()


def engine_check(policy: Path, ks: list[int], generations: int, checks: int, reps: int) -> None:
    """In one process, on CPU time (robust to other tenants): measure the engine's round costs on
    the demo share, then predict fresh generations at each k from their own row lengths and
    acceptance (out of sample: other seeds than the costs were measured on; cost and check
    generations interleaved in time, so that both see the box's load alike)."""
    import torch

    from tools.bench.cost_table import DemoShare, rounds_table, step_overhead
    from trainer.planning.inputs import cumulative_rates

    torch.set_num_threads(1)
    share = DemoShare(policy, ks)
    cost_runs, check_runs = [], []
    for n in range(max(generations, checks)):  # interleaved in time: costs and checks see the same load
        for k in ks:
            if n < generations:
                cost_runs.append(share.generate(30_000 + n, k))
            if n < checks:
                check_runs.append(share.generate(50_000 + n, k))
    prefill = share.measure_prefill()
    table = {
        "name": "in-process",
        "rounds": rounds_table(cost_runs),
        "prefill": prefill,
        "step_seconds": step_overhead(cost_runs, prefill),
    }
    costs = TableCosts(table)
    print(f"outside the timed rounds: {1e3 * table['step_seconds']:.2f} ms per engine step (in the costs)")
    prompt_tokens = round(statistics.mean(len(share.prompts[p]) for p in share.mine))
    measured: dict[int, list[float]] = {k: [] for k in ks}
    predicted: dict[int, list[float]] = {k: [] for k in ks}
    for n, g in enumerate(check_runs):
        rates = cumulative_rates(g.counters.drafted_per_position, g.counters.accepted_per_position)
        acc = Acceptance.from_cumulative(rates) if g.k else None
        work = EngineWorkload(
            rows=len(g.lengths), lengths=LengthDistribution.fixed(1), prompt_tokens=prompt_tokens, max_batch_size=MAX_BATCH,
            row_lengths=tuple(g.lengths),
        )  # fmt: skip
        measured[g.k].append(g.seconds)
        predicted[g.k].append(float(simulate_engine(work, acc, g.k, costs, reps, n).seconds.mean()))
    print(
        f"engine check: {policy}, costs from {generations} generations per k, {checks} fresh generations per k (CPU s)"
    )
    print(
        "| k | measured s (median) | predicted s (median) | predicted / measured, median [range] | median abs error |"
    )
    print("|---|---|---|---|---|")
    for k in ks:
        ratios = [p / m for p, m in zip(predicted[k], measured[k], strict=True)]
        print(
            f"| {k} | {statistics.median(measured[k]):.4f} | {statistics.median(predicted[k]):.4f} | "
            f"{statistics.median(ratios):.3f} [{min(ratios):.2f}, {max(ratios):.2f}] | "
            f"{100 * statistics.median(abs(r - 1) for r in ratios):.1f}% |"
        )
    pm = [statistics.median(predicted[k]) for k in ks]
    mm = [statistics.median(measured[k]) for k in ks]
    print(
        f"ordering of k: rank correlation {spearman(pm, mm):.2f}; fastest k predicted {ks[pm.index(min(pm))]}, "
        f"measured {ks[mm.index(min(mm))]}; speedup of k over plain predicted / measured: "
        + ", ".join(f"k={k} {pm[0] / pm[i]:.2f}/{mm[0] / mm[i]:.2f}" for i, k in enumerate(ks) if k)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="the demo's run directory (OUT/run)")
    ap.add_argument("--costs", type=Path, help="the cost table the run's steps are predicted from")
    ap.add_argument("--engine-check", type=Path, metavar="POLICY", help="validate in one process on CPU time instead")
    ap.add_argument("--ks", default="0,1,2,3,4,5,6", help="with --engine-check: the ks measured and checked")
    ap.add_argument("--generations", type=int, default=6, help="with --engine-check: generations per k for the costs")
    ap.add_argument("--checks", type=int, default=8, help="with --engine-check: fresh generations per k predicted")
    ap.add_argument("--k", type=int, default=3, help="the run's speculation k")
    ap.add_argument("--sweep", type=Path, help="`specrl bench rl --raw` output of a k sweep on the same policy")
    ap.add_argument("--replications", type=int, default=64)
    args = ap.parse_args(argv)
    if args.engine_check is not None:
        engine_check(
            args.engine_check, [int(k) for k in args.ks.split(",")], args.generations, args.checks, args.replications
        )
        return 0
    if args.costs is None or (args.run is None and args.sweep is None):
        ap.error("give --costs FILE with --run RUN_DIR and/or --sweep RAW.json (or --engine-check POLICY)")
    costs = load_costs(args.costs)
    table = json.loads(args.costs.read_text())["tables"][0]
    workload = table.get("workload", {})
    prompt_tokens = int(workload.get("prompt_tokens", 8))
    fleet = EngineSplit(
        prompts=PROMPTS,
        samples_per_prompt=SAMPLES,
        engines=ENGINES,
        max_batch_size=MAX_BATCH,
        prompt_tokens=prompt_tokens,
    )
    if args.run is not None:
        rows = read_run_metrics(args.run)
        rest_of = [r["time/logprobs"] + r["time/train"] + r["time/weight_push"] for r in rows]

        def gen(fl: EngineSplit, lengths: LengthDistribution, acc: Acceptance | None, k: int, seed: int) -> float:
            return generation(fl, lengths, acc, k, costs, args.replications, seed).seconds

        print(f"costs: {costs.description}; fixed cost per generation {1e3 * costs.request_seconds():.1f} ms")
        header = "| step | tau | len p50/p100 | gen spec meas / pred | gen plain meas / pred | step spec meas / pred | step plain meas / pred |"
        print(header)
        print("|---" * 7 + "|")
        ratios: dict[str, list[float]] = {"gen spec": [], "gen plain": [], "step spec": [], "step plain": []}
        phases: dict[str, list[float]] = {"refill": [], "rest (leave-one-out)": []}
        predicted_gen: list[tuple[float, float]] = []
        for i, row in enumerate(rows):
            lengths, acc = step_lengths(row), step_acceptance(row)
            if lengths is None or acc is None:
                raise SystemExit(f"step {row.get('step')}: no length percentiles or acceptance logged; rerun the demo")
            seed = 1000 + i
            batch = order_statistics(row, PROMPTS * SAMPLES)
            engine_rows = [batch[e::ENGINES] for e in range(ENGINES)]  # ranks dealt out: each sidecar a long row or two
            g_spec = float(
                rows_generation(engine_rows, acc, args.k, costs, prompt_tokens, args.replications, seed).mean()
            )
            g_plain = float(rows_generation(engine_rows, None, 0, costs, prompt_tokens, args.replications, seed).mean())
            rounds, refill_prompts = int(row.get("rollout/refill_rounds", 0)), row.get("rollout/refill_prompts")
            if rounds and refill_prompts is not None:
                per_round = max(math.ceil(refill_prompts / rounds), 1)
                refill_fleet = EngineSplit(
                    prompts=per_round, samples_per_prompt=SAMPLES, engines=min(ENGINES, per_round), max_batch_size=MAX_BATCH,
                    prompt_tokens=prompt_tokens,
                )  # fmt: skip
                refill = rounds * gen(refill_fleet, lengths, acc, args.k, seed + 500)
            else:
                refill = row["time/refill"]
            rest = statistics.median(rest_of[:i] + rest_of[i + 1 :])
            measured = {
                "gen spec": row["time/generation"],
                "gen plain": row["time/generation_plain"],
                "step spec": row["time/step"],
                "step plain": row["time/generation_plain"] + row["time/step"] - row["time/generation"],
            }
            predicted = {
                "gen spec": g_spec,
                "gen plain": g_plain,
                "step spec": g_spec + refill + rest,
                "step plain": g_plain + refill + rest,
            }
            for key in ratios:
                ratios[key].append(predicted[key] / measured[key])
            phases["rest (leave-one-out)"].append(rest / rest_of[i])
            predicted_gen.append((g_spec, g_plain))
            if row["time/refill"] > 0:
                phases["refill"].append(refill / row["time/refill"])
            cells = " | ".join(f"{measured[k]:.3f} / {predicted[k]:.3f}" for k in ratios)
            q50, q100 = row.get("rollout/response_len_q50"), row.get("rollout/response_len_q100")
            print(f"| {row['step']} | {acc.tau(args.k):.2f} | {q50:.0f}/{q100:.0f} | {cells} |")
        print()
        for key, rs in ratios.items():
            errors = [abs(r - 1) for r in rs]
            print(
                f"{key}: predicted / measured, median {statistics.median(rs):.3f} (range {min(rs):.2f}-{max(rs):.2f}); "
                f"median |error| {100 * statistics.median(errors):.1f}%"
            )
        for key, rs in phases.items():
            if rs:
                print(
                    f"phase {key}: predicted / measured, median {statistics.median(rs):.3f} "
                    f"(range {min(rs):.2f}-{max(rs):.2f}, {len(rs)} steps)"
                )
        spec_speedup = [r["time/generation_plain"] / r["time/generation"] for r in rows]
        pred_speedup = [plain / spec for spec, plain in predicted_gen]
        print(
            f"generation speedup of k = {args.k} over plain, median: measured {statistics.median(spec_speedup):.2f}x "
            f"(range {min(spec_speedup):.2f}-{max(spec_speedup):.2f}), predicted {statistics.median(pred_speedup):.2f}x"
        )

    if args.sweep:
        raw = json.loads(args.sweep.read_text())
        acc = Acceptance.from_cumulative(workload["accepted_cumulative"])
        lengths = LengthDistribution(values=tuple(workload["lengths"]), weights=(1.0,) * len(workload["lengths"]))
        ks = sorted(int(k) for k in raw["wall"] if k.isdigit())
        print(
            f"\nsweep of k ({args.sweep}): three generations per repeat; acceptance {acc.alphas}, mean length {lengths.mean:.1f}"
        )
        print("| k | tau | wall meas s | wall pred s | sidecar CPU meas s | CPU pred s |")
        print("|---|---|---|---|---|---|")
        pred_wall, pred_cpu, meas_wall, meas_cpu = [], [], [], []
        for k in ks:
            g = generation(fleet, lengths, acc if k else None, k, costs, args.replications, 7)
            # the sidecars' CPU: each engine's rounds and prefills plus its share of the fixed cost per generation
            pw, pc = 3 * g.seconds, 3 * ENGINES * (float(g.engine_seconds.mean()) + costs.request_seconds())
            mw, mc = statistics.median(raw["wall"][str(k)]), statistics.median(raw["cpu"][str(k)])
            pred_wall.append(pw)
            pred_cpu.append(pc)
            meas_wall.append(mw)
            meas_cpu.append(mc)
            print(f"| {k} | {g.tau:.2f} | {mw:.3f} | {pw:.3f} | {mc:.3f} | {pc:.3f} |")
        for name, pred, meas in (("wall", pred_wall, meas_wall), ("CPU", pred_cpu, meas_cpu)):
            best_p, best_m = ks[pred.index(min(pred))], ks[meas.index(min(meas))]
            print(
                f"{name}: rank correlation of predicted and measured times over k = {ks}: "
                f"{spearman(pred, meas):.2f}; best k predicted {best_p}, measured {best_m}; "
                f"predicted/measured median {statistics.median(p / m for p, m in zip(pred, meas, strict=True)):.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
