"""The planner's validation tools on a tiny checkpoint: `specrl bench cost-table` records the
engine's own round costs on the demo workload as a cost table `specrl plan` reads, with the
workload's acceptance and lengths; `specrl bench validate-plan` predicts a run's steps from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from tools.bench import cost_table as measure_cost_table
from tools.bench import validate_plan
from trainer.planning.cost_table import load_costs


@pytest.fixture(scope="module")
def costs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tools")
    cfg = ModelConfig.tiny(vocab_size=128, eos_token_id=[1])  # the demo's character prompts fit its vocab
    save_checkpoint(root / "policy", cfg, model_state_dict(build_model(cfg, seed=0)))
    out = root / "costs.json"
    args = ["--policy", str(root / "policy"), "--out", str(out), "--ks", "0,1,3", "--generations", "3"]
    assert measure_cost_table.main([*args, "--refill-generations", "2"]) == 0
    return out


def test_the_measured_table_holds_rounds_prefill_and_the_workload(costs: Path) -> None:
    table = load_costs(costs)
    assert 0 in table.cells[max(table.cells)] and table.prefill
    # a refill round's shape: one prompt's rows, measured from their first round at every k
    assert set(table.cells[measure_cost_table.SAMPLES]) == {0, 1, 3}
    doc = json.loads(costs.read_text())["tables"][0]
    assert 0 <= doc["step_seconds"] < min(r["seconds"] for r in doc["rounds"])  # bookkeeping, not a round
    workload = doc["workload"]
    share = measure_cost_table.PROMPTS // measure_cost_table.ENGINES * measure_cost_table.SAMPLES
    assert len(workload["lengths"]) == 3 * share  # three generations of one sidecar's rows at the largest k
    assert len(workload["accepted_cumulative"]) == 3
    assert all(1 <= n <= workload["max_new_tokens"] for n in workload["lengths"])


def test_validation_predicts_every_step_of_a_run(costs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    run.mkdir()
    step = {
        "time/generation": 0.05, "time/generation_plain": 0.07, "time/refill": 0.02, "time/logprobs": 0.0,
        "time/train": 0.3, "time/weight_push": 0.05, "rollout/refill_rounds": 1.0, "rollout/refill_prompts": 2.0,
        "spec/accept_pos0": 0.5, "spec/accept_pos1": 0.3, "spec/accept_pos2": 0.1,
        "rollout/response_len_q00": 5, "rollout/response_len_q50": 12, "rollout/response_len_q100": 40,
    }  # fmt: skip
    step["time/step"] = 0.05 + 0.02 + 0.3 + 0.05
    rows = [{"step": i + 1, **step} for i in range(3)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    raw = tmp_path / "raw.json"
    raw.write_text(
        json.dumps({"wall": {"0": [0.3], "1": [0.25], "3": [0.2]}, "cpu": {"0": [0.5], "1": [0.4], "3": [0.35]}})
    )
    assert (
        validate_plan.main(["--run", str(run), "--costs", str(costs), "--sweep", str(raw), "--replications", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("| 1 |") >= 1 and "gen spec: predicted / measured, median" in out
    assert "rank correlation of predicted and measured times" in out


def test_the_engine_check_predicts_fresh_generations(costs: Path, capsys: pytest.CaptureFixture) -> None:
    policy = costs.parent / "policy"
    args = ["--engine-check", str(policy), "--ks", "0,2", "--generations", "3", "--checks", "2", "--replications", "4"]
    assert validate_plan.main(args) == 0
    out = capsys.readouterr().out
    assert "| 0 |" in out and "| 2 |" in out and "ordering of k: rank correlation" in out


@pytest.mark.slow
def test_the_fleets_fixed_cost_is_cpu_seconds_less_the_prefill(costs: Path) -> None:
    """Two local sidecars: the fixed cost per generation is one sidecar's CPU share plus the
    client's, less the prefill the plan prices apart; the wall seconds are kept beside it."""
    prompts, sampling = measure_cost_table.sweep_workload(measure_cost_table.PROMPTS)
    prefill = 0.001
    fixed, note = measure_cost_table.fleet_fixed_cost(
        costs.parent / "policy", prompts, sampling, 1, prefill, costs.parent / "fleet-logs", tries=3
    )
    assert note["tries"] == 1 and note["one_token_wall_seconds"] > 0 and note["one_token_cpu_seconds"] > 0
    assert fixed == pytest.approx(max(note["one_token_cpu_seconds"] - prefill, 0.0))
