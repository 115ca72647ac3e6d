"""Speculation priced by the experts it reads (issue 58): the union formula, the controller's prior,
the planner's projection and `specrl plan --model qwen3-30b-a3b`.

Oracles: a Monte Carlo draw of uniform top-k routing (distinct experts of T tokens, each choosing k
distinct of E at random); the issue's own figures for 128 experts top-8 (~29 experts for a k = 3
verify at batch 1, ~3.6x the expert bytes; ~1.5x at batch 16; ~1x at 64); the controller's dense
prior (1 + slope per extra token) for a dense model, unchanged.

The planner's table by batch is `trainer/planning/experts.py`'s.
"""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from sidecar.engine.commit import verify_union
from sidecar.engine.speculation_settings import expert_reads_of
from sidecar.model.model import ModelConfig
from sidecar.model.moe import MoEConfig
from sidecar.speculation.config import SpeculationControllerConfig
from sidecar.speculation.controller import SpeculationController
from sidecar.speculation.expert_union import ExpertReads, MeasuredUnion, uniform_union
from trainer.planning.shapes import load_shape


def monte_carlo_union(experts: int, top_k: int, tokens: int, draws: int = 4000) -> float:
    g = torch.Generator().manual_seed(tokens)
    picks = torch.rand(draws, tokens, experts, generator=g).argsort(-1)[..., :top_k]  # k distinct per token
    hit = torch.zeros(draws, experts, dtype=torch.bool)
    hit.scatter_(1, picks.reshape(draws, -1), True)
    return hit.sum(-1).float().mean().item()


@pytest.mark.parametrize(
    ("experts", "top_k", "tokens"), [(128, 8, 1), (128, 8, 4), (128, 8, 16), (64, 6, 7), (8, 2, 3)]
)
def test_the_uniform_union_is_the_expected_count_of_distinct_experts(experts: int, top_k: int, tokens: int) -> None:
    assert uniform_union(experts, top_k, tokens) == pytest.approx(monte_carlo_union(experts, top_k, tokens), rel=0.02)


def test_the_issues_figures_for_128_experts_top_8() -> None:
    u = lambda t: uniform_union(128, 8, t)  # noqa: E731
    assert u(1) == pytest.approx(8.0) and u(4) == pytest.approx(29.1, abs=0.1)
    assert u(4) / u(1) == pytest.approx(3.6, abs=0.05)  # a k = 3 verify at batch 1
    assert u(64) / u(16) == pytest.approx(1.5, abs=0.05)  # at batch 16
    assert u(256) / u(64) == pytest.approx(1.0, abs=0.03)  # at batch 64


def controller(reads: ExpertReads | None) -> SpeculationController:
    p = SpeculationController(SpeculationControllerConfig(max_speculation_k=3), reads)
    for batch in (1, 64):
        p.observe_step(batch=batch, k=0, draft_seconds=0.0, step_seconds=0.010, tokens=batch)
    return p


def test_the_controllers_prior_counts_the_union_and_a_dense_prior_is_unchanged() -> None:
    shape = load_shape("qwen3-30b-a3b")
    reads = shape.expert_reads()
    slope = SpeculationControllerConfig(max_speculation_k=3).prior_verify_slope
    dense, moe = controller(None), controller(reads)
    verify_only = (
        SpeculationControllerConfig(max_speculation_k=3).prior_draft_cost * 3
    )  # the draft prior, identical for both
    assert dense.predicted_seconds(1, 3) == pytest.approx(0.010 * (1 + 3 * slope + verify_only))
    assert moe.predicted_seconds(1, 3) == pytest.approx(0.010 * (reads.verify_ratio(1, 4) + 3 * slope + verify_only))
    assert reads.verify_ratio(1, 4) > 2.0  # batch 1: the verify reads ~3.6x the expert bytes
    assert reads.verify_ratio(64, 4) < 1.05  # batch 64: every expert is read anyway
    rates_1, rates_64 = moe.expected_rates(1), moe.expected_rates(64)
    assert rates_1 is not None and rates_64 is not None
    best = lambda rates: max(range(len(rates)), key=lambda k: rates[k])  # noqa: E731
    assert best(rates_1) == 0 and best(rates_64) > 0  # the prior already says where it loses
    dense_1 = dense.expected_rates(1)
    assert dense_1 is not None and best(dense_1) > 0  # a dense model of the same costs drafts at batch 1


