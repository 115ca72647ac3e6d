"""The fused mixture-of-experts path on CUDA: tokens sorted by expert, two grouped GEMMs.

The design of vLLM's and SGLang's `fused_moe` Triton kernel (written here from its description):
a sparse layer's T tokens × k choices are T·k *slots*; `align_by_expert` sorts the slots by expert
and pads each expert's run to a multiple of the block (padding slots point past the end), so every
block of BLOCK_M consecutive sorted slots belongs to one expert; then

- `_gate_up_kernel`: per block, the expert's gate|up product of the block's tokens (one grouped
  GEMM over every active expert), SiLU(gate) · up, into a (T·k, I) activation by slot;
- `_down_kernel`: per block, the expert's down product of those activations, times each slot's
  routing weight, into a (T·k, hidden) output by slot;

and the k slots of each token are summed. Every shape is fixed by (T, k, E, the block): the
alignment runs on the device without a host read (a scatter-add count, a stable sort, a search), so
the whole path is captured in the round's CUDA graphs; it reads each active expert's weights once
per block of its tokens and never an inactive expert's (the union the cost model prices,
`speculation.expert_union`).

The arithmetic is `moe.experts_by_expert`'s (products accumulated in float32, each result rounded to
the model's dtype where the reference rounds it, the routing weight in the model's dtype), so the
two differ in the order of additions only; `tests/sidecar/model/test_moe_kernels.py` checks them in
Triton's interpreter on a CPU (float32) and compiled on a GPU. The weights are read as the stacked
(E, 2I, hidden) gate|up and (E, hidden, I) down tensors the experts' parameters are views of
(`SparseMoE.join_experts`). Imported only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 16
"""Sorted slots per block (one expert each); Triton's dot needs at least 16 rows."""


def align_by_expert(
    ids: Tensor,  # (T, k) expert ids
    num_experts: int,
    block_m: int = BLOCK_M,
) -> tuple[Tensor, Tensor]:  # slots (P,) int64, block_expert (P / block_m,) int64
    """The T·k slots (slot = token · k + j) sorted by expert (token order within one), each
    expert's run padded to a multiple of `block_m` with T·k (no slot); and each block's expert (-1:
    a block past the last run). P = T·k + E·(block_m − 1), rounded up to the block: fixed."""
    flat = ids.reshape(-1)
    n = flat.numel()
    total = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # slots by expert
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where expert e's slots begin in `order`
    rank = torch.arange(n, device=ids.device) - first[by_expert]
    slots = torch.full((total,), n, dtype=torch.int64, device=ids.device)
    slots.scatter_(0, starts[by_expert] + rank, order)
    block_start = torch.arange(0, total, block_m, device=ids.device)
    owner = torch.searchsorted(ends, block_start, right=True)
    return slots, torch.where(owner < num_experts, owner, -1)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    slots_ptr,
    block_expert_ptr,
    act_ptr,
    n_slots,
    top_k,
    hidden,
    inter,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e < 0:
        return
    slot = tl.load(slots_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    live = slot < n_slots
    token = tl.where(live, slot // top_k, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = cols < inter
    w_gate = w13_ptr + e * 2 * inter * hidden + cols[None, :] * hidden
    w_up = w_gate + inter * hidden
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        live_k = ks < hidden
        x = tl.load(x_ptr + token[:, None] * hidden + ks[None, :], mask=live[:, None] & live_k[None, :], other=0.0)
        wmask = live_n[None, :] & live_k[:, None]
        wg = tl.load(w_gate + ks[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_up + ks[:, None], mask=wmask, other=0.0)
        if IEEE:
            gate += tl.dot(x, wg, input_precision="ieee")
            up += tl.dot(x, wu, input_precision="ieee")
        else:
            gate += tl.dot(x, wg)
            up += tl.dot(x, wu)
    dtype = act_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(act_ptr + slot[:, None] * inter + cols[None, :], (a * u).to(dtype), mask=live[:, None] & live_n[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    slots_ptr,
    block_expert_ptr,
    weight_ptr,
    out_ptr,
    n_slots,
    hidden,
    inter,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e < 0:
        return
    slot = tl.load(slots_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    live = slot < n_slots
    row = tl.where(live, slot, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_n = cols < hidden
    w = w2_ptr + e * hidden * inter + cols[None, :] * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        live_k = ks < inter
        a = tl.load(act_ptr + row[:, None] * inter + ks[None, :], mask=live[:, None] & live_k[None, :], other=0.0)
        wd = tl.load(w + ks[:, None], mask=live_n[None, :] & live_k[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, wd, input_precision="ieee")
        else:
            acc += tl.dot(a, wd)
    dtype = out_ptr.dtype.element_ty
    routed = tl.load(weight_ptr + row, mask=live, other=0.0).to(tl.float32)  # in its own dtype (`weights_in_dtype`)
    y = acc.to(dtype).to(tl.float32) * routed[:, None]
    tl.store(out_ptr + row[:, None] * hidden + cols[None, :], y.to(dtype), mask=live[:, None] & live_n[None, :])


def fused_experts(
    x: Tensor,  # (T, hidden)
    weights: Tensor,  # (T, k) routing weights, in the dtype the products are taken in (then rounded to x's)
    ids: Tensor,  # (T, k) expert ids
    w13: Tensor,  # (E, 2I, hidden) each expert's gate rows then up rows
    w2: Tensor,  # (E, hidden, I)
) -> Tensor:  # (T, hidden)
    """sum_j weight_j · down_e(silu(gate_e(x)) · up_e(x)) over each token's k experts e = ids[:, j]."""
    t, k = ids.shape
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    x = x.contiguous()
    slots, block_expert = align_by_expert(ids, e)
    n = t * k
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    blocks = block_expert.numel()
    bn, bk = 64, 64
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        x, w13, slots, block_expert, act, n, k, hidden, inter, IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk
    )
    _down_kernel[(blocks, triton.cdiv(hidden, bn))](
        act,
        w2,
        slots,
        block_expert,
        weights.reshape(-1).contiguous(),
        out,
        n,
        hidden,
        inter,
        IEEE=ieee,
        BLOCK_M=BLOCK_M,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out.view(t, k, hidden).sum(dim=1)
