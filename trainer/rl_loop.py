"""The RL loop: generate → score → recompute log-probs → update policy and draft → push weights.

Reads like the algorithm (README, "How speculation works in RL"); every mechanism lives in the
module named after it: sidecar fan-out and fault handling in `sidecar.client.fleet`, local
sidecar processes in `trainer.local_sidecars`, the policy and its optimizers in
`trainer.policy`, the GRPO/DAPO loss in `trainer.losses`, the run directory in `trainer.run_dir`.

Each step records the timing breakdown of the reference study's table (weight sync, generation,
log-probs, training), the reward, and acceptance figures computed from the sidecars' raw counters
(τ = generated tokens per verify step, acceptance rate, acceptance per draft position). The
loop makes one update per rollout batch, so the PPO ratio's denominator is the current policy's
log-probs: unless `separate_logprob_pass` is set they come, detached, from the training forward
itself and the "log-probs" phase costs nothing. With
`rollout.measure_plain`, the step's prompts are generated once more with speculation off on the
same weights, so the speedup is measured side by side in the same run.

With `rollout.max_policy_lag` > 0 (asynchronous RL) rank 0 generates in a producer thread
(`trainer.rollout_pipeline`) while earlier steps train: `next_batch` takes the step's rollout,
regenerates any group older than the bound, and packs an off-policy batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from sidecar.client.fleet import Fleet, FleetConfig, derive_seed
from sidecar.config_io import to_mapping, write_yaml
from sidecar.model.model import ModelConfig
from sidecar.serve_config import ServeConfig
from sidecar.types import GenerationRequest, Sample, SamplingParams
from trainer.dynamic_sampling import Group, Selection, group_samples, select_groups, shaped_rewards
from trainer.export import EXPORT_DIR, export_policy
from trainer.local_sidecars import LocalSidecars
from trainer.losses import OverlongConfig, mismatch_metrics, sample_advantages
from trainer.policy import Policy, TrainBatch
from trainer.preflight import announce_task, check_sidecars, preflight
from trainer.ranks import (
    RankWatchdog,
    drain_export,
    is_leader,
    join_torchrun_group,
    multi_process,
    on_leader,
    share,
)
from trainer.reference import ReferencePolicy
from trainer.rl_config import RLConfig
from trainer.rollout_pipeline import RolloutPipeline
from trainer.run_dir import RunDir
from trainer.step_metrics import StepTimes, length_quantiles, reward_metric_name, speculation_metrics
from trainer.tasks import Problem, Task, distinct_problems, prompt_ids, score_completions
from trainer.tokenizer import Tokenizer
from trainer.trackers import open_trackers

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Run:
    """What a step needs: the config, policy, sidecars, task and tokenizer."""

    cfg: RLConfig
    policy: Policy
    sidecars: Fleet | None
    """The fleet; None on the ranks > 0 of a multi-process run (only rank 0 talks to sidecars)."""
    task: Task
    tokenizer: Tokenizer
    run_dir: RunDir
    reference: ReferencePolicy | None = None
    """The frozen reference policy of the KL penalty (when algorithm.kl_coef > 0)."""
    generating: threading.Lock = field(default_factory=threading.Lock)
    """Held while a step's rollout or an evaluation generates (rank 0): with generation running
    ahead in a thread of its own, an evaluation waits for the batch in progress, so neither's
    speculation counters take in the other's decoding."""

    @property
    def leader(self) -> bool:
        """Rank 0 (or a single process): generates, rewards, pushes, evaluates and writes the run."""
        return is_leader()

    @property
    def fleet(self) -> Fleet:
        if self.sidecars is None:
            raise RuntimeError("only rank 0 talks to the sidecars")
        return self.sidecars


STALE_SEED_BASE = 1_000
"""Regenerated groups draw seeds derive_seed(run seed, step, STALE_SEED_BASE + group): apart
from the step's own rounds (0 .. refill_rounds)."""


