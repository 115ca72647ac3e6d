"""Routing and the HybridOptimizer: one object to step, clip, zero, schedule and checkpoint.

Oracles: hand-built ``Muon`` + ``torch.optim.AdamW`` pairs, ``torch.nn.utils.clip_grad_norm_``,
``torch.optim.lr_scheduler``, and an uninterrupted run for resume.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from muon import HybridOptimizer, HybridOptimizerConfig, Muon, NewtonSchulzConfig, QKVLayout, build_optimizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tiny matrices: threads only cost


class TinyQwen3(nn.Module):
    """Parameter names and shapes of a Qwen3 checkpoint (HF names), two layers plus one MTP layer."""

    def __init__(self, vocab: int = 32, hidden: int = 16, ffn: int = 24, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList([self._layer(hidden, ffn) for _ in range(2)])
        self.model.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.mtp = nn.Module()
        mtp_layer = self._layer(hidden, ffn)
        mtp_layer.enorm, mtp_layer.hnorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        mtp_layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.mtp.layers = nn.ModuleList([mtp_layer])

    @staticmethod
    def _layer(hidden: int, ffn: int) -> nn.Module:
        layer = nn.Module()
        layer.input_layernorm, layer.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        layer.self_attn = nn.Module()
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, proj, nn.Linear(hidden, hidden, bias=proj != "o_proj"))
        layer.self_attn.q_norm, layer.self_attn.k_norm = nn.RMSNorm(4), nn.RMSNorm(4)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj, layer.mlp.up_proj = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        layer.mlp.down_proj = nn.Linear(ffn, hidden, bias=False)
        return layer


def fill_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_default_routing_of_qwen3_names() -> None:
    model = TinyQwen3()
    opt = build_optimizer(model.named_parameters(), HybridOptimizerConfig())
    muon = set(opt.muon_names)
    for name, p in model.named_parameters():
        hidden_matrix = p.ndim == 2 and not any(k in name for k in ("embed_tokens", "lm_head", "norm"))
        assert (name in muon) == hidden_matrix, name
    assert "model.layers.0.self_attn.q_proj.weight" in muon and "mtp.layers.0.eh_proj.weight" in muon
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(opt.adamw_names)
    assert "model.layers.1.self_attn.q_proj.bias" in opt.adamw_names
    assert len(opt.muon_names) + len(opt.adamw_names) == len(list(model.parameters()))


def test_megatron_names_and_fused_blocks() -> None:
    layout = QKVLayout(num_query_groups=2, heads_per_group=2, head_dim=4)  # 2 x (8 + 4 + 4) = 32 rows
    named = [
        ("embedding.word_embeddings.weight", nn.Parameter(torch.randn(32, 16))),
        ("decoder.layers.0.self_attention.linear_qkv.weight", nn.Parameter(torch.randn(32, 16))),
        ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", nn.Parameter(torch.ones(16))),
        ("decoder.layers.0.self_attention.q_layernorm.weight", nn.Parameter(torch.ones(4))),
        ("decoder.layers.0.mlp.linear_fc1.weight", nn.Parameter(torch.randn(48, 16))),
        ("decoder.final_layernorm.weight", nn.Parameter(torch.ones(16))),
        ("output_layer.weight", nn.Parameter(torch.randn(32, 16))),
    ]
    opt = build_optimizer(named, HybridOptimizerConfig(split_gated_fc1=True), qkv_layout=layout)
    assert opt.muon_names == [named[1][0], named[4][0]]
    assert opt.muon is not None
    blocks = opt.muon._row_blocks
    assert blocks[named[1][1]].sizes == (8, 4, 4) and blocks[named[1][1]].groups == 2
    assert blocks[named[4][1]].sizes == (24, 24)
    with pytest.raises(ValueError, match=r"'decoder.layers.0.self_attention.linear_qkv.weight' is a fused QKV"):
        build_optimizer(named, HybridOptimizerConfig())
    with pytest.raises(ValueError, match=r"linear_qkv.weight' has 32 \(global\) rows"):
        build_optimizer(
            named, HybridOptimizerConfig(), qkv_layout=QKVLayout(num_query_groups=4, heads_per_group=1, head_dim=4)
        )


def test_route_override_forces_excludes_and_rejects_non_matrices() -> None:
    model = TinyQwen3()

    def keep_trunk(name: str, p: nn.Parameter) -> str | None:
        return "exclude" if name.startswith("mtp.") else None

    trunk = build_optimizer(model.named_parameters(), HybridOptimizerConfig(), route=keep_trunk)
    draft = build_optimizer(
        [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.")], HybridOptimizerConfig(lr=1e-3)
    )
    trunk_names = set(trunk.muon_names + trunk.adamw_names)
    draft_names = set(draft.muon_names + draft.adamw_names)
    assert not trunk_names & draft_names
    assert trunk_names | draft_names == {n for n, _ in model.named_parameters()}

    forced = build_optimizer(
        model.named_parameters(), HybridOptimizerConfig(), route=lambda n, p: "adamw" if "o_proj" in n else None
    )
    assert not any("o_proj" in n for n in forced.muon_names)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(16,\) but was routed to Muon"):
        build_optimizer(
            model.named_parameters(),
            HybridOptimizerConfig(),
            route=lambda n, p: "muon" if n == "model.norm.weight" else None,
        )
    with pytest.raises(ValueError, match=r"returned 'sgd'"):
        build_optimizer(model.named_parameters(), HybridOptimizerConfig(), route=lambda n, p: "sgd")  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"lr": -1e-3}, r"HybridOptimizerConfig\.lr=-0\.001"),
        ({"muon_lr": -0.02}, r"HybridOptimizerConfig\.muon_lr=-0\.02"),
        ({"weight_decay": float("inf")}, r"HybridOptimizerConfig\.weight_decay=inf"),
        ({"momentum": 1.5}, r"HybridOptimizerConfig\.momentum=1\.5"),
        ({"scale": "rms"}, r"HybridOptimizerConfig\.scale='rms'"),
        ({"adamw_betas": (0.9,)}, r"HybridOptimizerConfig\.adamw_betas"),
        ({"qkv_split_mode": "per_head"}, r"HybridOptimizerConfig\.qkv_split_mode='per_head'"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        HybridOptimizerConfig(**kwargs)
    with pytest.raises(ValueError, match=r"NewtonSchulzConfig\.steps=0"):
        HybridOptimizerConfig(newton_schulz=NewtonSchulzConfig(steps=0))
    with pytest.raises(ValueError, match=r"NewtonSchulzConfig\.schedule='jordan'"):
        HybridOptimizerConfig(newton_schulz=NewtonSchulzConfig(schedule="jordan"))


def test_step_equals_hand_built_muon_and_adamw() -> None:
    config = HybridOptimizerConfig(lr=3e-3, weight_decay=0.05)
    model, ref = TinyQwen3(seed=1), TinyQwen3(seed=1)
    opt = build_optimizer(model.named_parameters(), config)
    ref_params = dict(ref.named_parameters())
    muon_params = [ref_params[n] for n in opt.muon_names]
    matrices = [ref_params[n] for n in opt.adamw_names if ref_params[n].ndim == 2]
    vectors = [ref_params[n] for n in opt.adamw_names if ref_params[n].ndim != 2]
    ref_muon = Muon(muon_params, lr=3e-3, weight_decay=0.05)
    ref_adamw = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.05}, {"params": vectors, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    for step in range(3):
        fill_grads(model, step)
        fill_grads(ref, step)
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch(norm_type: float) -> None:
    model, ref = TinyQwen3(), TinyQwen3()
    fill_grads(model, 0)
    fill_grads(ref, 0)
    opt = build_optimizer(model.named_parameters(), HybridOptimizerConfig())
    total = opt.clip_grad_norm_(1.0, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    assert total > 1.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="max_norm=0"):
        opt.clip_grad_norm_(0)


def test_lr_scheduler_drives_both_optimizers() -> None:
    opt = build_optimizer(TinyQwen3().named_parameters(), HybridOptimizerConfig(lr=1e-3, muon_lr=2e-2))
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.muon is not None and opt.adamw is not None
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(2e-2 / 8)
    assert all(g["lr"] == pytest.approx(1e-3 / 8) for g in opt.adamw.param_groups)
    assert [g["optimizer"] for g in opt.param_groups] == ["muon", "adamw", "adamw"]


def train(model: nn.Module, opt: HybridOptimizer, steps: range, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    g = torch.Generator().manual_seed(100)
    data = torch.randint(0, 32, (steps.stop, 4, 9), generator=g)
    for step in steps:
        tokens = data[step]
        hidden = model.model.embed_tokens(tokens[:, :-1])
        for layer in model.model.layers:
            hidden = hidden + layer.self_attn.o_proj(layer.self_attn.v_proj(layer.input_layernorm(hidden)))
            x = layer.post_attention_layernorm(hidden)
            hidden = hidden + layer.mlp.down_proj(nn.functional.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
        logits = model.lm_head(model.model.norm(hidden))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()


def make_run(seed: int = 5) -> tuple[TinyQwen3, HybridOptimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = TinyQwen3(seed=seed)
    config = HybridOptimizerConfig(lr=1e-2, newton_schulz=NewtonSchulzConfig(schedule="polar_express", steps=6))
    opt = build_optimizer(model.named_parameters(), config)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return model, opt, sched


def test_save_load_continue_equals_uninterrupted_bitwise() -> None:
    model, opt, sched = make_run()
    train(model, opt, range(0, 8), sched)

    model_a, opt_a, sched_a = make_run()
    train(model_a, opt_a, range(0, 4), sched_a)
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "optim": opt_a.state_dict(), "sched": sched_a.state_dict()}, buffer)
    del model_a, opt_a, sched_a

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model_b, opt_b, sched_b = make_run(seed=99)  # different init: everything must come from the checkpoint
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["optim"])
    sched_b.load_state_dict(saved["sched"])
    train(model_b, opt_b, range(4, 8), sched_b)

    for (name, p), (_, q) in zip(model.named_parameters(), model_b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert opt_b.muon is not None and opt.muon is not None and len(opt_b.muon.state) == len(opt.muon.state) > 0
    assert opt_b.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_deepcopy_keeps_both_inner_optimizers() -> None:
    model, opt, _ = make_run()
    twin = copy.deepcopy({"model": model, "opt": opt})
    fill_grads(model, 0)
    fill_grads(twin["model"], 0)
    opt.step()
    twin["opt"].step()
    for p, q in zip(model.parameters(), twin["model"].parameters(), strict=True):
        assert torch.equal(p, q) and p is not q


def test_load_rejects_a_checkpoint_with_other_routing() -> None:
    model, opt, _ = make_run()
    state = opt.state_dict()
    other = build_optimizer(
        model.named_parameters(), HybridOptimizerConfig(), route=lambda n, p: "exclude" if "mtp" in n else None
    )
    with pytest.raises(ValueError, match="checkpoint routes other parameters to muon"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="not a HybridOptimizer state dict"):
        opt.load_state_dict(opt.muon.state_dict())  # type: ignore[union-attr]
