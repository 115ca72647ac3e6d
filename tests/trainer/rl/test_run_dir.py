"""The run directory keeps every logged step and renders real PNG plots from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.rl.run_dir import RunDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_metrics_append_and_plots_are_pngs(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    for step in range(3):
        run.log(
            step,
            {
                "reward/train_mean": 0.1 * step,
                "reward/eval_mean": float("nan"),
                "spec/acceptance_length": 2.0 + step,
                "time/generation": 1.0,
                "time/train": 0.5,
            },
        )
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert json.loads(lines[0])["reward/eval_mean"] is None  # NaN is not valid JSON
    written = run.plot()
    assert {p.name for p in written} == {"reward.png", "acceptance.png", "step_time.png"}
    for p in written:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path: Path) -> None:
    RunDir(tmp_path).log(0, {"reward/train_mean": 1.0})
    with pytest.raises(FileExistsError, match="--resume"):
        RunDir(tmp_path)
    resumed = RunDir(tmp_path, resume=True)
    resumed.log(1, {"reward/train_mean": 0.5})
    assert [r["step"] for r in resumed.read_metrics()] == [0, 1]


def test_a_resume_drops_the_rows_of_steps_trained_after_its_checkpoint(tmp_path: Path) -> None:
    """Killed after logging step 3 with the last checkpoint at step 2: step 3 trains again, so its
    first row (from the lost trajectory) goes; the end-to-end case is in tests/trainer/rl/test_async_faults.py."""
    run = RunDir(tmp_path)
    for step in range(4):
        run.log(step, {"reward/train_mean": float(step)})
    resumed = RunDir(tmp_path, resume=True)
    assert resumed.rewind(2) == [3]
    assert [r["step"] for r in resumed.read_metrics()] == [0, 1, 2]
    assert resumed.rewind(2) == []  # nothing more to drop
    assert resumed.rewind(0) == [0, 1, 2]  # no checkpoint: the run starts over
    assert resumed.read_metrics() == []


def test_reward_plot_draws_held_out_evaluations_as_points_with_95_percent_error_bars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.axes

    drawn: list[tuple[list[float], list[float]]] = []
    errorbar = matplotlib.axes.Axes.errorbar

    def spy(self: matplotlib.axes.Axes, x: Any, y: Any, **kwargs: Any) -> Any:
        drawn.append((list(y), list(kwargs["yerr"])))
        return errorbar(self, x, y, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    run = RunDir(tmp_path / "r")
    run.log(0, {"reward/eval_mean": 0.5, "reward/eval_stderr": 0.03})
    for step in (1, 2):
        run.log(step, {"reward/train_mean": 0.4})
    run.log(3, {"reward/train_mean": 0.6, "reward/eval_mean": 0.7, "reward/eval_stderr": 0.02})
    assert (tmp_path / "r" / "plots" / "reward.png") in run.plot()
    assert drawn == [([0.5, 0.7], [pytest.approx(1.96 * 0.03), pytest.approx(1.96 * 0.02)])]  # train: a line


def test_an_asynchronous_runs_step_bars_stack_what_the_trainer_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With generation overlapping training, stacking its whole time would overstate the step:
    the bars stack the exposed generation and a dashed line shows the overlapped generation."""
    import matplotlib.axes

    bars: list[tuple[str, list[float]]] = []
    lines: list[tuple[str, list[float]]] = []
    bar, plot = matplotlib.axes.Axes.bar, matplotlib.axes.Axes.plot

    def spy_bar(self: matplotlib.axes.Axes, x: Any, h: Any, **kw: Any) -> Any:
        bars.append((kw["label"], list(h)))
        return bar(self, x, h, **kw)

    def spy_plot(self: matplotlib.axes.Axes, *args: Any, **kw: Any) -> Any:
        lines.append((kw.get("label", ""), list(args[1])))
        return plot(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", spy_bar)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy_plot)
    run = RunDir(tmp_path / "r")
    for step in (1, 2):
        run.log(
            step,
            {
                "time/generation": 3.0,
                "time/refill": 1.0,
                "time/wait_generation": 0.5,
                "time/stale_regeneration": 0.0,
                "time/train": 2.0,
                "time/weight_push": 0.1,
                "time/generation_exposed_share": 0.5 / 2.6,
            },
        )
    run.plot()
    stacked = dict(bars)
    assert stacked["wait_generation"] == [0.5, 0.5] and stacked["train"] == [2.0, 2.0]
    assert "generation" not in stacked and "refill" not in stacked
    assert ("generation (overlapped with training)", [4.0, 4.0]) in lines