@dataclass(kw_only=True, slots=True)
class Rollout:
    """Rank 0: one step's generated and rewarded groups, before they become its batch."""

    step: int
    groups: list[Group]
    """`select_groups`' choice: informative groups first, padded with masked ones."""
    informative: int
    metrics: dict[str, float]
    """Reward, refill and speculation metrics of the step."""
    times: StepTimes
    """Generation and refill seconds (the trainer adds its own phases)."""
    events: list[str]
    """What went wrong on the way (re-routes, short steps), logged with the step."""


def policy_config(cfg: RLConfig) -> Policy.Config:
    """The policy's config from the run config: every `Policy.Config` field has a run-config key."""
    return Policy.Config(
        tensor_parallel=cfg.train.tensor_parallel,
        data_parallel=cfg.train.data_parallel,
        seed=cfg.seed,
        temperature=cfg.rollout.temperature,
        grpo=cfg.algorithm,
        optimizer=cfg.optimizer,
        clip_grad=cfg.train.clip_grad,
        draft=cfg.draft,
        micro_batch_rows=cfg.train.micro_batch_rows,
        lr_schedule=cfg.train.lr_schedule,
        total_updates=cfg.steps * cfg.train.updates_per_batch,
    )


def build_policy(cfg: RLConfig) -> Policy:
    if cfg.draft.eagle3 is None:
        return Policy.from_checkpoint(cfg.model, policy_config(cfg))
    from sidecar.model.checkpoint import load_checkpoint
    from sidecar.model.eagle3_checkpoint import load_eagle3_draft

    model_config, tensors = load_checkpoint(cfg.model)
    draft = load_eagle3_draft(cfg.draft.eagle3, target=model_config)
    return Policy(model_config, policy_config(cfg), tensors, eagle3=draft)


def local_serve_config(cfg: RLConfig) -> ServeConfig:
    """What the run's local sidecars serve with: `sidecars.serve`, with the k of the rollouts and
    the run's EAGLE-3 draft (the keys the trainer owns, `rl_config.TRAINER_OWNED`)."""
    serve = cfg.sidecars.serve
    engine = dataclasses.replace(
        serve.engine,
        speculation_k=cfg.rollout.speculation_k,
        speculation_auto=cfg.rollout.speculation_auto,
        draft=cfg.draft.eagle3,
    )
    return dataclasses.replace(serve, engine=engine)


@contextlib.contextmanager
def sidecar_fleet(cfg: RLConfig, run_dir: Path) -> Iterator[tuple[Fleet, LocalSidecars | None]]:
    """The run's sidecars: local subprocesses (torn down on exit) or the given addresses, all
    reached with the run's credentials (`sidecars.security`; local sidecars get its token)."""
    local = None
    client = cfg.sidecars.client_config()
    client = dataclasses.replace(
        client,
        transports=cfg.sidecars.weight_transport.transport_config(),
        sparse_deltas=cfg.sidecars.weight_transport.sparse_deltas,
    )
    if cfg.sidecars.local:
        local = LocalSidecars(
            cfg.model,
            int(cfg.sidecars.local),
            run_dir / "logs",
            serve=local_serve_config(cfg),
            threads=cfg.sidecars.threads,
            startup_timeout_s=cfg.sidecars.startup_timeout_s,
            devices=cfg.sidecars.devices,
            token=client.token,
        )
    with contextlib.ExitStack() as stack:
        if local is not None:
            stack.enter_context(local)
            addresses = local.start()
        else:
            addresses = list(cfg.sidecars.addresses)
        fleet = stack.enter_context(Fleet(addresses, FleetConfig(client=client, deadline_s=cfg.rollout.deadline_s)))
        yield fleet, local


def logprobs_in_micro_batches(policy: Policy, tokens: Tensor, rows: int) -> Tensor:  # (B, S) -> (B, S-1)
    """The policy's log-probs of `tokens`, `rows` samples per forward (0: all at once), on CPU."""
    size = rows or tokens.shape[0]
    return torch.cat([policy.logprobs(part).cpu() for part in tokens.split(size)])


