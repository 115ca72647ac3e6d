"""The RL loop: generate → score → recompute log-probs → update policy and draft → push weights.

Reads like the algorithm (DESIGN.md "Data flow of one RL step"); every mechanism lives in the
module named after it: sidecar fan-out and fault handling in `sidecar.fleet`, local
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sidecar.fleet import Fleet, FleetConfig, derive_seed
from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters
from trainer.config_io import write_yaml
from trainer.local_sidecars import LocalSidecars
from trainer.losses import sample_advantages
from trainer.policy import Policy, TrainBatch
from trainer.rl_config import RLConfig
from trainer.run_dir import RunDir
from trainer.tasks import Problem, Task
from trainer.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Run:
    """What a step needs: the config, policy, sidecars, task and tokenizer."""

    cfg: RLConfig
    policy: Policy
    sidecars: Fleet
    task: Task
    tokenizer: Tokenizer
    run_dir: RunDir


def build_policy(cfg: RLConfig) -> Policy:
    return Policy.from_checkpoint(
        cfg.model,
        Policy.Config(
            seed=cfg.seed,
            temperature=cfg.rollout.temperature,
            grpo=cfg.algorithm,
            optimizer=cfg.optimizer,
            train_draft=cfg.train_draft,
            draft=cfg.draft,
            draft_optimizer=cfg.draft_optimizer,
        ),
    )


@contextlib.contextmanager
def sidecar_fleet(cfg: RLConfig, run_dir: Path) -> Iterator[tuple[Fleet, LocalSidecars | None]]:
    """The run's sidecars: local subprocesses (torn down on exit) or the given addresses, all
    reached with the run's credentials (`sidecars.security`; local sidecars get its token)."""
    local = None
    client = cfg.sidecars.security.client_config(timeout_s=cfg.sidecars.call_timeout_s)
    client = dataclasses.replace(
        client, transports=cfg.sidecars.weight_sync.transport_config(), delta_pushes=cfg.sidecars.weight_sync.deltas
    )
    if cfg.sidecars.local:
        local = LocalSidecars(
            cfg.model,
            cfg.sidecars.local,
            run_dir / "logs",
            spec_k=cfg.rollout.speculation_k,
            max_batch_size=cfg.sidecars.max_batch_size,
            threads=cfg.sidecars.threads,
            startup_timeout_s=cfg.sidecars.startup_timeout_s,
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


def latest_checkpoint(run_dir: RunDir) -> tuple[int, Path] | None:
    steps = [
        (int(m.group(1)), p) for p in run_dir.checkpoints.glob("step_*") if (m := re.match(r"step_(\d+)$", p.name))
    ]
    return max(steps) if steps else None


def evaluate(run: Run, size: int) -> float:
    """Mean reward of greedy completions on a fixed held-out set (same problems every time)."""
    rng = random.Random(1_000_003 + run.cfg.seed)
    problems = [run.task.sample(rng, "eval") for _ in range(size)]
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=run.cfg.rollout.max_new_tokens, stop_token_ids=(run.tokenizer.eos_id,)
    )
    prompts = [run.tokenizer.encode(p.prompt) for p in problems]
    request = GenerationRequest(prompts=prompts, sampling=sampling, speculation_k=run.cfg.rollout.speculation_k)
    samples = run.sidecars.generate(request).samples
    rewards = [run.task.reward(problems[s.prompt_index], run.tokenizer.decode(s.token_ids)) for s in samples]
    return sum(rewards) / len(rewards)


def speculation_metrics(c: SpeculationCounters) -> dict[str, float]:
    out = {"spec/acceptance_length": c.acceptance_length, "spec/acceptance_rate": c.acceptance_rate}
    for i, (d, a) in enumerate(zip(c.drafted_per_position, c.accepted_per_position, strict=False)):
        out[f"spec/accept_pos{i}"] = a / d if d else 0.0
    return out


