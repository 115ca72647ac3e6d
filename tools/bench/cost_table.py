#!/usr/bin/env python
"""A cost table of a policy checkpoint on the demo's RL workload, measured by the engine itself,
for `specrl plan --costs` (and the plan's validation, `specrl bench validate-plan`).

    specrl bench cost-table --policy OUT/policy --out /tmp/demo-costs.json --fleet

Why: the demo's sidecars decode batches of up to 32 rows of a 24-layer, hidden-128 policy on a
CPU, where a round's cost is the engine's, not a roofline's. This runs one sidecar's share of the
demo's rollout (`demo_config`'s prompts and samples over its two sidecars, temperature 1, up to
40 tokens, EOS; the fleet's one request per prompt) in this process at every static k of `--ks`,
interleaved, and keeps what the engine's controller measures of each decode round
(`tools/cost_ceiling.measure_step_costs`: the engine's own clock, CPU time of its thread, median
per (batch, k)); then the same for one prompt's rows (`--refill-generations`), the shape of a
DAPO refill round, whose small batches the full share reaches only in its last rounds. Also:
- the prefill of one prompt's rows and of the share's (this process's CPU time, drafting rows:
  the MTP prefill included);
- with `--fleet`, the fixed cost of one generation through the fleet and two local sidecars
  (CPU seconds of a 1-token generation of the whole workload, one sidecar's share plus the
  client's, less the prefill of one sidecar's rows): fan-out, gRPC and streaming back; wall
  seconds are kept beside it (`fleet_fixed_cost`);
- the workload's acceptance per draft position and response lengths at the largest k, pooled
  over the generations (the inputs a plan of this workload needs; `workload` in the file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.client.fleet import Fleet, derive_seed
from sidecar.engine.config import EngineConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.serve_config import ServeConfig
from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters
from tools.bench.common import cpu_seconds
from tools.bench.cost_ceiling import FixedK
from tools.bench.rl import sweep_workload
from trainer.planning.cost_table import cost_table_document
from trainer.planning.inputs import cumulative_rates
from trainer.rl.config import demo_config
from trainer.rl.local_sidecars import LocalSidecars

_DEMO = demo_config(Path("policy"), Path("run"))
PROMPTS, SAMPLES = _DEMO.rollout.prompts_per_step, _DEMO.rollout.samples_per_prompt
ENGINES, MAX_BATCH = int(_DEMO.sidecars.local), _DEMO.sidecars.serve.engine.max_batch_size
"""The demo's rollout (`trainer.rl.config.demo_config`): PROMPTS x SAMPLES per step over ENGINES sidecars."""


@dataclass(kw_only=True, slots=True)
class Generation:
    """One generation of the share: its rows' lengths, what its drafts did, its CPU seconds."""

    k: int
    lengths: list[int]
    counters: SpeculationCounters
    seconds: float
    timed: dict[tuple[int, int], list[float]]
    """(batch, k) -> seconds of each of the generation's decode rounds, as the engine's controller timed them."""

    @property
    def round_seconds(self) -> float:
        return sum(sum(v) for v in self.timed.values())

    @property
    def rounds(self) -> int:
        return sum(len(v) for v in self.timed.values())


def rounds_table(generations: list[Generation]) -> list[dict]:
    """Median seconds of a decode round per (batch, k) over these generations' rounds (cells
    timed fewer than 3 times left out)."""
    cells: dict[tuple[int, int], list[float]] = {}
    for g in generations:
        for key, xs in g.timed.items():
            cells.setdefault(key, []).extend(xs)
    return [
        {"batch": b, "k": k, "seconds": statistics.median(xs), "samples": len(xs)}
        for (b, k), xs in sorted(cells.items())
        if len(xs) >= 3
    ]


def step_overhead(generations: list[Generation], prefill: list[dict]) -> float:
    """Median CPU seconds per engine step spent outside the timed decode rounds (admission
    bookkeeping, stop checks, finishing rows): (generation - its rounds - one admission of its
    rows) / its rounds."""
    admit = prefill[-1]["seconds"]
    per_step = [(g.seconds - g.round_seconds - admit) / g.rounds for g in generations if g.rounds]
    return max(statistics.median(per_step), 0.0) if per_step else 0.0


