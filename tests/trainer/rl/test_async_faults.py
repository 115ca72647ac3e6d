"""Asynchronous RL (`rollout.max_policy_lag` 1 and 2) under faults, with real processes: `specrl
serve` sidecars, the real trainer loop, real gloo ranks.

Each fault either ends the run within a stated bound with an error that names the cause, or the
run goes on with nothing lost. Oracles: the rows of every batch the policy trained on (each step
trains once, on a full batch), the weight version every trained sample reports (never older
than the lag bound allows, never the restarted sidecar's initial weights), the versions the
sidecars report (GetInfo), the steps in metrics.jsonl, exit codes and the lines processes print,
and whether a sidecar's port still answers.

Faults are injected at a chosen moment by wrapping the loop's own functions (the step's update,
the producer's rollout) in this process, or in the spawned trainer's: nothing the loop does is
replaced. The synchronous counterparts are in tests/trainer/rl/test_rl_loop.py; the schedule alone, with
fakes, in tests/trainer/rl/test_async_rl.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.client.fleet import FleetConfig
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.model import ModelConfig
from tests.spawn_workers import python_call, run_commands
from trainer.policy import platform
from trainer.policy.losses import GRPOConfig
from trainer.policy.policy import Policy, TrainBatch
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TaskConfig, TrainConfig
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.ranks import EXIT_CODE
from trainer.rl.warmup import make_model
from trainer.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOK = CharTokenizer()
PROMPTS, G = 6, 4
ROWS = PROMPTS * G
RUN_BOUND_S = 240.0
"""A faulty run of a few steps ends (trained, or stopped with its error) within this; one takes
3-30 s on a 2-core box. In the default suite: (a), (c) at lags 1 and 2, (b) and (d) at lag 1
(about a minute); the rest is marked `long` (pytest --long)."""
WAIT_S = 60.0
"""How long an injected fault waits for the moment it targets."""


def tiny() -> ModelConfig:
    return ModelConfig.tiny(
        vocab_size=TOK.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny model: responses run to max_new_tokens, so generation is long enough to
    be interrupted, and no reward is needed (no group is filtered out)."""
    return make_model(tmp_path_factory.mktemp("faults") / "policy", tiny(), seed=0)


def config(checkpoint: Path, run_dir: Path, *, lag: int, steps: int, **overrides: Any) -> RLConfig:
    return RLConfig(
        model=checkpoint,
        task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
        rollout=RolloutConfig(
            prompts_per_step=PROMPTS,
            samples_per_prompt=G,
            temperature=1.0,
            max_new_tokens=20,
            refill_rounds=0,
            max_policy_lag=lag,
            deadline_s=60.0,
        ),
        algorithm=GRPOConfig(filter_equal_groups=False),  # every batch is full: PROMPTS * G rows
        sidecars=SidecarsConfig(local=2),
        steps=steps,
        eval_every=0,
        checkpoint_every=1,
        run_dir=run_dir,
        **overrides,
    )