def latest_checkpoint(checkpoints: Path) -> tuple[int, Path] | None:
    """The newest `step_N` directory under `checkpoints`, with N."""
    steps = [(int(m.group(1)), p) for p in checkpoints.glob("step_*") if (m := re.match(r"step_(\d+)$", p.name))]
    return max(steps) if steps else None


def evaluate(run: Run, size: int) -> tuple[float, float]:
    """Mean reward of greedy completions on a fixed held-out set (same problems every time, no
    problem twice), and its standard error (sample std / sqrt(n)): a change smaller than ~2
    standard errors is noise."""
    problems = distinct_problems(run.task, random.Random(1_000_003 + run.cfg.seed), "eval", size)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=run.cfg.rollout.max_new_tokens, stop_token_ids=(run.tokenizer.eos_id,)
    )
    prompts = [prompt_ids(run.task, run.tokenizer, p) for p in problems]
    request = GenerationRequest(prompts=prompts, sampling=sampling, speculation_k=run.cfg.rollout.request_k)
    with run.generating:
        samples = run.fleet.generate(request).samples
    rewards, _ = score_completions(
        run.task, [problems[s.prompt_index] for s in samples], [run.tokenizer.decode(s.token_ids) for s in samples]
    )
    return mean_and_stderr(rewards)


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Sample mean and its standard error (Bessel-corrected std / sqrt(n); 0 for n < 2)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate_logged(run: Run, progress: bool = False) -> dict[str, float]:
    """`evaluate` as metrics (reward/eval_mean, reward/eval_stderr), announced as a phase."""
    with phase(f"evaluating on {run.cfg.eval_size} held-out problems", progress):
        mean, stderr = evaluate(run, run.cfg.eval_size)
    return {"reward/eval_mean": mean, "reward/eval_stderr": stderr}


def _sampling(run: Run, step: int, round_: int) -> SamplingParams:
    ro = run.cfg.rollout
    return SamplingParams(
        temperature=ro.temperature,
        max_new_tokens=ro.max_new_tokens,
        stop_token_ids=(run.tokenizer.eos_id,),
        seed=derive_seed(run.cfg.seed, step, round_) if round_ else derive_seed(run.cfg.seed, step),
    )


def _score(run: Run, problems: list[Problem], prompts: list[list[int]], samples: list[Sample]) -> list[Group]:
    """Group the samples by prompt and reward them (task reward + configured overlong shaping)."""
    cfg = run.cfg
    overlong = (
        OverlongConfig(
            max_len=cfg.rollout.max_new_tokens,
            buffer_len=cfg.reward.overlong_buffer_len,
            penalty=cfg.reward.overlong_penalty,
        )
        if cfg.reward.overlong_buffer_len
        else None
    )
    groups = []
    for problem, prompt, group in zip(
        problems, prompts, group_samples(prompts, samples, cfg.rollout.samples_per_prompt), strict=True
    ):
        totals, parts = score_completions(
            run.task, [problem] * len(group), [run.tokenizer.decode(s.token_ids) for s in group]
        )
        task = torch.tensor(totals)
        lengths = torch.tensor([len(s.token_ids) for s in group])
        groups.append(
            Group(
                prompt=prompt,
                samples=group,
                rewards=shaped_rewards(task, lengths, overlong),
                task_rewards=task,
                problem=problem,
                reward_terms={name: torch.tensor(values) for name, values in parts.items()},
            )
        )
    return groups