class DemoShare:
    """One sidecar's share of the demo's rollout (every ENGINES-th prompt, SAMPLES samples each,
    submitted as the fleet does: one request per prompt) on an engine whose every step's k a
    recorder decides."""

    def __init__(self, policy: Path, ks: list[int]) -> None:
        self.prompts, self.sampling = sweep_workload(PROMPTS)
        self.mine = list(range(0, PROMPTS, ENGINES))  # sidecar 0's prompts under the fleet's round-robin
        self.ks = ks
        self.engine = TorchEngine.from_checkpoint(
            policy, speculation_k=max(ks), max_speculation_k=max(ks), max_batch_size=MAX_BATCH, speculation_auto=True
        )
        self.recorder = FixedK(max(ks))  # decides every step's k, records what the engine measured of it
        self.engine.set_speculation_controller(self.recorder)

    def generate(self, seed: int, k: int, prompts: int | None = None) -> Generation:
        """One generation of the share at k (of its first `prompts` prompts only: a refill round's shape)."""
        mine = self.mine[:prompts] if prompts else self.mine
        self.recorder.k = k
        seen = {key: len(xs) for key, xs in self.recorder.samples.items()}
        before = SpeculationCounters()
        before.add(self.engine.stats()[-1].counters)
        t = time.thread_time()
        for p in mine:
            self.engine.submit(
                GenerationRequest(
                    prompts=[self.prompts[p]],
                    sampling=replace(self.sampling, seed=derive_seed(seed, p)),
                    samples_per_prompt=SAMPLES,
                    request_id=f"{seed}/p{p}/k{k}",
                )
            )
        done: list = []
        while len(done) < len(mine) * SAMPLES:
            done += self.engine.step()
        seconds = time.thread_time() - t
        done.sort(key=lambda s: (s.request_id, s.sample_index))  # admission order
        timed = {
            key: [d + r for d, r in xs[seen.get(key, 0) :]]
            for key, xs in self.recorder.samples.items()
            if len(xs) > seen.get(key, 0)
        }
        return Generation(
            k=k,
            lengths=[len(s.token_ids) for s in done],
            counters=self.engine.stats()[-1].counters.minus(before),
            seconds=seconds,
            timed=timed,
        )

    def generations(self, count: int, seed: int = 30_000, prompts: int | None = None) -> list[Generation]:
        """`count` generations per k, k interleaved (the box's drift falls on every k alike)."""
        return [self.generate(seed + n, k, prompts) for n in range(count) for k in self.ks]

    def measure_prefill(self) -> list[dict]:
        """CPU seconds of admitting one prompt's rows and the whole share's (drafting rows: the MTP
        prefill included)."""
        out = []
        for rows_prompts in ([self.prompts[0]], [self.prompts[p] for p in self.mine]):
            xs = []
            for r in range(5):
                t = time.thread_time()
                self.engine.generate(
                    GenerationRequest(
                        prompts=rows_prompts,
                        sampling=replace(self.sampling, max_new_tokens=1, seed=r),
                        samples_per_prompt=SAMPLES,
                        speculation_k=max(self.ks),
                    )
                )
                xs.append(time.thread_time() - t)
            tokens = round(sum(len(p) for p in rows_prompts) / len(rows_prompts))
            out.append({"rows": SAMPLES * len(rows_prompts), "prompt_tokens": tokens, "seconds": statistics.median(xs)})
        return out