def test_the_engines_expert_reads_follow_the_layout() -> None:
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
    config = ModelConfig.tiny(num_hidden_layers=3, architectures=["Qwen3MoeForCausalLM"], moe=moe)
    reads = expert_reads_of(config)
    assert reads is not None and reads.sparse_layers == 2 and reads.expert_bytes == 3 * 64 * 32 * 4
    assert expert_reads_of(ModelConfig.tiny()) is None
    assert reads.verify_ratio(1, 1) == 1.0 and reads.verify_ratio(1, 4) > 1.0


def test_the_planners_bytes_are_the_union(tmp_path) -> None:
    shape = load_shape("qwen3-30b-a3b")
    assert shape.active_params == pytest.approx(3.3e9, rel=0.1)  # "A3B"
    reads = shape.expert_reads()
    one, four = shape.weight_bytes(1), shape.weight_bytes(4)
    expert_bytes = shape.sparse_layers * shape.expert_params * 2
    assert four - one == pytest.approx(expert_bytes * (uniform_union(128, 8, 4) - 8))
    assert float(shape.weight_bytes(1)) == pytest.approx(reads.step_bytes(1))
    assert math.isclose(float(shape.weight_bytes(10_000)), reads.fixed_bytes + 128 * expert_bytes, rel_tol=1e-9)


def test_specrl_plan_prints_the_union_aware_projection_for_qwen3_30b_a3b() -> None:
    from trainer.cli.main import main

    args = ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h200", "--lengths", "2000"]
    result = CliRunner().invoke(main, [*args, "--acceptance", "0.8,0.7,0.6", "--ks", "1,2,3"])
    assert result.exit_code == 0, result.output
    assert "experts read per round (128 routed experts, top 8, 48 sparse layers" in result.output
    assert "| 1 | 8.0 | 29.1 |" in result.output  # batch 1: 8 experts plain, 29 for a k = 3 verify
    assert "speculation at k = 3 pays from batch 4 up (it loses at batch 2 and below)" in result.output
    dense = CliRunner().invoke(main, [*args[:2], "qwen3-8b", *args[3:], "--acceptance", "0.8,0.7,0.6", "--ks", "3"])
    assert dense.exit_code == 0 and "experts read" not in dense.output, dense.output


def test_tools_bench_moe_runs_side_by_side_and_reports_the_measured_union(capsys: pytest.CaptureFixture[str]) -> None:
    """specrl bench moe (docs/moe.md's CPU figures) at its smallest: both models, both k, the union."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "tools" / "bench" / "moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--batches", "2", "--repeats", "1", "--new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["moe", "dense"]
    measured = rows[0].split("|")[7].strip()
    assert measured.endswith("forwards)") and float(rows[0].split("|")[8]) == pytest.approx(
        uniform_union(32, 4, 8), abs=0.05
    )


def test_the_measured_union_replaces_the_formula_where_measured() -> None:
    """Closed forms: nothing measured is the uniform formula; a measured count is its readings' mean;
    another count is the formula times the nearest measured count's ratio, never beyond E."""
    union = MeasuredUnion(128, 8)
    assert union(4) == pytest.approx(uniform_union(128, 8, 4))
    union.observe(4, 11.0)
    union.observe(4, 13.0)
    assert union(4) == pytest.approx(12.0)
    assert union(8) == pytest.approx(uniform_union(128, 8, 8) * 12.0 / uniform_union(128, 8, 4))
    assert union(3) == pytest.approx(uniform_union(128, 8, 3) * 12.0 / uniform_union(128, 8, 4))
    union.observe(64, 128.0)
    assert union(1024) == 128.0 and union.measured_tokens == [4, 64]
    with pytest.raises(ValueError, match="cannot read 129"):
        union.observe(64, 129.0)


