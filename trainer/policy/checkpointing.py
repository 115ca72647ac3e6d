"""Resumable training checkpoints: everything a step depends on, so resume continues bit for bit.

A checkpoint is a directory with one ``rank{r:05d}.pt`` per tensor-parallel shard r (that shard
of the model, the draft head, both optimizers, step counter and RNG states) and ``config.json``
(the model config, written by rank 0). Data-parallel replicas hold identical state, so only
replica 0 writes and every replica reads its shard's file: a run resumes with any
``train.data_parallel`` as long as ``train.tensor_parallel`` is unchanged. RNG states cover torch (CPU and, where present, CUDA), Python's ``random``,
NumPy and megatron-core's RNG tracker, as Megatron-LM's own checkpoints do.

Files are loaded with ``torch.load(weights_only=True)``: RNG states are stored as tensors and
plain tuples so no pickled objects are needed. Exporting weights for serving is a different thing
(`Policy.export_named_tensors` / `save_hf_checkpoint`, the naming contract).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from sidecar.errors import CheckpointError


class Policy(Protocol):
    """What a checkpoint saves and restores of a policy (`trainer.policy.policy.Policy`; a protocol, so
    that this module, which the policy imports, imports nothing of it)."""

    model: Any
    draft: Any
    optimizer: Any
    draft_optimizer: Any
    scheduler: Any
    draft_scheduler: Any
    step_count: int
    model_config: Any

    def state(self) -> dict[str, Any]: ...


FORMAT = "specrl.trainer.checkpoint/1"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _shard() -> tuple[int, bool]:
    """(this rank's tensor-parallel shard, whether it writes: data-parallel replica 0 does)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return _rank(), True
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank() == 0


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, in weights_only-loadable form."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (
            str(kind),
            torch.from_numpy(np.asarray(keys).astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        ),
        "megatron_tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`'s output."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss_np = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss_np))
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def save_policy(policy: Policy, path: Path) -> None:
    """Write this rank's state into `path` (every rank calls it; data-parallel replica 0 writes
    one file per tensor-parallel shard, rank 0 writes config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    shard, writes = _shard()
    if writes:
        payload = {"format": FORMAT, "policy": policy.state(), "rng": rng_state()}
        tmp = path / f"rank{shard:05d}.pt.tmp"
        torch.save(payload, tmp)
        tmp.replace(path / f"rank{shard:05d}.pt")  # atomic: a crash never leaves a half-written file
    if _rank() == 0:
        (path / "config.json").write_text(json.dumps(policy.model_config.to_hf_dict(), indent=2, sort_keys=True))
    if dist.is_initialized():
        dist.barrier()


def load_policy(policy: Policy, path: Path) -> None:
    """Restore this rank's state from `path` (written by `save_policy` with the same layout)."""
    file = path / f"rank{_shard()[0]:05d}.pt"
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist: was the checkpoint written with the same train.tensor_parallel?")
    payload = torch.load(file, map_location="cpu", weights_only=True)
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a specrl trainer checkpoint (format {payload.get('format')!r})")
    state = payload["policy"]
    missing, unexpected = policy.model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{file}: model state mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
    if (state["draft"] is None) != (policy.draft is None):
        raise CheckpointError(f"{file}: draft head presence differs from this model (num_nextn_predict_layers)")
    if policy.draft is not None:
        policy.draft.load_state_dict(state["draft"])
    policy.optimizer.load_state_dict(state["optimizer"])
    if policy.draft_optimizer is not None:
        policy.draft_optimizer.load_state_dict(state["draft_optimizer"])
    if state.get("scheduler") is not None:  # checkpoints from before LR schedules have none
        policy.scheduler.load_state_dict(state["scheduler"])
    if state.get("draft_scheduler") is not None and policy.draft_scheduler is not None:
        policy.draft_scheduler.load_state_dict(state["draft_scheduler"])
    policy.step_count = int(state["step"])
    set_rng_state(payload["rng"])