def rl_step(run: Run, step: int, rollouts: RolloutPipeline[Rollout] | None) -> dict[str, float]:
    """One RL step; returns its metrics (on every rank: rank 0's).

    `rollouts` (rank 0; None on the other ranks): where the step's batch comes from, for every lag
    (`rollout_pipeline`: at lag 0 its `take` generates the batch there and then, the synchronous
    loop; at lag L > 0 a producer thread runs up to L steps ahead). Multi-process (torchrun): rank 0
    generates and rewards, every rank gets the same batch and its data-parallel replica trains a
    token-balanced share of it on its tensor-parallel shard (`Policy.backward`); the ranks of
    replica 0 take part in the weight export (a collective) while rank 0 streams it to the
    sidecars."""
    cfg = run.cfg
    metrics: dict[str, float] = {}
    times = StepTimes()
    batch = share(next_batch(run, step, rollouts, metrics, times) if run.leader else None)
    assert batch is not None

    # 3. log-prob recomputation with the trainer's policy (the PPO ratio's denominator): in a
    #    pass of its own, or (default) taken detached from the training forward of step 4; and
    #    the frozen reference's log-probs when the KL penalty is on
    #    (several updates per batch always take the separate pass: after the first update the
    #    training forward no longer computes the sampling policy's log-probs)
    t = time.perf_counter()
    updates = cfg.train.updates_per_batch
    if cfg.separate_logprob_pass or updates > 1:
        batch.old_logprobs = logprobs_in_micro_batches(run.policy, batch.tokens, cfg.train.micro_batch_rows)
    if run.reference is not None:
        size = cfg.train.micro_batch_rows or batch.tokens.shape[0]
        batch.ref_logprobs = torch.cat([run.reference.logprobs(part).cpu() for part in batch.tokens.split(size)])
    times.logprobs = time.perf_counter() - t

    # 4. policy and draft update(s)
    t = time.perf_counter()
    trained = run.policy.train_updates(
        batch, epochs=cfg.train.epochs, mini_batches=cfg.train.mini_batches, seed=cfg.seed * 7919 + step
    )
    metrics.update({f"train/{k}": v for k, v in trained.items()})
    times.train = time.perf_counter() - t
    if batch.old_logprobs is not None:  # the sampling policy's log-probs, before any update
        where = batch.generated if batch.generated is not None else batch.mask
        mismatch = mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, where)  # type: ignore[arg-type]
        metrics.update({f"train/{k}": v for k, v in mismatch.items()})
    metrics["mismatch/logprob_abs_max"] = metrics["train/mismatch_logprob_abs_max"]

    # 5. push target + draft to every sidecar (version + 1); the export gathers tensor-parallel
    #    shards, so every rank walks it
    if run.leader:
        times.weight_push = run.fleet.push_weights(
            run.policy.export_named_tensors, names=run.policy.export_names()
        ).seconds
        metrics["weights/version"] = float(run.fleet.version)
        assert rollouts is not None  # `next_batch` took this step's batch from it
        rollouts.trained(step)  # the batch `max_policy_lag` steps ahead may start
        if cfg.rollout.max_policy_lag:  # the producer generates without bringing sidecars back
            events: list[str] = []  # (a rejoin pushes the trainer's weights: only between updates)
            run.fleet.rejoin(events, force=False)
            if events:
                log.warning("step %d: %s", step, "; ".join(events))
    else:
        drain_export(run.policy)

    # refill rounds count as the same cost on both sides of the step speedup (conservative: they
    # are speculative here and would be plain without speculation)
    if run.leader:
        metrics.update(times.metrics(overlapped=cfg.rollout.max_policy_lag > 0))
    shared = share(metrics if run.leader else None)
    assert shared is not None
    return shared


def gather_rollout(run: Run, step: int) -> Rollout:
    """Steps 1-2 (rank 0): generate, reward and refill one step's groups. Runs in the rollout
    producer's thread when `rollout.max_policy_lag` > 0 (while earlier steps train); it holds
    `run.generating`, so an evaluation's generations never mix into its counters."""
    with run.generating:
        metrics: dict[str, float] = {}
        times = StepTimes()
        events: list[str] = []
        chosen = _gather(run, step, metrics, times, events)
    return Rollout(
        step=step, groups=chosen.groups, informative=chosen.informative, metrics=metrics, times=times, events=events
    )