@dataclass
class Watch:
    """What the loop did, recorded by wrapping its functions in this process."""

    local: LocalSidecars | None = None
    trained: list[tuple[int, int]] = field(default_factory=list)
    """Per update: (trainer step, batch rows)."""
    generating: int | None = None
    """The step whose rollout the producer is generating now."""
    hooks: dict[int, Callable[[Watch, int], None]] = field(default_factory=dict)
    """Called at the start of step s's update (main thread; the producer generates ahead)."""
    versions_at_update: list[int] = field(default_factory=list)
    """The trainer's weight version at each step's start (what the lag is measured against)."""
    faults: list[threading.Thread] = field(default_factory=list)
    killed_during: int = -1
    """The step whose rollout was generating when sidecar 0 was killed."""

    def in_background(self, fault: Callable[[], None]) -> None:
        """Run `fault` beside the loop (it waits for its moment without holding up the trainer)."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                fault()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=run, name="fault", daemon=True)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.start()
        self.faults.append(thread)

    def faults_done(self) -> None:
        for thread in self.faults:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "an injected fault never ran"
            for e in thread.errors:  # type: ignore[attr-defined]
                raise e


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    import trainer.rl.loop as loop
    import trainer.rl.rollouts as rollouts
    import trainer.rl.run_setup as run_setup

    w = Watch()

    class Recorded(LocalSidecars):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            w.local = self

    real_gather, real_update, real_step = rollouts.gather_rollout, Policy.train_updates, loop.rl_step
    step_now = [0]

    def gather(run: Any, step: int) -> Any:
        w.generating = step
        try:
            rollout = real_gather(run, step)
        finally:
            w.generating = None
        versions = [s.weight_version for g in rollout.groups for s in g.samples]
        rollout.metrics["test/min_version"] = float(min(versions))
        return rollout

    def rl_step(run: Any, step: int, rollouts: Any = None) -> dict[str, float]:
        step_now[0] = step
        w.versions_at_update.append(run.fleet.version)
        return real_step(run, step, rollouts)

    def train_updates(self: Policy, batch: TrainBatch, **kwargs: Any) -> dict[str, float]:
        step = step_now[0]
        if step in w.hooks:
            w.hooks[step](w, step)
        w.trained.append((step, batch.tokens.shape[0]))
        return real_update(self, batch, **kwargs)

    monkeypatch.setattr(run_setup, "LocalSidecars", Recorded)
    monkeypatch.setattr(rollouts, "gather_rollout", gather)
    monkeypatch.setattr(loop, "rl_step", rl_step)
    monkeypatch.setattr(Policy, "train_updates", train_updates)
    # a down sidecar is probed for rejoining at the trainer's next push, not 30 s later
    monkeypatch.setattr(run_setup, "FleetConfig", lambda **kw: FleetConfig(probe_interval_s=0.2, **kw))
    yield w


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the fault's moment never came: {what} within {timeout_s:.0f}s")
        time.sleep(0.01)


def kill_mid_generation(w: Watch, step: int, *, restart: bool) -> None:
    """From step `step` on, in the background: SIGKILL sidecar 0 once the producer generates a
    later step than the trainer's and sidecar 0 has started on it (tokens produced), so its
    streams break mid-way; with `restart`, start it again at once, empty (the checkpoint's
    weights, version 0), on its old port."""
    local = w.local
    assert local is not None
    address = local.addresses[0]

    def fault() -> None:
        with SidecarClient(address) as c:
            before = c.stats().total.generated_tokens
            wait_for(lambda: w.generating is not None and w.generating > step, f"the producer past step {step}")
            ahead = w.generating
            wait_for(lambda: c.stats().total.generated_tokens > before, "sidecar 0 producing tokens")
        local.kill(0)
        w.killed_during = ahead  # type: ignore[assignment]
        if restart:
            local.restart(0)

    w.in_background(fault)


def assert_nothing_lost(history: list[dict[str, float]], w: Watch, *, lag: int, steps: int) -> None:
    """Every step trained once, on a full batch, from samples within the lag bound."""
    assert [s for s, _ in w.trained] == list(range(steps))  # none twice, none skipped
    assert all(rows == ROWS for _, rows in w.trained), w.trained
    assert [m["weights/version"] for m in history] == [float(v) for v in range(2, steps + 2)]
    assert all(0.0 <= m["rollout/policy_lag_max"] <= lag for m in history), [
        m["rollout/policy_lag_max"] for m in history
    ]
    assert all(m["rollout/duplicates"] == 0 for m in history)
    # the oldest sample of each step: within the bound of the version the trainer held then
    for m, held in zip(history, w.versions_at_update, strict=True):
        assert held - lag <= m["test/min_version"] <= held, (m["test/min_version"], held)


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, 2])
def test_a_sidecar_killed_while_the_producer_generates_loses_nothing(
    checkpoint: Path, tmp_path: Path, watch: Watch, lag: int
) -> None:
    """(a) Sidecar 0 dies while the next batch is generating: its prompts are re-routed to
    sidecar 1 and the run trains every step on a full batch; sidecar 0 stays down."""
    steps = 4
    watch.hooks[0] = lambda w, s: kill_mid_generation(w, s, restart=False)
    t = time.monotonic()
    history = train_run(config(checkpoint, tmp_path / "run", lag=lag, steps=steps))
    assert time.monotonic() - t < RUN_BOUND_S
    watch.faults_done()
    assert_nothing_lost(history, watch, lag=lag, steps=steps)
    hit = history[watch.killed_during]
    assert hit["rollout/rerouted"] > 0, hit  # the kill broke streams of the batch in flight


def train_run(cfg: RLConfig, **kwargs: Any) -> list[dict[str, float]]:
    from trainer.rl.loop import train

    return train(cfg, progress=False, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, 2])
def test_a_sidecar_restarted_empty_serves_only_after_it_has_the_current_weights(
    checkpoint: Path, tmp_path: Path, watch: Watch, lag: int
) -> None:
    """(c) Sidecar 0 is killed mid-generation and started again at once, empty (version 0, the
    checkpoint's weights) on its old port. It must not sample for the run until the trainer has
    pushed it the current weights (between updates), and then it serves again."""
    steps = 8
    watch.hooks[0] = lambda w, s: kill_mid_generation(w, s, restart=True)
    watch.hooks[2] = lambda w, s: w.faults_done()  # the restart is complete (a slow update)
    served: dict[str, int] = {}

    def last_step(w: Watch, s: int) -> None:  # both sidecars serve what the trainer last pushed
        assert w.local is not None
        for n, a in enumerate(w.local.addresses):
            with SidecarClient(a) as c:
                served[f"version{n}"] = c.info().weight_version
                served[f"tokens{n}"] = c.stats().total.generated_tokens

    watch.hooks[steps - 1] = last_step
    t = time.monotonic()
    history = train_run(config(checkpoint, tmp_path / "run", lag=lag, steps=steps))
    assert time.monotonic() - t < RUN_BOUND_S
    watch.faults_done()
    assert_nothing_lost(history, watch, lag=lag, steps=steps)
    assert all(m["test/min_version"] >= 1 for m in history)  # none from the restarted sidecar's version 0
    assert history[watch.killed_during]["rollout/rerouted"] > 0  # the kill broke streams in flight
    assert served["version0"] == served["version1"] == watch.versions_at_update[-1], served
    assert served["tokens0"] > 0, served  # the restarted sidecar took work again
    assert len(list((tmp_path / "run" / "logs").glob("sidecar0.*.log"))) == 2  # the restart was real


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, pytest.param(2, marks=pytest.mark.long)])
def test_a_push_refused_with_a_batch_in_flight_stops_the_run_naming_the_sidecar(
    checkpoint: Path, tmp_path: Path, watch: Watch, lag: int
) -> None:
    """(b) While the producer generates ahead, another writer pushes sidecar 0 a newer version
    (1000): the trainer's next push is refused by sidecar 0 as stale. The run stops at once with
    sidecar 0's error, trains nothing after it, and `--resume` runs every step once."""
    state = load_checkpoint(checkpoint)[1]
    in_flight: list[int | None] = []

    def other_writer(w: Watch, step: int) -> None:
        local = w.local
        assert local is not None
        address = local.addresses[0]

        def fault() -> None:
            with SidecarClient(address) as c:
                before = c.stats().total.generated_tokens
                wait_for(lambda: w.generating is not None and w.generating > step, "the producer generating ahead")
                wait_for(lambda: c.stats().total.generated_tokens > before, "sidecar 0 producing tokens")
                specs, _ = c.describe_weights()
                c.push_weights([(spec.name, state[spec.name]) for spec in specs], 1000)

        w.in_background(fault)
        w.faults_done()  # the trainer's push comes after the other writer's
        in_flight.append(w.generating)

    watch.hooks[0] = other_writer
    cfg = config(checkpoint, tmp_path / "run", lag=lag, steps=4)
    t = time.monotonic()
    with pytest.raises(SidecarCallError) as refused:
        train_run(cfg)
    assert time.monotonic() - t < RUN_BOUND_S
    assert in_flight[0] is not None  # a batch was generating when the update began
    assert watch.local is not None
    err = refused.value
    assert err.method == "PushWeights" and err.code == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "1000" in err.details, err  # names the version sidecar 0 serves
    assert [s for s, _ in watch.trained] == [0]  # step 0 trained, its push refused; nothing after
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step logged

    watch.trained.clear()
    watch.hooks.clear()
    watch.versions_at_update.clear()
    history = train_run(cfg, resume=True)  # fresh local sidecars: every step once
    assert [s for s, _ in watch.trained] == [0, 1, 2, 3]
    assert all(m["rollout/policy_lag_max"] <= lag for m in history)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def _listening(log: Path) -> str:
    for line in log.read_text(errors="replace").splitlines():
        if "listening on" in line:
            return line.rsplit(" ", 1)[1]
    raise AssertionError(f"{log} has no 'listening on' line")


def answers(address: str) -> bool:
    """Whether something still serves `address` (a health check within 2 s)."""
    with SidecarClient(address) as c:
        return c.health()


def _train_command(checkpoint: Path, run: Path, *, lag: int, steps: int, resume: bool) -> list[str]:
    sets = {
        "steps": steps,
        "eval_every": 0,
        "checkpoint_every": 2,
        "rollout.prompts_per_step": PROMPTS,
        "rollout.samples_per_prompt": G,
        "rollout.max_new_tokens": 20,
        "rollout.refill_rounds": 0,
        "rollout.max_policy_lag": lag,
        "algorithm.filter_equal_groups": "false",
    }
    cmd = [sys.executable, "-m", "trainer.cli.main", "train", "--model", str(checkpoint), "--run-dir", str(run)]
    cmd += ["--local-sidecars", "2", *(["--resume"] if resume else [])]
    return cmd + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.slow
@pytest.mark.parametrize("lag", [1, pytest.param(2, marks=pytest.mark.long)])
def test_a_trainer_killed_mid_step_resumes_without_training_a_step_twice_or_skipping_one(
    checkpoint: Path, tmp_path: Path, lag: int
) -> None:
    """(d) `specrl train` is SIGKILLed mid-step (step 4 training, later batches generating, the
    last checkpoint at step 2, step 3 logged after it). Its sidecars must not outlive it, and
    `--resume` continues from step 2: the log holds each step once, from the run that counts."""
    run, steps = tmp_path / "run", 8
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    metrics = run / "metrics.jsonl"
    proc = subprocess.Popen(
        _train_command(checkpoint, run, lag=lag, steps=steps, resume=False),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
            "step 3 logged",
            timeout_s=RUN_BOUND_S,
        )
        proc.kill()  # within ~10 ms of step 3's row: step 4 trains, later batches generate
    finally:
        proc.kill()
        proc.wait(30)
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged[:3] == [1, 2, 3] and len(logged) < steps, logged
    killed_at = len(logged)
    # the killed trainer's sidecars stop by themselves: nothing serves their ports for long
    addresses = [_listening(p) for p in sorted((run / "logs").glob("sidecar*.log"))]
    deadline = time.monotonic() + 30
    while any(answers(a) for a in addresses) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(answers(a) for a in addresses), f"sidecars {addresses} outlived their trainer"

    t = time.monotonic()
    done = subprocess.run(
        _train_command(checkpoint, run, lag=lag, steps=steps, resume=True),
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - t < RUN_BOUND_S
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed_from = 2 * (killed_at // 2)  # the last checkpoint before the kill
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == f"step_{steps}"
    assert all(r["rollout/policy_lag_max"] <= lag for r in rows)
    resumed_rows = rows[resumed_from:]
    assert [r["weights/version"] for r in resumed_rows] == [float(v) for v in range(2, 2 + len(resumed_rows))]


def _dp_worker(checkpoint: str, run_dir: str, lag: str) -> None:
    """A rank of a data-parallel-2 run (env:// from the test); rank 1 SIGKILLs itself at the start
    of step 1's update, while rank 0's producer generates step 2's batch ahead."""
    torch.set_num_threads(1)
    from trainer.rl.loop import train

    if os.environ["RANK"] == "1":
        real = Policy.train_updates
        calls = []

        def train_updates(self: Policy, batch: TrainBatch, **kwargs: Any) -> dict[str, float]:
            calls.append(1)
            if len(calls) == 2:
                time.sleep(0.5)  # rank 0's producer is well into the next batch
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, batch, **kwargs)

        Policy.train_updates = train_updates  # type: ignore[method-assign]
    cfg = config(Path(checkpoint), Path(run_dir), lag=int(lag), steps=4, train=TrainConfig(data_parallel=2))
    cfg.train.rank_timeout_s = 20.0
    cfg.sidecars.local = 1
    train(cfg, progress=False)
    print("finished without noticing rank 1", flush=True)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("lag", [1, 2])
def test_a_rank_killed_with_a_batch_in_flight_stops_every_rank_and_its_sidecars(
    checkpoint: Path, tmp_path: Path, lag: int
) -> None:
    """(e) Data parallel 2 (gloo): rank 1 is SIGKILLed during step 1's update while rank 0's
    producer generates ahead. Rank 0 stops within train.rank_timeout_s (20 s) plus its teardown,
    naming rank 1, and stops its local sidecar on the way out."""
    run, port = tmp_path / "run", platform.free_port()
    commands = [python_call("tests.trainer.rl.test_async_faults:_dp_worker", checkpoint, run, lag) for _ in range(2)]
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in (0, 1)]
    (c0, o0), (c1, _) = run_commands(commands, timeout_s=RUN_BOUND_S, envs=envs, env={"OMP_NUM_THREADS": "1"})
    assert c1 == -signal.SIGKILL
    assert c0 in (1, EXIT_CODE), o0[-3000:]  # its own collective failed (1), or its watchdog stopped it
    assert "RankFailure: rank 1 died" in o0 or "rank 1: silent" in o0, o0[-3000:]
    assert "finished without noticing" not in o0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # step 0 trained on both ranks; step 1 on neither
    address = _listening(next((run / "logs").glob("sidecar0.*.log")))
    assert not answers(address), f"sidecar {address} outlived the run"
