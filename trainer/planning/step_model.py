"""A model of one RL step's time, with and without speculation, from explicit inputs.

Why: whether speculation pays depends on the batch (a verify of k + 1 tokens costs about a plain
step while decode is memory-bound, several once it is compute-bound), on acceptance per draft
position, and on how the batch drains: a step's generation lasts until its longest row is done,
so speculation's gain shrinks while the batch is full and grows again as it empties (the long
tail runs at batch 1-4). None of this is captured by the serving rule of thumb
tau / (1 + k c); so this module simulates the engine round by round.

One engine's generation (`simulate_engine`), per replication:
- each row's length L (tokens it emits; the first comes from the prefill) is drawn from the
  response-length distribution; each row needs L - 1 decode tokens;
- a decode round emits 1 + A tokens for a row, A = the accepted run of its k drafts, with
  P(A >= j) = prod_{i <= j} alpha_i (alpha_i: acceptance of position i given all before it
  accepted, optionally scaled per row by `Acceptance.spread`); drawn by inverse CDF from one
  uniform per (row, round), so that higher acceptance never takes a row more rounds on the
  same draws (the monotonicity the tests check);
- rows are admitted first come, first served into `max_batch_size` slots (continuous batching: a
  row waiting for a slot enters after the round in which another row ended, with its prefill);
- the engine's time is sum over rounds of cost(rows decoding, k, their KV tokens) plus the
  prefills, with the cost from a measured table or a roofline (`RoundCosts`).
The fleet's generation is the expected slowest of its engines plus the per-request overhead;
the step adds training, log-probs and weight sync (`StepInputs`); with a policy lag > 0 the
generation of later steps overlaps the training of earlier ones (`pipeline_step_seconds`).

What it leaves out is listed in `LEFT_OUT` and printed with every plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

LEFT_OUT = (
    "a round is priced at its full draft width k even when the rows' last tokens narrow it",
    "rows of an engine are independent: no prompt-level correlation of lengths or acceptance",
    "acceptance is one distribution for the whole step (no drift within a generation, no weight push mid-step)",
    "prefill is one cost per admission batch; chunked prefill mixed into decode rounds is not modelled",
    "no preemption, KV-cache eviction or recomputation when memory runs out",
    "the fleet gives every engine the busiest engine's row count; load imbalance beyond that is not modelled",
    "weight sync is bytes / bandwidth + latency; the draft's own training cost is inside the trainer's cost per token",
)


class RoundCosts(Protocol):
    """What one engine's rounds cost (a measured table or a roofline)."""

    description: str

    def round_seconds(self, batch: np.ndarray, k: int, kv_tokens: np.ndarray) -> np.ndarray:
        """Seconds of one decode round (k draft steps and a (k+1)-token verify; k = 0 is a plain
        step) at each entry's batch size (rows decoding, >= 1), their KV context summed in
        `kv_tokens`."""
        ...

    def prefill_seconds(self, rows: int, prompt_tokens: int) -> float:
        """Seconds of admitting `rows` rows of `prompt_tokens` each (one prefill forward)."""
        ...

    def request_seconds(self) -> float:
        """Fixed seconds per generation request (fan-out, RPC, streaming back)."""
        ...

    def leaves_out(self) -> list[str]:
        """What this cost model does not capture (printed with the plan)."""
        ...