def _gather(run: Run, step: int, metrics: dict[str, float], times: StepTimes, events: list[str]) -> Selection:
    cfg, ro = run.cfg, run.cfg.rollout
    rejoin = not ro.max_policy_lag  # asynchronous: the trainer brings sidecars back between updates
    rng = random.Random(cfg.seed * 1_000_003 + step)
    problems: list[Problem] = [run.task.sample(rng, "train") for _ in range(ro.prompts_per_step)]
    prompts = [prompt_ids(run.task, run.tokenizer, p) for p in problems]
    sampling = _sampling(run, step, 0)

    def rollout_request(k: int | None) -> GenerationRequest:
        return GenerationRequest(
            prompts=prompts, sampling=sampling, samples_per_prompt=ro.samples_per_prompt, speculation_k=k
        )

    # 1. generate across the pool (G samples per prompt), speculatively
    run.fleet.speculation_delta()  # baseline of the raw counters
    plain_first = ro.measure_plain and step % 2 == 1  # alternate the order of the side-by-side passes
    if plain_first:
        times.generation_plain = run.fleet.generate(rollout_request(0), rejoin=rejoin).seconds
        run.fleet.speculation_delta()
    rollout = run.fleet.generate(rollout_request(ro.request_k), rejoin=rejoin)
    counters = run.fleet.speculation_delta()
    if ro.measure_plain and not plain_first:
        times.generation_plain = run.fleet.generate(rollout_request(0), rejoin=rejoin).seconds
    samples = rollout.samples
    times.generation = rollout.seconds
    metrics["rollout/rerouted"] = float(rollout.rerouted)
    metrics["rollout/duplicates"] = float(rollout.duplicates)
    metrics["rollout/regenerated"] = float(rollout.regenerated)
    metrics["rollout/samples_nonfinite"] = float(rollout.nonfinite)  # the fleet warned, naming the sidecars
    metrics["rollout/weight_version"] = float(min(s.weight_version for s in samples))
    metrics["rollout/response_len"] = sum(len(s.token_ids) for s in samples) / len(samples)
    metrics.update(length_quantiles([len(s.token_ids) for s in samples]))
    events += rollout.events

    # 2. rewards (with overlong shaping); DAPO dynamic sampling refills groups whose rewards are
    #    all equal with fresh prompts, for at most rollout.refill_rounds rounds
    first = _score(run, problems, prompts, samples)
    metrics["reward/train_mean"] = float(torch.stack([g.task_rewards for g in first]).mean())
    for name in first[0].reward_terms:  # a task with several reward terms: each one's mean
        metrics[f"reward/{reward_metric_name(name)}_mean"] = float(
            torch.stack([g.reward_terms[name] for g in first]).mean()
        )
    if cfg.reward.overlong_buffer_len:
        metrics["reward/overlong_penalty_mean"] = float(torch.stack([g.rewards - g.task_rewards for g in first]).mean())
    metrics["rollout/kept_fraction_first_round"] = sum(g.informative for g in first) / len(first)
    refills: list[Group] = []
    rounds = 0
    refill_seconds = 0.0
    while cfg.algorithm.filter_equal_groups and rounds < ro.refill_rounds:
        missing = ro.prompts_per_step - sum(g.informative for g in first + refills)
        if missing <= 0:
            break
        rounds += 1
        more = [run.task.sample(rng, "train") for _ in range(missing)]
        more_prompts = [prompt_ids(run.task, run.tokenizer, p) for p in more]
        run.fleet.speculation_delta()
        extra = run.fleet.generate(
            GenerationRequest(
                prompts=more_prompts,
                sampling=_sampling(run, step, rounds),
                samples_per_prompt=ro.samples_per_prompt,
                speculation_k=ro.request_k,
            ),
            rejoin=rejoin,
        )
        counters.add(run.fleet.speculation_delta())
        refill_seconds += extra.seconds
        events += extra.events
        refills += _score(run, more, more_prompts, extra.samples)
    metrics.update(speculation_metrics(counters))
    metrics["spec/draft_collapsed"] = float(len(run.fleet.draft_collapses()))  # sidecars whose draft collapsed
    events += run.fleet.take_draft_alarms()  # each collapse once, with its sidecar and weight version
    chosen = select_groups(first, refills, ro.prompts_per_step, cfg.algorithm.filter_equal_groups)
    metrics["rollout/refill_rounds"] = float(rounds)
    metrics["rollout/refill_prompts"] = float(len(refills))  # prompts generated by the refill rounds
    metrics["rollout/refilled_groups"] = float(sum(g.informative for g in refills))
    metrics["rollout/kept_fraction"] = chosen.informative / ro.prompts_per_step
    times.refill = refill_seconds
    if cfg.algorithm.filter_equal_groups and ro.refill_rounds and chosen.informative < ro.prompts_per_step:
        events.append(
            f"dynamic sampling found {chosen.informative} of {ro.prompts_per_step} informative groups after "
            f"{rounds} refill round(s); the rest stay masked out (raise rollout.refill_rounds)"
        )
    return chosen


