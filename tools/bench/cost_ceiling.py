"""The automatic-k controller's ceiling on a workload: its own model, priced by the workload's measured step costs.

Why: when automatic k falls short of the best static k, either its model (acceptance per position,
where rows end, stragglers, probes) chooses badly, or its online cost estimates (medians of the last
few steps per batch bucket and k, on a box where one step's time scatters by ~20%) misprice the
widths it compares. To tell them apart, `measure_step_costs` first runs the workload at every static
k with a recording policy and keeps the median seconds of a decode step per (batch, k); a controller
built with `TablePriced` then decides exactly as the engine's does (same acceptance and stop-token
learning, same probes, guard and margin) but prices every step from that table instead of its own
measurements. Run next to plain automatic mode, "auto / auto on the measured costs" is the share
of the gap that better cost estimates could close (`specrl bench rl --in-process --ceiling`;
BENCHMARKS.md at ca4d93b, "Adaptive speculation", tenth session).

The table is the workload's, measured before the sweep on the same engine and model: a ceiling for
comparison, not a configuration to run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

from sidecar.speculation.config import RowState, SpeculationControllerConfig, SpeculationDecision
from sidecar.speculation.controller import SpeculationController

if TYPE_CHECKING:  # specrl bench adaptive sim imports `FixedK` and replays without torch
    from sidecar.engine.torch_engine import TorchEngine

StepCosts = dict[int, dict[int, float]]
"""batch -> k -> median seconds of one decode step (draft phase and verify)."""


class FixedK(SpeculationController):
    """Decides `k` for every step, never refuses a draft, and records what the engine reports of
    each decode step and of each draft prefill (also `specrl bench adaptive sim --measure`'s recorder)."""

    def __init__(self, max_speculation_k: int) -> None:
        super().__init__(SpeculationControllerConfig(max_speculation_k=max_speculation_k))
        self.k = 0
        self.samples: dict[tuple[int, int], list[tuple[float, float]]] = {}
        """(batch, k) -> (draft phase, rest of the step) seconds of each decode step."""
        self.prefill_samples: list[float] = []
        """Seconds per prompt token of each draft prefill at admission."""

    def decide(self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None):
        self.last = SpeculationDecision(k=self.k, reason="model", batch_size=batch)
        return self.last

    def may_draft(self, *args: object, **kwargs: object) -> bool:
        return True

    def observe_step(self, *, batch: int, k: int, draft_seconds: float, step_seconds: float, **_: object) -> None:
        self.samples.setdefault((batch, k), []).append((draft_seconds, step_seconds - draft_seconds))

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_samples.append(seconds / tokens)


def measure_step_costs(
    engine: TorchEngine,
    generate: Callable[[TorchEngine, int], None],
    ks: list[int],
    generations: int,
    least: int = 3,
) -> StepCosts:
    """Median seconds of a decode step per (batch, k) over `generations` generations of the
    workload at each static k of `ks` (`generate(engine, seed)` runs one generation whose rows do
    not pin k; `engine` is an automatic-mode engine this function takes over). Cells measured
    fewer than `least` times are left out."""
    if not ks or generations < 1:
        raise ValueError(f"need at least one k and one generation, got ks={ks}, generations={generations}")
    recorder = FixedK(max(ks))
    engine.set_speculation_controller(recorder)
    for n in range(generations):
        for k in ks:  # interleaved, so the box's drift falls on every k alike
            recorder.k = k
            generate(engine, 30_000 + n)
    table: StepCosts = {}
    for (batch, k), steps in sorted(recorder.samples.items()):
        if len(steps) >= least:
            table.setdefault(batch, {})[k] = statistics.median(draft + rest for draft, rest in steps)
    if not table:
        raise ValueError("no (batch, k) was measured often enough: run more generations")
    return table


class TablePriced(SpeculationController):
    """The controller as it is, its step costs read from a measured table (`measure_step_costs`):
    a (batch, k) not in the table takes the nearest batch that has that k."""

    def __init__(self, config: SpeculationControllerConfig, table: StepCosts) -> None:
        super().__init__(config)
        missing = [k for k in range(config.max_speculation_k + 1) if not any(k in row for row in table.values())]
        if missing:
            raise ValueError(f"the cost table has no batch size measured at k = {missing}")
        self.table = table

    def predicted_steps(self, batch: int, ks: list[int]) -> list[float] | None:
        out = []
        for k in ks:
            nearest = min((b for b, row in self.table.items() if k in row), key=lambda b: (abs(b - batch), b))
            out.append(self.table[nearest][k])
        return out
