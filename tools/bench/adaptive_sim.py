"""Replay the adaptive speculation controller against a modelled engine: decisions without timing noise.

On the project's shared 2-core box the in-process A/B of the controller swings by +-3% between two
runs of the same code even at 30 repeats (BENCHMARKS.md at ca4d93b, "Adaptive speculation", seventh
session), the size of every effect left to find. Here the engine is a model: each decode step
costs a fixed time per (batch, k) measured once on the real engine (`--measure`), times seeded
log-normal noise; drafts are accepted with per-position rates scaled per row by the rows' spread;
rows end at their request's answer length, the RL demo's arrival pattern (one Generate per
prompt, a step apart) included. The real `SpeculationController` decides every step and observes
what the modelled step did, exactly as the engine reports it, and each configuration (static k
and auto) runs the same seeded workload: auto's time against the best static k's is then a
property of the controller's logic under a known truth, repeatable to the last digit.

Rows admitted with a draft pay its prefill (`--prefill-per-token`, measured with the cost table),
which is what a refusal at admission (`SpeculationController.may_draft`) saves. What it leaves out:
the engine's own bookkeeping per step, the catch-up cost after plain rounds beyond one draft
step, and acceptance that drifts (one fixed draft); costs that move with the box's load over
minutes only with `--drift`.

`--calibrate` checks the controller's price of each static k (its straggler model) against the
modelled engine's truth for a batch with given tokens left, after random-k generations taught it
the workload.

    specrl bench adaptive sim --measure /tmp/i16a/rl/policy --costs /tmp/costs.json
    specrl bench adaptive sim --costs /tmp/costs.json --generations 400
    specrl bench adaptive sim --costs /tmp/costs.json --generations 200 --calibrate 40,20,10,4
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.speculation.config import RowState, SpeculationControllerConfig, SpeculationDecision
from sidecar.speculation.controller import SpeculationController
from tools.bench.cost_ceiling import FixedK

Costs = dict[int, dict[int, tuple[float, float]]]
"""batch -> k -> (draft seconds, verify seconds) of one decode step."""
PREFILL_KEY = "prefill_per_token"
"""The cost table's entry for the draft's prefill at admission (seconds per prompt token)."""


@dataclass
class Workload:
    """One generation: `requests` requests of `rows` samples each, the i-th submitted `lag` steps
    after the one before (the fleet's one Generate per prompt), its rows' stop token at output
    position `ends[i]` (with probability `other_end` anywhere up to the cap instead)."""

    alphas: list[float]
    """P(draft position i accepted | position i - 1 was), i = 1..max k."""
    spread: float = 0.15
    """Relative standard deviation of a row's acceptance (a row's rates are alphas x (1 + spread x N(0, 1)))."""
    ends: list[int] = field(default_factory=lambda: [20, 21])
    rows: int = 4
    lag: int = 1
    max_new_tokens: int = 40
    other_end: float = 0.01
    prompt_tokens: int = 16
    """Each row's prompt: the draft's prefill at admission covers all but its last token."""
    prefill_per_token: float = 0.0
    """Seconds of the draft's prefill per prompt token (rows admitted with a draft pay it)."""


@dataclass
class _Row:
    end: int
    scale: float
    length: int = 0
    drafted_one: int = 0
    accepted_one: int = 0
    drafts: bool = True
    """False: admitted without a draft (`SpeculationController.may_draft`), plain for its whole generation."""


def _new_row(work: Workload, end: int, rng: random.Random) -> _Row:
    """A row of a request whose rows stop at `end` (anywhere, with probability `other_end`),
    its acceptance scaled by a draw of the rows' spread."""
    return _Row(
        end=end if rng.random() >= work.other_end else rng.randrange(work.max_new_tokens),
        scale=max(1.0 + work.spread * rng.gauss(0.0, 1.0), 0.0),
    )


def _step(row: _Row, drafts: int, left: int, work: Workload, rng: random.Random) -> tuple[int, int, bool]:
    """One decode step of `row` with `drafts` drafts and `left` tokens to its cap: (drafts
    accepted, tokens emitted, whether its stop token was among them). The row's length is the
    caller's to advance."""
    a = 0
    while a < drafts and rng.random() < min(max(work.alphas[a] * row.scale, 0.02), 0.98):
        a += 1
    n = min(a + 1, left)
    stopped = row.length <= row.end < row.length + n
    if stopped:
        n = row.end - row.length + 1
    return a, n, stopped


