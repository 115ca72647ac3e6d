"""Data parallelism: each replica of the (tensor-parallel) model trains on its share of a batch.

With ``train.data_parallel`` = D and ``train.tensor_parallel`` = T, ``torchrun`` starts D x T
processes and megatron-core's ``parallel_state`` groups them into D replicas of T shards. Every
rank receives the whole step's batch (rank 0 broadcasts it); each replica keeps a token-balanced
share of its rows (`balanced_rows`, greedy longest-first: a long response does not leave the
other replicas idle) cropped to its own longest row (`share_of`).

Normalisation makes D replicas compute the D = 1 update: the loss of every share is divided by
the *whole* batch's counts (`trainer.policy.losses.BatchTotals`, taken before the split), so the
shares' gradients *sum* to the whole batch's gradient. The sum is megatron-core's
``DistributedDataParallel`` (`wrap`): contiguous gradient buckets all-reduced over
``parallel_state.get_data_parallel_group()``, overlapped with the backward pass
(``overlap_grad_reduce``; on CPU the gloo all-reduce runs in gloo's own threads), with the
1/D averaging switched off (``calculate_per_token_loss``) because the loss is already divided by
the global count. Muon and AdamW then step on the full reduced gradient, identically on every
replica (Muon's Newton-Schulz iterations are repeated D times; a sharded Muon would split them).

Metrics follow the same rule: every loss metric is a share that sums to the whole batch's
(`reduce_metrics`); the training-inference mismatch gathers every replica's per-token log-prob
gaps (`reduce_mismatch`), so its mean, p99 and maximum are the whole batch's exactly.
"""

from __future__ import annotations

import copy
import heapq
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.policy.losses import mismatch_of_gaps


def balanced_rows(lengths: list[int], parts: int) -> list[list[int]]:
    """Split row indices into `parts` lists of near-equal total length (greedy, longest first).

    Deterministic (ties go to the lower part), every part non-empty when len(lengths) >= parts,
    each list ascending. The greedy longest-processing-time rule is within 4/3 of the best split.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(lengths) < parts:
        raise ValueError(
            f"{len(lengths)} rows cannot be shared by {parts} data-parallel replicas: every replica needs a row; "
            "raise rollout.prompts_per_step (or lower train.mini_batches / train.data_parallel)"
        )
    heap = [(0, p) for p in range(parts)]  # (tokens so far, part)
    out: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        load, part = heapq.heappop(heap)
        out[part].append(row)
        heapq.heappush(heap, (load + lengths[row], part))
    return [sorted(rows) for rows in out]


def row_lengths(tokens_mask: Tensor) -> list[int]:  # (B, S-1) 0/1 over tokens[:, 1:] -> B lengths
    """Each row's length up to its last response token (+1 for the first token)."""
    b, t = tokens_mask.shape
    idx = torch.arange(1, t + 1).expand(b, t)
    last = (idx * (tokens_mask != 0)).max(dim=1).values
    return [int(v) + 1 for v in last]


def wrap(module: nn.Module, config: Any, *, overlap: bool) -> nn.Module:
    """megatron-core DistributedDataParallel around `module`, summing (not averaging) gradients
    over the data-parallel group. `config`: the model's TransformerConfig (copied, not changed)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    summing = copy.copy(config)
    summing.calculate_per_token_loss = True  # the loss is divided by the global count already
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=overlap, grad_reduce_in_fp32=True)
    return DistributedDataParallel(summing, ddp, module)


def adopt_main_grads(module: nn.Module) -> None:
    """Point each parameter's .grad at its reduced DDP buffer (`main_grad`), where optimizers,
    clipping and the tensor-parallel q/k-norm sum look for it."""
    for p in module.parameters():
        main = getattr(p, "main_grad", None)
        if main is not None:
            p.grad = main


def reduce_metrics(metrics: dict[str, float], group: dist.ProcessGroup) -> dict[str, float]:
    """Sum each metric over the data-parallel group (every key any rank has; absent counts 0)."""
    keys: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, sorted(metrics), group=group)
    union = sorted({k for ks in keys if ks is not None for k in ks})
    values = torch.tensor([metrics.get(k, 0.0) for k in union], dtype=torch.float64)
    dist.all_reduce(values, group=group)
    return dict(zip(union, values.tolist(), strict=True))


def reduce_mismatch(
    train_logprobs: Tensor,  # (b, T) this replica's rows
    rollout_logprobs: Tensor,  # (b, T)
    mask: Tensor,  # (b, T)
    group: dist.ProcessGroup,
) -> dict[str, float]:
    """`trainer.policy.losses.mismatch_metrics` of the whole batch from every replica's rows: each replica's
    per-token differences are gathered (one float64 per response token: small next to the batch),
    so the mean, p99 and maximum are the whole batch's exactly, as one process computes them."""
    with torch.no_grad():
        m = mask.to(torch.bool)
        diff = (train_logprobs.detach().to(torch.float64) - rollout_logprobs.to(torch.float64))[m].cpu()
        parts: list[Tensor | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, diff, group=group)
    return mismatch_of_gaps(torch.cat([p for p in parts if p is not None]))
