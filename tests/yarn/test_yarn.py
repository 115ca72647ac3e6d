"""Rotary embeddings (yarn/) against independent oracles: the project design's reference numbers, the closed form of
plain RoPE, Hugging Face transformers' YaRN, llama3 (`_compute_llama3_parameters`), Qwen3 and Llama rotary code, and
megatron-core's own YarnRotaryEmbedding built by a real GPTModel (for llama3: the GPTModel the trainer builds). The trainer-vs-engine log-prob check at 4x the original length lives with those issues."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from yarn import RopeConfig, RotaryEmbedding, apply_rotary, attention_scale, inv_freq

DESIGN = RopeConfig(head_dim=64, base=1e4, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)

# (name, RopeConfig kwargs) covering each knob; positions are checked up to 4x the original length.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("design", dict(head_dim=64, base=1e4, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)),
    ("qwen3_like", dict(head_dim=128, base=1e6, rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)),
    ("untruncated", dict(head_dim=32, base=5e5, rope_type="yarn", factor=8.0, original_max_position_embeddings=512,
                         truncate=False)),
    ("betas", dict(head_dim=16, rope_type="yarn", factor=2.5, original_max_position_embeddings=256, beta_fast=16.0,
                   beta_slow=2.0)),
    ("deepseek_mscale", dict(head_dim=64, rope_type="yarn", factor=40.0, original_max_position_embeddings=512,
                             mscale=1.0, mscale_all_dim=0.707)),
    ("mscale_alone", dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=512,
                          mscale=0.5)),
    ("attention_factor", dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=512,
                              attention_factor=1.3)),
    ("factor_one", dict(head_dim=64, rope_type="yarn", factor=1.0, original_max_position_embeddings=512)),
    ("plain", dict(head_dim=64, base=1e4)),
]  # fmt: skip


def _max_pos(cfg: RopeConfig) -> int:
    return 4 * (cfg.original_max_position_embeddings or 512)


def _hf_config(cfg: RopeConfig) -> Any:
    """A transformers Qwen3Config carrying the same rotary settings (via the legacy rope_scaling key)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=cfg.head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        max_position_embeddings=_max_pos(cfg),
        rope_theta=cfg.base,
        rope_scaling=cfg.to_hf_rope_scaling(),
    )


# ---------------------------------------------------------------------------------------- published numbers


def test_design_numbers() -> None:
    assert DESIGN.correction_range() == (8, 21)
    f = inv_freq(DESIGN)
    assert f.shape == (32,) and f.dtype == torch.float32
    expected = {0: 1.0, 1: 0.7498942, 2: 0.56234133, 9: 0.07066310, 14: 0.011627212, 20: 0.00097300857}
    for i, v in expected.items():
        assert f[i].item() == pytest.approx(v, rel=2e-7), i
    assert f[-1].item() == pytest.approx(3.3338038e-05, rel=2e-7)
    assert attention_scale(DESIGN) == pytest.approx(0.1 * math.log(4) + 1, abs=1e-12)
    assert attention_scale(DESIGN) == pytest.approx(1.1386294361, abs=1e-10)