def simulate(
    costs: Costs,
    work: Workload,
    decider: int | SpeculationController,
    generations: int,
    seed: int,
    noise: float,
    drift: float = 0.0,
    drift_steps: float = 200.0,
) -> tuple[float, int]:
    """(seconds, decode steps) of `generations` generations with `decider`: a static k, or the
    controller deciding every step.
    Each step's cost is the table's x exp(`noise` N(0, 1)) x exp(x), x the box's load: an AR(1)
    process of standard deviation `drift` and time constant `drift_steps` steps, the same for
    every width (another process taking the cores for a minute slows every step)."""
    k, policy = (decider, None) if isinstance(decider, int) else (None, decider)
    rng = random.Random(seed)
    load = random.Random(seed + 10**6)  # the same load for every configuration
    rho = math.exp(-1.0 / drift_steps)
    max_speculation_k = max(costs[min(costs)])
    seconds, steps, last_k, x = 0.0, 0, 0, 0.0
    for _ in range(generations):
        waiting = [[_new_row(work, end, rng) for _ in range(work.rows)] for end in work.ends]
        running: list[_Row] = []
        step = 0
        while running or waiting:
            if waiting and step % work.lag == 0:
                new = waiting.pop(0)
                prefill_tokens = len(new) * (work.prompt_tokens - 1)
                if policy is not None:  # the engine asks at admission whether the new rows keep a draft
                    rows_now = [*running, *new]
                    lefts = [work.max_new_tokens - r.length for r in rows_now]
                    if not policy.may_draft(
                        len(rows_now),
                        max(lefts),
                        [RowState(r.length, lf) for r, lf in zip(rows_now, lefts, strict=True)],
                        joining=len(new),
                        prompt_tokens=prefill_tokens,
                    ):
                        for r in new:
                            r.drafts = False
                if work.prefill_per_token and (k or policy is not None) and new[0].drafts:
                    prefill = prefill_tokens * work.prefill_per_token * math.exp(x)  # the load, not step noise
                    seconds += prefill
                    if policy is not None:
                        policy.observe_draft_prefill(prefill_tokens, prefill)
                running += new
            step += 1
            if not running:
                continue
            b = len(running)
            left = [work.max_new_tokens - r.length for r in running]
            tokens_left = max(left)  # the next request is not queued yet: it comes a step later
            consulted = policy is not None and any(r.drafts for r in running)  # the engine's rule
            if consulted:
                chosen = policy.decide(
                    b, tokens_left, [RowState(r.length, lf) for r, lf in zip(running, left, strict=True)]
                ).k
            else:
                chosen = k or 0
            row_k = [min(chosen, lf - 1) if r.drafts else 0 for r, lf in zip(running, left, strict=True)]
            round_k = max(row_k)
            draft_s, verify_s = costs[_nearest(costs, b)][min(round_k, max_speculation_k)]
            catch_up = round_k > last_k + 1 and last_k == 0
            x = rho * x + math.sqrt(1.0 - rho * rho) * drift * load.gauss(0.0, 1.0)
            draft_s = (draft_s + (costs[_nearest(costs, b)][1][0] if catch_up else 0.0)) * math.exp(
                noise * rng.gauss(0.0, 1.0) + x
            )
            verify_s *= math.exp(noise * rng.gauss(0.0, 1.0) + x)
            ends, drafted, accepted, finished = [], [], [], []
            emitted_total = ended = 0
            for row, ke, lf in zip(running, row_k, left, strict=True):
                a, n, stopped = _step(row, ke, lf, work, rng)
                if ke:
                    drafted.append(min(ke, n))
                    accepted.append(min(a, n))
                    row.drafted_one += 1
                    row.accepted_one += a > 0
                ends.append((row.length, n, stopped))
                row.length += n
                emitted_total += n
                ended += stopped
                if stopped or row.length >= work.max_new_tokens:
                    finished.append(row)
            if consulted:
                policy.observe_acceptance(drafted, accepted)
                policy.observe_step(
                    batch=b,
                    k=round_k,
                    draft_seconds=draft_s if round_k else 0.0,
                    step_seconds=draft_s * (round_k > 0) + verify_s,
                    tokens=emitted_total,
                    chosen=True,
                    catch_up=catch_up,
                    ended=ended,
                    rows=ends,
                )
                for row in finished:
                    policy.observe_finished_row(row.drafted_one, row.accepted_one)
            running = [r for r in running if r not in finished]
            seconds += draft_s * (round_k > 0) + verify_s
            steps += 1
            last_k = round_k
    return seconds, steps


