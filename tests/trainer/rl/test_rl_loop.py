"""The RL loop end to end, against real `specrl serve` subprocesses.

Oracles: the weight version each sample reports (set by the pushes, read back from the sidecar);
the Megatron policy's own log-prob recomputation of the sampled tokens (the engine's log-probs
must equal it); the task's verifiable reward on held-out problems the model never trained on;
plain greedy decoding with the full forward pass (what every sample must equal at temperature 0,
wherever it was generated); and the exact set of (prompt, sample) pairs that was asked for.

The held-out evaluation (`reward/eval_mean`) is `trainer/rl/evaluation.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from muon import HybridOptimizerConfig
from sidecar.client.client import ClientConfig
from sidecar.client.fleet import Fleet, FleetConfig
from sidecar.engine.config import EngineConfig
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import ModelConfig
from sidecar.serve_config import ServeConfig
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar_fixtures import greedy_reference
from trainer.draft.objective import DraftConfig
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TaskConfig
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.loop import train
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import (
    DraftInitConfig,
    WarmupConfig,
    acceptance_length,
    draft_init,
    make_model,
    supervised_warmup,
)
from trainer.tokenizer import CharTokenizer

TASK = ArithmeticTask(regime="zero", digits=2)
TOK = CharTokenizer()


def tiny() -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=TOK.vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model warmed up part of the way (it earns some reward, not all), then draft-initialised."""
    root = tmp_path_factory.mktemp("rl")
    torch.set_num_threads(1)
    make_model(root / "init", tiny(), seed=0)
    supervised_warmup(root / "init", root / "warm", TASK, TOK, WarmupConfig(steps=150, batch_size=32, lr=3e-3))
    draft_init(root / "warm", root / "policy", TASK, TOK, DraftInitConfig(prompts=256, steps=80, lr=3e-3))
    return {"init": root / "init", "warm": root / "warm", "policy": root / "policy"}


@pytest.mark.slow
def test_draft_init_beats_an_untrained_draft(checkpoints: dict[str, Path]) -> None:
    # the trunk is identical in both checkpoints: only the draft differs
    _, warm = load_checkpoint(checkpoints["warm"])
    _, init = load_checkpoint(checkpoints["policy"])
    assert all(torch.equal(warm[n], init[n]) for n in warm if not n.startswith("mtp."))
    rng = random.Random(5)
    prompts = [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(16)]
    kw = {"k": 3, "temperature": 1.0, "max_new_tokens": 24, "stop": TOK.eos_id}
    untrained = acceptance_length(checkpoints["warm"], prompts, **kw)  # type: ignore[arg-type]
    initialised = acceptance_length(checkpoints["policy"], prompts, **kw)  # type: ignore[arg-type]
    assert initialised > untrained + 0.3, (untrained, initialised)


@pytest.mark.slow
def test_eagle3_draft_init_beats_an_untrained_eagle3_draft(tmp_path: Path) -> None:
    # EAGLE-3 drafts serve targets without MTP layers, of at least 4 layers (3 ascending taps past layer 0)
    make_model(tmp_path / "init", dataclasses.replace(tiny(), num_hidden_layers=4, num_nextn_predict_layers=0), seed=0)
    supervised_warmup(
        tmp_path / "init", tmp_path / "target", TASK, TOK, WarmupConfig(steps=100, batch_size=32, lr=3e-3)
    )
    target = tmp_path / "target"
    tensors = load_checkpoint(target)[1]
    # the budget of the MTP draft-init above, into a separate draft directory; the target stays
    losses = draft_init(
        target, tmp_path / "eagle3", TASK, TOK, DraftInitConfig(prompts=256, steps=80, lr=3e-3, kind="eagle3")
    )
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(t, tensors[n]) for n, t in load_checkpoint(target)[1].items())  # the target stays
    draft_init(target, tmp_path / "start", TASK, TOK, DraftInitConfig(prompts=8, steps=1, lr=1e-9, kind="eagle3"))
    rng = random.Random(5)
    prompts = [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(16)]
    kw = {"k": 3, "temperature": 1.0, "max_new_tokens": 24, "stop": TOK.eos_id}
    start = acceptance_length(target, prompts, draft=tmp_path / "start", **kw)  # type: ignore[arg-type]
    trained = acceptance_length(target, prompts, draft=tmp_path / "eagle3", **kw)  # type: ignore[arg-type]
    assert trained > start + 0.3, (start, trained)
    with pytest.raises(ValueError, match="for kind 'eagle3' only"):
        DraftInitConfig(draft_vocab_size=10)

    # online: the sidecar serves the draft directory, the trainer trains it and pushes it each step
    cfg = RLConfig(
        model=target,
        draft=DraftConfig(eagle3=tmp_path / "eagle3"),
        task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
        rollout=RolloutConfig(
            prompts_per_step=8, samples_per_prompt=4, temperature=0.7, max_new_tokens=24, speculation_k=3
        ),
        optimizer=HybridOptimizerConfig(lr=5e-4),
        sidecars=SidecarsConfig(local=1),
        steps=3,
        eval_every=0,
        run_dir=tmp_path / "run",
    )
    history = train(cfg, progress=False)
    assert [m["weights/version"] for m in history] == [2.0, 3.0, 4.0]  # pushes with the draft were accepted
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in history)
    assert all(m["train/draft_loss"] > 0 and m["spec/acceptance_length"] > 1.5 for m in history), history