@dataclass(kw_only=True, slots=True)
class Acceptance:
    """Acceptance per draft position."""

    alphas: tuple[float, ...]
    """P(draft position i accepted | positions 1..i-1 accepted), i = 1, 2, ...; a position beyond
    the last given takes the last value (stated in the plan's assumptions)."""
    spread: float = 0.0
    """Relative standard deviation of a row's acceptance around `alphas` (rows differ: the
    straggler effect); 0 = every row alike."""

    def __post_init__(self) -> None:
        if not self.alphas:
            raise ValueError("alphas is empty: give the acceptance of at least draft position 1")
        bad = [a for a in self.alphas if not 0.0 <= a <= 1.0 or math.isnan(a)]
        if bad:
            raise ValueError(f"acceptance per position must lie in [0, 1], got {list(self.alphas)}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"spread must lie in [0, 1] (a relative standard deviation), got {self.spread}")

    def alpha(self, position: int) -> float:
        """alpha of draft position `position` (1-based)."""
        return self.alphas[min(position, len(self.alphas)) - 1]

    def survival(self, k: int) -> np.ndarray:
        """P(A >= j) for j = 1..k: the chance that the first j drafts are all accepted."""
        return np.cumprod([self.alpha(j) for j in range(1, k + 1)]) if k else np.zeros(0)

    def tau(self, k: int) -> float:
        """Expected tokens per round of one row far from its end: 1 + sum_j P(A >= j) (the
        acceptance length, bonus token included)."""
        return 1.0 + float(self.survival(k).sum())

    @classmethod
    def from_cumulative(cls, rates: Sequence[float], spread: float = 0.0) -> Acceptance:
        """From P(first j drafts accepted), j = 1..n: what the sidecars' counters give
        (`accepted_per_position[j] / drafted_per_position[j]`, the trainer's `spec/accept_pos*`)."""
        alphas: list[float] = []
        prev = 1.0
        for r in rates:
            if prev <= 0.0:
                alphas.append(alphas[-1] if alphas else 0.0)
                continue
            alphas.append(min(max(r / prev, 0.0), 1.0))
            prev = r
        return cls(alphas=tuple(alphas), spread=spread)

    @classmethod
    def for_tau(cls, tau: float, k: int, spread: float = 0.0) -> Acceptance:
        """One alpha for every position such that the acceptance length at `k` is `tau`
        (tau = (1 - a^(k+1)) / (1 - a)); what a study reporting only tau gives."""
        if k < 1:
            raise ValueError(f"an acceptance length is measured at k >= 1 drafts, got k = {k}")
        if not 1.0 <= tau <= k + 1:
            raise ValueError(f"an acceptance length at k = {k} lies in [1, {k + 1}], got {tau}")
        lo, hi = 0.0, 1.0
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(mid**j for j in range(k + 1)) < tau else (lo, mid)
        return cls(alphas=(round((lo + hi) / 2, 9),), spread=spread)


@dataclass(kw_only=True, slots=True)
class LengthDistribution:
    """Response lengths (tokens a row emits), as a discrete distribution."""

    values: tuple[int, ...]
    weights: tuple[float, ...]
    label: str = ""

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.weights):
            raise ValueError(
                f"a length distribution needs as many weights as values, got {len(self.values)} and {len(self.weights)}"
            )
        if min(self.values) < 1:
            raise ValueError(f"response lengths must be >= 1 token, got {min(self.values)}")
        if min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError("length weights must be >= 0 and not all 0")

    @property
    def mean(self) -> float:
        w = np.asarray(self.weights)
        return float(np.dot(self.values, w) / w.sum())

    @property
    def max(self) -> int:
        return max(v for v, w in zip(self.values, self.weights, strict=True) if w > 0)

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=shape, p=w / w.sum())

    @classmethod
    def fixed(cls, length: int) -> LengthDistribution:
        return cls(values=(length,), weights=(1.0,), label=f"every row {length} tokens")

    @classmethod
    def from_quantiles(cls, quantiles: dict[float, float], label: str = "") -> LengthDistribution:
        """A piecewise-linear quantile function through {percentile: length}, which must include
        0 and 100 (what the trainer logs per step as `rollout/response_len_qNN`)."""
        qs = sorted(quantiles)
        if not qs or qs[0] != 0 or qs[-1] != 100:
            raise ValueError(f"length quantiles need the 0th and 100th percentiles, got {qs}")
        grid = (np.arange(400) + 0.5) / 4.0  # 400 equally likely percentiles
        vals = np.interp(grid, qs, [quantiles[q] for q in qs])
        return cls(values=tuple(int(max(round(v), 1)) for v in vals), weights=(1.0,) * 400, label=label)

    @classmethod
    def lognormal(cls, mean: float, cv: float, cap: int) -> LengthDistribution:
        """Log-normal lengths with this mean and coefficient of variation, rows reaching `cap`
        (max new tokens) stopping there: a long tail of reasoning rollouts."""
        if mean < 1 or cv < 0 or cap < 1:
            raise ValueError(f"lognormal lengths need mean >= 1, cv >= 0 and a cap >= 1, got {mean}, {cv}, {cap}")
        sigma = math.sqrt(math.log1p(cv * cv))
        mu = math.log(mean) - sigma * sigma / 2
        u = (np.arange(400) + 0.5) / 400
        from statistics import NormalDist

        z = np.array([NormalDist().inv_cdf(float(p)) for p in u])
        vals = np.minimum(np.exp(mu + sigma * z), cap)
        return cls(
            values=tuple(int(max(round(v), 1)) for v in vals),
            weights=(1.0,) * 400,
            label=f"lognormal mean {mean:g} cv {cv:g} capped at {cap}",
        )


