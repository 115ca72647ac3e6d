"""Where megatron-core meets the machine: process groups, seeding and the CPU accommodations.

megatron-core (0.16.x, the newest that resolves on Python 3.11) is written for CUDA. It runs
correctly on CPU with gloo once three assumptions are met, and every one of them lives here so
that the rest of the trainer never branches on the device:

1. ``torch.cuda.current_device`` must return the CPU device. Megatron allocates buffers with
   ``device=torch.cuda.current_device()`` (rotary frequencies, attention masks, all-gather
   buffers, RNG bookkeeping); without CUDA that call raises. Returning ``torch.device("cpu")``
   makes every such allocation land on the CPU.
2. The causal mask must be passed explicitly as a boolean tensor. With ``attention_mask=None``
   Megatron's unfused softmax builds its default causal mask with ``device="cuda"``
   (``megatron.core.transformer.utils.get_default_causal_mask``), which fails on CPU.
   `causal_mask` builds the same mask (True = masked out) on the right device.
3. Seed with ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``. The training
   RNG tracker snapshots and restores *CUDA* generator states on every ``fork()``; the inference
   tracker's ``add``/``fork`` are no-ops, so dropout and initialisation draw from the CPU default
   generator instead. We train without dropout, so nothing is lost; initialisation is made
   tensor-parallel invariant with ``use_cpu_initialization`` (see `trainer.policy.policy`).

A fourth concerns mixture-of-experts layers wherever TransformerEngine is absent (CPU or not):
megatron-core 0.16.1's ``moe_utils`` imports its TE kernels (``te_general_gemm``, the fused
permutes and top-k) in a ``try`` that leaves the names undefined when TE is missing, and the
router's logits then raise ``NameError`` instead of taking its torch path;
`apply_moe_accommodations` defines them as None, the value Megatron tests for.

The CUDA accommodations are applied only when CUDA is absent (`apply_cpu_accommodations` is a no-op
otherwise); on GPU, megatron-core runs as designed with NCCL.

`init_single_process_group` and `free_port` serve tests and single-process tools: a world of
one over gloo on a FileStore/TCP store on 127.0.0.1. Multi-process runs are launched with
``torchrun`` (which sets the env:// variables) and call `init_distributed`.
"""

from __future__ import annotations

import datetime
import os
import socket
from contextlib import closing

import torch
import torch.distributed as dist


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def has_cuda() -> bool:
    """Whether this process trains on CUDA (False on the CPU/gloo path)."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device the policy lives on: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


def apply_cpu_accommodations() -> None:
    """Make megatron-core's CUDA-only calls resolve to the CPU (no-op when CUDA is present).

    Idempotent, and re-applied if something (a test's monkeypatch undo) restored the original.
    Only ``torch.cuda.current_device`` is patched; see the module docstring.
    """
    if has_cuda() or torch.cuda.current_device is _cpu_current_device:
        return
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


_TE_KERNELS = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def apply_moe_accommodations() -> None:
    """Define Megatron's TE kernel names in ``moe_utils`` as None where TE is absent (module
    docstring, the fourth accommodation); a no-op with TE, idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False):
        return
    for name in _TE_KERNELS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def causal_mask(seq_len: int, dev: torch.device | None = None) -> torch.Tensor:
    """Boolean causal mask in Megatron's convention: (1, 1, S, S), True where attention is masked.

    Position i may attend to j <= i. `attention_mask` passes it on every CPU forward
    (accommodation 2 in the module docstring).
    """
    dev = dev if dev is not None else device()
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=dev), diagonal=1)[None, None]


def attention_mask(seq_len: int, dev: torch.device | None = None) -> torch.Tensor | None:
    """What to pass as GPTModel's ``attention_mask`` for causal attention: the explicit boolean
    mask on CPU (accommodation 2), None on CUDA (Megatron/TE apply their own causal mask)."""
    return None if has_cuda() else causal_mask(seq_len, dev)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for test process groups)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend() -> str:
    """The collective backend: NCCL on CUDA, gloo on CPU."""
    return "nccl" if has_cuda() else "gloo"


def init_distributed(*, rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> None:
    """Join a process group of `world_size` over a TCP store on 127.0.0.1:`port`.

    Used by tests that spawn workers; `torchrun` launches use ``init_distributed_from_env``.
    """
    apply_cpu_accommodations()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call teardown() first")
    dist.init_process_group(
        backend=backend(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_distributed_from_env(*, timeout_s: float = 600.0) -> None:
    """Join the process group described by torchrun's env:// variables (RANK, WORLD_SIZE, ...)."""
    apply_cpu_accommodations()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("RANK/WORLD_SIZE are not set: launch with torchrun, or use init_single_process_group()")
    if has_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend(), timeout=datetime.timedelta(seconds=timeout_s))


def init_single_process_group() -> None:
    """A world of one (rank 0) on a free 127.0.0.1 port; no-op if a group already exists."""
    if dist.is_initialized():
        return
    init_distributed(rank=0, world_size=1, port=free_port())


def initialize_model_parallel(
    tensor_parallel: int = 1, pipeline_parallel: int = 1, *, seed: int = 1234, expert_parallel: int = 1
) -> None:
    """Create Megatron's TP/PP/DP (and expert-parallel) groups over the existing world and seed its RNG tracker.

    Data parallel size is what remains: world_size / (tensor_parallel * pipeline_parallel);
    `expert_parallel` ranks share out a mixture of experts' experts (it must divide the world).
    With groups of the same layout already present they are kept (models built on them stay
    valid) and only the RNGs are re-seeded; a different layout re-creates them.
    """
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("no process group: call init_single_process_group() or init_distributed_from_env() first")
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel*pipeline_parallel="
            f"{tensor_parallel * pipeline_parallel}; choose sizes that divide the number of processes"
        )
    if world % expert_parallel != 0:
        raise ValueError(
            f"world size {world} is not divisible by expert_parallel={expert_parallel}; launch a multiple of it"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
            and parallel_state.get_pipeline_model_parallel_world_size() == pipeline_parallel
            and parallel_state.get_expert_model_parallel_world_size() == expert_parallel
        ):
            seed_everything(seed)  # same layout: keep the groups (live models hold them)
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
    )
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Seed torch and Megatron's RNG tracker (accommodation 3 on CPU)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if has_cuda():
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    else:
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def teardown() -> None:
    """Destroy Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
