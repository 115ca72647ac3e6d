"""Which kernels the cached forwards run: torch's operators (the reference), or fused Triton kernels.

Why: on a GPU a decode round at small batch costs its kernel launches more than its arithmetic
(BENCHMARKS.md, "The engine on a GPU": a round ≈ weight bytes / bandwidth + kernels × a few µs),
and torch runs a decoder layer's norms, rotary embedding, cache writes, attention and activation as
~28 kernels. `DecodeKernels` runs them as five (`triton_kernels`), so a layer is nine (ten where
the attention splits a long context): the fused residual add and input norm, the q|k|v product, the
q/k norm + rotary + cache write, attention, the output product, the fused add and post-attention
norm, the gate|up product, silu·mul, the down product (whose residual add is the next layer's first
kernel). The MTP draft's norms and a round's counter-based uniforms are one kernel each too.

`TorchEngine.kernels` holds a `DecodeKernels` where the engine runs fixed-shape rounds on CUDA and
Triton is installed (`for_device`), else `DecodeOps` (torch's operators); the engine sets it on the
model (`Qwen3WithMTP.kernels`) at every step. Attention and the cache write use the kernels only in
fixed-shape forwards (`AttentionPlan.fixed_shape`, what CUDA graphs capture), the norms and the
activation in every cached forward. The torch functions here are the references, each the operators
the model ran before (same order, same rounding); `tests/sidecar/model/test_decode_kernels.py` checks the
kernels against them in Triton's interpreter on a CPU and on a GPU.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


def triton_available() -> bool:
    """Whether Triton can be imported here."""
    return importlib.util.find_spec("triton") is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm with a given weight: normalised in float32 and rounded to x's dtype by `F.rms_norm`
    (one fused kernel where torch has one), then the weight — Hugging Face's order of operations."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm after it (x when delta is None)."""
    total = x if delta is None else x + delta
    return total, rms_norm(total, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a fused (..., 2I) gate|up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DecodeOps:
    """The torch operators of the cached forwards' fusable pieces (the references)."""

    def add_rms_norm(self, x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return add_rms_norm(x, delta, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return silu_mul(gate_up)


class DecodeKernels(DecodeOps):
    """The fused kernels (`triton_kernels`): compiled for CUDA tensors, or run by Triton's
    interpreter on CPU tensors in float32 where `TRITON_INTERPRET=1` was set before Triton was
    imported (tests)."""

    def __init__(self) -> None:
        from sidecar.model import triton_kernels

        self._k = triton_kernels

    @staticmethod
    def for_device(device: torch.device) -> DecodeOps:
        """What a cached forward on `device` runs: Triton's kernels on CUDA where Triton is
        installed, else torch's operators."""
        if device.type != "cuda":
            return DecodeOps()
        if not triton_available():
            log.warning("Triton is not installed: decode rounds run torch's unfused operators (slower)")
            return DecodeOps()
        return DecodeKernels()

    def add_rms_norm(self, x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return self._k.add_rms_norm(x, delta, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self._k.silu_mul(gate_up)

    def qk_norm_rope_store(
        self,
        qkv: Tensor,
        bias: Tensor | None,
        norm: Tensor | None,
        cos_table: Tensor,
        sin_table: Tensor,
        rope_positions: Tensor,
        eps: float,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        table: Tensor,
    ) -> Tensor:
        return self._k.qk_norm_rope_store(
            qkv, bias, norm, cos_table, sin_table, rope_positions, eps, keys, values, positions, table
        )

    def decode_attention(
        self, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, table: Tensor, read: int
    ) -> Tensor:
        return self._k.decode_attention(q, keys, values, positions, table, read)

    def fused_experts(self, x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
        """A sparse layer's routed experts, sorted by expert, as two grouped GEMMs (`moe_kernels`)."""
        from sidecar.model import moe_kernels

        return moe_kernels.fused_experts(x, weights, ids, w13, w2)

    def round_uniforms(self, keys: Tensor, positions: Tensor, k: int) -> Tensor:
        """A round's (B, 2k + 1) counter-based uniforms, bit for bit `rows.BatchTensors.round_uniforms`."""
        return self._k.round_uniforms(keys, positions, k)
