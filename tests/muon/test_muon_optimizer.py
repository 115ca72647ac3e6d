"""The Muon update rule against torch.optim.Muon, an exact SVD and closed forms.

Oracles: ``torch.optim.Muon`` (PyTorch's own implementation of Keller Jordan's Muon, which
iterates in bfloat16 with the quintic schedule); the exact polar factor of the hand-computed
momentum (scale-free, so the EMA and the sum form of momentum agree); the closed-form RMS of a
scaled orthogonal matrix; and separate Newton–Schulz calls for fused blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from muon import Muon, NewtonSchulzConfig, QKVLayout, gated_fc1_blocks, orthogonalize, scaled_polar

pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tiny matrices: threads only cost


EXACT = NewtonSchulzConfig(schedule="polar_express", steps=10)  # = U·Vᵀ to ~1e-6 (see NS tests)


def polar(m: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
    return (u @ vh).float()


@pytest.mark.parametrize(
    ("scale", "torch_scale"), [("match_adamw_rms", "match_rms_adamw"), ("keller_jordan", "original")]
)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(48, 32), (24, 40)])
def test_matches_torch_optim_muon(scale: str, torch_scale: str, nesterov: bool, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    initial = torch.randn(*shape, generator=g)
    ours = torch.nn.Parameter(initial.clone())
    ref = torch.nn.Parameter(initial.clone())
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov}
    opt = Muon([ours], scale=scale, newton_schulz=NewtonSchulzConfig(dtype="bfloat16"), **kwargs)
    ref_opt = torch.optim.Muon([ref], adjust_lr_fn=torch_scale, **kwargs)
    for _ in range(4):
        grad = torch.randn(*shape, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    # Both iterate in bfloat16; they differ only in how the normalising norm is rounded
    # (we take it in float32), which moves a few bf16 ulps of a ~0.02-sized update.
    torch.testing.assert_close(ours.detach(), ref.detach(), atol=1e-5, rtol=0)
    assert (ours.detach() - initial).abs().max() > 1e-3  # the comparison is not between two no-ops


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_direction_is_polar_factor_of_the_momentum(nesterov: bool) -> None:
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(20, 30, generator=g)
    g1, g2 = torch.randn(20, 30, generator=g), torch.randn(20, 30, generator=g)
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.1, momentum=0.9, nesterov=nesterov, scale="none", newton_schulz=EXACT)
    p.grad = g1
    opt.step()
    before = p.detach().clone()
    p.grad = g2
    opt.step()
    mu = 0.9
    momentum = mu * g1 + g2  # the classic form; Muon's EMA differs by a positive factor only
    direction = g2 + mu * momentum if nesterov else momentum
    torch.testing.assert_close(p.detach(), before - 0.1 * polar(direction), atol=2e-6, rtol=0)


@pytest.mark.parametrize(("rows", "cols"), [(64, 16), (16, 64), (32, 32)])
def test_update_rms_matches_closed_form(rows: int, cols: int) -> None:
    lr = 0.01
    for scale, expected in [
        ("match_adamw_rms", 0.2),  # 0.2·√max(r,c) · ‖UVᵀ‖_rms, ‖UVᵀ‖_rms = √(min/(r·c)) = 1/√max
        ("keller_jordan", math.sqrt(max(1.0, rows / cols)) * math.sqrt(min(rows, cols) / (rows * cols))),
    ]:
        p = torch.nn.Parameter(torch.zeros(rows, cols))
        p.grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        Muon([p], lr=lr, momentum=0.0, scale=scale, newton_schulz=EXACT).step()
        rms = p.detach().square().mean().sqrt().item()
        assert rms == pytest.approx(lr * expected, rel=1e-5)


def test_weight_decay_is_decoupled() -> None:
    """With a zero gradient the update is zero and only W·(1 − lr·λ) remains (AdamW-style decay)."""
    w = torch.randn(8, 12)
    p = torch.nn.Parameter(w.clone())
    p.grad = torch.zeros_like(w)
    Muon([p], lr=0.5, weight_decay=0.2).step()
    torch.testing.assert_close(p.detach(), w * (1 - 0.5 * 0.2), atol=0, rtol=0)


def test_params_without_grad_are_untouched() -> None:
    a, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    before = b.detach().clone()
    a.grad = torch.randn(4, 4)
    Muon([a, b], lr=0.1, weight_decay=0.1).step()
    assert torch.equal(b.detach(), before)


def test_qkv_split_equals_three_separate_calls_per_query_group() -> None:
    layout = QKVLayout(num_query_groups=2, heads_per_group=3, head_dim=4)  # per group: 12 q, 4 k, 4 v rows
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(2 * (12 + 4 + 4), 16, generator=g)
    out = scaled_polar(fused, newton_schulz=NewtonSchulzConfig(), scale="match_adamw_rms", blocks=layout.row_blocks())
    start = 0
    for _group in range(2):
        for rows in (12, 4, 4):
            block = fused[start : start + rows]
            expected = orthogonalize(block) * 0.2 * math.sqrt(max(rows, 16))
            torch.testing.assert_close(out[start : start + rows], expected, atol=1e-6, rtol=0)
            start += rows
    assert start == fused.size(0)
    # And it is not the same as orthogonalising the fused matrix whole.
    whole = scaled_polar(fused, newton_schulz=NewtonSchulzConfig(), scale="match_adamw_rms")
    assert (whole - out).abs().max() > 1e-2


def test_qkv_per_kind_split_equals_three_calls_on_all_groups_rows() -> None:
    """megatron-core's granularity: one Q matrix (every group's query rows, in order), one K, one V."""
    layout = QKVLayout(num_query_groups=3, heads_per_group=2, head_dim=4)  # per group: 8 q, 4 k, 4 v rows
    fused = torch.randn(3 * 16, 20, generator=torch.Generator().manual_seed(5))
    out = scaled_polar(
        fused, newton_schulz=NewtonSchulzConfig(), scale="match_adamw_rms", blocks=layout.row_blocks("per_kind")
    )
    groups = fused.view(3, 16, 20)
    for lo, hi in [(0, 8), (8, 12), (12, 16)]:
        rows = groups[:, lo:hi].reshape(-1, 20)  # this kind's rows of every group, stacked
        expected = orthogonalize(rows) * 0.2 * math.sqrt(max(rows.size(0), 20))
        torch.testing.assert_close(out.view(3, 16, 20)[:, lo:hi].reshape(-1, 20), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="mode='per_head'"):
        layout.row_blocks("per_head")


def test_gated_fc1_split_equals_two_separate_calls() -> None:
    fused = torch.randn(24, 10, generator=torch.Generator().manual_seed(4))
    out = scaled_polar(fused, newton_schulz=NewtonSchulzConfig(), scale="none", blocks=gated_fc1_blocks(24))
    torch.testing.assert_close(out[:12], orthogonalize(fused[:12]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[12:], orthogonalize(fused[12:]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="even number of rows"):
        gated_fc1_blocks(7)


def test_muon_uses_row_blocks_for_a_fused_parameter() -> None:
    layout = QKVLayout.from_heads(num_attention_heads=4, num_query_groups=2, head_dim=2)
    p = torch.nn.Parameter(torch.zeros(2 * (4 + 2 + 2), 6))
    grad = torch.randn_like(p)
    p.grad = grad
    Muon([p], lr=1.0, momentum=0.0, scale="none", row_blocks={p: layout.row_blocks()}).step()
    expected = -scaled_polar(grad, newton_schulz=NewtonSchulzConfig(), scale="none", blocks=layout.row_blocks())
    assert torch.equal(p.detach(), expected)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lr": -0.1}, "lr=-0.1"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"momentum": 1.0}, "momentum=1.0"),
        ({"weight_decay": -1.0}, "weight_decay=-1.0"),
        ({"scale": "spectral_norm"}, "scale='spectral_norm'"),
        ({"newton_schulz": None, "lr": -1}, "lr=-1"),
    ],
)
def test_bad_hyperparameters_name_the_field(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern.replace("(", r"\(").replace("[", r"\[")):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], **kwargs)


def test_bad_param_group_value_is_caught() -> None:
    with pytest.raises(ValueError, match=r"Muon param group 1: lr=-2"):
        Muon(
            [
                {"params": [torch.nn.Parameter(torch.ones(2, 2))]},
                {"params": [torch.nn.Parameter(torch.ones(2, 2))], "lr": -2},
            ]
        )
    with pytest.raises(ValueError, match=r"NewtonSchulzConfig\.steps=0"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(2, 2))], "ns_steps": 0}])


def test_non_matrix_parameter_is_named() -> None:
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(8,\): Muon only optimises 2-D"):
        Muon([("model.norm.weight", torch.nn.Parameter(torch.ones(8)))])
    with pytest.raises(ValueError, match=r"#0 of Muon param group 0"):
        Muon([torch.nn.Parameter(torch.ones(2, 2, 2))])


def test_row_blocks_must_fit_the_parameter() -> None:
    p = torch.nn.Parameter(torch.ones(10, 4))
    with pytest.raises(ValueError, match="10 global rows"):
        Muon([p], row_blocks={p: gated_fc1_blocks(12)})
