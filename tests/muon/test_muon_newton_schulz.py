"""Newton–Schulz orthogonalisation against closed forms and an exact SVD.

Oracles: the project's design band of singular values for the quintic schedule (and the closed-form
maximum of its polynomial), the exact polar factor U·Vᵀ from ``torch.linalg.svd`` for Polar
Express, and the symmetries every polynomial-in-XXᵀ iteration must have.
"""

from __future__ import annotations

import math

import pytest
import torch

from muon import POLAR_EXPRESS_COEFFICIENTS, NewtonSchulzConfig, orthogonalize

pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tiny matrices: threads only cost


def matrix_with_spectrum(rows: int, cols: int, singular_values: torch.Tensor, seed: int) -> torch.Tensor:
    """U·diag(s)·Vᵀ with Haar-like random orthonormal U (rows×k) and V (cols×k), in float64."""
    g = torch.Generator().manual_seed(seed)
    k = singular_values.numel()
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    return u @ torch.diag(singular_values.double()) @ v.T


def normalised_spectrum(k: int) -> torch.Tensor:
    """k singular values in [1e-2, 1] whose Frobenius norm is 1 (what NS sees after normalising)."""
    small = torch.logspace(-2, -0.5, k - 1, dtype=torch.float64)
    largest = math.sqrt(1.0 - float(small.square().sum()))
    return torch.cat([torch.tensor([largest], dtype=torch.float64), small])


