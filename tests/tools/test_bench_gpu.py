"""`specrl bench gpu --device cpu --tiny`: the GPU benchmark's whole path on a tiny shape. Its
output must be a cost table `specrl plan --costs` reads, written as it goes (a part out of time
skips its cells and says so, and what was measured before stays)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tools.bench import gpu as bench_gpu
from trainer.cli.main import main
from trainer.planning.cost_table import load_costs


def test_tiny_run_writes_a_cost_table_that_plan_reads(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert bench_gpu.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    doc = json.loads((out / "costs.json").read_text())
    table = load_costs(out / "costs.json", "tiny")
    assert sorted(table.cells) == [1, 4] and all(sorted(row) == [0, 1, 3] for row in table.cells.values())
    assert table.prefill and table.context == 8 + 6
    assert doc["reference"]["copy"]["bytes_per_s"] > 0
    assert doc["reference"]["weight_read_limit_ms"]["tiny"]["ms"] > 0
    assert set(doc["reference"]["hf_eager"]["tiny"]) >= {"1", "4"}  # HF eager beside it
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert sum("round_ms" in r for r in logged) == 6
    assert not any("sglang" in s for s in doc["skipped"])  # SGLang is tried on CUDA only
    assert "| tiny | 1 |" in (out / "summary.md").read_text()
    result = CliRunner().invoke(
        main,
        ["plan", "--model", "qwen3-0.6b", "--costs", str(out / "costs.json"), "--prompts", "2", "--samples", "2",
         "--lengths", "8", "--max-new-tokens", "8", "--acceptance", "0.5", "--ks", "1,3", "--replications", "2"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "measured cost table 'tiny' (cpu;" in result.output


def test_a_part_out_of_time_is_skipped_and_said(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert bench_gpu.main(["--device", "cpu", "--tiny", "--out", str(out), "--part-s", "0", "--no-hf"]) == 0
    doc = json.loads((out / "costs.json").read_text())
    assert doc["tables"] == []
    assert any("copy" in s for s in doc["skipped"]) and any("engine tiny: batch 1" in s for s in doc["skipped"])