@pytest.mark.slow
def test_rl_steps_end_to_end(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    cfg = RLConfig(
        model=checkpoints["policy"],
        task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
        rollout=RolloutConfig(
            prompts_per_step=16, samples_per_prompt=8, temperature=0.7, max_new_tokens=24, speculation_k=3
        ),
        optimizer=HybridOptimizerConfig(lr=5e-4),
        sidecars=SidecarsConfig(local=2),
        steps=12,
        eval_every=12,
        eval_size=128,
        run_dir=tmp_path / "run",
    )
    history = train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    # weight versions advance by one per step: step i samples version i+1 and pushes i+2
    assert [m["rollout/weight_version"] for m in history] == [float(v) for v in range(1, 13)]
    assert [m["weights/version"] for m in history] == [float(v) for v in range(2, 14)]
    # the sidecars' log-probs are the trainer's, for the weights it pushed
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in history), [m["mismatch/logprob_abs_max"] for m in history]
    # speculation ran, and its figures come from the sidecars' counters
    assert all(m["spec/acceptance_length"] > 1.0 for m in history)
    # no sample lost or duplicated on the healthy path
    assert all(m["rollout/rerouted"] == 0 and m["rollout/duplicates"] == 0 for m in history)
    # held-out reward (greedy, problems never trained on) improves over the starting policy
    before, after = rows[0]["reward/eval_mean"], rows[-1]["reward/eval_mean"]
    assert after > before, (before, after)
    # the run directory holds everything a user looks at
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file()
    assert {p.name for p in (run / "plots").iterdir()} >= {"reward.png", "acceptance.png", "step_time.png"}
    assert (run / "checkpoints" / "step_12").is_dir()

    # the same run directory is refused without --resume, and resumes after step 12 with it
    with pytest.raises(FileExistsError):
        train(cfg, progress=False)
    cfg.steps = 13
    resumed = train(cfg, resume=True, progress=False)
    assert len(resumed) == 1
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(14))
    assert resumed[0]["mismatch/logprob_abs_max"] < 1e-4


