"""Asynchronous RL in the loop (`rollout.max_policy_lag`), against an in-memory fleet whose
weight version each push bumps: the oracle is the version every sample reports (what the
bound is about), the batches the policy was given, and the generate calls the fleet saw.
The schedule's own property test is tests/trainer/rl/test_rollout_pipeline.py; the loss's correction is
checked by hand in tests/trainer/policy/test_trainer_losses.py; the real loop against real sidecars in
tests/trainer/rl/test_rl_loop.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.rl.loop_fakes import TOK, FakeFleet, RecordingPolicy, RuleTask, lag_zero
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig
from trainer.rl.loop import rl_step
from trainer.rl.rollout_pipeline import RolloutPipeline
from trainer.rl.rollouts import Rollout, gather_rollout, rollout_pipeline
from trainer.rl.run import Run
from trainer.rl.step_metrics import StepTimes

PROMPTS, G = 6, 4


def _run(lag: int, fleet: FakeFleet) -> tuple[Run, RecordingPolicy]:
    cfg = RLConfig(
        model=Path("unused"),
        rollout=RolloutConfig(
            prompts_per_step=PROMPTS, samples_per_prompt=G, max_new_tokens=4, refill_rounds=0, max_policy_lag=lag
        ),
        sidecars=SidecarsConfig(addresses=["fake:1"]),
    )
    policy = RecordingPolicy()
    run = Run(cfg=cfg, policy=policy, sidecars=fleet, task=RuleTask(), tokenizer=TOK, run_dir=None)  # type: ignore[arg-type]
    return run, policy


def test_lag_zero_is_the_synchronous_on_policy_loop() -> None:
    fleet = FakeFleet()
    run, policy = _run(0, fleet)
    with rollout_pipeline(run, 0, 3) as rollouts:
        history = [rl_step(run, s, rollouts) for s in range(3)]
    assert all(not b.off_policy for b in policy.batches)  # no importance weights: today's update
    assert [m["rollout/policy_lag_max"] for m in history] == [0.0, 0.0, 0.0]
    assert [m["rollout/weight_version"] for m in history] == [1.0, 2.0, 3.0]  # each step samples the last push
    assert fleet.rejoins == 0  # the generate calls bring sidecars back themselves, as before


@pytest.mark.parametrize("lag", [1, 2])
def test_generation_runs_ahead_within_the_bound(lag: int) -> None:
    fleet = FakeFleet(delay_s=0.01)
    run, policy = _run(lag, fleet)
    steps = 5
    with RolloutPipeline[Rollout](lambda s: gather_rollout(run, s), first=0, last=steps, max_lag=lag) as rollouts:
        history = [rl_step(run, s, rollouts) for s in range(steps)]
    lags = [m["rollout/policy_lag_max"] for m in history]
    assert all(0 <= x <= lag for x in lags), lags
    assert lags[1] >= 1  # step 1's batch started before step 0's push: it ran ahead
    assert all(b.off_policy for b in policy.batches)  # the loss corrects for the sampling policy
    assert [b.tokens.shape[0] for b in policy.batches] == [PROMPTS * G] * steps
    assert fleet.calls == steps  # every batch generated once, none regenerated
    assert fleet.rejoins == steps  # sidecars come back between updates, not while one is running
    assert all(m["rollout/stale_regenerated"] == 0 for m in history)
    for m in history:
        assert m["time/step"] == pytest.approx(
            m["time/wait_generation"]
            + m["time/stale_regeneration"]
            + m["time/logprobs"]
            + m["time/train"]
            + m["time/weight_push"]
        )


def test_a_stale_group_is_regenerated_not_trained_on() -> None:
    """A sidecar that served weights older than the bound (the fake's call 2 reports samples five
    versions old): every group of that step is regenerated from the served weights, counted, and
    the batch holds only fresh samples."""
    fleet = FakeFleet(stale_calls={2})
    run, policy = _run(1, fleet)
    with lag_zero(run, 3) as rollouts:  # generated when taken: the fake's call numbers are the steps'
        history = [rl_step(run, s, rollouts) for s in range(3)]
    assert len(policy.batches) == 3  # every step trained, on a full batch
    assert [m["rollout/stale_regenerated"] for m in history] == [0.0, PROMPTS * G, 0.0]
    assert fleet.calls == 3 + PROMPTS  # one regeneration per stale group
    assert all(m["rollout/policy_lag_max"] <= 1 for m in history)


def test_samples_still_stale_after_regeneration_stop_the_run_with_the_cause() -> None:
    fleet = FakeFleet(stale_calls=set(range(2, 100)))
    run, _ = _run(1, fleet)
    with lag_zero(run, 2) as rollouts:
        rl_step(run, 0, rollouts)
        with pytest.raises(RuntimeError, match="serves weights older than it was asked for"):
            rl_step(run, 1, rollouts)


def test_measuring_plain_beside_an_asynchronous_step_is_refused() -> None:
    with pytest.raises(ValueError, match="measure_plain: false with rollout.max_policy_lag > 0"):
        RolloutConfig(max_policy_lag=1, measure_plain=True)
    with pytest.raises(ValueError, match="max_policy_lag must be >= 0"):
        RolloutConfig(max_policy_lag=-1)


def test_a_refused_push_with_a_batch_in_flight_trains_nothing_stale_and_keeps_the_served_version() -> None:
    """Step 1's push is refused (e.g. the weights do not match the served model) while step 2's
    batch is generating: the error stops the run, the sidecars keep serving the last accepted
    version, and the batch generated ahead is dropped, not trained on (a resume regenerates it)."""
    import grpc

    from sidecar.client.client import SidecarCallError

    def refused() -> BaseException:
        return SidecarCallError("fake:1", "PushWeights", grpc.StatusCode.INVALID_ARGUMENT, "shape mismatch")

    fleet = FakeFleet(delay_s=0.01, refuse_push=2, push_failure=refused)
    run, policy = _run(1, fleet)
    trained: list[dict[str, float]] = []
    with (
        pytest.raises(SidecarCallError, match="shape mismatch"),
        RolloutPipeline[Rollout](lambda s: gather_rollout(run, s), first=0, last=4, max_lag=1) as rollouts,
    ):
        for s in range(4):
            trained.append(rl_step(run, s, rollouts))
    assert len(trained) == 1 and len(policy.batches) == 2  # step 1 trained, its push refused
    assert fleet.version == 2  # the first push only: the served weights are the last accepted ones
    assert fleet.calls <= 3  # steps 0, 1 and at most the one batch generated ahead


def test_step_times_add_up_to_the_step_synchronous_and_overlapped() -> None:
    """Closed form: synchronously a step is its generation plus everything after it; overlapped, only
    what the trainer waited for plus its own phases (refill is part of the producer's work)."""
    t = StepTimes(
        generation=2.0,
        generation_plain=3.0,
        refill=1.0,
        logprobs=0.5,
        train=1.5,
        weight_push=0.25,
        wait_generation=0.4,
        stale_regeneration=0.1,
    )
    sync = t.metrics(overlapped=False)
    assert sync["time/step"] == pytest.approx(2.0 + 1.0 + 0.5 + 1.5 + 0.25)
    assert sync["time/generation_share"] == pytest.approx(3.0 / 5.25)
    assert sync["speedup/generation"] == pytest.approx(1.5)
    assert sync["speedup/step"] == pytest.approx((3.0 + 3.25) / 5.25)
    assert "time/generation_exposed_share" not in sync and sync["time/train"] == 1.5
    lagged = t.metrics(overlapped=True)
    assert lagged["time/step"] == pytest.approx(0.5 + 0.5 + 1.5 + 0.25)
    assert lagged["time/generation_exposed_share"] == pytest.approx(0.5 / 2.75)
    assert "speedup/generation" not in StepTimes(generation=1.0).metrics(overlapped=False)
    assert "time/generation_plain" not in StepTimes(generation=1.0).metrics(overlapped=False)