def test_design_ramp_ends_follow_the_paper() -> None:
    # Below the correction range frequencies are kept (extrapolation), above it they are divided by the factor.
    d, s = 64, 4.0
    plain = torch.tensor([1e4 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    f = inv_freq(DESIGN).double()
    torch.testing.assert_close(f[:9], plain[:9], rtol=1e-6, atol=0)
    torch.testing.assert_close(f[21:], plain[21:] / s, rtol=1e-6, atol=0)
    assert torch.all((f[9:21] < plain[9:21]) & (f[9:21] > plain[9:21] / s))


@pytest.mark.parametrize("original", [512, 2048])
def test_factor_one_equals_plain_rope_exactly(original: int) -> None:
    yarn1 = RopeConfig(head_dim=64, rope_type="yarn", factor=1.0, original_max_position_embeddings=original)
    plain = RopeConfig(head_dim=64)
    assert torch.equal(inv_freq(yarn1), inv_freq(plain))
    assert attention_scale(yarn1) == attention_scale(plain) == 1.0
    closed_form = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(inv_freq(plain).double(), closed_form, rtol=3e-7, atol=0)
    pos = torch.arange(4 * 2048)
    for a, b in zip(RotaryEmbedding(yarn1)(pos), RotaryEmbedding(plain)(pos), strict=True):
        assert torch.equal(a, b)
    cos, sin = RotaryEmbedding(plain)(pos)
    angles = pos[:, None].double() * closed_form.repeat(2)[None, :]
    # float32 angles carry ~2 ulp of relative error: allow 2.4e-7 rad per unit of position.
    bound = (pos[:, None].double() + 1) * 2.4e-7
    assert torch.all((cos.double() - angles.cos()).abs() <= bound)
    assert torch.all((sin.double() - angles.sin()).abs() <= bound)


def test_factor_is_honoured_not_derived_from_max_position_embeddings() -> None:
    hf = {"head_dim": 64, "max_position_embeddings": 32768, "rope_theta": 1e4,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}  # fmt: skip
    cfg = RopeConfig.from_hf(hf)  # max/original would be 16
    assert cfg.factor == 4.0
    assert torch.equal(inv_freq(cfg), inv_freq(DESIGN))


# ------------------------------------------------------------------------------------ Hugging Face oracle


@pytest.mark.parametrize("name,kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_matches_hugging_face_yarn_parameters(name: str, kwargs: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = RopeConfig(**kwargs)
    hf = _hf_config(cfg)
    if cfg.rope_type == "default":  # transformers 5 computes plain RoPE in the model class, not in the registry
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        hf_inv_freq, hf_scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    torch.testing.assert_close(inv_freq(cfg), hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_scale(cfg) == pytest.approx(hf_scale if hf_scale is not None else 1.0, rel=1e-12)
    # Reading HF's own serialised config (transformers 5 writes rope_parameters) gives back the same config.
    assert RopeConfig.from_hf(hf.to_dict()) == RopeConfig.from_hf(
        {"head_dim": cfg.head_dim, "rope_theta": cfg.base, "rope_scaling": cfg.to_hf_rope_scaling()}
    )
    assert inv_freq(RopeConfig.from_hf(hf.to_dict())).equal(inv_freq(cfg))


def test_from_hf_mscale_all_dim_without_mscale_matches_hugging_face() -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale_all_dim": 0.7}
    hf = Qwen3Config(hidden_size=128, num_attention_heads=2, head_dim=64, max_position_embeddings=4096,
                     rope_scaling=dict(scaling))  # fmt: skip
    _, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = RopeConfig.from_hf({"head_dim": 64, "rope_scaling": scaling})
    assert attention_scale(ours) == pytest.approx(hf_scale, rel=1e-12)
    assert attention_scale(ours) == pytest.approx(
        0.1 * math.log(8) + 1, rel=1e-12
    )  # HF: mscale_all_dim alone is ignored


@pytest.mark.parametrize("name,kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_cos_sin_match_hugging_face_qwen3_rotary(name: str, kwargs: dict[str, Any]) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = RopeConfig(**kwargs)
    positions = torch.arange(_max_pos(cfg))[None, :]  # (1, T)
    x = torch.zeros(1, positions.shape[1], cfg.head_dim)
    # Factor 1 is plain RoPE by definition (the project design); HF's YaRN blend of two equal tensors can round one
    # ulp away from it, which at position ~2k moves cos by ~3e-5. So plain RoPE is the oracle there.
    hf_cfg = _hf_config(RopeConfig(head_dim=cfg.head_dim, base=cfg.base) if cfg.factor == 1.0 else cfg)
    hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_cfg)(x, positions)
    cos, sin = RotaryEmbedding(cfg)(positions)
    assert cos.shape == sin.shape == (1, positions.shape[1], cfg.head_dim)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_hugging_face_qwen3(dtype: torch.dtype) -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 64, generator=gen).to(dtype)  # (B, H, T, D)
    k = torch.randn(2, 2, 5, 64, generator=gen).to(dtype)  # (B, Hkv, T, D)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3000, 5000, 7000, 8000, 8191]])  # (B, T)
    cos, sin = RotaryEmbedding(DESIGN)(positions)  # (B, T, D)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=1)
    ours_q, ours_k = apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k, cos[:, None], sin[:, None])
    assert ours_q.dtype == ours_k.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(ours_q, hf_q, rtol=0, atol=tol)
    torch.testing.assert_close(ours_k, hf_k, rtol=0, atol=tol)


# ------------------------------------------------------------------------------------------------- llama3

LLAMA3: list[tuple[str, dict[str, Any]]] = [
    ("llama3.1_8b", dict(head_dim=128, base=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192)),
    ("llama3.2_1b", dict(head_dim=64, base=5e5, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192)),
    ("tiny", dict(head_dim=16, base=1e4, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=32)),
    ("other_factors", dict(head_dim=32, base=1e4, rope_type="llama3", factor=3.0, low_freq_factor=2.0,
                           high_freq_factor=8.0, original_max_position_embeddings=256)),
]  # fmt: skip


def _hf_llama_config(cfg: RopeConfig) -> Any:
    from transformers import LlamaConfig

    assert cfg.original_max_position_embeddings is not None
    params = {"rope_theta": cfg.base, **(cfg.to_hf_rope_scaling() or {})}
    return LlamaConfig(hidden_size=cfg.head_dim * 2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=cfg.head_dim, max_position_embeddings=4 * cfg.original_max_position_embeddings,
                       rope_parameters=params)  # fmt: skip


@pytest.mark.parametrize("name,kwargs", LLAMA3, ids=[c[0] for c in LLAMA3])
def test_llama3_equals_transformers_compute_llama3_parameters_bit_for_bit(name: str, kwargs: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = RopeConfig(**kwargs)
    hf = _hf_llama_config(cfg)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert inv_freq(cfg).equal(hf_inv_freq.float())
    assert attention_scale(cfg) == hf_scale == 1.0
    plain = inv_freq(RopeConfig(head_dim=cfg.head_dim, base=cfg.base))
    assert not inv_freq(cfg).equal(plain) and inv_freq(cfg)[0] == plain[0]  # slow pairs scaled, the fastest kept
    assert RopeConfig.from_hf(hf.to_dict()) == cfg  # what transformers 5 serialises reads back


@pytest.mark.parametrize("name,kwargs", LLAMA3, ids=[c[0] for c in LLAMA3])
def test_llama3_cos_sin_match_transformers_llama_rotary(name: str, kwargs: dict[str, Any]) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = RopeConfig(**kwargs)
    positions = torch.arange(4 * (cfg.original_max_position_embeddings or 0))[None, :]
    hf_cos, hf_sin = LlamaRotaryEmbedding(_hf_llama_config(cfg))(torch.zeros(1, 1, cfg.head_dim), positions)
    cos, sin = RotaryEmbedding(cfg)(positions)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "scaling,field",
    [
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "high_freq_factor": 4.0},
         "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
          "original_max_position_embeddings": 64}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "original_max"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "beta_fast": 32}, "beta_fast"),
    ],
)  # fmt: skip
def test_llama3_errors_name_the_field(scaling: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RopeConfig.from_hf({"head_dim": 16, "rope_parameters": {"rope_theta": 1e4, **scaling}})


# --------------------------------------------------------------------------------------- megatron oracle


@pytest.fixture(scope="module")
def megatron_model_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Single-process gloo model parallelism, as GPTModel needs; torch.cuda.current_device -> CPU without CUDA."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    patch = pytest.MonkeyPatch()
    if not torch.cuda.is_available():  # YarnRotaryEmbedding moves its tensors to current_device() on every call
        patch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    own_pg = not dist.is_initialized()
    if own_pg:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    own_mp = not parallel_state.model_parallel_is_initialized()
    if own_mp:
        parallel_state.initialize_model_parallel(1, 1)
    yield
    if own_mp:
        parallel_state.destroy_model_parallel()
    if own_pg:
        dist.destroy_process_group()
    patch.undo()


def _megatron_config(head_dim: int, **overrides: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=head_dim,
                             ffn_hidden_size=64, use_cpu_initialization=True, **overrides)  # fmt: skip


@pytest.mark.parametrize("name,kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_cos_sin_match_megatron_gpt_model(name: str, kwargs: dict[str, Any], megatron_model_parallel: None) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from yarn.megatron import configure

    cfg = RopeConfig(**kwargs)
    config = _megatron_config(cfg.head_dim)
    model_kwargs = configure(config, cfg)
    assert model_kwargs["position_embedding_type"] == ("rope" if name in ("plain", "factor_one") else "yarn")
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                     max_sequence_length=_max_pos(cfg), **model_kwargs)  # fmt: skip
    n = _max_pos(cfg)
    out = model.rotary_pos_emb(n)  # what GPTModel.forward calls: raw angles (and, for yarn, its own mscale)
    emb = out[0] if isinstance(out, tuple) else out  # (T, 1, 1, D)
    mscale = _yarn_get_concentration_factor_from_config(config)  # what each attention layer multiplies by
    cos, sin = RotaryEmbedding(cfg)(torch.arange(n))
    torch.testing.assert_close(cos, (emb.cos() * mscale)[:, 0, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, (emb.sin() * mscale)[:, 0, 0], rtol=0, atol=1e-6)
    x = torch.randn(n, 1, 2, cfg.head_dim, generator=torch.Generator().manual_seed(1))  # (T, B, H, D), Megatron sbhd
    rotated = _apply_rotary_pos_emb_bshd(x, emb, mscale=mscale)
    torch.testing.assert_close(apply_rotary(x, cos[:, None, None], sin[:, None, None]), rotated, rtol=0, atol=1e-5)


def test_megatron_configure_rejects_what_it_cannot_reproduce() -> None:
    from yarn.megatron import configure

    with pytest.raises(ValueError, match="kv_channels"):
        configure(_megatron_config(32), DESIGN)
    with pytest.raises(ValueError, match="rotary_interleaved"):
        configure(_megatron_config(64, rotary_interleaved=True), DESIGN)
    factor_one = RopeConfig(head_dim=64, rope_type="yarn", factor=1.0, original_max_position_embeddings=8,
                            attention_factor=1.2)  # fmt: skip
    with pytest.raises(ValueError, match="attention_factor"):
        configure(_megatron_config(64), factor_one)


def test_megatron_configure_clears_stale_yarn_attributes() -> None:
    from yarn.megatron import YARN_ATTRIBUTES, configure

    config = _megatron_config(64)
    assert configure(config, DESIGN)["position_embedding_type"] == "yarn"
    assert all(hasattr(config, a) for a in YARN_ATTRIBUTES)
    assert configure(config, RopeConfig(head_dim=64))["position_embedding_type"] == "rope"
    assert not any(hasattr(config, a) for a in YARN_ATTRIBUTES)


# ------------------------------------------------------------------------------------ rotary properties


@pytest.mark.parametrize("cfg", [RopeConfig(head_dim=64), DESIGN], ids=["plain", "yarn"])
def test_rotation_preserves_norm_up_to_the_attention_scale(cfg: RopeConfig) -> None:
    x = torch.randn(3, 7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cos, sin = RotaryEmbedding(cfg)(torch.randint(0, 8192, (3, 7), generator=torch.Generator().manual_seed(3)))
    y = apply_rotary(x, cos.double(), sin.double())
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1) * attention_scale(cfg), rtol=1e-6, atol=0)


@pytest.mark.parametrize("cfg", [RopeConfig(head_dim=64), DESIGN], ids=["plain", "yarn"])
def test_score_depends_only_on_relative_position(cfg: RopeConfig) -> None:
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(64, dtype=torch.float64, generator=gen), torch.randn(64, dtype=torch.float64, generator=gen)
    rope = RotaryEmbedding(cfg)

    def score(m: int, n: int) -> float:
        cos, sin = rope(torch.tensor([m, n]))
        qm = apply_rotary(q, cos[0].double(), sin[0].double())
        kn = apply_rotary(k, cos[1].double(), sin[1].double())
        return float(qm @ kn)

    for m, n in [(5, 2), (100, 37), (40, 90)]:
        for shift in (1, 1000, 6000):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), rel=1e-4, abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)  # the score does depend on the offset
    # Same positions: q·k scaled by the attention scale squared (cos² + sin² = scale²).
    assert score(9, 9) == pytest.approx(float(q @ k) * attention_scale(cfg) ** 2, rel=1e-5)


