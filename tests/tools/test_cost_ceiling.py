"""The controller-ceiling tool (tools/bench/cost_ceiling.py): the cost table it measures comes from the
engine's own decode steps at each static k, and a controller priced from it decides by the table
(oracle: the closed-form argmax of tests/sidecar/speculation/test_speculation_policy.py)."""

from __future__ import annotations

import pytest

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.speculation.test_speculation_policy import exact_config, feed_acceptance, oracle_best
from tools.bench.cost_ceiling import TablePriced, measure_step_costs


def test_the_table_holds_every_static_k_that_ran(random_model: Qwen3WithMTP) -> None:
    engine = TorchEngine(random_model, speculation_k=3, max_speculation_k=3, speculation_auto=True)

    def generate(e: TorchEngine, seed: int) -> None:
        e.generate(
            GenerationRequest(
                prompts=[[3, 4, 5, 6]],
                sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed),
                samples_per_prompt=2,
            )
        )

    table = measure_step_costs(engine, generate, [0, 1, 3], generations=2)
    assert set(table[2]) == {0, 1, 3}  # batch 2: the only batch that ran
    assert all(seconds > 0 for seconds in table[2].values())


def test_a_table_priced_controller_decides_by_the_table() -> None:
    alphas = [0.8, 0.7, 0.6, 0.5, 0.4]
    verify = [0.010, 0.012, 0.0135, 0.016, 0.019, 0.023]
    policy = TablePriced(exact_config(), {8: dict(enumerate(verify))})
    feed_acceptance(policy, alphas)
    policy.observe_step(batch=8, k=0, draft_seconds=0.0, step_seconds=0.5, tokens=8)  # its own measurements are ignored
    best, _ = oracle_best(alphas, verify, 0.0)
    assert policy.predicted_seconds(16, 2) == pytest.approx(verify[2])  # the nearest batch measured
    assert policy.decide(8).k == best


def test_a_table_without_some_k_is_refused() -> None:
    with pytest.raises(ValueError, match=r"k = \[4, 5\]"):
        TablePriced(exact_config(), {8: {0: 0.01, 1: 0.012, 2: 0.013, 3: 0.015}})
