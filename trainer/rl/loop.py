"""The RL loop: generate → score → recompute log-probs → update policy and draft → push weights.

Reads like the algorithm (README, "How speculation works in RL"); every mechanism lives in the
module named after it: the step's rollout (generation, rewards, DAPO refill, stale groups, the
packed batch) in `trainer.rl.rollouts`, the held-out evaluation in `trainer.rl.evaluation`, the policy
and the sidecar fleet a run is built of in `trainer.rl.run_setup`, sidecar fan-out and fault
handling in `sidecar.client.fleet`, the policy and its optimizers in `trainer.policy.policy`, the
GRPO/DAPO loss in `trainer.policy.losses`, the run directory in `trainer.rl.run_dir`.

Each step records the timing breakdown of the reference study's table (weight sync, generation,
log-probs, training), the reward, and acceptance figures computed from the sidecars' raw counters
(τ = generated tokens per verify step, acceptance rate, acceptance per draft position). The
loop makes one update per rollout batch, so the PPO ratio's denominator is the current policy's
log-probs: unless `separate_logprob_pass` is set they come, detached, from the training forward
itself and the "log-probs" phase costs nothing. With
`rollout.measure_plain`, the step's prompts are generated once more with speculation off on the
same weights, so the speedup is measured side by side in the same run.

With `rollout.max_policy_lag` > 0 (asynchronous RL) rank 0 generates in a producer thread
(`trainer.rl.rollout_pipeline`) while earlier steps train: `rollouts.next_batch` takes the step's rollout,
regenerates any group older than the bound, and packs an off-policy batch.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import Tensor
from tqdm import tqdm

from sidecar.client.fleet import Fleet
from trainer.policy.losses import mismatch_metrics
from trainer.policy.policy import Policy
from trainer.policy.reference import ReferencePolicy
from trainer.rl import ranks
from trainer.rl.config import RLConfig
from trainer.rl.evaluation import evaluate_logged
from trainer.rl.export import EXPORT_DIR, export_policy
from trainer.rl.preflight import announce_task, preflight
from trainer.rl.rollout_pipeline import RolloutPipeline
from trainer.rl.rollouts import Rollout, next_batch, rollout_pipeline
from trainer.rl.run import Run, phase
from trainer.rl.run_setup import build_policy, latest_checkpoint, open_run_dir, sidecar_fleet
from trainer.rl.step_metrics import StepTimes

log = logging.getLogger(__name__)


def logprobs_in_micro_batches(policy: Policy, tokens: Tensor, rows: int, routes: Tensor | None = None) -> Tensor:
    """The policy's log-probs of `tokens` (B, S) -> (B, S-1), `rows` samples per forward (0: all at
    once), on CPU; `routes` (`TrainBatch.routes`) replayed where given."""
    parts = tokens.split(rows or tokens.shape[0])
    replayed = routes.split(rows or tokens.shape[0]) if routes is not None else [None] * len(parts)
    return torch.cat([policy.logprobs(t, r).cpu() for t, r in zip(parts, replayed, strict=True)])


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
    batch = ranks.share(next_batch(run, step, rollouts, metrics, times) if run.leader else None)
    assert batch is not None

    # 3. log-prob recomputation with the trainer's policy (the PPO ratio's denominator): in a pass of its own, or
    #    (default) taken detached from the training forward of step 4 (several updates per batch always take the
    #    separate pass: after the first update the training forward no longer computes the sampling policy's
    #    log-probs); and the frozen reference's log-probs when the KL penalty is on
    t = time.perf_counter()
    updates = cfg.train.updates_per_batch
    if cfg.separate_logprob_pass or updates > 1:
        batch.old_logprobs = logprobs_in_micro_batches(
            run.policy, batch.tokens, cfg.train.micro_batch_rows, batch.routes
        )
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
    for s in ("mean", "p99", "max"):  # the per-token log-prob gap to the sampler, in nats
        metrics[f"mismatch/logprob_abs_{s}"] = metrics[f"train/mismatch_logprob_abs_{s}"]

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
        ranks.drain_export(run.policy)

    # refill rounds count as the same cost on both sides of the step speedup (conservative: they
    # are speculative here and would be plain without speculation)
    if run.leader:
        metrics.update(times.metrics(overlapped=cfg.rollout.max_policy_lag > 0))
    shared = ranks.share(metrics if run.leader else None)
    assert shared is not None
    return shared


PLOT_INTERVAL_S = 10.0
"""Plots are redrawn after a step when this long has passed since the last drawing (a drawing
costs ~1 s of CPU for all of them), and always on the way out."""


def train(cfg: RLConfig, *, resume: bool = False, progress: bool = True) -> list[dict[str, float]]:
    """Run `cfg` to the end; returns each step's metrics (also in run_dir/metrics.jsonl).

    Plots are redrawn as steps finish (at most every PLOT_INTERVAL_S) and once more on the way
    out, so an interrupted run keeps them; the configured trackers get every row that
    metrics.jsonl gets. Under torchrun every rank runs this; only rank 0 probes and starts
    sidecars, pushes weights, evaluates and writes the run directory (`trainer.rl.ranks`); each
    data-parallel replica trains its share of the same batches on its tensor-parallel shards. A
    rank that fails or dies stops every rank within about `train.rank_timeout_s`, with its error
    (`trainer.rl.ranks.RankWatchdog`)."""
    ranks.join_torchrun_group()
    if not ranks.multi_process():
        return _train(cfg, resume, progress, None)
    with ranks.RankWatchdog(timeout_s=cfg.train.rank_timeout_s) as watchdog:
        try:
            return _train(cfg, resume, progress, watchdog)
        except BaseException as e:
            first = watchdog.fail(e)  # the others stop within a beat
            if first is not None:  # another rank failed first: its error is the one to report
                raise first from e
            raise


def _train(cfg: RLConfig, resume: bool, progress: bool, watchdog: ranks.RankWatchdog | None) -> list[dict[str, float]]:
    leader = ranks.is_leader()
    progress = progress and leader
    prepared = preflight(cfg, probe_sidecars=False)  # seconds, on every rank: nothing is built yet
    if progress:
        announce_task(prepared.task, prepared.tokenizer)
    run_dir = ranks.on_leader(lambda: open_run_dir(cfg, resume, prepared.model_config))
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
    if resume and (found := ranks.share(latest_checkpoint(cfg.run_dir / "checkpoints") if leader else None)):
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

            orch = ranks.on_leader(start_fleet)  # a failed start stops every rank
            names = policy.export_names()
            with phase(f"first weight push ({len(names)} tensors to the sidecars)", progress):
                if orch is not None:
                    orch.push_weights(policy.export_named_tensors, orch.start_version(), names=names)
                else:  # replica 0's other ranks: rank 0's push gathers their tensor-parallel shards
                    ranks.drain_export(policy)
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
