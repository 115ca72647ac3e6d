"""`specrl plan`: the cost table's interpolation and errors, the roofline's regimes, and the
command's answers to bad input (each says what to fix) and to good input (a table, a verdict,
the plot and the JSON).

The verdict and its JSON are `trainer/planning/report.py`'s, the plot `trainer/planning/plot.py`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from trainer.cli.main import main
from trainer.planning.cost_table import CostTableError, TableCosts, cost_table_document, load_costs
from trainer.planning.hardware import PROFILES, profile
from trainer.planning.roofline import RooflineConfig, RooflineCosts
from trainer.planning.shapes import load_shape

TABLE = {
    "name": "demo",
    "device": "cpu",
    "rounds": [
        {"batch": 1, "k": 0, "seconds": 0.010},
        {"batch": 1, "k": 1, "seconds": 0.013},
        {"batch": 1, "k": 3, "seconds": 0.019},
        {"batch": 8, "k": 0, "seconds": 0.020},
        {"batch": 8, "k": 3, "seconds": 0.040},
    ],
    "prefill": [{"rows": 1, "prompt_tokens": 10, "seconds": 0.002}, {"rows": 8, "prompt_tokens": 10, "seconds": 0.008}],
    "request_seconds": 0.004,
}


def write_table(path: Path, *tables: dict) -> Path:
    path.write_text(json.dumps(cost_table_document(list(tables))))
    return path


def test_a_table_is_exact_at_its_cells_and_linear_between() -> None:
    t = TableCosts(TABLE)
    none = np.zeros(1)
    assert t.round_seconds(np.array([1.0]), 3, none)[0] == pytest.approx(0.019)
    assert t.round_seconds(np.array([4.5]), 0, none)[0] == pytest.approx(0.015)  # halfway from 1 to 8
    assert t.round_seconds(np.array([1.0]), 2, none)[0] == pytest.approx(0.016)  # between k = 1 and 3
    # batch 8 has k = 0 and 3 only: k = 1 interpolates linearly between them
    assert t.round_seconds(np.array([8.0]), 1, none)[0] == pytest.approx(0.020 + 0.020 / 3)
    assert t.round_seconds(np.array([16.0]), 0, none)[0] == pytest.approx(0.020 + 8 * 0.010 / 7)
    assert any("extrapolating" in n for n in t.leaves_out())
    assert t.prefill_seconds(8, 20) == pytest.approx(0.016)
    assert t.request_seconds() == 0.004


@pytest.mark.parametrize(
    "rounds,message",
    [
        ([{"batch": 1, "k": 1, "seconds": 0.01}], "no plain step"),
        ([{"batch": 1, "k": 0, "seconds": -1}], "must be >= 0"),
        ([{"batch": 0, "k": 0, "seconds": 0.01}], "'batch' must be >= 1"),
        ([{"batch": 1, "k": 0}], "missing 'seconds'"),
        ([{"batch": 1, "k": 0, "seconds": 0.01}, {"batch": 1, "k": 0, "seconds": 0.02}], "measured twice"),
    ],
)
def test_a_bad_table_says_what_to_fix(rounds: list, message: str) -> None:
    with pytest.raises(CostTableError, match=message):
        TableCosts({"name": "t", "rounds": rounds})


def test_a_file_with_several_tables_needs_a_name(tmp_path: Path) -> None:
    path = write_table(tmp_path / "c.json", TABLE, {**TABLE, "name": "other"})
    with pytest.raises(CostTableError, match="pick one with --costs-table"):
        load_costs(path)
    assert load_costs(path, "other").name == "other"
    with pytest.raises(CostTableError, match="has no table 'x'; it holds demo, other"):
        load_costs(path, "x")
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(CostTableError, match="not a cost table"):
        load_costs(tmp_path / "bad.json")


def test_the_roofline_is_flat_in_width_while_memory_bound_and_linear_once_compute_bound() -> None:
    shape, hw = load_shape("qwen3-8b"), profile("h100")
    rc = RooflineCosts(shape, hw, RooflineConfig(memory_efficiency=1.0, compute_efficiency=1.0))
    one = rc.forward(np.array([1.0]), 1, np.array([0.0]))[0]
    assert one == pytest.approx(shape.weight_bytes(np.array([1.0]))[0] / hw.bytes_per_s, rel=1e-3)
    assert rc.forward(np.array([1.0]), 8, np.array([0.0]))[0] == pytest.approx(one, rel=1e-3)
    big = rc.forward(np.array([1024.0]), 8, np.array([0.0]))[0]  # 8192 tokens: far past the ridge
    assert big == pytest.approx(2 * shape.active_params * 8192 / hw.flops_per_s, rel=1e-6)


def test_every_profile_has_published_figures() -> None:
    assert set(PROFILES) == {"h100", "h200", "b200", "gb200", "a100", "l40s", "h20"}
    assert profile("H100").hbm_tb_s == 3.35 and profile("gb200").bf16_dense_tflops == 2500.0


def run_plan(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["plan", *args])
    return result.exit_code, result.output


BASE = ["--model", "qwen3-8b", "--lengths", "2000", "--max-new-tokens", "4096", "--acceptance", "0.8,0.7,0.6"]


def test_an_unknown_profile_lists_the_known_ones() -> None:
    code, out = run_plan(*BASE, "--hardware", "tpu9")
    assert code == 2
    assert "unknown hardware profile 'tpu9'" in out and "h100, h200, b200, gb200, a100, l40s, h20" in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--hardware", "h100", "--engines", "8", "--prompts", "4"], "lower --engines or raise --prompts"),
        (["--hardware", "h100", "--lengths", "9000"], "must lie in 1..max new tokens (4096)"),
        ([], "give exactly one of --hardware NAME"),
        (["--hardware", "h100", "--model", "qwen3-235b-a22b"], "raise --gpus-per-engine to at least"),
        (["--hardware", "h100", "--acceptance", "0.8,x"], "give conditional acceptance per position"),
        (["--hardware", "h100", "--acceptance", "1.3"], "must lie in [0, 1]"),
        (["--hardware", "h100", "--ks", "3,a"], "comma-separated integers"),
        (["--hardware", "h100", "--model", "gpt-9"], "neither a preset"),
        (["--hardware", "h100", "--generation-share", "0.7", "--train-seconds", "3"], "give one of --generation-share"),
        (["--hardware", "h100", "--sync-gbps", "10"], "a generation share already includes the weight sync"),
        (["--hardware", "h100", "--engines", "0"], "--engines must be >= 1, got 0"),
    ],
)
def test_inconsistent_input_says_what_to_fix(extra: list[str], message: str) -> None:
    args = list(BASE)
    for i in range(0, len(extra) - 1):
        if extra[i].startswith("--") and extra[i] in args:  # an override replaces the base value
            j = args.index(extra[i])
            args[j + 1] = extra[i + 1]
    rest = [x for i, x in enumerate(extra) if not (x in BASE or (i and extra[i - 1] in BASE))]
    code, out = run_plan(*args, *rest)
    assert code == 2, out
    assert message in " ".join(out.split()), out


def test_a_table_plan_prints_the_verdict_the_assumptions_and_what_is_left_out(tmp_path: Path) -> None:
    costs = write_table(tmp_path / "c.json", TABLE)
    code, out = run_plan(
        "--model", "qwen3-0.6b", "--costs", str(costs), "--prompts", "4", "--samples", "4", "--engines", "2",
        "--lengths", "q0=3,q50=12,q100=40", "--max-new-tokens", "40", "--acceptance", "0.9,0.8,0.7",
        "--ks", "1,3", "--train-seconds", "0.5", "--replications", "8",
        "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    assert code == 0, out
    assert "| k | tau |" in out and "recommended k = 3: speculation pays" in out
    assert "left out of the model:" in out and "costs do not grow with the KV context" in out
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["recommended_k"] == 3 and [p["k"] for p in doc["ks"]] == [0, 1, 3]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_roofline_plan_says_when_speculation_does_not_pay() -> None:
    """An engine of 512 rows of short answers is compute-bound: a 4-token verify costs ~4 plain steps."""
    code, out = run_plan(
        "--model", "qwen3-8b", "--hardware", "h100", "--prompts", "64", "--samples", "8", "--lengths", "200",
        "--max-new-tokens", "256", "--prompt-tokens", "64", "--acceptance", "0.5", "--ks", "3", "--replications", "4",
    )  # fmt: skip
    assert code == 0, out
    assert "recommended k = 0: speculation does not pay" in out


def test_inputs_come_from_a_run_directory(tmp_path: Path) -> None:
    """--lengths-from / --acceptance-from read what the trainer logged (metrics.jsonl)."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 0, "reward/eval_mean": 0.5},  # an evaluation row: no timings, skipped
        {"step": 1, "time/generation": 0.2, "spec/accept_pos0": 0.9, "spec/accept_pos1": 0.72,
         "rollout/response_len_q00": 4, "rollout/response_len_q50": 10, "rollout/response_len_q100": 20},
        {"step": 2, "time/generation": 0.2, "spec/accept_pos0": 0.7, "spec/accept_pos1": 0.56,
         "rollout/response_len_q00": 4, "rollout/response_len_q50": 10, "rollout/response_len_q100": 20},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    from trainer.planning.inputs import acceptance_from_run, lengths_from_run

    acc = acceptance_from_run(run)  # medians 0.8 and 0.64 of P(first j accepted)
    assert acc.alphas == pytest.approx((0.8, 0.8))
    assert lengths_from_run(run).max == 20
    code, out = run_plan(
        "--model", "qwen3-8b", "--hardware", "h100", "--lengths-from", str(run), "--acceptance-from", str(run),
        "--max-new-tokens", "32", "--ks", "2", "--replications", "2", "--async-lag", "1",
    )  # fmt: skip
    assert code == 0, out
    assert "exposed gen s" in out and "async RL at policy lag 1" in out
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]))
    code, out = run_plan(*BASE[:2], "--hardware", "h100", "--lengths-from", str(run), "--acceptance", "0.5")
    assert code == 2 and "no RL step with 'time/generation' logged" in out