def _nearest(costs: Costs, batch: int) -> int:
    return min(costs, key=lambda b: (abs(b - batch), b))


class _Recording(SpeculationController):
    """The controller as it is, counting its decisions by (batch, k, reason)."""

    def __init__(self, config: SpeculationControllerConfig) -> None:
        super().__init__(config)
        self.decisions: Counter[tuple[int, int, str]] = Counter()

    def decide(self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None):
        d = super().decide(batch, tokens_left, rows)
        self.decisions[(batch, d.k, d.reason)] += 1
        return d


class _RandomK(SpeculationController):
    """Drafts a uniformly random k each step and learns from it like the controller: acceptance
    and costs of every width, without the bias of its own choices."""

    def __init__(self, config: SpeculationControllerConfig, seed: int) -> None:
        super().__init__(config)
        self._rng = random.Random(seed)

    def decide(self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None):
        self.last = SpeculationDecision(
            k=self._rng.randint(0, self.config.max_speculation_k), reason="probe", batch_size=batch
        )
        return self.last

    def may_draft(self, *args: object, **kwargs: object) -> bool:
        return True


def finish_seconds(costs: Costs, work: Workload, k: int, length: int, trials: int, rng: random.Random) -> float:
    """Mean seconds for one batch of the workload's rows (`rows` x its requests, all at output
    `length`) to finish under static k (drafts capped by each row's tokens left; a row stops at
    its request's end, or anywhere with probability `other_end`, or at the cap): the truth that
    the controller's price of k from this state (`SpeculationController.expected_rates`) is for."""
    max_speculation_k = max(costs[min(costs)])
    total = 0.0
    for _ in range(trials):
        rows = [_new_row(work, end, rng) for end in work.ends for _ in range(work.rows)]
        for row in rows:
            row.length = length
            if row.end < length:  # its stop position is behind it: it runs to the cap
                row.end = work.max_new_tokens
        while rows:
            left = [work.max_new_tokens - r.length for r in rows]
            row_k = [min(k, lf - 1) for lf in left]
            round_k = max(row_k)
            draft_s, verify_s = costs[_nearest(costs, len(rows))][min(round_k, max_speculation_k)]
            total += draft_s * (round_k > 0) + verify_s
            running = []
            for row, ke, lf in zip(rows, row_k, left, strict=True):
                _, n, stopped = _step(row, ke, lf, work, rng)
                row.length += n
                if not stopped and row.length < work.max_new_tokens:
                    running.append(row)
            rows = running
    return total / trials


def calibrate(
    costs: Costs,
    work: Workload,
    max_speculation_k: int,
    lefts: list[int],
    generations: int,
    trials: int,
    seed: int,
    noise: float,
) -> None:
    """Print, for a batch of the workload's rows all with `left` tokens to go, each static k's
    true speedup over plain to the batch's end (`finish_seconds`, Monte Carlo) next to the
    controller's price of it, after `generations` generations of random k taught it the
    workload's acceptance, stop positions and (noisy) costs."""
    policy = _RandomK(SpeculationControllerConfig(max_speculation_k=max_speculation_k), seed)
    simulate(costs, work, policy, generations, seed, noise)
    rng = random.Random(seed + 1)
    n = work.rows * len(work.ends)
    a = policy.acceptance
    click.echo(
        f"learnt: acceptance {' '.join(f'{x:.3f}' for x in a.rates())}, spread {a.spread():.3f}, "
        f"tokens per step {' '.join(f'{x:.3f}' for x in a.tokens_by_k(max_speculation_k))}"
    )
    click.echo(f"batch {n}; per k = 0..{max_speculation_k}: true speedup to the batch's end | the controller's price")
    for left in lefts:
        length = work.max_new_tokens - left
        seconds = [finish_seconds(costs, work, k, length, trials, rng) for k in range(max_speculation_k + 1)]
        rates = policy.expected_rates(n, left, [RowState(length, left)] * n)
        assert rates is not None
        true = " ".join(f"{seconds[0] / t:.3f}" for t in seconds)
        price = " ".join(f"{r / rates[0]:.3f}" for r in rates)
        click.echo(f"{left:4d} tokens left: {true} | {price}")


