"""`specrl export`: a run's policy, with its draft, as a Hugging Face checkpoint.

A run keeps resumable Megatron checkpoints (`trainer.checkpointing`: ``runs/x/checkpoints/step_N``,
one ``rank*.pt`` per tensor-parallel shard); what a user takes out is the checkpoint naming
contract (`sidecar.model.checkpoint`), which transformers' ``Qwen3ForCausalLM.from_pretrained``,
`specrl serve` and SGLang read. Nothing here converts weights itself: the policy is rebuilt as
the run built it (`trainer.rl_loop.build_policy`), restored from the step's checkpoint as a resume
restores it (`Policy.load`), and written by the exporters the weight pushes and `draft-init` use
(`Policy.save_hf`: ``config.json`` + ``model.safetensors``, the MTP layers inside as
``mtp.layers.*``; `Policy.save_draft`: an EAGLE-3 draft in the SGLang/vLLM layout). The tokenizer
files (and generation_config.json) are copied from the checkpoint the run started from.

Layout of an export ``OUT/``::

    config.json, model.safetensors     the policy (and its MTP layers, if it has them)
    tokenizer.json, ...                the starting model's tokenizer files
    eagle3/                            the EAGLE-3 draft of a run that trains one (`draft.eagle3`):
                                       specrl serve --model OUT --draft OUT/eagle3

`specrl train` exports its last step to ``RUN_DIR/export`` at the end (run config ``export``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch.distributed as dist

from sidecar.errors import SpecrlError
from trainer.draft_objective import Eagle3Head
from trainer.policy import Policy
from trainer.ranks import is_leader
from trainer.tokenizer import copy_tokenizer_files

EXPORT_DIR = "export"
"""Where `specrl train` exports its last step, under the run directory."""
EAGLE3_DIR = "eagle3"
"""The EAGLE-3 draft's directory inside an export."""


class ExportError(SpecrlError, ValueError):
    """A run directory or step that cannot be exported; the message says what exists."""


def export_policy(policy: Policy, model: Path, out: Path) -> Path:
    """Write `policy` (its trunk and draft as they are now) to `out` as described in the module
    docstring, with the tokenizer files of `model` (the checkpoint the run started from).

    Collective under torchrun (the tensor-parallel shards are gathered; rank 0 writes). The export
    is assembled beside `out` and then moved into place, so `out` holds either the previous export
    or the whole new one, never a mixture of both."""
    out = Path(out)
    staging = out.with_name(out.name + ".partial")
    if is_leader() and staging.exists():
        shutil.rmtree(staging)  # what an interrupted export left
    policy.save_hf(staging)
    if isinstance(policy.draft, Eagle3Head):
        policy.save_draft(staging / EAGLE3_DIR)
    if is_leader():
        copy_tokenizer_files(model, staging)
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    if dist.is_initialized():
        dist.barrier()
    return out


def kept_steps(run_dir: Path) -> list[int]:
    """The steps of the run's kept checkpoints (``checkpoints/step_N``), ascending."""
    names = (p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    return sorted(int(n[len("step_") :]) for n in names if n[len("step_") :].isdigit())


def export_run(run_dir: Path, out: Path, step: int | None = None, *, progress: bool = False) -> int:
    """Export the run in `run_dir` at `step` (default: its last kept checkpoint) to `out`; returns
    the step exported. ExportError for a directory that holds no run, a step that was not kept,
    or an `out` that already holds something. `progress`: announce the phases on stderr."""
    from sidecar.config_io import ConfigError, from_mapping, load_file
    from trainer.rl_config import RLConfig
    from trainer.rl_loop import build_policy, phase

    run_dir, out = Path(run_dir), Path(out)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(
            f"{run_dir} is not a run directory (it has no config.yaml): pass the --run-dir of a `specrl train` run"
        )
    steps = kept_steps(run_dir)
    if not steps:
        raise ExportError(
            f"{run_dir} has no checkpoint to export (no checkpoints/step_N): a run writes one at its end "
            "and every checkpoint_every steps"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; kept steps: {', '.join(map(str, steps))}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty: choose another --out, or remove it first")
    try:
        cfg = from_mapping(RLConfig, load_file(config))
    except (ConfigError, TypeError) as e:
        raise ExportError(f"{config}: cannot be read as a run config ({e})") from None
    for path, key in ((cfg.model, "model"), (cfg.draft.eagle3, "draft.eagle3")):
        if path is not None and not Path(path).is_dir():
            raise ExportError(
                f"{config}: {key} {path} does not exist (relative paths are read from the current directory, "
                "as `specrl train` read them): run export from where the run was started"
            )
    # one process per tensor-parallel shard, as the run had (torchrun for > 1); replicas: any number
    world, tp = (dist.get_world_size() if dist.is_initialized() else 1), cfg.train.tensor_parallel
    if world % tp:
        raise ExportError(
            f"{run_dir} was trained with train.tensor_parallel={tp}: export it with one process per shard, "
            f"torchrun --nproc-per-node {tp} -m trainer.cli export {run_dir} --out {out}"
        )
    train = dataclasses.replace(cfg.train, data_parallel=world // tp)
    with phase(f"restoring the policy of step {step} (Megatron)", progress and is_leader()):
        policy = build_policy(dataclasses.replace(cfg, train=train))
        policy.load(run_dir / "checkpoints" / f"step_{step}")
    with phase(f"writing {out}", progress and is_leader()):
        export_policy(policy, cfg.model, out)
    return step
