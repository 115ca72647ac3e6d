"""Decode, verify and draft costs from a model's shape and a GPU profile (a roofline).

Why: speculation trades k cheap draft steps and a (k+1)-token verify against k + 1 plain steps.
While a forward is memory-bound its time is the bytes it reads (weights, and the KV cache of
every row) over the bandwidth, whatever its width; once its tokens pass the card's ridge
(peak FLOP/s over bytes/s: ~300 tokens on an H100 at bf16) the arithmetic sets the time and a
verify of k + 1 tokens costs up to k + 1 plain steps. So a forward costs

    max(bytes / (bandwidth x memory_efficiency), FLOPs / (peak x compute_efficiency)) + overhead

with bytes = weights read (all of a dense model; of a mixture of experts the experts its tokens
route to) + the rows' KV cache + the KV written, and FLOPs = 2 x active parameters x tokens +
attention over the context. A draft step is such a forward of the draft (one decoder layer, its
input projection and its output head; `DraftShape`), or, for an n-gram draft, host time per row.

Leaves out (stated with every plan): communication between the GPUs of one engine (tensor /
expert parallel all-reduces and all-to-alls), kernel efficiency that varies with shape, the
sampling and rejection work of a round, and host time unless `forward_overhead_s` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainer.planning.hardware import HardwareProfile
from trainer.planning.shapes import ModelShape

DRAFT_KINDS = ("mtp", "eagle3", "ngram")


@dataclass(kw_only=True, slots=True, frozen=True)
class DraftShape:
    """The draft beside the target."""

    kind: str = "eagle3"
    """mtp: one decoder layer over [embedding; hidden] (DeepSeek-V3 style), the target's full
    output head; eagle3: one decoder layer over fused low/middle/high hidden states, its own
    output head over `vocab` tokens; ngram: no forward, `host_s_per_row` per row and round."""
    vocab: int = 32000
    """Output-head size of an EAGLE-3 draft (its reduced draft vocabulary)."""
    host_s_per_row: float = 0.0
    """n-gram: seconds of host lookup per row and round (the whole draft of a row)."""

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"draft kind must be one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        if self.vocab < 1 or self.host_s_per_row < 0:
            raise ValueError(f"draft vocab must be >= 1 and host seconds >= 0, got {self.vocab}, {self.host_s_per_row}")

    def params(self, target: ModelShape) -> tuple[float, float]:
        """(parameters read per draft step, of which the output head) for `target`."""
        layer = target.attention_params + 3 * target.hidden * target.intermediate
        if self.kind == "mtp":
            return (
                layer + 2 * target.hidden * target.hidden + target.vocab * target.hidden,
                target.vocab * target.hidden,
            )
        if self.kind == "eagle3":
            head = self.vocab * target.hidden
            # input: [embedding; fused 3 x hidden -> hidden] into a layer whose QKV read 2 x hidden
            qkv = target.hidden * (target.heads + 2 * target.kv_heads) * target.head_dim
            extra = 3 * target.hidden * target.hidden + qkv
            return layer + extra + head, head
        return 0.0, 0.0


@dataclass(kw_only=True, slots=True)
class RooflineConfig:
    """How much of the published peaks a forward reaches, and the engine's size."""

    memory_efficiency: float = 0.8
    """Fraction of HBM bandwidth a decode forward achieves (well-tuned engines: 0.7-0.9)."""
    compute_efficiency: float = 0.6
    """Fraction of the dense bf16 peak a wide verify or a prefill achieves."""
    forward_overhead_s: float = 0.0
    """Host and launch seconds per forward (0: CUDA graphs hide them)."""
    gpus: int = 1
    """GPUs per engine (tensor / expert parallel): bandwidth and peak add up; communication is left out."""
    draft: DraftShape = field(default_factory=DraftShape)

    def __post_init__(self) -> None:
        for name in ("memory_efficiency", "compute_efficiency"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}")
        if self.forward_overhead_s < 0:
            raise ValueError(f"forward_overhead_s must be >= 0, got {self.forward_overhead_s}")
        if self.gpus < 1:
            raise ValueError(f"gpus per engine must be >= 1, got {self.gpus}")


class RooflineCosts:
    """`step_model.RoundCosts` from a shape, a profile and a `RooflineConfig`."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, cfg: RooflineConfig | None = None) -> None:
        self.shape, self.hw, self.cfg = shape, hw, cfg or RooflineConfig()
        self.bandwidth = hw.bytes_per_s * self.cfg.memory_efficiency * self.cfg.gpus
        self.peak = hw.flops_per_s * self.cfg.compute_efficiency * self.cfg.gpus
        d = self.cfg.draft
        self.description = (
            f"roofline: {shape.name} on {self.cfg.gpus} x {hw.name} ({hw.hbm_tb_s:g} TB/s x "
            f"{self.cfg.memory_efficiency:g}, {hw.bf16_dense_tflops:g} TFLOP/s x {self.cfg.compute_efficiency:g}), "
            f"{d.kind} draft"
        )

    def forward(self, rows: np.ndarray, width: int, kv_tokens: np.ndarray) -> np.ndarray:
        """Seconds of one target forward of `width` new tokens for each of `rows` rows over
        `kv_tokens` context tokens summed over the rows."""
        s = self.shape
        rows = np.asarray(rows, dtype=float)
        tokens = rows * width
        moved = s.weight_bytes(tokens) + (np.asarray(kv_tokens) + tokens) * s.kv_bytes_per_token
        flops = 2.0 * s.active_params * tokens + s.attention_flops(width, kv_tokens)
        return np.maximum(moved / self.bandwidth, flops / self.peak) + self.cfg.forward_overhead_s

    def draft_step(self, rows: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
        """Seconds of one draft step for `rows` rows (the draft's one layer attends over its own KV)."""
        s, d = self.shape, self.cfg.draft
        rows = np.asarray(rows, dtype=float)
        if d.kind == "ngram":
            return rows * d.host_s_per_row
        params, _ = d.params(s)
        kv_per_token = 2 * s.kv_heads * s.head_dim * s.kv_bytes_per_value
        moved = params * s.weight_bytes_per_param + (np.asarray(kv_tokens) + rows) * kv_per_token
        flops = 2.0 * params * rows + 4.0 * s.heads * s.head_dim * np.asarray(kv_tokens)
        return np.maximum(moved / self.bandwidth, flops / self.peak) + self.cfg.forward_overhead_s

    def round_seconds(self, batch: np.ndarray, k: int, kv_tokens: np.ndarray) -> np.ndarray:
        verify = self.forward(batch, k + 1, kv_tokens)
        if k == 0:
            return verify
        if self.cfg.draft.kind == "ngram":
            return verify + self.draft_step(batch, kv_tokens)  # one lookup proposes all k tokens
        return verify + k * self.draft_step(batch, kv_tokens)

    def prefill_seconds(self, rows: int, prompt_tokens: int) -> float:
        return float(self.forward(np.array([rows]), prompt_tokens, np.array([rows * prompt_tokens / 2]))[0])

    def request_seconds(self) -> float:
        return 0.0

    def leaves_out(self) -> list[str]:
        return [
            "communication between the GPUs of one engine (tensor/expert-parallel collectives)",
            "kernel efficiency varying with shape: one memory and one compute efficiency for every forward",
            "sampling, rejection and bookkeeping work of a round"
            + ("" if self.cfg.forward_overhead_s else "; host and launch time (forward overhead 0)"),
        ]
