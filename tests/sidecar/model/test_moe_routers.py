"""The routers of `sidecar.model.moe` against transformers' own router modules (issue 58).

Oracle: `Qwen3MoeTopKRouter` and `Glm4MoeTopkRouter` at the same weights, over many random tokens:
the same experts and the same weights (compared by expert id: the order of a token's k choices is
not part of the result, the expert sum adds them in expert order). Controls: the parts of each rule
matter at these weights (renormalisation, the expert-score bias, the group limit), so a router that
skipped one would fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from sidecar.model.model import ModelConfig
from sidecar.model.moe import HF_DEFAULTS, MoEConfig, route

HIDDEN, EXPERTS, TOKENS = 32, 16, 512


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.float().gather(1, order), ids.gather(1, order)


def tokens(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_topk_routes_as_qwen3_moe(norm_topk_prob: bool) -> None:
    hf_cfg = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob
    )
    router = Qwen3MoeTopKRouter(hf_cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0)))
        _, hf_weights, hf_ids = router(tokens(1))
    cfg = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=4, moe_intermediate_size=8, norm_topk_prob=norm_topk_prob)
    weights, ids = route(torch.nn.functional.linear(tokens(1), router.weight.detach()), cfg)
    (w, i), (hw, hi) = by_id(weights, ids), by_id(hf_weights, hf_ids)
    assert torch.equal(i, hi)
    torch.testing.assert_close(w, hw, atol=1e-6, rtol=0)
    assert torch.allclose(w.sum(-1), torch.ones(TOKENS)) == norm_topk_prob  # renormalised iff asked


GLM: dict[str, Any] = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)


def glm_route(bias: torch.Tensor, **overrides: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[Any, ...]]:
    """(ours, transformers') routing of the same tokens at the same router weight and bias."""
    kw = GLM | overrides
    hf_cfg = transformers.Glm4MoeConfig(hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, **kw)
    router = Glm4MoeTopkRouter(hf_cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.3)
        router.e_score_correction_bias.copy_(bias)
        _, hf_weights, hf_ids = router(tokens(2))
    cfg = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=4, moe_intermediate_size=8, router="sigmoid_grouped", **kw)
    logits = torch.nn.functional.linear(tokens(2), router.weight.detach())
    return route(logits, cfg, bias), (hf_weights, hf_ids)


BIAS = torch.linspace(-0.3, 0.3, EXPERTS)[torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(3))]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_topk_prob": False}, {"n_group": 1, "topk_group": 1}, {"routed_scaling_factor": 1.0}],
    ids=["glm45", "not_renormalised", "one_group", "unscaled"],
)
def test_sigmoid_grouped_routes_as_glm4_moe(overrides: dict[str, Any]) -> None:
    (weights, ids), (hf_weights, hf_ids) = glm_route(BIAS, **overrides)
    (w, i), (hw, hi) = by_id(weights, ids), by_id(hf_weights, hf_ids)
    assert torch.equal(i, hi)
    torch.testing.assert_close(w, hw, atol=1e-6, rtol=0)


def test_the_bias_and_the_group_limit_change_the_choice() -> None:
    """Controls: without the expert-score bias, or without the group limit, the choices differ."""
    (_, ids), _ = glm_route(BIAS)
    (_, unbiased), _ = glm_route(torch.zeros(EXPERTS))
    (_, ungrouped), _ = glm_route(BIAS, topk_group=4)
    chosen = ids.sort(-1).values
    assert (chosen != unbiased.sort(-1).values).any(-1).float().mean() > 0.2
    assert (chosen != ungrouped.sort(-1).values).any(-1).float().mean() > 0.05
    groups = ids // (EXPERTS // GLM["n_group"])  # every token's experts lie in at most topk_group groups
    assert all(len(set(row.tolist())) <= GLM["topk_group"] for row in groups)


@pytest.mark.parametrize(
    ("architecture", "config_cls"),
    [("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig), ("Glm4MoeForCausalLM", transformers.Glm4MoeConfig)],
)
def test_a_key_config_json_leaves_out_takes_transformers_default(architecture: str, config_cls: Any) -> None:
    """Where a config.json omits a key, transformers' forward uses its class default: so must we."""
    hf = config_cls()
    for key, value in HF_DEFAULTS[architecture].items():
        theirs = getattr(hf, key, None)
        if key == "partial_rotary_factor":
            theirs = hf.rope_parameters["partial_rotary_factor"]
        assert theirs == value, key
    minimal = {"architectures": [architecture], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48}
    minimal |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    config = ModelConfig.from_hf_dict(minimal)
    assert config.moe is not None and config.moe.num_experts == 128 and config.moe.num_experts_per_tok == 8
    assert config.moe.norm_topk_prob == hf.norm_topk_prob
    if architecture == "Glm4MoeForCausalLM":
        assert (config.moe.n_shared_experts, config.moe.first_k_dense_replace, config.partial_rotary_factor) == (
            1,
            1,
            0.5,
        )