@dataclass(kw_only=True, slots=True)
class EngineWorkload:
    """What one engine generates in one step."""

    rows: int
    lengths: LengthDistribution
    prompt_tokens: int
    max_batch_size: int
    """Rows decoded at once; rows beyond wait for a slot (continuous batching)."""
    row_lengths: tuple[int, ...] | None = None
    """The rows' lengths exactly, in admission order (instead of draws from `lengths`): what a
    validation against one measured generation conditions on."""

    def __post_init__(self) -> None:
        for name in ("rows", "prompt_tokens", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.row_lengths is not None and (len(self.row_lengths) != self.rows or min(self.row_lengths) < 1):
            raise ValueError(f"row_lengths must give {self.rows} lengths >= 1, got {self.row_lengths}")


@dataclass(kw_only=True, slots=True)
class EngineRuns:
    """Replications of one engine's generation at one k."""

    seconds: np.ndarray  # (replications,) prefills included
    rounds: np.ndarray  # (replications,) decode rounds
    tokens: np.ndarray  # (replications,) tokens emitted
    mean_batch: float  # rows per round, averaged over rounds


UNIFORM_BLOCK = 256
"""Rounds of uniforms drawn at once for every row: uniform (row, round) is the same whatever the
acceptance or k, so a higher acceptance never costs a row a round on the same seed."""


def rounds_needed(need: np.ndarray, survival: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Decode rounds for each row to emit `need[i]` tokens when a round emits 1 + A,
    P(A >= j) = survival[i, j-1] (rows, k). One uniform per (row, round): A = #{j: U < survival_j}."""
    rows, k = survival.shape
    if k == 0:
        return need.astype(np.int64).copy()
    out = np.zeros(rows, dtype=np.int64)
    emitted = np.zeros(rows, dtype=np.int64)
    done = need <= 0
    offset = 0
    while not done.all():
        u = rng.random((rows, UNIFORM_BLOCK))
        step = np.ones((rows, UNIFORM_BLOCK), dtype=np.int64)
        for j in range(k):
            step += u < survival[:, j : j + 1]
        total = emitted[:, None] + np.cumsum(step, axis=1)
        reached = total >= need[:, None]
        hit = reached.any(axis=1) & ~done
        out[hit] = offset + reached[hit].argmax(axis=1) + 1
        emitted = total[:, -1]
        done |= hit
        offset += UNIFORM_BLOCK
    return out


def simulate_engine(
    work: EngineWorkload,
    acceptance: Acceptance | None,
    k: int,
    costs: RoundCosts,
    replications: int = 64,
    seed: int = 0,
) -> EngineRuns:
    """Replications of one engine's generation at draft length `k` (see the module docstring).
    The same seed draws the same lengths and uniforms for every k and every acceptance."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k > 0 and acceptance is None:
        raise ValueError("k > 0 needs an acceptance per draft position")
    if replications < 1:
        raise ValueError(f"replications must be >= 1, got {replications}")
    rng = np.random.default_rng(seed)
    n = work.rows
    seconds, rounds_out, tokens = np.zeros(replications), np.zeros(replications), np.zeros(replications)
    batch_rounds = total_rounds = 0.0
    for rep in range(replications):
        drawn = work.lengths.sample(rng, (n,))  # drawn either way: the same seed, the same uniforms after
        lengths = np.array(work.row_lengths, dtype=np.int64) if work.row_lengths is not None else drawn
        spread_z = rng.standard_normal(n)
        row_rng = np.random.default_rng(rng.integers(2**63))
        survival: np.ndarray = np.zeros((n, 0))
        if k and acceptance is not None:
            base = np.array([acceptance.alpha(j) for j in range(1, k + 1)])
            scale = np.clip(1.0 + acceptance.spread * spread_z, 0.0, None)
            survival = np.cumprod(np.clip(base[None, :] * scale[:, None], 0.0, 1.0), axis=1)
        need = lengths - 1
        r = rounds_needed(need, survival, row_rng)
        start = admission_rounds(r, work.max_batch_size)
        end = start + r
        horizon = int(end.max()) + 2
        alive = np.zeros(horizon)
        const = np.zeros(horizon)
        slope = np.zeros(horizon)
        dec = r > 0
        s_j = np.where(dec, need / np.maximum(r, 1), 0.0)  # tokens per round, linear progress
        a_j = work.prompt_tokens + 1 - s_j * (start + 1)
        np.add.at(alive, start[dec] + 1, 1.0)
        np.add.at(alive, end[dec] + 1, -1.0)
        np.add.at(const, start[dec] + 1, a_j[dec])
        np.add.at(const, end[dec] + 1, -a_j[dec])
        np.add.at(slope, start[dec] + 1, s_j[dec])
        np.add.at(slope, end[dec] + 1, -s_j[dec])
        b = np.cumsum(alive)
        kv = np.cumsum(const) + np.cumsum(slope) * np.arange(horizon)
        on = b > 0.5
        decode = float(costs.round_seconds(b[on], k, np.maximum(kv[on], 0.0)).sum()) if on.any() else 0.0
        admits, counts = np.unique(start, return_counts=True)
        prefill = sum(costs.prefill_seconds(int(c), work.prompt_tokens) for c in counts) if admits.size else 0.0
        seconds[rep] = decode + prefill
        rounds_out[rep] = float(on.sum())
        tokens[rep] = float(lengths.sum())
        batch_rounds += float(b[on].sum())
        total_rounds += float(on.sum())
    return EngineRuns(
        seconds=seconds, rounds=rounds_out, tokens=tokens, mean_batch=batch_rounds / max(total_rounds, 1.0)
    )


def admission_rounds(rounds: np.ndarray, slots: int) -> np.ndarray:
    """The round after which each row starts decoding, first come first served into `slots`
    slots: the first `slots` rows start at 0, each later one when the earliest slot frees."""
    n = rounds.shape[0]
    start = np.zeros(n, dtype=np.int64)
    if n <= slots:
        return start
    free = [int(x) for x in rounds[:slots]]
    heapq.heapify(free)
    for i in range(slots, n):
        t = heapq.heappop(free)
        start[i] = t
        heapq.heappush(free, t + int(rounds[i]))
    return start


def expected_max(samples: np.ndarray, n: int) -> float:
    """E[max of n independent draws] from the empirical distribution of `samples`."""
    x = np.sort(np.asarray(samples, dtype=float))
    m = x.size
    cdf = np.arange(1, m + 1) / m
    weights = cdf**n - np.concatenate([[0.0], cdf[:-1]]) ** n
    return float(np.dot(x, weights))


@dataclass(kw_only=True, slots=True)
class EngineSplit:
    """How a step's rows reach the engines."""

    prompts: int
    samples_per_prompt: int
    engines: int = 1
    max_batch_size: int = 256
    prompt_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("prompts", "samples_per_prompt", "engines", "max_batch_size", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def rows_per_engine(self) -> int:
        """The busiest engine's rows: prompts go round-robin, each with all its samples."""
        return math.ceil(self.prompts / self.engines) * self.samples_per_prompt

    def workload(self, lengths: LengthDistribution) -> EngineWorkload:
        return EngineWorkload(
            rows=self.rows_per_engine,
            lengths=lengths,
            prompt_tokens=self.prompt_tokens,
            max_batch_size=self.max_batch_size,
        )


@dataclass(kw_only=True, slots=True)
class Generation:
    """A step's generation at one k, over the fleet."""

    k: int
    seconds: float
    engine_seconds: np.ndarray
    tau: float
    mean_batch: float
    tokens: float


def generation(
    fleet: EngineSplit,
    lengths: LengthDistribution,
    acceptance: Acceptance | None,
    k: int,
    costs: RoundCosts,
    replications: int = 64,
    seed: int = 0,
) -> Generation:
    """Expected seconds of one generation over the fleet: the slowest engine plus the request's overhead."""
    runs = simulate_engine(fleet.workload(lengths), acceptance, k, costs, replications, seed)
    return Generation(
        k=k,
        seconds=expected_max(runs.seconds, fleet.engines) + costs.request_seconds(),
        engine_seconds=runs.seconds,
        tau=acceptance.tau(k) if acceptance is not None and k else 1.0,
        mean_batch=runs.mean_batch,
        tokens=float(runs.tokens.mean()) * fleet.engines,
    )


def fleet_step_samples(engine_seconds: np.ndarray, engines: int, steps: int, seed: int = 0) -> np.ndarray:
    """Per-step generation seconds of a fleet: the slowest of `engines` draws from one engine's replications."""
    rng = np.random.default_rng(seed)
    return rng.choice(engine_seconds, size=(steps, engines)).max(axis=1)


@dataclass(kw_only=True, slots=True)
class StepInputs:
    """The rest of an RL step (seconds), beside generation."""

    train_seconds: float
    """Log-prob recomputation and the policy (and draft) update of one step."""
    weight_sync_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.train_seconds < 0 or self.weight_sync_seconds < 0:
            raise ValueError(
                f"step times must be >= 0, got train {self.train_seconds} and sync {self.weight_sync_seconds}"
            )

    @classmethod
    def from_share(cls, plain_generation: float, share: float, weight_sync_seconds: float = 0.0) -> StepInputs:
        """The rest of the step such that plain generation is `share` of a synchronous plain step
        (what a study reporting a generation share gives)."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a generation share lies in (0, 1], got {share}")
        rest = plain_generation * (1.0 - share) / share
        return cls(train_seconds=max(rest - weight_sync_seconds, 0.0), weight_sync_seconds=weight_sync_seconds)


def pipeline_step_seconds(
    generations: np.ndarray, train_seconds: float, sync_seconds: float, lag: int, steps: int = 400
) -> tuple[float, float]:
    """Mean seconds per RL step and the generation time the trainer waits for (exposed),
    when generation may run `lag` weight versions ahead of training (0: synchronous).

    Generation of step t starts when the generator is free and the weights of step t - 1 - lag
    are trained and pushed; training of step t starts when its rollouts and the previous update
    are done. `generations`: per-step generation seconds, cycled (their spread matters at lag 1).
    Lag 0 gives generation + train + sync exactly."""
    if lag < 0:
        raise ValueError(f"the policy lag must be >= 0, got {lag}")
    g = np.resize(np.asarray(generations, dtype=float), steps)
    gen_end = np.zeros(steps)
    ready = np.zeros(steps)  # weights after step t trained and pushed
    prev_gen_end = prev_ready = 0.0
    for t in range(steps):
        weights = ready[t - 1 - lag] if t - 1 - lag >= 0 else 0.0
        start = max(prev_gen_end, weights)
        gen_end[t] = start + g[t]
        ready[t] = max(gen_end[t], prev_ready) + train_seconds + sync_seconds
        prev_gen_end, prev_ready = gen_end[t], ready[t]
    warm = steps // 4
    per_step = (ready[-1] - ready[warm]) / (steps - 1 - warm)
    exposed = max(per_step - train_seconds - sync_seconds, 0.0)
    return float(per_step), float(exposed)


@dataclass(kw_only=True, slots=True)
class KPlan:
    """The prediction for one k."""

    k: int
    generation: float
    step: float
    exposed_generation: float
    tau: float
    generation_speedup: float = 1.0
    step_speedup: float = 1.0
    mean_batch: float = 0.0


@dataclass(kw_only=True, slots=True)
class Plan:
    """Predictions per k, plain (k = 0) first."""

    ks: list[KPlan] = field(default_factory=list)
    lag: int = 0

    @property
    def plain(self) -> KPlan:
        return self.ks[0]

    @property
    def best(self) -> KPlan:
        return min(self.ks, key=lambda p: (p.step, p.k))


def plan_step(
    fleet: EngineSplit,
    lengths: LengthDistribution,
    acceptance: Acceptance | None,
    ks: Sequence[int],
    costs: RoundCosts,
    rest: StepInputs | float,
    lag: int = 0,
    replications: int = 64,
    seed: int = 0,
) -> Plan:
    """Generation and step time per k (plain always included). `rest`: the non-generation
    phases, or a generation share of the synchronous plain step to derive them from."""
    order = sorted({0, *ks})
    gens = {k: generation(fleet, lengths, acceptance, k, costs, replications, seed) for k in order}
    inputs = rest if isinstance(rest, StepInputs) else StepInputs.from_share(gens[0].seconds, float(rest))
    plan = Plan(lag=lag)
    for k in order:
        g = gens[k]
        per_step_gen = fleet_step_samples(g.engine_seconds, fleet.engines, 400, seed) + costs.request_seconds()
        if lag:
            step, exposed = pipeline_step_seconds(per_step_gen, inputs.train_seconds, inputs.weight_sync_seconds, lag)
        else:
            step, exposed = g.seconds + inputs.train_seconds + inputs.weight_sync_seconds, g.seconds
        plan.ks.append(
            KPlan(k=k, generation=g.seconds, step=step, exposed_generation=exposed, tau=g.tau, mean_batch=g.mean_batch)
        )
    base = plan.plain
    for p in plan.ks:
        p.generation_speedup = base.generation / p.generation
        p.step_speedup = base.step / p.step
    return plan