def test_automatic_k_prices_the_measured_union_and_turns_speculation_off_where_it_loses() -> None:
    """A constructed cost table (plain step 10 ms at batch 1 and 64, Qwen3-30B-A3B's bytes): the
    prior of a k = 3 verify at batch 1 is the measured union's bytes over a plain step's (closed
    form); under uniform routing (29 experts for 4 tokens) automatic k chooses k = 0 at batch 1; where
    the engine measured that 4 consecutive tokens share their 8 experts it drafts, as for a dense model."""
    reads = load_shape("qwen3-30b-a3b").expert_reads()
    slope = SpeculationControllerConfig(max_speculation_k=3).prior_verify_slope
    draft = SpeculationControllerConfig(max_speculation_k=3).prior_draft_cost * 3
    best = lambda rates: max(range(len(rates)), key=lambda k: rates[k])  # noqa: E731
    uniform = controller(reads)
    assert uniform.union is not None and uniform.union.measured_tokens == []
    rates = uniform.expected_rates(1)
    assert rates is not None and best(rates) == 0  # speculation loses: k = 0
    shared = controller(reads)
    for tokens, distinct in ((1, 8.0), (4, 8.0)):
        shared.observe_expert_union(tokens, distinct)
    ratio = (reads.fixed_bytes + reads.sparse_layers * 8.0 * reads.expert_bytes) / reads.step_bytes(1)
    assert ratio == pytest.approx(1.0)
    assert shared.predicted_seconds(1, 3) == pytest.approx(0.010 * (ratio + 3 * slope + draft))
    rates = shared.expected_rates(1)
    assert rates is not None and best(rates) > 0
    some = controller(reads)
    some.observe_expert_union(4, 16.0)  # half the uniform union's extra experts
    expected = (reads.fixed_bytes + reads.sparse_layers * 16.0 * reads.expert_bytes) / reads.step_bytes(1)
    assert some.predicted_seconds(1, 3) == pytest.approx(0.010 * (expected + 3 * slope + draft))
    assert controller(None).union is None  # a dense target measures nothing
    no_sparse = ExpertReads(experts=8, top_k=2, sparse_layers=0, expert_bytes=1.0, fixed_bytes=1.0)
    assert controller(no_sparse).union is None  # nor one whose layers are all dense


def test_verify_union_counts_every_verified_column_and_no_padding() -> None:
    """By hand: row 0 verified 3 columns (experts {0, 1}, {1, 2}, {5, 6}), row 1 one ({3, 4}); its
    padding columns name experts 7 and 6, which no verify read."""
    routes = torch.tensor([[[[0, 1], [1, 2], [5, 6]], [[3, 4], [7, 7], [6, 6]]]], dtype=torch.uint8)
    assert verify_union(routes, [2, 0], experts=8) == (4, 7.0)
    two_layers = torch.cat([routes, torch.zeros_like(routes)])  # a second layer reads expert 0 only
    assert verify_union(two_layers, [2, 0], experts=8) == (4, 4.0)


def test_the_engines_automatic_k_measures_the_union_of_its_verifies() -> None:
    """An MoE target under automatic k: the controller holds the engine's readings, each a union the
    tokens could read (between top k and min(E, tokens x top k)); one token reads exactly top k."""
    from sidecar.engine.torch_engine import UNION_EVERY, TorchEngine
    from sidecar.model.model import build_model
    from sidecar.types import GenerationRequest, SamplingParams

    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    config = ModelConfig.tiny(num_nextn_predict_layers=1, architectures=["Qwen3MoeForCausalLM"], moe=moe)
    engine = TorchEngine(build_model(config, seed=3), speculation_k=3, kv_block_size=4)
    engine.set_speculation_auto(3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6 * UNION_EVERY)
    engine.generate(GenerationRequest(prompts=[[1, 2, 3]], sampling=sp))
    engine.generate(GenerationRequest(prompts=[[4, 5], [6]], sampling=sp))
    union = engine.speculation.controller.union if engine.speculation.controller else None
    assert union is not None and union.measured_tokens
    for tokens in union.measured_tokens:
        assert 2 <= union(tokens) <= min(8, 2 * tokens)
    if 1 in union.measured_tokens:
        assert union(1) == 2.0
