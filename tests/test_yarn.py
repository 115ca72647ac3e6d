"""YaRN rotary embedding (yarn/) against independent oracles: DESIGN.md's published numbers, the closed form
of plain RoPE, Hugging Face transformers' YaRN and Qwen3 rotary code, and megatron-core's YarnRotaryEmbedding."""

from __future__ import annotations

import math

import pytest
import torch

from yarn import RopeConfig, attention_scale, inv_freq

DESIGN = RopeConfig(head_dim=64, base=1e4, rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)


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
