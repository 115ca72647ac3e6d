"""`specrl bench learning`'s comparison report on synthetic runs (the runs themselves take minutes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench.learning import plot_compare, summarize
from trainer.rl.equivalence import tost_paired


def _run(first: float, last: float, generation_s: float) -> dict[str, Any]:
    return {
        "eval_step": [0, 10, 20],
        "eval_mean": [first, (first + last) / 2, last],
        "eval_stderr": [0.03, 0.03, 0.03],
        "train_step": list(range(1, 21)),
        "train_mean": [0.3 + 0.01 * i for i in range(20)],
        "generation_s": generation_s,
        "tau": 2.5,
    }


def test_summary_pairs_by_seed_and_plots(tmp_path: Path) -> None:
    plain_final = {0: 0.80, 1: 0.78, 2: 0.83, 3: 0.79}
    spec_final = {0: 0.81, 1: 0.77, 2: 0.85, 3: 0.78}
    runs = {
        "plain": {s: _run(0.5, f, 40.0) for s, f in plain_final.items()},
        "k3": {s: _run(0.5, f, 25.0) for s, f in spec_final.items()},
    }
    text = summarize(runs, margin=0.05, alpha=0.05)
    expected = tost_paired([spec_final[s] - plain_final[s] for s in range(4)], 0.05, 0.05)
    assert f"k3 vs plain, final held-out reward, paired by seed: {expected.describe()}" in text
    assert "1.60x faster" in text  # 40 s / 25 s of generation, per seed
    assert "calibration (4000 simulations of 4 normal differences" in text
    plot_compare(runs, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_an_arm_without_enough_paired_seeds_says_so() -> None:
    runs = {"plain": {0: _run(0.5, 0.8, 40.0)}, "auto": {0: _run(0.5, 0.8, 30.0)}}
    assert "auto vs plain: 1 paired seed(s); TOST needs at least 2" in summarize(runs, 0.05, 0.05)