def measure(
    model: Path, batches: list[int], max_speculation_k: int, steps: int, rounds: int, prompt_tokens: int = 16
) -> tuple[Costs, float]:
    """(draft, verify) seconds per decode step of the real engine, per batch and k: the median over
    `rounds` passes (each the median of `steps` steps), so that one slow moment of the box does not
    become the modelled engine's truth; and the draft's prefill at admission, seconds per prompt
    token (the median over every batch size and round, prompts of `prompt_tokens`)."""
    import torch

    from sidecar.engine.torch_engine import TorchEngine
    from sidecar.types import GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    engine = TorchEngine.from_checkpoint(
        str(model), speculation_k=max_speculation_k, max_speculation_k=max_speculation_k, max_batch_size=64
    )
    policy = FixedK(max_speculation_k)
    engine.set_speculation_controller(policy)
    passes: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in range(rounds):
        for b in batches:
            for k in range(max_speculation_k + 1):
                policy.k = k
                policy.samples.clear()
                params = SamplingParams(temperature=1.0, max_new_tokens=(steps + 4) * (k + 1), seed=r)
                engine.submit(
                    GenerationRequest(
                        prompts=[[3, 4, 5, 6]], sampling=params, samples_per_prompt=b, request_id=f"m{r}-{b}-{k}"
                    )
                )
                while engine.has_work():
                    engine.step()
                if k == 1:  # the draft's prefill of a prompt of the workload's length
                    engine.generate(
                        GenerationRequest(
                            prompts=[list(range(3, 3 + prompt_tokens))],
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=2, seed=r),
                            samples_per_prompt=b,
                        )
                    )
                got = policy.samples.get((b, k), [])[2:]  # the first steps warm up (and catch up)
                passes.setdefault((b, k), []).append(
                    (statistics.median(d for d, _ in got) if k else 0.0, statistics.median(v for _, v in got))
                )
        click.echo(f"measured round {r + 1} of {rounds}", err=True)
    out: Costs = {}
    for (b, k), got in sorted(passes.items()):
        out.setdefault(b, {})[k] = (statistics.median(d for d, _ in got), statistics.median(v for _, v in got))
        click.echo(f"batch {b} k={k}: draft {1e3 * out[b][k][0]:.2f} ms, verify {1e3 * out[b][k][1]:.2f} ms", err=True)
    prefill = statistics.median(policy.prefill_samples)
    click.echo(f"draft prefill: {1e6 * prefill:.1f} us per prompt token", err=True)
    return out, prefill


def _setting(text: str) -> tuple[str, int | float]:
    name, _, value = text.partition("=")
    if not value:
        raise click.BadParameter(f"{text!r} is not NAME=VALUE")
    return name, int(value) if value.lstrip("-").isdigit() else float(value)