def rollout_pipeline(run: Run, first: int, last: int | None = None) -> RolloutPipeline[Rollout]:
    """Rank 0's rollouts for steps first..last-1 (default: to the run's end) at the run's
    `rollout.max_policy_lag`: one path for every lag (lag 0 runs no thread)."""
    return RolloutPipeline(
        lambda s: gather_rollout(run, s),
        first=first,
        last=run.cfg.steps if last is None else last,
        max_lag=run.cfg.rollout.max_policy_lag,
    )


def next_batch(
    run: Run, step: int, rollouts: RolloutPipeline[Rollout] | None, metrics: dict[str, float], times: StepTimes
) -> TrainBatch:
    """Rank 0: the step's rollout from `rollouts`, its groups regenerated where the lag bound is
    broken, packed into the batch; adds the metrics, and the rollout's times to `times`."""
    if rollouts is None:
        raise ValueError("rank 0 takes its batches from a rollout pipeline (`rollout_pipeline`), at every lag")
    taken = rollouts.take(step)
    rollout, waited, gated = taken.value, taken.waited_s, taken.gated_s
    metrics.update(rollout.metrics)
    times.generation, times.generation_plain, times.refill = (
        rollout.times.generation,
        rollout.times.generation_plain,
        rollout.times.refill,
    )
    times.wait_generation, times.wait_weights = waited, gated
    events = list(rollout.events)
    t = time.perf_counter()
    metrics["rollout/stale_regenerated"] = float(refresh_stale_groups(run, rollout, events))
    times.stale_regeneration = time.perf_counter() - t
    lags = [run.fleet.version - s.weight_version for g in rollout.groups for s in g.samples]
    metrics["rollout/policy_lag_mean"] = sum(lags) / len(lags)
    metrics["rollout/policy_lag_max"] = float(max(lags))
    if events:
        log.warning("step %d: %s", step, "; ".join(events))
    return pack_batch(run, rollout)


def refresh_stale_groups(run: Run, rollout: Rollout, events: list[str]) -> int:
    """Regenerate, from the served weights, every group with a sample whose first token came from
    a version more than `rollout.max_policy_lag` behind the trainer's; returns how many samples
    were regenerated. (The producer starts a batch only within the bound and asks the sidecars
    for at least the fleet's version, so this is the guard against a sidecar that served older
    weights than it was asked for, not the normal path.) Raises if a fresh generation is stale too."""
    cfg = run.cfg
    bound = run.fleet.version - cfg.rollout.max_policy_lag
    regenerated = 0
    for n, group in enumerate(rollout.groups):
        behind = run.fleet.version - min(s.weight_version for s in group.samples)
        if behind <= cfg.rollout.max_policy_lag:
            continue
        assert group.problem is not None
        sampling = dataclasses.replace(
            _sampling(run, rollout.step, 0), seed=derive_seed(cfg.seed, rollout.step, STALE_SEED_BASE + n)
        )
        fresh = run.fleet.generate(
            GenerationRequest(
                prompts=[group.prompt],
                sampling=sampling,
                samples_per_prompt=cfg.rollout.samples_per_prompt,
                speculation_k=cfg.rollout.request_k,
                min_weight_version=bound,
            )
        )
        oldest = min(s.weight_version for s in fresh.samples)
        if oldest < bound:
            raise RuntimeError(
                f"step {rollout.step}: regenerated samples still came from weight version {oldest}, more than "
                f"rollout.max_policy_lag={cfg.rollout.max_policy_lag} behind the trainer's {run.fleet.version}: "
                "a sidecar serves weights older than it was asked for; check its logs (GetInfo weight_version)"
            )
        events += fresh.events
        events.append(
            f"regenerated group {n}: a sample was {behind} versions behind "
            f"(rollout.max_policy_lag={cfg.rollout.max_policy_lag})"
        )
        rollout.groups[n] = _score(run, [group.problem], [group.prompt], fresh.samples)[0]
        regenerated += len(group.samples)
    return regenerated


