"""Steps 1-2 of an RL step, on rank 0: a step's rollout (generate G samples a prompt across the
sidecars, reward them, refill uninformative groups with DAPO's dynamic sampling), then the
batch it becomes (groups regenerated where the asynchronous lag bound is broken, advantages,
masks). `rollout_pipeline` runs the gathering ahead of training when `rollout.max_policy_lag` > 0."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass

import torch

from sidecar.client.fleet import FleetResult, derive_seed
from sidecar.types import GenerationRequest, SamplingParams
from trainer.policy.losses import OverlongConfig, sample_advantages
from trainer.policy.moe import batch_routes, routes_asked
from trainer.policy.policy import TrainBatch
from trainer.rl.dynamic_sampling import Group, Selection, group_samples, select_groups, shaped_rewards
from trainer.rl.environments import Environment
from trainer.rl.episodes import EpisodeLimits, Episodes, episode_metrics, run_episodes
from trainer.rl.rollout_pipeline import RolloutPipeline
from trainer.rl.run import Run
from trainer.rl.step_metrics import (
    StepTimes,
    length_quantiles,
    prefix_cache_metrics,
    reward_metric_name,
    speculation_metrics,
)
from trainer.rl.tasks import Problem, prompt_ids, score_completions

log = logging.getLogger(__name__)


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


def _sampling(run: Run, step: int, round_: int) -> SamplingParams:
    ro = run.cfg.rollout
    return SamplingParams(
        temperature=ro.temperature,
        max_new_tokens=ro.max_new_tokens,
        stop_token_ids=(run.tokenizer.eos_id,),
        seed=derive_seed(run.cfg.seed, step, round_) if round_ else derive_seed(run.cfg.seed, step),
    )


def _generate(
    run: Run,
    problems: list[Problem],
    prompts: list[list[int]],
    sampling: SamplingParams,
    k: int | None,
    *,
    rejoin: bool = True,
    min_weight_version: int = 0,
) -> FleetResult | Episodes:
    """G samples of each prompt across the fleet: one completion each, or, for a multi-turn
    environment, one episode each (`trainer.rl.episodes`)."""
    cfg, ro = run.cfg, run.cfg.rollout
    if isinstance(run.task, Environment):
        return run_episodes(
            run.fleet,
            run.task,
            run.tokenizer,
            problems,
            prompts,
            samples_per_prompt=ro.samples_per_prompt,
            sampling=sampling,
            limits=EpisodeLimits(max_turns=cfg.task.max_turns, max_tokens=cfg.task.max_episode_tokens),
            speculation_k=k,
            min_weight_version=min_weight_version,
            rejoin=rejoin,
        )
    request = GenerationRequest(
        prompts=prompts,
        sampling=sampling,
        samples_per_prompt=ro.samples_per_prompt,
        speculation_k=k,
        min_weight_version=min_weight_version,
        routes=routes_asked(cfg.algorithm.routing_replay),
    )
    return run.fleet.generate(request, rejoin=rejoin)


def _score(
    run: Run, problems: list[Problem], prompts: list[list[int]], generated: FleetResult | Episodes
) -> list[Group]:
    """Group the samples by prompt and reward them (the task's reward, or an episode's return, plus
    the configured overlong shaping, which counts the policy's own tokens)."""
    cfg, per_prompt = run.cfg, run.cfg.rollout.samples_per_prompt
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
    by_prompt = group_samples(prompts, generated.samples, per_prompt)
    for n, (problem, prompt, group) in enumerate(zip(problems, prompts, by_prompt, strict=True)):
        masks: list[list[int]] | None = None
        parts: dict[str, list[float]] = {}
        if isinstance(generated, Episodes):
            totals = generated.returns[n * per_prompt : (n + 1) * per_prompt]
            masks = generated.loss_masks[n * per_prompt : (n + 1) * per_prompt]
            lengths = torch.tensor([sum(m) for m in masks])
        else:
            totals, parts = score_completions(
                run.task,  # type: ignore[arg-type]  # a single-turn task
                [problem] * len(group),
                [run.tokenizer.decode(s.token_ids) for s in group],
            )
            lengths = torch.tensor([len(s.token_ids) for s in group])
        task = torch.tensor(totals)
        groups.append(
            Group(
                prompt=prompt,
                samples=group,
                rewards=shaped_rewards(task, lengths, overlong),
                task_rewards=task,
                problem=problem,
                reward_terms={name: torch.tensor(values) for name, values in parts.items()},
                loss_masks=masks,
            )
        )
    return groups


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

    # 1. generate across the pool (G samples per prompt), speculatively
    run.fleet.speculation_delta()  # baseline of the raw counters
    plain_first = ro.measure_plain and step % 2 == 1  # alternate the order of the side-by-side passes
    if plain_first:
        times.generation_plain = _generate(run, problems, prompts, sampling, 0, rejoin=rejoin).seconds
        run.fleet.speculation_delta()
    before = dict(run.fleet.latest_stats)
    rollout = _generate(run, problems, prompts, sampling, ro.request_k, rejoin=rejoin)
    counters = run.fleet.speculation_delta()
    metrics.update(prefix_cache_metrics(before, run.fleet.latest_stats))
    if ro.measure_plain and not plain_first:
        times.generation_plain = _generate(run, problems, prompts, sampling, 0, rejoin=rejoin).seconds
    samples = rollout.samples
    times.generation = rollout.seconds
    metrics["rollout/rerouted"] = float(rollout.rerouted)
    metrics["rollout/duplicates"] = float(rollout.duplicates)
    metrics["rollout/regenerated"] = float(rollout.regenerated)
    metrics["rollout/samples_nonfinite"] = float(rollout.nonfinite)  # the fleet warned, naming the sidecars
    metrics["rollout/weight_version"] = float(min(s.weight_version for s in samples))
    metrics["rollout/response_len"] = sum(len(s.token_ids) for s in samples) / len(samples)
    metrics.update(length_quantiles([len(s.token_ids) for s in samples]))
    if isinstance(rollout, Episodes):
        metrics.update(episode_metrics(rollout))
    events += rollout.events

    # 2. rewards (with overlong shaping); DAPO dynamic sampling refills groups whose rewards are
    #    all equal with fresh prompts, for at most rollout.refill_rounds rounds
    first = _score(run, problems, prompts, rollout)
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
        extra = _generate(run, more, more_prompts, _sampling(run, step, rounds), ro.request_k, rejoin=rejoin)
        counters.add(run.fleet.speculation_delta())
        refill_seconds += extra.seconds
        events += extra.events
        refills += _score(run, more, more_prompts, extra)
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
        fresh = _generate(
            run, [group.problem], [group.prompt], sampling, cfg.rollout.request_k, min_weight_version=bound
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
        rollout.groups[n] = _score(run, [group.problem], [group.prompt], fresh)[0]
        regenerated += len(group.samples)
    return regenerated


def pack_batch(run: Run, rollout: Rollout) -> TrainBatch:
    """The rollout's groups as a training batch: advantages per group, filtered groups masked out,
    off-policy when the loop runs ahead of training."""
    cfg, groups = run.cfg, rollout.groups
    rewards = torch.stack([g.rewards for g in groups])  # (N, G)
    advantages, keep = sample_advantages(rewards, cfg.algorithm)
    masks = None
    if any(g.loss_masks is not None for g in groups):  # multi-turn: observations stay out of the loss
        masks = [m for g in groups for m in (g.loss_masks or [[1] * len(s.token_ids) for s in g.samples])]
    batch = TrainBatch.from_sequences(
        [g.prompt for g in groups for _ in g.samples],
        [s.token_ids for g in groups for s in g.samples],
        advantages,
        rollout_logprobs=[s.logprobs for g in groups for s in g.samples],
        pad_id=run.tokenizer.pad_id,
        loss_masks=masks,
    )
    if cfg.algorithm.routing_replay == "rollout":  # the experts that sampled each token, replayed
        samples = [s for g in groups for s in g.samples]
        lengths = [len(g.prompt) + len(s.token_ids) for g in groups for s in g.samples]
        batch.routes = batch_routes(samples, lengths, batch.tokens.shape[1])
    batch.generated = batch.mask.clone()  # every sampled token (the loss then drops filtered groups)
    batch.mask = batch.mask * keep.float()[:, None]
    batch.off_policy = cfg.rollout.max_policy_lag > 0
    return batch
