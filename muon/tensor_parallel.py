"""Tensor parallelism for Muon: orthogonalise the full matrix, keep the local shard.

The polar factor is not shard-local: orthogonalising each rank's slice of a column-parallel
weight would give an update that depends on the tensor-parallel (TP) size. So for a TP-sharded
parameter the momentum-updated shard is all-gathered along its partition dimension, the full
matrix is orthogonalised (identically on every rank), and each rank keeps its own chunk. Every
rank then holds exactly the update a single process would compute; the cost is one all-gather
of the update per sharded matrix and redundant Newton–Schulz work on every rank — the
"duplicated" mode of megatron-core 0.16's own ``TensorParallelMuon``, and the gather-then-
orthogonalise idea of Moonlight's Distributed Muon (Liu et al. 2025, arXiv:2502.16982).

megatron-core marks sharded parameters with attributes
(megatron/core/tensor_parallel/layers.py, ``set_tensor_model_parallel_attributes``):
``tensor_model_parallel`` (bool), ``partition_dim`` (0 column-parallel, 1 row-parallel) and
``partition_stride``. With stride s each rank stores s pieces, piece j being the rank's slice of
the j-th of s equal global blocks (how a SwiGLU fc1 stores ``[gate_shard; up_shard]``); the
gather below rebuilds the global order, and the scatter inverts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Where a parameter's local tensor sits in the global matrix."""

    group: dist.ProcessGroup
    """The tensor-parallel process group."""
    dim: int
    """Partition dimension (0: rows sharded, 1: columns sharded)."""
    stride: int = 1
    """Pieces per rank (see module docstring)."""

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


def is_tensor_parallel(param: Tensor) -> bool:
    """Whether megatron-core marked this parameter as sharded across the TP group."""
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_spec(param: Tensor, group: dist.ProcessGroup | None, *, row_stride: int | None = None) -> ShardSpec | None:
    """The shard layout of ``param`` from megatron-core's attributes; None when not sharded.

    ``row_stride`` overrides ``partition_stride`` for row-sharded (dim 0) parameters whose fused
    row layout the caller knows better (a SwiGLU fc1 is stride 2 however megatron-core labelled it).
    """
    if group is None or not is_tensor_parallel(param) or dist.get_world_size(group) == 1:
        return None
    dim = int(getattr(param, "partition_dim", 0))
    if dim not in (0, 1) or param.ndim != 2:
        raise ValueError(
            f"tensor-parallel parameter of shape {tuple(param.shape)} has partition_dim={dim}; "
            "Muon supports 2-D weights sharded along dim 0 or 1"
        )
    stride = row_stride if (row_stride is not None and dim == 0) else int(getattr(param, "partition_stride", 1))
    spec = ShardSpec(group=group, dim=dim, stride=stride)
    if param.size(dim) % spec.stride:
        raise ValueError(
            f"tensor-parallel parameter of shape {tuple(param.shape)}: partition_stride={spec.stride} "
            f"does not divide its local size {param.size(dim)} along dim {dim}"
        )
    return spec


def global_shape(param: Tensor, group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Shape of the unsharded parameter (its own shape when not tensor-parallel)."""
    spec = shard_spec(param, group)
    if spec is None:
        return tuple(param.shape)
    shape = list(param.shape)
    shape[spec.dim] *= spec.world_size
    return tuple(shape)


def gather_full(local: Tensor, spec: ShardSpec) -> Tensor:  # local (r, c) -> full in global order
    """All-gather the shards of ``local`` along ``spec.dim`` and rebuild the global matrix."""
    pieces = [torch.empty_like(local) for _ in range(spec.world_size)]
    dist.all_gather(pieces, local.contiguous(), group=spec.group)
    by_rank = [piece.chunk(spec.stride, dim=spec.dim) for piece in pieces]
    return torch.cat([by_rank[r][j] for j in range(spec.stride) for r in range(spec.world_size)], dim=spec.dim)


def local_chunk(full: Tensor, spec: ShardSpec) -> Tensor:  # full in global order -> this rank's (r, c)
    """This rank's shard of a global-order matrix (inverse of :func:`gather_full`)."""
    blocks = full.chunk(spec.stride, dim=spec.dim)
    return torch.cat([block.chunk(spec.world_size, dim=spec.dim)[spec.rank] for block in blocks], dim=spec.dim)


def total_grad_norm(
    params: Iterable[Tensor],
    group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    *,
    expert_group: dist.ProcessGroup | None = None,
) -> Tensor:  # () float32
    """Norm of all gradients as if the model were unsharded.

    Sharded parameters contribute their local part on every rank; replicated ones (norms, and
    any parameter without ``tensor_model_parallel``) only on TP rank 0, so nothing is counted
    twice (megatron-core's ``param_is_not_tensor_parallel_duplicate`` rule). The partial sums
    are all-reduced over ``group``. With ``expert_group`` (expert parallelism), the parameters
    Megatron marks ``allreduce=False`` (this rank's experts; the other ranks hold the others) are
    summed over that group as well (megatron-core's rule in its optimizer).
    """
    rank = 0 if group is None else dist.get_rank(group)
    parts: list[list[Tensor]] = [[], []]  # [replicated over expert_group, this rank's experts]
    for p in params:
        if p.grad is not None and (rank == 0 or is_tensor_parallel(p)):
            own = expert_group is not None and not getattr(p, "allreduce", True)
            parts[int(own)].append(p.grad.detach())
    grads = parts[0] + parts[1]
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        for g in (group, expert_group):
            if g is not None:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=g)
        return local

    def power_sum(gs: list[Tensor]) -> Tensor:
        if not gs:
            return torch.zeros((), device=device)
        return (
            torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in gs]).pow(norm_type).sum()
        )

    dense, experts = power_sum(parts[0]), power_sum(parts[1])
    if group is not None:
        dist.all_reduce(dense, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=group)
    if expert_group is not None:
        dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=expert_group)
    return (dense + experts).pow(1.0 / norm_type)