@pytest.mark.slow
def test_a_killed_sidecar_loses_no_sample_and_rejoins_with_current_weights(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    config, state = load_checkpoint(checkpoints["policy"])
    rng = random.Random(11)
    prompts = [TOK.encode(TASK.sample(rng, "train").prompt) for _ in range(48)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(TOK.eos_id,))
    with LocalSidecars(
        checkpoints["policy"], 2, tmp_path / "logs", serve=ServeConfig(engine=EngineConfig(max_batch_size=2))
    ) as local:
        local.start()
        with Fleet(local.addresses, FleetConfig(deadline_s=60.0)) as orch:
            # streamed (names given): the rejoin below re-streams the current weights the same way
            orch.push_weights(lambda: state.items(), orch.start_version(), names=list(state))
            victim = orch.clients[0]
            baseline = victim.stats().total.generated_tokens

            def kill_when_busy() -> None:  # mid-stream: as soon as sidecar 0 has produced tokens
                for _ in range(1000):
                    if victim.stats().total.generated_tokens > baseline:
                        break
                    time.sleep(0.01)
                local.kill(0)

            killer = threading.Thread(target=kill_when_busy)
            killer.start()
            result = orch.generate(
                GenerationRequest(prompts=prompts, sampling=sampling, samples_per_prompt=3, speculation_k=3)
            )
            killer.join()

            keys = [(s.prompt_index, s.sample_index) for s in result.samples]
            assert sorted(keys) == [(p, i) for p in range(48) for i in range(3)]  # none lost, none twice
            assert result.rerouted > 0 and result.duplicates == 0
            assert any("is down" in e for e in result.events)
            for s in result.samples[::7]:  # wherever it ran, a sample is the plain greedy decode
                assert s.token_ids == greedy_reference(
                    state, prompts[s.prompt_index], 24, config=config, stop=TOK.eos_id
                )

            # the crashed sidecar comes back (initial weights, version 0) and must be brought up
            # to the current version before it serves anything
            local.restart(0)
            events: list[str] = []
            orch.rejoin(events)
            assert any("rejoined" in e for e in events), events
            assert orch.served_versions() == {a: orch.version for a in local.addresses}
            again = orch.generate(GenerationRequest(prompts=prompts[:4], sampling=sampling))
            assert all(s.weight_version == orch.version for s in again.samples)


@pytest.mark.slow
def test_a_sidecar_that_stops_answering_is_given_up_on_at_the_deadline(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    _, state = load_checkpoint(checkpoints["policy"])
    rng = random.Random(12)
    prompts = [TOK.encode(TASK.sample(rng, "train").prompt) for _ in range(8)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(TOK.eos_id,), seed=5)
    with LocalSidecars(checkpoints["policy"], 2, tmp_path / "logs") as local:
        local.start()
        config = FleetConfig(deadline_s=4.0, client=ClientConfig(timeout_s=2.0, retries=1))
        with Fleet(local.addresses, config) as orch:
            orch.push_weights(lambda: state.items(), orch.start_version())
            os.kill(local.pid(0), signal.SIGSTOP)  # alive but silent: no error ever comes back
            try:
                result = orch.generate(GenerationRequest(prompts=prompts, sampling=sampling, samples_per_prompt=2))
            finally:
                os.kill(local.pid(0), signal.SIGCONT)
            keys = sorted((s.prompt_index, s.sample_index) for s in result.samples)
            assert keys == [(p, i) for p in range(8) for i in range(2)]
            assert result.rerouted > 0 and any("deadline" in e for e in result.events), result.events
            events: list[str] = []
            orch.rejoin(events)  # answering again, already at the current version
            assert any("rejoined" in e for e in events), events


@pytest.mark.slow
def test_specrl_train_command_runs_a_step(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from trainer.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text("rollout: {prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 16}\nsteps: 1\n")
    args = ["train", "--config", str(config), "--model", str(checkpoints["policy"]), "--local-sidecars", "1"]
    args += ["--run-dir", str(tmp_path / "run"), "--set", "eval_every=0"]
    # two updates per rollout batch, in micro-batches of one sample, with a warm-up schedule
    args += ["--set", "train.mini_batches=2", "--set", "train.micro_batch_rows=1"]
    args += ["--set", "algorithm.filter_equal_groups=false"]  # so no mini-batch is empty
    # the KL penalty to the frozen starting policy, and DAPO overlong shaping
    args += ["--set", "algorithm.kl_coef=0.05", "--set", "reward.overlong_buffer_len=4"]
    args += ["--set", "train.lr_schedule={warmup_steps: 4}", "--set", "optimizer.lr=4e-4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "done: 1 steps" in result.output
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 1 and row["weights/version"] == 2.0
    assert row["train/step"] == row["train/updates"] == 2.0
    assert row["train/lr"] == pytest.approx(1.5e-4)  # mean of updates 0-1 of a 4-update warm-up to 4e-4
    assert row["mismatch/logprob_abs_max"] < 1e-4  # from the separate pass, before any update
    assert row["train/kl"] >= -1e-6 and row["reward/overlong_penalty_mean"] <= 0.0  # k3 >= 0 up to float32


@pytest.mark.slow
def test_demo_pipeline_at_toy_size(tmp_path: Path) -> None:
    """The demo's phases and report, shrunk (the real demo takes minutes)."""
    from trainer.cli.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        layers=2,
        warmup=WarmupConfig(steps=20, batch_size=16),
        draft_init=DraftInitConfig(prompts=32, steps=10, batch_size=16),
        rl_steps=1,
        acceptance_prompts=4,
    )
    report = run_demo(tmp_path, cfg)
    assert len(report.steps) == 1
    step = report.steps[0]
    assert step["time/generation_plain"] > 0 and step["speedup/generation"] > 0
    text = report.render()
    assert "speedup" in text and "before RL" in text
    assert (tmp_path / "run" / "plots" / "step_time.png").is_file()


@pytest.mark.slow
def test_asynchronous_steps_stay_within_the_lag_and_resume_without_losing_a_step(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """`rollout.max_policy_lag: 1` against real sidecars: step t+1 generates while step t trains,
    pushes land while rows are in flight (a sample's first and last tokens may come from
    different versions), every sample is at most one version behind the trainer, the loss
    carries the truncated importance weights, and a resume after an interruption with a batch
    in flight continues at the first untrained step."""
    cfg = RLConfig(
        model=checkpoints["policy"],
        task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
        rollout=RolloutConfig(
            prompts_per_step=8, samples_per_prompt=4, temperature=1.0, max_new_tokens=24, max_policy_lag=1
        ),
        optimizer=HybridOptimizerConfig(lr=5e-4),
        sidecars=SidecarsConfig(local=2),
        steps=4,
        eval_every=0,
        checkpoint_every=2,
        run_dir=tmp_path / "run",
    )
    history = train(cfg, progress=False)
    assert [m["weights/version"] for m in history] == [2.0, 3.0, 4.0, 5.0]
    assert all(0.0 <= m["rollout/policy_lag_max"] <= 1.0 for m in history), history
    assert history[1]["rollout/policy_lag_max"] == 1.0  # generated from the weights before step 0's push
    assert all(m["rollout/stale_regenerated"] == 0 for m in history)
    for m in history:  # importance weights: truncated at the cap, and near 1 one small update away
        assert 0.0 < m["train/is_weight_mean"] <= cfg.algorithm.importance_cap
        assert 0.0 <= m["train/is_weight_clipped_frac"] <= 1.0
        assert m["time/wait_generation"] >= 0 and m["time/wait_weights"] >= 0
    assert history[0]["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # step 0: nothing trained yet

    cfg.steps = 6  # resumes at step 4 (the last checkpoint) and trains steps 4 and 5 once each
    resumed = train(cfg, resume=True, progress=False)
    assert len(resumed) == 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert all(m["rollout/policy_lag_max"] <= 1.0 for m in resumed)