def pack_batch(run: Run, rollout: Rollout) -> TrainBatch:
    """The rollout's groups as a training batch: advantages per group, filtered groups masked out,
    off-policy when the loop runs ahead of training."""
    cfg, groups = run.cfg, rollout.groups
    rewards = torch.stack([g.rewards for g in groups])  # (N, G)
    advantages, keep = sample_advantages(rewards, cfg.algorithm)
    batch = TrainBatch.from_sequences(
        [g.prompt for g in groups for _ in g.samples],
        [s.token_ids for g in groups for s in g.samples],
        advantages,
        rollout_logprobs=[s.logprobs for g in groups for s in g.samples],
        pad_id=run.tokenizer.pad_id,
    )
    batch.generated = batch.mask.clone()  # every generated token (the loss then drops filtered groups)
    batch.mask = batch.mask * keep.float()[:, None]
    batch.off_policy = cfg.rollout.max_policy_lag > 0
    return batch


@contextlib.contextmanager
def phase(desc: str, enabled: bool = True) -> Iterator[None]:
    """Say that a slow phase started and how long it took (on stderr, between progress bars)."""
    if enabled:
        tqdm.write(f"{desc} ...", file=sys.stderr)
    t = time.perf_counter()
    yield
    if enabled:
        tqdm.write(f"{desc}: done in {time.perf_counter() - t:.1f}s", file=sys.stderr)


PLOT_INTERVAL_S = 10.0
"""Plots are redrawn after a step when this long has passed since the last drawing (a drawing
costs ~1 s of CPU for all of them), and always on the way out."""


def train(cfg: RLConfig, *, resume: bool = False, progress: bool = True) -> list[dict[str, float]]:
    """Run `cfg` to the end; returns each step's metrics (also in run_dir/metrics.jsonl).

    Plots are redrawn as steps finish (at most every PLOT_INTERVAL_S) and once more on the way
    out, so an interrupted run keeps them; the configured trackers get every row that
    metrics.jsonl gets. Under torchrun every rank runs this; only rank 0 probes and starts
    sidecars, pushes weights, evaluates and writes the run directory (`trainer.ranks`); each
    data-parallel replica trains its share of the same batches on its tensor-parallel shards. A
    rank that fails or dies stops every rank within about `train.rank_timeout_s`, with its error
    (`trainer.ranks.RankWatchdog`)."""
    join_torchrun_group()
    if not multi_process():
        return _train(cfg, resume, progress, None)
    with RankWatchdog(timeout_s=cfg.train.rank_timeout_s) as watchdog:
        try:
            return _train(cfg, resume, progress, watchdog)
        except BaseException as e:
            first = watchdog.fail(e)  # the others stop within a beat
            if first is not None:  # another rank failed first: its error is the one to report
                raise first from e
            raise


