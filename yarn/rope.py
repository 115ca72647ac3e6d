"""Rotary position embeddings (RoPE) with YaRN or llama3 scaling, one implementation for all of specrl.

RoPE (Su et al. 2021, arXiv:2104.09864) rotates each pair (x_i, x_{i+d/2}) of a query/key head by the
angle ``position * inv_freq[i]`` with ``inv_freq[i] = base^(-2i/d)``. YaRN (Peng et al. 2023, "YaRN:
Efficient Context Window Extension of Large Language Models", arXiv:2309.00071) stretches the context by
``factor``: dimensions that rotate fast enough to see many full turns within the original context keep
their frequency (extrapolation), slow dimensions are divided by ``factor`` (interpolation), and a linear
ramp blends the two between the correction range (low, high) set by ``beta_fast``/``beta_slow`` rotations.
It also multiplies cos and sin by an attention scale ``0.1 ln(factor) + 1`` (so q·k grows by its square),
which keeps the softmax entropy of long contexts close to that of short ones.

llama3 (Meta's Llama 3.1 scaling, transformers' ``_compute_llama3_parameters``) divides by ``factor`` the
frequencies whose wavelength exceeds ``original_max_position_embeddings / low_freq_factor``, keeps those
whose wavelength is below ``original_max_position_embeddings / high_freq_factor``, and interpolates
smoothly in between; cos and sin are not rescaled.

Why a module of our own: the trainer (megatron-core ``YarnRotaryEmbedding``) and the rollout engines must
produce the same log-probabilities, including past the original context. So this module follows the
float32 operation order that Hugging Face transformers and megatron-core share (cos/sin equal theirs bit
for bit on CPU) and ``yarn.megatron`` configures Megatron from the same ``RopeConfig``. ``factor`` is used
as given: it is never re-derived from ``max_position_embeddings / original_max_position_embeddings``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

ROPE_TYPES = ("default", "yarn", "llama3")

# Keys of a Hugging Face ``rope_scaling`` / ``rope_parameters`` entry that this module understands, by rope type.
_HF_COMMON_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "partial_rotary_factor"}
)
_HF_KEYS = {
    "default": _HF_COMMON_KEYS,
    "yarn": _HF_COMMON_KEYS | {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor"},
    "llama3": _HF_COMMON_KEYS | {"low_freq_factor", "high_freq_factor"},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeConfig:
    """Everything that determines the rotary embedding of one attention head.

    Field names follow Hugging Face's ``rope_scaling`` keys so a config.json maps one to one.
    """

    head_dim: int
    """Rotated dimension per head (even); all of it is rotated (no partial rotary)."""
    base: float = 10000.0
    """RoPE base θ (``rope_theta``)."""
    rope_type: str = "default"
    """``"default"`` (plain RoPE), ``"yarn"`` or ``"llama3"``."""
    factor: float = 1.0
    """The context-extension factor s >= 1 (YaRN's, llama3's), used exactly as given."""
    original_max_position_embeddings: int | None = None
    """Context length the model was pre-trained with (YaRN's L); required for ``"yarn"`` and ``"llama3"``."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below ``original_max_position_embeddings / high_freq_factor`` keep their frequency."""
    beta_fast: float = 32.0
    """Rotations within L above which a dimension is purely extrapolated (keeps its frequency)."""
    beta_slow: float = 1.0
    """Rotations within L below which a dimension is purely interpolated (frequency / factor)."""
    mscale: float = 1.0
    """DeepSeek-style numerator coefficient of the attention scale; used only with ``mscale_all_dim``."""
    mscale_all_dim: float = 0.0
    """DeepSeek-style denominator coefficient; 0 means "not given" (scale = 0.1 ln s + 1)."""
    truncate: bool = True
    """Round the correction range outwards to integers (floor/ceil), as the YaRN reference does."""
    attention_factor: float | None = None
    """Explicit cos/sin scale; overrides the value derived from ``factor``/``mscale``."""

    def __post_init__(self) -> None:
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs of dimensions), got {self.head_dim}")
        if not (math.isfinite(self.base) and self.base > 1.0):
            raise ValueError(f"base (rope_theta) must be a finite number > 1, got {self.base!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; use one of {ROPE_TYPES} "
                "(linear, dynamic and longrope scaling are not implemented)"
            )
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"factor must be a finite number >= 1 (the context-extension ratio), got {self.factor!r}")
        if self.attention_factor is not None and not (
            math.isfinite(self.attention_factor) and self.attention_factor > 0
        ):
            raise ValueError(f"attention_factor must be a finite number > 0 or None, got {self.attention_factor!r}")
        if self.rope_type == "default":
            if self.factor != 1.0 or self.attention_factor not in (None, 1.0):
                raise ValueError(
                    f"factor={self.factor} / attention_factor={self.attention_factor} only take effect with "
                    "rope_type='yarn' or 'llama3'; set one (and original_max_position_embeddings) or drop them"
                )
            return
        orig = self.original_max_position_embeddings
        if orig is None:
            raise ValueError(
                f"original_max_position_embeddings is required for rope_type={self.rope_type!r}: set it to the "
                "context length the model was pre-trained with"
            )
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise ValueError(f"original_max_position_embeddings must be a positive int, got {orig!r}")
        if self.rope_type == "llama3":
            if self.attention_factor is not None:
                raise ValueError("attention_factor does not apply to rope_type='llama3' (its cos/sin are unscaled)")
            if not (0 < self.low_freq_factor < self.high_freq_factor and math.isfinite(self.high_freq_factor)):
                raise ValueError(
                    f"low_freq_factor ({self.low_freq_factor!r}) and high_freq_factor ({self.high_freq_factor!r}) "
                    "must satisfy 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4)"
                )
            return
        if not (math.isfinite(self.beta_slow) and self.beta_slow > 0):
            raise ValueError(f"beta_slow must be a finite number > 0, got {self.beta_slow!r}")
        if not (math.isfinite(self.beta_fast) and self.beta_fast > self.beta_slow):
            raise ValueError(
                f"beta_fast ({self.beta_fast!r}) must be greater than beta_slow ({self.beta_slow!r}); "
                "YaRN's defaults are beta_fast=32, beta_slow=1"
            )
        for name in ("mscale", "mscale_all_dim"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")

    def correction_range(self) -> tuple[float, float]:
        """YaRN's (low, high) dimension-pair range of the ramp; see ``_correction_range``."""
        if self.rope_type != "yarn":
            raise ValueError("correction_range is only defined for rope_type='yarn'")
        assert self.original_max_position_embeddings is not None  # checked in __post_init__
        return _correction_range(
            self.beta_fast,
            self.beta_slow,
            self.head_dim,
            self.base,
            self.original_max_position_embeddings,
            self.truncate,
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> RopeConfig:
        """Read a Hugging Face model config (config.json as a dict).

        Uses ``head_dim`` (or ``hidden_size // num_attention_heads``), ``rope_theta`` and ``rope_scaling``
        (transformers 4.x), or ``rope_parameters`` (transformers 5.x). ``factor`` and
        ``original_max_position_embeddings`` must be present for YaRN: neither is guessed from
        ``max_position_embeddings``, which only appears in the error message as a hint.
        """
        head_dim = config.get("head_dim")
        if head_dim is None:
            try:
                head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
            except KeyError as e:
                raise ValueError(
                    f"config has neither head_dim nor {e.args[0]}: cannot size the rotary embedding"
                ) from e
        scaling = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        base = scaling.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        unknown = sorted(set(scaling) - _HF_KEYS.get(str(rope_type), _HF_COMMON_KEYS))
        if unknown:
            raise ValueError(
                f"rope_scaling has keys this implementation does not understand for rope_type {rope_type!r}: {unknown}"
            )
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("rope_scaling.partial_rotary_factor != 1 is not supported: the whole head is rotated")
        if rope_type not in ("yarn", "llama3"):
            return cls(head_dim=int(head_dim), base=float(base), rope_type=str(rope_type))
        if scaling.get("factor") is None:
            raise ValueError(f"rope_scaling.factor is required for rope_type={rope_type!r} (it is never inferred)")
        if scaling.get("original_max_position_embeddings") is None:
            hint = config.get("max_position_embeddings")
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings is required for rope_type={rope_type!r}: set it to "
                f"the pre-training context length (max_position_embeddings={hint}, factor={scaling['factor']})"
            )
        if rope_type == "llama3":
            absent = [k for k in ("low_freq_factor", "high_freq_factor") if scaling.get(k) is None]
            if absent:
                raise ValueError(f"rope_scaling.{absent[0]} is required for rope_type='llama3' (as in transformers)")
            return cls(
                head_dim=int(head_dim),
                base=float(base),
                rope_type="llama3",
                factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
            )
        # Hugging Face treats a null or 0 beta as "use the default" (its `get(...) or 32`); so do we.
        return cls(
            head_dim=int(head_dim),
            base=float(base),
            rope_type="yarn",
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            # HF uses the mscale ratio only when both are truthy: a missing mscale next to mscale_all_dim
            # must therefore read as 0 ("not given"), not as the dataclass default 1.
            mscale=float(scaling.get("mscale") or (0.0 if scaling.get("mscale_all_dim") else 1.0)),
            mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
            truncate=bool(scaling.get("truncate", True)),
            attention_factor=None if scaling.get("attention_factor") is None else float(scaling["attention_factor"]),
        )

    def to_hf_rope_scaling(self) -> dict[str, Any] | None:
        """The Hugging Face ``rope_scaling`` entry for this config (None for plain RoPE)."""
        if self.rope_type == "default":
            return None
        if self.rope_type == "llama3":
            return {
                "rope_type": "llama3",
                "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
            }
        out: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "truncate": self.truncate,
        }
        if self.mscale != 1.0 or self.mscale_all_dim:
            out.update(mscale=self.mscale, mscale_all_dim=self.mscale_all_dim)
        if self.attention_factor is not None:
            out["attention_factor"] = self.attention_factor
        return out