def test_four_times_the_original_length_is_finite() -> None:
    cfg = RopeConfig(head_dim=16, rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 512, 16, generator=gen), torch.randn(1, 2, 512, 16, generator=gen)  # (B, H, T, D)
    cos, sin = RotaryEmbedding(cfg)(torch.arange(512))  # 4x the original 128
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    out = torch.nn.functional.scaled_dot_product_attention(
        apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), k, is_causal=True
    )
    assert torch.isfinite(out).all()


def test_cache_grows_to_the_same_values_and_checks_positions() -> None:
    rope = RotaryEmbedding(DESIGN, max_positions=16)
    late = torch.tensor([[8191, 3], [4096, 17]])
    cos, sin = rope(late)
    assert rope.cos_cached.shape[0] >= 8192
    full_cos, full_sin = RotaryEmbedding(DESIGN, max_positions=8192)(late)
    assert torch.equal(cos, full_cos) and torch.equal(sin, full_sin)
    assert cos.shape == (2, 2, 64) and cos.dtype == torch.float32
    with pytest.raises(ValueError, match="positions"):
        rope(torch.tensor([-1]))
    with pytest.raises(TypeError, match="positions"):
        rope(torch.tensor([1.0]))


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=-4), "head_dim"),
        (dict(head_dim=63), "head_dim"),
        (dict(head_dim=64, base=0.0), "base"),
        (dict(head_dim=64, base=-1e4), "base"),
        (dict(head_dim=64, rope_type="linear"), "rope_type"),
        (dict(head_dim=64, rope_type="yarn", factor=0.5, original_max_position_embeddings=2048), "factor"),
        (dict(head_dim=64, rope_type="yarn", factor=4.0), "original_max_position_embeddings"),
        (dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=0),
         "original_max_position_embeddings"),
        (dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048, beta_fast=1.0),
         "beta_fast"),
        (dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048, beta_slow=0.0),
         "beta_slow"),
        (dict(head_dim=64, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048,
              attention_factor=0.0), "attention_factor"),
        (dict(head_dim=64, factor=4.0), "rope_type='yarn'"),
    ],
)  # fmt: skip
def test_invalid_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RopeConfig(**kwargs)


