"""Newton–Schulz orthogonalisation: the polar factor U·Vᵀ of a matrix, with matmuls only.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) replaces the update direction
of a weight matrix with the orthogonal polar factor of its momentum, M = U·S·Vᵀ → U·Vᵀ. An SVD is
too slow and too GPU-unfriendly for every step, so the factor is approximated by iterating an odd
quintic polynomial on the singular values:

    X₀ = M / ‖M‖_F,      X_{t+1} = a·X_t + b·(X_t X_tᵀ) X_t + c·(X_t X_tᵀ)² X_t

Each step maps every singular value σ to p(σ) = a σ + b σ³ + c σ⁵ and leaves U, V untouched, so
the iteration only has to push all σ ∈ (0, 1] towards 1. Two coefficient schedules:

* ``quintic`` — Keller Jordan's fixed (3.4445, −4.7750, 2.0315): tuned to raise small singular
  values fast; it deliberately does not converge but oscillates in about [0.68, 1.14] after five
  steps, which is enough for optimisation.
* ``polar_express`` — Amsel, Persson, Musco & Gower 2025, "The Polar Express: Optimal Matrix Sign
  Methods and Their Application to the Muon Algorithm" (arXiv:2505.16932), Algorithm 1: a
  different minimax-optimal polynomial per step, each divided by a 1.01 safety factor (except the
  last), the input normalised by 1.01·‖M‖_F. From step 8 on the last polynomial (15x − 10x³ + 3x⁵)/8
  repeats; it converges to exactly 1, so with enough steps the output is U·Vᵀ.

Matrices taller than wide are transposed first so the Gram matrix X Xᵀ is the small one (Muon's
standard FLOP saving); the result is transposed back. The iteration may run in bfloat16 (as on GPU
in the reference implementations) or float32; leading dimensions are a batch of independent
matrices (used for the per-query-group Q, K, V blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, repeat

import torch
from torch import Tensor

Coefficients = tuple[float, float, float]

QUINTIC_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic, used for every step."""

_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),  # the paper: "subsequent coeffs equal this numerically"
)
POLAR_EXPRESS_SAFETY = 1.01
"""Safety factor of arXiv:2505.16932 Algorithm 1: every polynomial but the last is evaluated at
x/1.01 (a/1.01, b/1.01³, c/1.01⁵) and the input is normalised by 1.01·‖M‖_F, so round-off that
pushes a singular value slightly above the interval cannot blow up."""

_SAFE_POLAR_EXPRESS = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]
)
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = (*_SAFE_POLAR_EXPRESS, _POLAR_EXPRESS_RAW[-1])
"""Per-step coefficients (a, b, c) of Polar Express, safety factor applied; the last one repeats."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """A named coefficient schedule: per-step polynomials and the input normalisation."""

    coefficients: Callable[[int], list[Coefficients]]
    """Maps a step count to that many (a, b, c) triples."""
    norm_factor: float
    """The input is divided by ``norm_factor · ‖M‖_F + eps``."""


def _quintic(steps: int) -> list[Coefficients]:
    return [QUINTIC_COEFFICIENTS] * steps


def _polar_express(steps: int) -> list[Coefficients]:
    tail = repeat(POLAR_EXPRESS_COEFFICIENTS[-1], max(0, steps - len(POLAR_EXPRESS_COEFFICIENTS)))
    return list(chain(POLAR_EXPRESS_COEFFICIENTS[:steps], tail))


SCHEDULES: dict[str, Schedule] = {
    "quintic": Schedule(coefficients=_quintic, norm_factor=1.0),
    "polar_express": Schedule(coefficients=_polar_express, norm_factor=POLAR_EXPRESS_SAFETY),
}
"""Registry of coefficient schedules; add an entry to plug in another one."""

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, slots=True, frozen=True)
class NewtonSchulzConfig:
    """How to orthogonalise one update matrix."""

    schedule: str = "quintic"
    """Coefficient schedule, a key of ``SCHEDULES``: ``"quintic"`` or ``"polar_express"``."""
    steps: int = 5
    """Number of polynomial steps (5 is Muon's default; Polar Express converges with ~10+)."""
    dtype: str = "float32"
    """Iteration precision: ``"float32"`` or ``"bfloat16"`` (faster on GPUs, ~1e-2 accurate)."""
    eps: float = 1e-7
    """Added to the normalising norm so an all-zero update stays zero instead of NaN."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"NewtonSchulzConfig.schedule={self.schedule!r} is unknown; choose one of {sorted(SCHEDULES)}"
            )
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"NewtonSchulzConfig.steps={self.steps!r} must be a positive integer (Muon uses 5)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"NewtonSchulzConfig.dtype={self.dtype!r} is unknown; choose one of {sorted(_DTYPES)}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"NewtonSchulzConfig.eps={self.eps!r} must be a small positive number, e.g. 1e-7")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def orthogonalize(
    matrix: Tensor,  # (..., m, n) one matrix or a batch of independent ones
    config: NewtonSchulzConfig | None = None,
) -> Tensor:  # (..., m, n) approximate polar factor, same dtype as ``matrix``
    """Approximate the polar factor U·Vᵀ of each (m, n) matrix with a Newton–Schulz iteration.

    The result is invariant to a positive rescaling of the input (up to ``eps``) and equivariant
    to row and column permutations, because every step is a polynomial in X Xᵀ applied to X.
    """
    config = config or NewtonSchulzConfig()
    if matrix.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix (..., m, n); got shape {tuple(matrix.shape)}")
    schedule = SCHEDULES[config.schedule]
    x = matrix.to(config.torch_dtype).reshape(-1, *matrix.shape[-2:])  # (B, m, n)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.matrix_norm(x.float(), ord="fro", keepdim=True)  # (B, 1, 1)
    x = x / (norm * schedule.norm_factor + config.eps).to(x.dtype)
    for a, b, c in schedule.coefficients(config.steps):
        gram = x @ x.mT  # (B, m', m') with m' = min(m, n): the small Gram matrix
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·G + c·G²
        x = torch.baddbmm(x, poly, x, beta=a)  # a·X + (b·G + c·G²)·X
    if tall:
        x = x.mT
    x = x.reshape(matrix.shape)
    return x.to(matrix.dtype)