def _correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    """Dimension-pair index whose wavelength fits ``num_rotations`` times into ``max_position`` (YaRN eq. 17)."""
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_position: int, truncate: bool
) -> tuple[float, float]:
    low = _correction_dim(beta_fast, dim, base, max_position)
    high = _correction_dim(beta_slow, dim, base, max_position)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)  # the upper clamp uses dim - 1, as HF and Megatron do


def _get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scale(cfg: RopeConfig) -> float:
    """Factor applied to cos and sin (so to q·k squared): YaRN's ``0.1 ln(factor) + 1`` by default, 1 for
    plain RoPE and llama3.

    ``attention_factor`` overrides it. With both ``mscale`` and ``mscale_all_dim`` non-zero it is
    DeepSeek's ratio ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``. Otherwise
    ``mscale`` is ignored, as Hugging Face transformers does (megatron-core would use
    ``get_mscale(factor, mscale)`` there; ``yarn.megatron`` reconciles the two).
    """
    if cfg.rope_type == "llama3":
        return 1.0
    if cfg.attention_factor is not None:
        return float(cfg.attention_factor)
    if cfg.mscale and cfg.mscale_all_dim:
        return float(_get_mscale(cfg.factor, cfg.mscale) / _get_mscale(cfg.factor, cfg.mscale_all_dim))
    return _get_mscale(cfg.factor)


