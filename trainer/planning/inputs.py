"""The plan's measured inputs: acceptance and response lengths from a run directory or a sidecar,
and the command line's compact spellings of them.

Why: the numbers the simulator needs are already measured — the sidecars count accepted drafts per
position (GetStats, `sidecar.types.SpeculationCounters`), the trainer logs them per step
(`spec/accept_pos*` in the run directory's metrics.jsonl) with the response-length percentiles
(`rollout/response_len_qNN`) and each phase's seconds (`time/*`). Reading them here keeps
`specrl plan` a function of what a user has measured, not of what they guess.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from trainer.planning.step_model import Acceptance, LengthDistribution

LENGTH_KEY = re.compile(r"^rollout/response_len_q(\d+)$")
ACCEPT_KEY = re.compile(r"^spec/accept_pos(\d+)$")


def read_run_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step rows of a run directory's metrics.jsonl (rows without RL-step timings dropped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} holds no metrics.jsonl: pass the run directory of a `specrl train` or demo run")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if isinstance(r.get("time/generation"), int | float)]
    if not steps:
        raise ValueError(f"{path} has no RL step with 'time/generation' logged")
    return steps


def step_acceptance(row: dict[str, Any], spread: float = 0.0) -> Acceptance | None:
    """One step's acceptance per position (its `spec/accept_pos*`: P(first j drafts accepted))."""
    pos = sorted(
        (int(m.group(1)), float(v)) for key, v in row.items() if (m := ACCEPT_KEY.match(key)) and v is not None
    )
    if not pos:
        return None
    return Acceptance.from_cumulative([v for _, v in pos], spread=spread)


def step_lengths(row: dict[str, Any]) -> LengthDistribution | None:
    """One step's response-length distribution from its logged percentiles."""
    qs = {float(m.group(1)): float(v) for key, v in row.items() if (m := LENGTH_KEY.match(key)) and v is not None}
    if not qs:
        return None
    return LengthDistribution.from_quantiles(qs, label=f"step {row.get('step', '?')} percentiles")


def acceptance_from_run(run_dir: Path, spread: float = 0.0) -> Acceptance:
    """Median over the run's steps of P(first j drafts accepted), as conditional acceptance."""
    rows = read_run_metrics(run_dir)
    per_pos: dict[int, list[float]] = {}
    for row in rows:
        for key, v in row.items():
            if (m := ACCEPT_KEY.match(key)) and isinstance(v, int | float):
                per_pos.setdefault(int(m.group(1)), []).append(float(v))
    if not per_pos:
        raise ValueError(f"{run_dir}: no spec/accept_pos* metrics (was speculation on?)")
    return Acceptance.from_cumulative([statistics.median(per_pos[i]) for i in sorted(per_pos)], spread=spread)


def lengths_from_run(run_dir: Path) -> LengthDistribution:
    """The run's response lengths: every step's percentiles pooled (equal weight per step)."""
    rows = read_run_metrics(run_dir)
    values: list[int] = []
    for row in rows:
        dist = step_lengths(row)
        if dist is not None:
            values += list(dist.values)
    if not values:
        raise ValueError(
            f"{run_dir}: no rollout/response_len_qNN metrics (logged by specrl since the planning change); "
            "give --lengths instead"
        )
    return LengthDistribution(values=tuple(values), weights=(1.0,) * len(values), label=f"pooled from {run_dir}")


def acceptance_from_sidecar(address: str, spread: float = 0.0) -> Acceptance:
    """The serving weight version's acceptance per position from a sidecar's GetStats."""
    from sidecar.client.client import SidecarClient  # the client side, only when asked

    with SidecarClient(address) as client:
        stats = client.stats()
    current = [v for v in stats.versions if v.weight_version == stats.weight_version] or stats.versions
    c = current[-1].counters if current else stats.total
    if not c.drafted_per_position or not c.drafted_per_position[0]:
        raise ValueError(f"sidecar {address} has verified no drafts at weight version {stats.weight_version} yet")
    return Acceptance.from_cumulative(cumulative_rates(c.drafted_per_position, c.accepted_per_position), spread=spread)


def cumulative_rates(drafted: list[int], accepted: list[int]) -> list[float]:
    """P(first j drafts accepted) per position j from raw counters (`accepted` is as long as the
    deepest position ever accepted: a shorter list means 0 beyond it)."""
    return [(accepted[i] if i < len(accepted) else 0) / d for i, d in enumerate(drafted) if d]


def parse_acceptance(text: str, spread: float = 0.0) -> Acceptance:
    """'0.8,0.7,0.6' (conditional per position) or 'tau=2.47@3' (one alpha giving that
    acceptance length at k = 3)."""
    text = text.strip()
    if m := re.fullmatch(r"tau\s*=\s*([\d.]+)\s*@\s*(\d+)", text):
        return Acceptance.for_tau(float(m.group(1)), int(m.group(2)), spread=spread)
    try:
        alphas = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--acceptance {text!r}: give conditional acceptance per position ('0.8,0.7,0.6') or 'tau=2.47@3'"
        ) from None
    return Acceptance(alphas=alphas, spread=spread)


def parse_lengths(text: str, cap: int) -> LengthDistribution:
    """'1200' (every row), 'lognormal:mean=6000,cv=0.6' (capped at max new tokens), or
    'q0=3,q50=20,q100=40' (percentiles)."""
    text = text.strip()
    if text.isdigit():
        length = int(text)
        if not 1 <= length <= cap:
            raise ValueError(f"--lengths {length} must lie in 1..max new tokens ({cap})")
        return LengthDistribution.fixed(length)
    if text.startswith("lognormal:"):
        fields = _fields(text[len("lognormal:") :], {"mean", "cv"}, text)
        return LengthDistribution.lognormal(fields["mean"], fields["cv"], cap)
    if text.startswith("q"):
        qs = {float(k[1:]): v for k, v in _fields(text, None, text).items()}
        if max(qs.values()) > cap:
            raise ValueError(f"--lengths {text!r}: a percentile exceeds max new tokens ({cap}); raise --max-new-tokens")
        return LengthDistribution.from_quantiles(qs, label=text)
    raise ValueError(
        f"--lengths {text!r}: give a length ('1200'), 'lognormal:mean=6000,cv=0.6', "
        "'q0=3,q50=20,q100=40', or --lengths-from RUN_DIR"
    )


def _fields(text: str, required: set[str] | None, whole: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--lengths {whole!r}: {part!r} is not key=number") from None
    if required is not None and set(out) != required:
        raise ValueError(f"--lengths {whole!r}: needs exactly {sorted(required)}, got {sorted(out)}")
    return out
