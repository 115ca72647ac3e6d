"""`specrl bench kv --quick`: the paged-against-static KV benchmark's whole path on a tiny model.
Both arms generate every sample to its drawn length on the same KV budget; the static arm never
runs more rows than the budget's full-context rows, the paged one runs more; a group's samples
admitted together prefill their prompt once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench import kv as bench_kv


def test_quick_run_writes_both_arms(tmp_path: Path, capsys) -> None:
    out = tmp_path / "kv.json"
    assert bench_kv.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    config, arms = doc["config"], doc["arms"]
    assert set(arms) == {"static", "paged"}
    for arm in arms.values():
        assert arm["samples_finished"] == arm["samples"] == config["groups"] * config["group"]
        assert arm["generated_tokens"] == arm["expected_tokens"] == sum(config["lengths"])
        assert arm["blocks_total"] == arms["static"]["blocks_total"]  # one budget
        # the stats' prefill counts the prompts' prefill and the preempted rows' recomputation
        prompt_prefill = arm["prefill_tokens"] - arm["resume_prefill_tokens"]
        assert prompt_prefill == pytest.approx(arm["prompt_prefill_ratio"] * arm["prompt_tokens"])
    static, paged = arms["static"], arms["paged"]
    assert static["peak_rows"] <= config["budget_rows"] and static["preemptions"] == 0
    assert paged["peak_rows"] > static["peak_rows"]
    assert paged["prompt_prefill_ratio"] < 1 and paged["prompt_prefill_ratio"] < static["prompt_prefill_ratio"]
    assert doc["ratios"]["peak_rows"] == paged["peak_rows"] / static["peak_rows"]
    assert "| peak_rows | " in capsys.readouterr().out