def fleet_fixed_cost(
    policy: Path,
    prompts: list[list[int]],
    sampling: SamplingParams,
    k: int,
    prefill_seconds: float,
    logs: Path,
    tries: int = 9,
) -> tuple[float, dict]:
    """The fixed cost of one generation through the fleet and two local sidecars, in CPU seconds
    like the rest of the table: per 1-token generation of the whole workload, one sidecar's share
    of the sidecars' CPU (both threads of work run side by side, one per core) plus this client's,
    less the prefill of one sidecar's rows (which the plan prices on its own). Wall seconds are
    recorded beside it: on a shared box they measure the other tenants (a 1-token generation took
    0.3-2 s of wall for ~0.1 s of CPU at load 10-16, 2026-11-27), so they are not the cost."""
    walls, cpus = [], []
    with (
        LocalSidecars(policy, ENGINES, logs, serve=ServeConfig(engine=EngineConfig(speculation_k=k))) as local,
        Fleet(local.start()) as fleet,
    ):
        pids = [local.pid(i) for i in range(ENGINES)]
        for r in range(tries):
            request = GenerationRequest(
                prompts=prompts, sampling=replace(sampling, max_new_tokens=1, seed=r), samples_per_prompt=SAMPLES
            )
            side, mine = cpu_seconds(pids), time.process_time()
            walls.append(fleet.generate(request).seconds)
            cpus.append((cpu_seconds(pids) - side) / ENGINES + time.process_time() - mine)
    cpu, wall = statistics.median(cpus[2:]), statistics.median(walls[2:])  # the first two warm up
    note = {"one_token_cpu_seconds": cpu, "one_token_wall_seconds": wall, "tries": tries - 2}
    return max(cpu - prefill_seconds, 0.0), note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ks", default="0,1,2,3,4,5,6")
    ap.add_argument("--generations", type=int, default=8, help="generations of the workload per k")
    ap.add_argument(
        "--refill-generations",
        type=int,
        default=4,
        help="generations per k of one prompt (a refill round's shape: small batches measured from their start)",
    )
    ap.add_argument("--fleet", action="store_true", help="also measure the fixed cost per generation through the fleet")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ks = [int(k) for k in args.ks.split(",")]
    if 0 not in ks:
        ap.error("--ks must include 0 (plain decoding is the baseline)")
    share = DemoShare(args.policy, ks)
    prompts, sampling = share.prompts, share.sampling
    started = time.monotonic()
    measured = share.generations(args.generations)
    # a refill round (DAPO's dynamic sampling) sends a sidecar one prompt: its batch starts at
    # SAMPLES rows, which the full share's rounds pass only in their last few rounds
    refill_shaped = share.generations(args.refill_generations, seed=40_000, prompts=1)
    rounds = rounds_table(measured + refill_shaped)
    at_max = [g for g in measured if g.k == max(ks)]
    print(f"rounds measured in {time.monotonic() - started:.0f} s", flush=True)
    prefill = share.measure_prefill()
    step_seconds = step_overhead(measured, prefill)
    lengths = [n for g in at_max for n in g.lengths]
    counters = SpeculationCounters()
    for g in at_max:
        counters.add(g.counters)

    request_seconds, fleet_note = 0.0, {}
    if args.fleet:
        request_seconds, fleet_note = fleet_fixed_cost(
            args.policy,
            prompts,
            sampling,
            max(ks),
            prefill[-1]["seconds"],
            args.out.parent / (args.out.stem + "-sidecar-logs"),
        )
        print(
            f"fleet: 1-token generation {1e3 * fleet_note['one_token_wall_seconds']:.1f} ms wall, "
            f"{1e3 * fleet_note['one_token_cpu_seconds']:.1f} ms CPU (per sidecar + client)",
            flush=True,
        )

    drafted, accepted = counters.drafted_per_position, counters.accepted_per_position
    doc = cost_table_document(
        [
            {
                "name": args.policy.name,
                "device": "cpu (" + (torch.backends.cpu.get_cpu_capability() or "?") + ", 1 thread)",
                "source": "specrl bench cost-table: the engine's own round timings (thread CPU time) on the demo workload",
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "rounds": rounds,
                "prefill": prefill,
                "request_seconds": request_seconds,
                **({"request": fleet_note} if fleet_note else {}),
                "step_seconds": step_seconds,
                "workload": {
                    "prompts": PROMPTS,
                    "samples_per_prompt": SAMPLES,
                    "engines": ENGINES,
                    "prompt_tokens": round(statistics.mean(len(p) for p in prompts)),
                    "max_new_tokens": sampling.max_new_tokens,
                    "k": max(ks),
                    "accepted_cumulative": cumulative_rates(drafted, accepted),
                    "lengths": lengths,
                },
            }
        ],
        command=" ".join(sys.argv),
    )
    args.out.write_text(json.dumps(doc, indent=1))
    for r in rounds:
        print(f"batch {r['batch']:>2} k {r['k']}: {1e3 * r['seconds']:.2f} ms")
    print(
        f"prefill {prefill}; request {request_seconds * 1e3:.1f} ms; tau at k={max(ks)} {counters.acceptance_length:.2f}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