def test_acceptance_comes_from_a_sidecars_getstats(tmp_path: Path) -> None:
    """The version counters GetStats reports give the same per-position acceptance as the
    per-sample counters of what was generated (an independent sum)."""
    from sidecar.client.client import SidecarClient
    from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters
    from tests.sidecar_fixtures import make_checkpoint, start_sidecar
    from trainer.planning.inputs import acceptance_from_sidecar

    sidecar = start_sidecar(make_checkpoint(tmp_path / "ckpt"), speculation_k=3)
    try:
        with SidecarClient(sidecar.address) as client:
            sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)  # a random draft accepts often here
            samples = client.generate(
                GenerationRequest(prompts=[[1, 2, 3], [4, 5]], sampling=sampling, samples_per_prompt=3)
            )
        total = SpeculationCounters()
        for s in samples:
            total.add(s.counters)
        assert len(total.drafted_per_position) == 3 and total.accepted_tokens > 0
        expected = [
            (total.accepted_per_position[i] if i < len(total.accepted_per_position) else 0) / d
            for i, d in enumerate(total.drafted_per_position)
        ]
        acc = acceptance_from_sidecar(sidecar.address)
        assert acc.survival(3) == pytest.approx(expected)
    finally:
        sidecar.stop(0.2)


def test_a_batch_that_cannot_price_a_k_is_left_to_its_neighbours() -> None:
    t = TableCosts({"name": "t", "rounds": [
        {"batch": 1, "k": 0, "seconds": 0.01}, {"batch": 2, "k": 1, "seconds": 0.03}, {"batch": 2, "k": 3, "seconds": 0.05},
        {"batch": 4, "k": 0, "seconds": 0.03},
    ]})  # fmt: skip
    assert t.round_seconds(np.array([2.0]), 0, np.zeros(1))[0] == pytest.approx(0.0166667, rel=1e-4)  # 1 and 4 only
    assert t.round_seconds(np.array([2.0]), 2, np.zeros(1))[0] == pytest.approx(0.04)
    with pytest.raises(
        CostTableError, match=r"cannot price k = 5 at batch 1 \(measured there: k = \[0\]\); measure k = 5"
    ):
        TableCosts(
            {"name": "t", "rounds": [{"batch": 1, "k": 0, "seconds": 0.01}, {"batch": 2, "k": 1, "seconds": 0.03}]}
        ).round_seconds(np.array([2.0]), 5, np.zeros(1))


def test_training_per_token_and_sync_bandwidth_price_the_rest_of_the_step() -> None:
    from trainer.planning.cli import PlanOptions, make_plan

    opts = PlanOptions(
        model="qwen3-8b", hardware="h100", prompts=4, samples=2, prompt_tokens=100, lengths="300",
        max_new_tokens=512, ks=(0,), train_ms_per_token=2.0, sync_gbps=16.380854272, sync_seconds=0.5,
        replications=2,
    )  # fmt: skip
    plan, ctx = make_plan(opts)
    train = 2e-3 * 4 * 2 * (100 + 300)  # 8 samples of 400 tokens
    sync = 0.5 + 1.0  # 16.38 GB of bf16 weights at 16.38 GB/s
    assert plan.plain.step == pytest.approx(plan.plain.generation + train + sync, rel=1e-6)
    assert "2 ms/token" in ctx.rest


def test_a_tables_step_overhead_adds_to_every_round() -> None:
    t = TableCosts({**TABLE, "step_seconds": 0.002})
    assert t.round_seconds(np.array([1.0, 8.0]), 3, np.zeros(2)) == pytest.approx([0.021, 0.042])