def inv_freq(cfg: RopeConfig) -> Tensor:
    """Inverse frequencies, (head_dim // 2,) float32 on CPU.

    Float32 in the operation order HF transformers and megatron-core use, so angles
    ``position * inv_freq`` agree with theirs bit for bit even at long positions. Factor 1 returns plain
    RoPE exactly (the YaRN blend of two equal tensors could round differently by one ulp).
    """
    dim = cfg.head_dim
    pos_freqs = cfg.base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    extrapolation = 1.0 / pos_freqs
    if cfg.rope_type == "llama3":
        return _llama3(extrapolation, cfg)
    if cfg.rope_type == "default" or cfg.factor == 1.0:
        return extrapolation
    interpolation = 1.0 / (cfg.factor * pos_freqs)
    low, high = cfg.correction_range()
    if low == high:
        high += 0.001  # avoid division by zero, as the reference does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # 1 for fast (high-frequency) pairs, 0 for slow ones
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _llama3(inv: Tensor, cfg: RopeConfig) -> Tensor:
    """Llama 3.1's scaling of plain inverse frequencies, in transformers' float32 operation order
    (``_compute_llama3_parameters``; megatron-core's ``RotaryEmbedding._apply_scaling`` is the same)."""
    assert cfg.original_max_position_embeddings is not None  # checked in __post_init__
    old_context = cfg.original_max_position_embeddings
    low_freq_wavelen = old_context / cfg.low_freq_factor
    high_freq_wavelen = old_context / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / cfg.factor, inv)  # long wavelengths: divided
    smooth = (old_context / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of the rotary angles for given positions, with a cache that grows on demand.

    ``forward(positions)`` returns float32 ``(cos, sin)`` of shape ``positions.shape + (head_dim,)``,
    already multiplied by ``attention_scale(cfg)`` (the Hugging Face convention); layout is
    rotate-half (both halves of the head share frequencies), as in HF Qwen3 and Megatron. Each call reads
    the largest position on the host (one device sync): call it once per model forward and share the
    result across layers. A decoding engine instead precomputes the tables once (`ensure`) and reads
    them with `lookup`, which never syncs. The cached rows equal a direct computation bit for bit, so growing the cache
    never changes results.
    """

    def __init__(self, cfg: RopeConfig, *, max_positions: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.scale = attention_scale(cfg)
        self.register_buffer("inv_freq", inv_freq(cfg), persistent=False)
        self.register_buffer("cos_cached", torch.empty(0, cfg.head_dim), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, cfg.head_dim), persistent=False)
        if max_positions > 0:
            self._build_cache(max_positions)

    inv_freq: Tensor
    cos_cached: Tensor
    sin_cached: Tensor

    def _build_cache(self, n: int) -> None:
        positions = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)  # (n,)
        freqs = positions[:, None] * self.inv_freq[None, :]  # (n, head_dim/2), same rounding as torch.outer
        emb = torch.cat((freqs, freqs), dim=-1)  # (n, head_dim)
        self.cos_cached = emb.cos() * self.scale
        self.sin_cached = emb.sin() * self.scale

    @property
    def table_size(self) -> int:
        """Positions [0, table_size) the cos/sin tables hold."""
        return int(self.cos_cached.shape[0])

    def ensure(self, n: int) -> None:
        """Precompute the tables for positions [0, n) (a host-side size check; nothing is read back)."""
        if n > self.table_size:
            self._build_cache(n)

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # positions: (...) int64, on the tables' device
        """cos/sin by table lookup without any host read: the fixed-shape form a compiled or captured
        forward needs. The caller validated positions against `table_size` (an engine does so at
        admission); positions past the table are clamped to its last row, never read out of bounds."""
        idx = positions.clamp(0, self.table_size - 1)
        return self.cos_cached[idx], self.sin_cached[idx]

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # positions: (...) int64
        if positions.dtype.is_floating_point:
            raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
        if positions.numel():
            lo, hi = (int(v) for v in torch.aminmax(positions))
            if lo < 0:
                raise ValueError(f"positions must be >= 0, got {lo}")
            if hi >= self.cos_cached.shape[0]:
                self._build_cache(max(hi + 1, 2 * self.cos_cached.shape[0]))
        idx = positions.to(self.cos_cached.device)
        return self.cos_cached[idx], self.sin_cached[idx]  # each (..., head_dim)


def _rotate_half(x: Tensor) -> Tensor:  # (..., d) -> (..., d): (x1, x2) -> (-x2, x1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., head_dim) by angles given as cos/sin broadcastable to it (rotate-half layout).

    cos/sin are cast to ``x.dtype`` first, as HF and Megatron do, so the result keeps x's dtype.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin
