"""`specrl export`: a run's policy, with its draft, as a Hugging Face checkpoint.

A run keeps resumable Megatron checkpoints (`trainer.policy.checkpointing`: ``runs/x/checkpoints/step_N``,
one ``rank*.pt`` per tensor-parallel shard); what a user takes out is the checkpoint naming
contract (`sidecar.model.checkpoint`), which transformers' ``Qwen3ForCausalLM.from_pretrained``,
`specrl serve` and SGLang read. Nothing here converts weights itself: the policy is rebuilt as
the run built it (`trainer.rl.run_setup.build_policy`), restored from the step's checkpoint as a resume
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

import shutil
from pathlib import Path

import torch.distributed as dist

from sidecar.errors import SpecrlError
from trainer.draft.objective import Eagle3Head
from trainer.policy.policy import Policy
from trainer.rl.ranks import is_leader
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
