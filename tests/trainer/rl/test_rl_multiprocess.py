"""The RL loop under several processes (gloo), end to end with a real sidecar: tensor parallel 2;
data parallel 2 x tensor parallel 2 in four processes, launched as two "nodes" by separate
`torchrun --nnodes 2` invocations; and rank 0 failing in the middle of a weight push.

Only rank 0 may start local sidecars, push weights and write the run directory; the other ranks
train their replica's share on their shard and (replica 0) take part in the weight export.
Oracles: the files on disk (one sidecar log, one writer of metrics.jsonl, one checkpoint file per
tensor-parallel shard), the weight versions the sidecar reports, and the sidecar's log-probs of
its samples, which equal the trainer's only if the pushed weights are the trainer's gathered
shards and (data parallel) every replica holds the same weights: each replica measures the
mismatch on its own share, and the reduced maximum covers all of them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from sidecar.model.checkpoint import load_checkpoint, model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from tests.spawn_workers import join_group, leave_group, python_call, run_commands, spawn
from trainer.policy import platform
from trainer.rl.ranks import EXIT_CODE


def _config(ckpt: str, run_dir: str, *, tp: int, eval_every: int = 2) -> object:
    from trainer.policy.losses import GRPOConfig
    from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TrainConfig

    return RLConfig(
        model=Path(ckpt),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, refill_rounds=0),
        algorithm=GRPOConfig(filter_equal_groups=False),
        train=TrainConfig(tensor_parallel=tp),
        sidecars=SidecarsConfig(local=1),
        steps=2,
        eval_every=eval_every,
        eval_size=4,
        run_dir=Path(run_dir),
    )


def _worker(rank: int, port: int, ckpt: str, run_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port)
    from trainer.rl.loop import train

    history = train(_config(ckpt, run_dir, tp=2), progress=False)  # type: ignore[arg-type]
    torch.save(history, f"{out}.{rank}")
    leave_group()


def _checkpoint(tmp_path: Path) -> Path:
    mc = ModelConfig.tiny(vocab_size=128, max_position_embeddings=128)
    save_checkpoint(tmp_path / "ckpt", mc, model_state_dict(build_model(mc, seed=2)))
    return tmp_path / "ckpt"


@pytest.mark.slow
def test_two_tensor_parallel_ranks_run_the_loop_with_one_writer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    spawn(_worker, (str(_checkpoint(tmp_path)), str(run), str(tmp_path / "history")), nprocs=2, timeout_s=280)
    h0 = torch.load(tmp_path / "history.0", weights_only=False)
    h1 = torch.load(tmp_path / "history.1", weights_only=False)

    # every rank returns rank 0's step metrics (the evaluation runs on rank 0 only)
    assert len(h0) == 2 and h1 == [{k: v for k, v in m.items() if not k.startswith("reward/eval")} for m in h0]
    assert [m["rollout/weight_version"] for m in h0] == [1.0, 2.0]
    assert [m["weights/version"] for m in h0] == [2.0, 3.0]
    # the sidecar's log-probs are the sharded trainer's: the push carried the gathered shards
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in h0), [m["mismatch/logprob_abs_max"] for m in h0]
    assert [p.name for p in (run / "logs").glob("*.log")] == ["sidecar0.1.log"]  # one sidecar, started once
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # one writer
    assert "reward/eval_stderr" in rows[-1]
    assert {"rank00000.pt", "rank00001.pt"} <= {p.name for p in (run / "checkpoints" / "step_2").iterdir()}

    # the run's export at its end gathered both shards; `specrl export` under torchrun restores the
    # step from its two shard files and writes the same tensors, bit for bit
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer.cli.main"]
    export = [*torchrun, "export", str(run), "--step", "2", "--out", str(tmp_path / "exported")]
    ((code, output),) = run_commands([export], timeout_s=200, env={"OMP_NUM_THREADS": "1"})
    assert code == 0 and output.count("export: step 2 of") == 1, output[-3000:]  # rank 0 reports
    _, at_end = load_checkpoint(run / "export")  # full (gathered) shapes, as config.json says
    _, exported = load_checkpoint(tmp_path / "exported")
    assert at_end.keys() == exported.keys() and all(torch.equal(at_end[n], exported[n]) for n in at_end)


def _node_command(node: int, port: int, ckpt: Path, run: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
    torchrun += ["--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    train = ["-m", "trainer.cli.main", "train", "--model", str(ckpt), "--run-dir", str(run), "--local-sidecars", "1"]
    sets = [
        "steps=2",
        "eval_every=0",
        "train.data_parallel=2",
        "train.tensor_parallel=2",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8",
        "rollout.refill_rounds=0",
        "algorithm.filter_equal_groups=false",
    ]
    return torchrun + train + [a for s in sets for a in ("--set", s)]


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_data_x_tensor_parallel_end_to_end(tmp_path: Path) -> None:
    """Two `torchrun --nnodes 2 --nproc-per-node 2` invocations: four processes, two data-parallel
    replicas of two tensor-parallel shards (each replica on one "node"), a real sidecar."""
    ckpt, run, port = _checkpoint(tmp_path), tmp_path / "run", platform.free_port()
    env = {"OMP_NUM_THREADS": "1"}
    (c0, o0), (c1, o1) = run_commands([_node_command(n, port, ckpt, run) for n in (0, 1)], timeout_s=500, env=env)
    assert c0 == 0 and c1 == 0, (o0[-3000:], o1[-3000:])
    assert "done: 2 steps" in o0 and "done:" not in o1  # rank 0 (node 0) reports
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one writer
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0]
    assert [r["weights/version"] for r in rows] == [2.0, 3.0]
    # step 2's samples come from the pushed update; each replica compares them with its own weights
    # on its own share, and the maximum is reduced over both
    assert all(r["mismatch/logprob_abs_max"] < 1e-4 for r in rows), [r["mismatch/logprob_abs_max"] for r in rows]
    # metrics are reduced over the replicas: the loss counted every response token of the batch
    assert all(r["train/tokens"] == pytest.approx(4 * r["rollout/response_len"]) for r in rows)
    assert [p.name for p in (run / "logs").glob("*.log")] == ["sidecar0.1.log"]  # one sidecar, by rank 0
    # replica 0 writes one file per tensor-parallel shard
    assert sorted(p.name for p in (run / "checkpoints" / "step_2").glob("*.pt")) == ["rank00000.pt", "rank00001.pt"]


def _failing_push_worker(ckpt: str, run_dir: str) -> None:
    """A rank of a tensor-parallel-2 run (env:// from the test); rank 0's second push (step 0's)
    fails after two tensors, while rank 1 is inside the export's all-gathers."""
    torch.set_num_threads(1)
    from sidecar.client.fleet import Fleet
    from trainer.rl.loop import train

    if os.environ["RANK"] == "0":
        real = Fleet.push_weights
        calls = []

        def push(self, weights, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 2:
                source = weights()
                next(source), next(source)
                raise RuntimeError("injected: the push to the sidecars failed")
            return real(self, weights, *args, **kwargs)

        Fleet.push_weights = push  # type: ignore[method-assign]
    train(_config(ckpt, run_dir, tp=2, eval_every=0), progress=False)  # type: ignore[arg-type]


@pytest.mark.slow
def test_rank_0_failing_mid_push_stops_every_rank_with_its_error(tmp_path: Path) -> None:
    ckpt, run, port = _checkpoint(tmp_path), tmp_path / "run", platform.free_port()
    commands = [python_call("tests.trainer.rl.test_rl_multiprocess:_failing_push_worker", ckpt, run) for _ in range(2)]
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in (0, 1)]
    # the process group waits 600 s (init_distributed_from_env); the watchdog must end it far sooner
    (c0, o0), (c1, o1) = run_commands(commands, timeout_s=240, envs=envs)
    assert c0 == 1 and "injected: the push to the sidecars failed" in o0, o0[-3000:]
    assert c1 == EXIT_CODE and "stopped because rank 0: RuntimeError: injected: the push" in o1, o1[-3000:]
    log = (run / "logs" / "sidecar0.1.log").read_text()
    assert log  # rank 0 started the sidecar and, failing, stopped it: no process is left behind