def _train(cfg: RLConfig, resume: bool, progress: bool, watchdog: RankWatchdog | None) -> list[dict[str, float]]:
    leader = is_leader()
    progress = progress and leader
    prepared = preflight(cfg, probe_sidecars=False)  # seconds, on every rank: nothing is built yet
    if progress:
        announce_task(prepared.task, prepared.tokenizer)
    run_dir = on_leader(lambda: _open_run_dir(cfg, resume, prepared.model_config))
    with phase("building the policy (Megatron)", progress):
        policy = build_policy(cfg)
        reference = None
        if cfg.algorithm.kl_coef > 0:
            reference = ReferencePolicy.from_checkpoint(
                cfg.reference_model or cfg.model,
                tensor_parallel=cfg.train.tensor_parallel,
                temperature=cfg.rollout.temperature,
            )
    start = 0
    if resume and (found := share(latest_checkpoint(cfg.run_dir / "checkpoints") if leader else None)):
        start, path = found
        policy.load(path)
        log.info("resumed from %s (step %d)", path, start)
    if resume and run_dir is not None and (dropped := run_dir.rewind(start)):
        log.warning(
            "resuming after step %d: dropped the metrics of steps %s, trained after the last checkpoint "
            "(they train again now; checkpoint_every sets how much a crash loses)",
            start,
            dropped,
        )
    history: list[dict[str, float]] = []
    fleet = (
        f"starting {cfg.sidecars.local} local sidecar(s) (engine {cfg.sidecars.serve.engine.kind}, "
        f"device {', '.join(cfg.sidecars.devices)})"
        if cfg.sidecars.local
        else f"connecting to {len(cfg.sidecars.addresses)} sidecar(s)"
    )
    try:
        with contextlib.ExitStack() as stack:

            def start_fleet() -> Fleet:
                with phase(fleet, progress):
                    orch, local = stack.enter_context(sidecar_fleet(cfg, cfg.run_dir))
                if watchdog is not None and local is not None:
                    watchdog.at_abort(local.close)  # stopped by another rank's failure: no orphans
                return orch

            orch = on_leader(start_fleet)  # a failed start stops every rank
            names = policy.export_names()
            with phase(f"first weight push ({len(names)} tensors to the sidecars)", progress):
                if orch is not None:
                    orch.push_weights(policy.export_named_tensors, orch.start_version(), names=names)
                else:  # replica 0's other ranks: rank 0's push gathers their tensor-parallel shards
                    drain_export(policy)
            run = Run(
                cfg=cfg,
                policy=policy,
                sidecars=orch,
                task=prepared.task,
                tokenizer=prepared.tokenizer,
                run_dir=run_dir,  # type: ignore[arg-type]
                reference=reference,
            )
            if leader and cfg.eval_every and start == 0:
                run_dir.log(0, evaluate_logged(run, progress))  # type: ignore[union-attr]
            last_plot = 0.0
            # lag 0: each step generates its batch when it takes it; lag L > 0: a producer thread
            rollouts = stack.enter_context(rollout_pipeline(run, start)) if leader else None
            bar = tqdm(range(start, cfg.steps), desc="RL steps", disable=not progress, unit="step")
            for step in bar:
                metrics = rl_step(run, step, rollouts)
                done = step + 1
                if leader and cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                    metrics.update(evaluate_logged(run, progress))
                history.append(metrics)
                if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
                    policy.save(cfg.run_dir / "checkpoints" / f"step_{done}")  # collective: every rank
                if run_dir is not None:
                    run_dir.log(done, metrics)
                    if time.monotonic() - last_plot >= PLOT_INTERVAL_S:
                        run_dir.plot()
                        last_plot = time.monotonic()
                bar.set_postfix(
                    reward=f"{metrics['reward/train_mean']:.2f}", tau=f"{metrics['spec/acceptance_length']:.2f}"
                )
        if cfg.export:  # the sidecars are stopped; every rank takes part (tensor-parallel gathers)
            out = cfg.run_dir / EXPORT_DIR
            with phase(f"exporting the policy of step {cfg.steps} to {out}", progress):
                export_policy(policy, cfg.model, out)
    finally:
        if run_dir is not None:
            run_dir.close()
            run_dir.plot()  # also after a failure or an interrupt: the plots show every logged step
    return history


def _open_run_dir(cfg: RLConfig, resume: bool, model: ModelConfig) -> RunDir:
    """Rank 0's run directory with the resolved config and the trackers; probes remote sidecars."""
    if cfg.sidecars.addresses:
        check_sidecars(cfg, model)
    run_dir = RunDir(cfg.run_dir, resume=resume)
    write_yaml(cfg, run_dir.config_path)
    run_dir.trackers = open_trackers(cfg.trackers, run_dir.root, to_mapping(cfg))
    return run_dir
