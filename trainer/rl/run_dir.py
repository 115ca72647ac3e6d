"""The run directory: resolved config, `metrics.jsonl`, PNG plots and checkpoints.

Layout of `runs/<name>/`:

    config.yaml        the resolved run config (reproduces the run)
    metrics.jsonl      one JSON object per step (flat keys such as "reward/mean")
    plots/*.png        reward (held-out evaluations as points with 95% error bars), acceptance
                       (mean and per draft position), step-time breakdown, generation share of
                       the step, speedups; redrawn as the run goes
    checkpoints/       model, draft, optimizer and RNG state (see trainer/policy/checkpointing.py)

Metric keys are `group/name`; plots select them by group, so a new metric needs no plotting
code. Writes are append-and-flush, so a crashed run keeps every finished step; a resumed run
first drops the rows of steps after the checkpoint it resumes from (`rewind`), so each step's row
comes from the trajectory that continues.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.rl.trackers import Tracker

PLOTS: dict[str, tuple[str, list[str]]] = {
    "reward.png": ("Reward", ["reward/train_mean", "reward/eval_mean"]),
    "acceptance.png": ("Acceptance length τ (tokens per verify step)", ["spec/acceptance_length"]),
    "acceptance_per_position.png": ("Acceptance rate per draft position", ["spec/accept_pos*"]),
    "step_time.png": (
        "Step time breakdown (s)",
        ["time/weight_push", "time/generation", "time/refill", "time/logprobs", "time/train"],
    ),
    "generation_share.png": ("Generation share of the step time", ["time/generation_share"]),
    "speedup.png": ("Speedup of speculation vs plain decoding (same run)", ["speedup/generation", "speedup/step"]),
}
"""File name -> (title, metric keys); a key ending in "*" stands for every key with that prefix."""


class RunDir:
    """A run's directory on disk; `log` also forwards each row to the given trackers."""

    def __init__(self, root: str | Path, *, resume: bool = False, trackers: list[Tracker] | None = None) -> None:
        self.root = Path(root)
        metrics = self.root / "metrics.jsonl"
        if metrics.exists() and not resume:
            raise FileExistsError(
                f"{self.root} already holds a run; pass --resume to continue it or choose another --run-dir"
            )
        (self.root / "plots").mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        self.metrics_path = metrics
        self.trackers: list[Tracker] = list(trackers or [])

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    def log(self, step: int, metrics: Mapping[str, float | int | str]) -> None:
        """Append one step's metrics (non-finite floats are written as null)."""
        row: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            row[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics)  # type: ignore[arg-type]

    def rewind(self, step: int) -> list[int]:
        """Drop the rows of steps after `step` (a resume from checkpoint `step_{step}`: those steps
        were trained after it, their updates are lost and they train again); with `step` 0 the
        run starts over and every row goes. Returns the steps dropped. Trackers that already got
        those rows keep them."""
        if not self.metrics_path.exists():
            return []
        kept, dropped = [], []
        for line in self.metrics_path.read_text().splitlines():
            row_step = json.loads(line)["step"]
            if step > 0 and row_step <= step:
                kept.append(line)
            else:
                dropped.append(row_step)
        if dropped:
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.metrics_path)  # atomic: a crash now leaves the old or the new file
        return dropped

    def close(self) -> None:
        """Close the trackers (metrics.jsonl is flushed after every row)."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def plot(self) -> list[Path]:
        """Render the PNG plots from metrics.jsonl; returns the files written."""
        return plot_metrics(self.read_metrics(), self.root / "plots")


def plot_metrics(rows: Iterable[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per entry of PLOTS that has data; series are drawn against "step"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    present = sorted({k for r in rows for k in r})
    written = []
    for filename, (title, patterns) in PLOTS.items():
        keys = [k for p in patterns for k in ([q for q in present if q.startswith(p[:-1])] if p.endswith("*") else [p])]
        series = {
            k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), int | float) and "step" in r] for k in keys
        }
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        if filename == "step_time.png":
            overlapped = {}
            if any("time/generation_exposed_share" in r for r in rows):  # asynchronous: stack what was waited for
                overlapped = {
                    r["step"]: r["time/generation"] + r.get("time/refill", 0.0) for r in rows if "time/generation" in r
                }
                series = {ASYNC_STACK.get(k, k): _series(rows, ASYNC_STACK.get(k, k)) for k in series}
            steps = sorted({s for v in series.values() for s, _ in v})
            bottom = [0.0] * len(steps)
            for key, points in series.items():
                value = dict(points)
                heights = [value.get(s, 0.0) for s in steps]
                ax.bar(steps, heights, bottom=bottom, label=key.split("/", 1)[1])
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            if overlapped:
                when = sorted(overlapped)
                ax.plot(
                    when,
                    [overlapped[x] for x in when],
                    "k--",
                    marker=".",
                    label="generation (overlapped with training)",
                )
        else:
            for key, points in series.items():
                xs, ys = zip(*points, strict=True)
                errors = _stderr_of(rows, key)
                if errors is not None:  # an estimate with its noise: points with 95% intervals
                    yerr = [1.96 * errors.get(x, 0.0) for x in xs]
                    label = f"{key.split('/', 1)[1]} (±1.96 s.e.)"
                    ax.errorbar(xs, ys, yerr=yerr, fmt="o", markersize=4, capsize=3, label=label)
                else:
                    ax.plot(xs, ys, marker="o", markersize=3, label=key.split("/", 1)[1])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


ASYNC_STACK = {"time/generation": "time/wait_generation", "time/refill": "time/stale_regeneration"}
"""With `rollout.max_policy_lag` > 0 generation runs while earlier steps train: the step-time bars
stack what the trainer waited for (the exposed generation, regenerated stale groups) and a line
shows the whole generation time it overlapped."""


def _series(rows: list[Mapping[str, Any]], key: str) -> list[tuple[Any, float]]:
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and "step" in r]


def _stderr_of(rows: list[Mapping[str, Any]], key: str) -> dict[Any, float] | None:
    """step -> standard error for a `..._mean` metric that is logged with a `..._stderr` twin."""
    if not key.endswith("_mean"):
        return None
    twin = key[: -len("_mean")] + "_stderr"
    errors = {r["step"]: r[twin] for r in rows if isinstance(r.get(twin), int | float) and "step" in r}
    return errors or None