@click.command()
@click.option("--costs", "costs_path", type=click.Path(path_type=Path), required=True, help="Cost table (JSON).")
@click.option(
    "--measure", "model", type=click.Path(path_type=Path), help="Measure the cost table on this checkpoint first."
)
@click.option("--max-speculation-k", default=6, show_default=True)
@click.option("--generations", default=400, show_default=True, help="Generations per configuration and seed.")
@click.option("--seed", default=0, show_default=True)
@click.option("--seeds", default=1, show_default=True, help="Seeds seed .. seed + seeds - 1, each a whole replay.")
@click.option("--noise", default=0.05, show_default=True, help="Log-normal sd of each step's measured cost.")
@click.option("--drift", default=0.0, show_default=True, help="Sd of the box's load (log cost, every width alike).")
@click.option("--drift-steps", default=200.0, show_default=True, help="Time constant of the load, in steps.")
@click.option("--alphas", default="0.88,0.88,0.78,0.83,0.9,0.65", show_default=True)
@click.option("--spread", default=0.15, show_default=True)
@click.option("--ends", default="20,21", show_default=True, help="Stop-token position of each request's rows.")
@click.option("--rows", default=4, show_default=True, help="Rows per request.")
@click.option("--lag", default=1, show_default=True, help="Steps between requests.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Each row's length cap.")
@click.option("--prompt-tokens", default=16, show_default=True, help="Each row's prompt length.")
@click.option(
    "--prefill-per-token",
    type=float,
    help="Seconds of the draft's prefill per prompt token [default: the cost table's, else 0: not modelled].",
)
@click.option(
    "--set", "overrides", multiple=True, help="A controller setting for auto, NAME=VALUE (SpeculationControllerConfig)."
)
@click.option(
    "--calibrate",
    "lefts",
    help="Instead: the straggler price against the truth for a batch with these tokens left (e.g. 40,20,10,4).",
)
@click.option("--trials", default=2000, show_default=True, help="Monte Carlo batches per k and state (--calibrate).")
def main(
    costs_path: Path,
    model: Path | None,
    max_speculation_k: int,
    generations: int,
    seed: int,
    seeds: int,
    noise: float,
    drift: float,
    drift_steps: float,
    overrides: tuple[str, ...],
    lefts: str | None,
    trials: int,
    **w,
) -> None:
    """Static k = 0..max k and auto on one modelled workload; auto against the best static k."""
    if model is None and not costs_path.is_file():
        raise click.BadParameter(
            f"{costs_path} does not exist; measure it first with --measure CHECKPOINT", param_hint="--costs"
        )
    if model is not None:
        rows = w["rows"] * len(w["ends"].split(","))
        table, prefill = measure(model, list(range(1, rows + 1)), max_speculation_k, 12, 3, w["prompt_tokens"])
        saved = {PREFILL_KEY: prefill, **{b: {k: list(v) for k, v in t.items()} for b, t in table.items()}}
        costs_path.write_text(json.dumps(saved, indent=1))
    loaded = json.loads(costs_path.read_text())
    table_prefill = loaded.pop(PREFILL_KEY, 0.0)
    costs: Costs = {int(b): {int(k): (v[0], v[1]) for k, v in t.items()} for b, t in loaded.items()}
    work = Workload(
        alphas=[float(a) for a in w["alphas"].split(",")],
        spread=w["spread"],
        ends=[int(e) for e in w["ends"].split(",")],
        rows=w["rows"],
        lag=w["lag"],
        max_new_tokens=w["max_new_tokens"],
        prompt_tokens=w["prompt_tokens"],
        prefill_per_token=table_prefill if w["prefill_per_token"] is None else w["prefill_per_token"],
    )
    k_top = min(max_speculation_k, len(work.alphas))
    if lefts is not None:
        try:
            tokens = [int(x) for x in lefts.split(",")]
        except ValueError:
            raise click.BadParameter(
                f"{lefts!r} is not a comma-separated list of integers", param_hint="--calibrate"
            ) from None
        if not all(1 <= t <= work.max_new_tokens for t in tokens):
            raise click.BadParameter(f"tokens left must be in 1..{work.max_new_tokens}", param_hint="--calibrate")
        calibrate(costs, work, k_top, tokens, generations, trials, seed, noise)
        return
    settings = dict(_setting(o) for o in overrides)
    try:
        SpeculationControllerConfig(max_speculation_k=k_top, **settings)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--set") from None
    ratios = []
    for s in range(seed, seed + seeds):
        results = {}
        for k in range(k_top + 1):
            results[f"k={k}"] = simulate(costs, work, k, generations, s, noise, drift, drift_steps)
        policy = _Recording(SpeculationControllerConfig(max_speculation_k=k_top, **settings))
        results["auto"] = simulate(costs, work, policy, generations, s, noise, drift, drift_steps)
        plain = results["k=0"][0]
        best = min((v[0], name) for name, v in results.items() if name != "auto")
        ratios.append(best[0] / results["auto"][0])
        if s == seed:
            for name, (secs, n) in results.items():
                click.echo(f"{name:>5}: {secs:8.3f} s {n:6d} steps  {plain / secs:5.3f}x plain")
            click.echo("auto's decisions by batch (k and reason: m model, p probe, g guard):")
            for b in sorted({b for b, _, _ in policy.decisions}):
                shares = {f"{k}{r[0]}": n for (bb, k, r), n in sorted(policy.decisions.items()) if bb == b}
                click.echo(f"  {b}: {shares}")
        click.echo(f"seed {s}: auto / best static ({best[1]}) {ratios[-1]:.3f}")
    if seeds > 1:
        se = statistics.stdev(ratios) / math.sqrt(len(ratios))
        click.echo(f"auto / best static over {seeds} seeds: {statistics.mean(ratios):.4f} +- {se:.4f} (standard error)")


if __name__ == "__main__":
    main()