@pytest.mark.parametrize(
    "scaling,field",
    [
        ({"rope_type": "yarn", "original_max_position_embeddings": 2048}, "rope_scaling.factor"),
        ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        ({"rope_type": "dynamic", "factor": 4.0}, "rope_type"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "low_freq_factor": 1},
         "low_freq_factor"),
        ({"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 2048}, "factor"),
    ],
)  # fmt: skip
def test_from_hf_errors_name_the_field(scaling: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RopeConfig.from_hf({"hidden_size": 256, "num_attention_heads": 4, "rope_scaling": scaling})


def test_from_hf_reads_plain_and_legacy_configs() -> None:
    plain = RopeConfig.from_hf({"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e6, "rope_scaling": None})
    assert plain == RopeConfig(head_dim=64, base=1e6)
    legacy = RopeConfig.from_hf({"head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 4,
                                 "original_max_position_embeddings": 2048}})  # fmt: skip
    assert legacy == DESIGN
    assert RopeConfig.from_hf({"head_dim": 64, "rope_scaling": DESIGN.to_hf_rope_scaling()}) == DESIGN


@pytest.mark.parametrize("name,kwargs", LLAMA3, ids=[c[0] for c in LLAMA3])
def test_llama3_trainer_rotates_as_the_engine_bit_for_bit(
    name: str, kwargs: dict[str, Any], megatron_model_parallel: None
) -> None:
    """The trainer's GPTModel (`trainer.policy.gpt.build_gpt_model`, Megatron's plain rotary module given
    llama3's frequencies by `yarn.megatron.install_frequencies`) and the engine's `RotaryEmbedding`
    compute the same angles, cos and sin bit for bit; without the frequencies Megatron's would differ."""
    from trainer.policy.gpt import build_gpt_model

    cfg = RopeConfig(**kwargs)
    params = {"rope_theta": cfg.base, **(cfg.to_hf_rope_scaling() or {})}
    hf = dict(vocab_size=16, hidden_size=2 * cfg.head_dim, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=cfg.head_dim, rope_parameters=params)  # fmt: skip
    model = build_gpt_model(hf)
    n = 4 * (cfg.original_max_position_embeddings or 0)
    emb = model.rotary_pos_emb(n)  # (T, 1, 1, D) angles, as GPTModel.forward computes them
    emb = (emb[0] if isinstance(emb, tuple) else emb)[:, 0, 0]
    assert model.rotary_pos_emb.inv_freq.equal(inv_freq(cfg))
    cos, sin = RotaryEmbedding(cfg)(torch.arange(n))
    assert emb.cos().equal(cos) and emb.sin().equal(sin)
    plain = build_gpt_model(hf | {"rope_parameters": {"rope_theta": cfg.base}})  # the negative control
    assert not plain.rotary_pos_emb(n)[:, 0, 0].cos().equal(cos)