@pytest.mark.parametrize(("rows", "cols"), [(48, 16), (16, 48), (96, 24)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quintic_singular_values_land_in_design_band(rows: int, cols: int, dtype: str) -> None:
    s = normalised_spectrum(16)
    assert s.min() >= 1e-2 and s.max() <= 1.0
    m = matrix_with_spectrum(rows, cols, s, seed=rows + cols).float() * 37.0  # any scale
    out = orthogonalize(m, NewtonSchulzConfig(schedule="quintic", steps=5, dtype=dtype))
    sv = torch.linalg.svdvals(out.double())[: s.numel()]
    # the design band: about [0.68, 1.14]; bfloat16 rounding adds up to ~1e-2.
    slack = 0.0 if dtype == "float32" else 0.02
    assert sv.min() >= 0.68 - slack, sv
    assert sv.max() <= 1.14 + slack, sv


def test_quintic_never_exceeds_the_polynomial_maximum() -> None:
    """After ≥1 step every singular value is p(x) for some x in [0, 1]; max p on [0, 1] is closed form."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x_star = math.sqrt((-3 * b - math.sqrt(9 * b * b - 20 * a * c)) / (10 * c))  # smaller root of p'(x) = 0
    p_max = a * x_star + b * x_star**3 + c * x_star**5
    s = torch.logspace(-4, 0, 40, dtype=torch.float64)  # badly conditioned: many values below 1e-2
    m = matrix_with_spectrum(80, 40, s, seed=3).float()
    sv = torch.linalg.svdvals(orthogonalize(m).double())
    assert sv.max() <= p_max + 1e-5
    assert 1.20 < p_max < 1.21


@pytest.mark.parametrize(("rows", "cols"), [(96, 64), (64, 96), (40, 40)])
def test_polar_express_matches_svd_polar_factor(rows: int, cols: int) -> None:
    k = min(rows, cols)
    s = torch.logspace(-2, 0, k, dtype=torch.float64)  # condition number 100
    m = matrix_with_spectrum(rows, cols, s, seed=k)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    polar = (u @ vh).float()
    out = orthogonalize(m.float(), NewtonSchulzConfig(schedule="polar_express", steps=10))
    # float32 iteration: error is round-off, ~1e-6 per entry; we allow 1e-5.
    assert (out - polar).abs().max() < 1e-5
    five = orthogonalize(m.float(), NewtonSchulzConfig(schedule="polar_express", steps=5))
    assert (five - polar).abs().max() > 1e-4  # the test can tell a converged result from an early one


def test_polar_express_coefficients_are_the_published_ones() -> None:
    """arXiv:2505.16932 Algorithm 1: first triple 8.2872…/1.01 etc.; the last triple is (15, −10, 3)/8."""
    a0, b0, c0 = POLAR_EXPRESS_COEFFICIENTS[0]
    assert a0 == pytest.approx(8.28721201814563 / 1.01, rel=1e-15)
    assert b0 == pytest.approx(-23.595886519098837 / 1.01**3, rel=1e-15)
    assert c0 == pytest.approx(17.300387312530933 / 1.01**5, rel=1e-15)
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (15 / 8, -10 / 8, 3 / 8)
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8
    # The paper designs the composition for singular values in [1e-3, 1] (after the 1.01
    # normalisation): eight steps map that whole interval to 1 up to float64 round-off.
    x = torch.logspace(-3, 0, 20001, dtype=torch.float64) / 1.01
    y = x.clone()
    for a, b, c in POLAR_EXPRESS_COEFFICIENTS:
        y = a * y + b * y**3 + c * y**5
    assert (y - 1).abs().max() < 1e-12


@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
def test_invariant_to_input_scale(schedule: str) -> None:
    m = torch.randn(32, 20, generator=torch.Generator().manual_seed(0))
    cfg = NewtonSchulzConfig(schedule=schedule)
    base = orthogonalize(m, cfg)
    for factor in (1e-3, 0.5, 7.0, 1e4):
        torch.testing.assert_close(orthogonalize(m * factor, cfg), base, atol=2e-5, rtol=0)


@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
def test_equivariant_to_row_and_column_permutations(schedule: str) -> None:
    g = torch.Generator().manual_seed(1)
    m = torch.randn(24, 40, generator=g)
    rows, cols = torch.randperm(24, generator=g), torch.randperm(40, generator=g)
    cfg = NewtonSchulzConfig(schedule=schedule)
    base = orthogonalize(m, cfg)
    torch.testing.assert_close(orthogonalize(m[rows], cfg), base[rows], atol=2e-5, rtol=0)
    torch.testing.assert_close(orthogonalize(m[:, cols], cfg), base[:, cols], atol=2e-5, rtol=0)


def test_transpose_commutes_and_batch_equals_separate_calls() -> None:
    g = torch.Generator().manual_seed(2)
    batch = torch.randn(3, 16, 40, generator=g)
    out = orthogonalize(batch)
    for i in range(3):
        torch.testing.assert_close(out[i], orthogonalize(batch[i]), atol=1e-6, rtol=0)
        torch.testing.assert_close(orthogonalize(batch[i].T), out[i].T, atol=1e-6, rtol=0)


def test_zero_input_gives_zero_and_dtype_is_kept() -> None:
    assert torch.equal(orthogonalize(torch.zeros(8, 4)), torch.zeros(8, 4))
    half = torch.randn(8, 4, dtype=torch.bfloat16)
    assert orthogonalize(half).dtype == torch.bfloat16


def test_bfloat16_iteration_close_to_float32() -> None:
    m = torch.randn(64, 32, generator=torch.Generator().manual_seed(4))
    fp32 = orthogonalize(m, NewtonSchulzConfig(dtype="float32"))
    bf16 = orthogonalize(m, NewtonSchulzConfig(dtype="bfloat16"))
    assert bf16.dtype == torch.float32
    rel = (bf16 - fp32).norm() / fp32.norm()
    assert 0 < rel < 5e-2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"steps": -3}, "steps"),
        ({"schedule": "cubic"}, "schedule"),
        ({"dtype": "float16"}, "dtype"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"NewtonSchulzConfig\.{field}="):
        NewtonSchulzConfig(**kwargs)


def test_vector_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs a matrix"):
        orthogonalize(torch.ones(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_svd_polar_factor(dtype: str) -> None:
    s = torch.logspace(-2, 0, 64, dtype=torch.float64)
    m = matrix_with_spectrum(192, 64, s, seed=5)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    out = orthogonalize(m.float().cuda(), NewtonSchulzConfig(schedule="polar_express", steps=10, dtype=dtype)).cpu()
    tolerance = 1e-4 if dtype == "float32" else 5e-2  # bf16 keeps ~3 significant digits per entry
    assert (out - (u @ vh).float()).abs().max() < tolerance
