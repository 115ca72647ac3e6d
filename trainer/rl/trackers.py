"""Optional experiment trackers: TensorBoard and Weights & Biases, through their own libraries.

`metrics.jsonl` in the run directory is always written and stays the source of truth (plots are
drawn from it); a tracker receives the same rows as they are logged. TensorBoard event files go to
`run_dir/tensorboard` (written by `torch.utils.tensorboard`, which needs the `tensorboard`
package); W&B runs in offline mode by default (no network, no account: `wandb sync` uploads the
`run_dir/wandb/offline-run-*` directory later). Both are in the `track` extra:
`pip install 'specrl[track]'`.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol


@dataclass(kw_only=True, slots=True)
class TrackersConfig:
    """Which trackers a run reports to, besides metrics.jsonl."""

    tensorboard: bool = False
    """Write TensorBoard event files to run_dir/tensorboard (`tensorboard --logdir run_dir`)."""
    wandb: bool = False
    """Log to Weights & Biases (see `wandb_mode`)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """"offline": a local run under run_dir/wandb, uploaded later with `wandb sync`; "online" needs
    network and `wandb login`."""
    wandb_project: str = "specrl"
    """Weights & Biases project."""
    wandb_name: str = ""
    """Run name; "": the run directory's name."""


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


MISSING = "trackers.{name} needs the {package} package: pip install 'specrl[track]' (or set trackers.{name}=false)"


def check_trackers(cfg: TrackersConfig) -> list[str]:
    """Problems with the configured trackers (missing packages), each naming the key and the fix."""
    problems = []
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(MISSING.format(name="tensorboard", package="tensorboard"))
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        problems.append(MISSING.format(name="wandb", package="wandb"))
    return problems


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardTracker:
    """Scalars to TensorBoard event files."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # an interrupted run keeps every logged step

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Scalars to a Weights & Biases run (offline by default)."""

    def __init__(self, cfg: TrackersConfig, run_dir: Path, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.wandb_project,
            name=cfg.wandb_name or run_dir.resolve().name,
            dir=str(run_dir),
            mode=cfg.wandb_mode,
            config=dict(config),
            reinit="finish_previous",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(cfg: TrackersConfig, run_dir: Path, config: Mapping[str, Any]) -> list[Tracker]:
    """The configured trackers, opened (the caller closes them)."""
    problems = check_trackers(cfg)
    if problems:
        raise ImportError("; ".join(problems))
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if cfg.wandb:
        trackers.append(WandbTracker(cfg, run_dir, config))
    return trackers
