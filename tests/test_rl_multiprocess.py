"""The RL loop under two processes (gloo, tensor parallel 2), end to end with a real sidecar.

Only rank 0 may start local sidecars, push weights and write the run directory; rank 1 trains its
shard of the same batches and takes part in the weight export. Oracles: the files on disk (one
sidecar log, one writer of metrics.jsonl), the weight versions the sidecar reports, and the
sidecar's log-probs of its samples, which equal the sharded trainer's only if the pushed weights
are the trainer's gathered tensor-parallel shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from tests.spawn_workers import join_group, leave_group, spawn


def _worker(rank: int, port: int, ckpt: str, run_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, 2, port)
    from trainer.losses import GRPOConfig
    from trainer.rl_config import RLConfig, RolloutConfig, SidecarsConfig, TrainConfig
    from trainer.rl_loop import train

    cfg = RLConfig(
        model=Path(ckpt),
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, refill_rounds=0),
        algorithm=GRPOConfig(filter_equal_groups=False),
        train=TrainConfig(tensor_parallel=2),
        sidecars=SidecarsConfig(local=1),
        steps=2,
        eval_every=2,
        eval_size=4,
        run_dir=Path(run_dir),
    )
    history = train(cfg, progress=False)
    torch.save(history, f"{out}.{rank}")
    leave_group()


@pytest.mark.slow
def test_two_tensor_parallel_ranks_run_the_loop_with_one_writer(tmp_path: Path) -> None:
    mc = ModelConfig.tiny(vocab_size=128, max_position_embeddings=128)
    save_checkpoint(tmp_path / "ckpt", mc, model_state_dict(build_model(mc, seed=2)))
    run = tmp_path / "run"
    spawn(_worker, (str(tmp_path / "ckpt"), str(run), str(tmp_path / "history")), nprocs=2, timeout_s=280)
    h0 = torch.load(tmp_path / "history.0", weights_only=False)
    h1 = torch.load(tmp_path / "history.1", weights_only=False)

    # every rank returns rank 0's step metrics (the evaluation runs on rank 0 only)
    assert len(h0) == 2 and h1 == [{k: v for k, v in m.items() if not k.startswith("reward/eval")} for m in h0]
    assert [m["rollout/weight_version"] for m in h0] == [1.0, 2.0]
    assert [m["weights/version"] for m in h0] == [2.0, 3.0]
    # the sidecar's log-probs are the sharded trainer's: the push carried the gathered shards
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in h0), [m["mismatch/logprob_abs_max"] for m in h0]
    assert [p.name for p in (run / "logs").iterdir()] == ["sidecar0.1.log"]  # one sidecar, started once
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # one writer
    assert "reward/eval_stderr" in rows[-1]
    assert {"rank00000.pt", "rank00001.pt"} <= {p.name for p in (run / "checkpoints" / "step_2").iterdir()}