def rl_step(run: Run, step: int) -> dict[str, float]:
    """One RL step; returns its metrics."""
    cfg, ro = run.cfg, run.cfg.rollout
    rng = random.Random(cfg.seed * 1_000_003 + step)
    problems: list[Problem] = [run.task.sample(rng, "train") for _ in range(ro.prompts_per_step)]
    prompts = [run.tokenizer.encode(p.prompt) for p in problems]
    sampling = SamplingParams(
        temperature=ro.temperature,
        max_new_tokens=ro.max_new_tokens,
        stop_token_ids=(run.tokenizer.eos_id,),
        seed=derive_seed(cfg.seed, step),  # with the prompt and sample index: each sample's stream
    )

    def rollout_request(k: int) -> GenerationRequest:
        return GenerationRequest(
            prompts=prompts, sampling=sampling, samples_per_prompt=ro.samples_per_prompt, speculation_k=k
        )

    metrics: dict[str, float] = {}

    # 1. generate across the pool (G samples per prompt), speculatively
    run.sidecars.speculation_delta()  # baseline of the raw counters
    plain_first = ro.measure_plain and step % 2 == 1  # alternate the order of the side-by-side passes
    if plain_first:
        metrics["time/generation_plain"] = run.sidecars.generate(rollout_request(0)).seconds
        run.sidecars.speculation_delta()
    rollout = run.sidecars.generate(rollout_request(ro.speculation_k))
    metrics.update(speculation_metrics(run.sidecars.speculation_delta()))
    if ro.measure_plain and not plain_first:
        metrics["time/generation_plain"] = run.sidecars.generate(rollout_request(0)).seconds
    samples = rollout.samples
    metrics["time/generation"] = rollout.seconds
    metrics["rollout/rerouted"] = float(rollout.rerouted)
    metrics["rollout/duplicates"] = float(rollout.duplicates)
    metrics["rollout/regenerated"] = float(rollout.regenerated)
    metrics["rollout/weight_version"] = float(min(s.weight_version for s in samples))
    metrics["rollout/response_len"] = sum(len(s.token_ids) for s in samples) / len(samples)

    # 2. rewards and group-relative advantages
    rewards = torch.tensor(
        [run.task.reward(problems[s.prompt_index], run.tokenizer.decode(s.token_ids)) for s in samples]
    ).view(ro.prompts_per_step, ro.samples_per_prompt)
    advantages, keep = sample_advantages(rewards, cfg.algorithm)
    metrics["reward/train_mean"] = float(rewards.mean())
    metrics["rollout/kept_fraction"] = float(keep.float().mean())
    batch = TrainBatch.from_sequences(
        [prompts[s.prompt_index] for s in samples],
        [s.token_ids for s in samples],
        advantages,
        rollout_logprobs=[s.logprobs for s in samples],
        pad_id=run.tokenizer.pad_id,
    )
    batch.generated = batch.mask.clone()  # every generated token (the loss then drops filtered groups)
    batch.mask = batch.mask * keep.float()[:, None]

    # 3. log-prob recomputation with the trainer's policy (the PPO ratio's denominator): in a
    #    pass of its own, or (default) taken detached from the training forward of step 4
    t = time.perf_counter()
    if cfg.separate_logprob_pass:
        batch.old_logprobs = run.policy.logprobs(batch.tokens).cpu()
    metrics["time/logprobs"] = time.perf_counter() - t

    # 4. policy and draft update
    t = time.perf_counter()
    metrics.update({f"train/{k}": v for k, v in run.policy.train_step(batch).items()})
    metrics["time/train"] = time.perf_counter() - t
    metrics["mismatch/logprob_abs_max"] = metrics["train/mismatch_logprob_abs_max"]

    # 5. push target + draft to every sidecar (version + 1)
    metrics["time/weight_sync"] = run.sidecars.push_weights(
        run.policy.export_named_tensors, names=run.policy.export_names()
    ).seconds
    metrics["weights/version"] = float(run.sidecars.version)

    rest = metrics["time/logprobs"] + metrics["time/train"] + metrics["time/weight_sync"]
    metrics["time/step"] = metrics["time/generation"] + rest
    if ro.measure_plain:
        metrics["speedup/generation"] = metrics["time/generation_plain"] / metrics["time/generation"]
        metrics["speedup/step"] = (metrics["time/generation_plain"] + rest) / metrics["time/step"]
    if rollout.events:
        log.warning("step %d: %s", step, "; ".join(rollout.events))
    return metrics


def train(cfg: RLConfig, *, resume: bool = False, progress: bool = True) -> list[dict[str, float]]:
    """Run `cfg` to the end; returns each step's metrics (also in run_dir/metrics.jsonl)."""
    run_dir = RunDir(cfg.run_dir, resume=resume)
    write_yaml(cfg, run_dir.config_path)
    policy = build_policy(cfg)
    start = 0
    if resume and (found := latest_checkpoint(run_dir)) is not None:
        start, path = found
        policy.load(path)
        log.info("resumed from %s (step %d)", path, start)
    history: list[dict[str, float]] = []
    with sidecar_fleet(cfg, run_dir.root) as (orch, _local):
        run = Run(
            cfg=cfg,
            policy=policy,
            sidecars=orch,
            task=cfg.task.build(),
            tokenizer=load_tokenizer(cfg.tokenizer),
            run_dir=run_dir,
        )
        orch.push_weights(policy.export_named_tensors, orch.start_version(), names=policy.export_names())
        if cfg.eval_every and start == 0:
            run_dir.log(0, {"reward/eval_mean": evaluate(run, cfg.eval_size)})
        bar = tqdm(range(start, cfg.steps), desc="RL steps", disable=not progress, unit="step")
        for step in bar:
            metrics = rl_step(run, step)
            done = step + 1
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                metrics["reward/eval_mean"] = evaluate(run, cfg.eval_size)
            run_dir.log(done, metrics)
            history.append(metrics)
            bar.set_postfix(
                reward=f"{metrics['reward/train_mean']:.2f}", tau=f"{metrics['spec/acceptance_length']:.2f}"
            )
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
                policy.save(run_dir.checkpoints / f"step_{done}")
        run_dir.plot()
    return history
