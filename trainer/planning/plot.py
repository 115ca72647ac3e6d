"""`specrl plan --plot FILE`: predicted generation speedup over plain against the batch size, one
line per k.

Why: the one figure that says where speculation turns from a gain to a loss on given hardware: a
memory-bound decode makes a (k+1)-token verify cost about a plain step at small batches, and
the verify's arithmetic catches up as the batch grows. Each point simulates one engine whose
rows all start together (no queue), with the plan's lengths, acceptance and costs, up to the
plan's rows decoding at once (what fits in memory beside the weights, or the given --max-batch-size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from trainer.planning.step_model import Acceptance, EngineWorkload, LengthDistribution, RoundCosts, simulate_engine

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def speedup_by_batch(
    work: EngineWorkload,
    acceptance: Acceptance,
    ks: Sequence[int],
    costs: RoundCosts,
    batches: Sequence[int] = BATCHES,
    replications: int = 16,
    seed: int = 0,
) -> dict[int, list[float]]:
    """k -> generation speedup over plain at each batch size (rows = max batch = that size)."""
    out: dict[int, list[float]] = {k: [] for k in ks if k > 0}
    for b in batches:
        w = replace(work, rows=b, max_batch_size=b)
        plain = simulate_engine(w, None, 0, costs, replications, seed).seconds.mean()
        for k in out:
            spec = simulate_engine(w, acceptance, k, costs, replications, seed).seconds.mean()
            out[k].append(float(plain / spec))
    return out


def plot_speedup(
    path: Path,
    work: EngineWorkload,
    acceptance: Acceptance,
    ks: Sequence[int],
    costs: RoundCosts,
    title: str,
    batches: Sequence[int] = BATCHES,
    lengths: LengthDistribution | None = None,
) -> dict[int, list[float]]:
    """Draw the figure into `path` (PNG, Agg backend); returns the plotted speedups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if lengths is not None:
        work = replace(work, lengths=lengths)
    curves = speedup_by_batch(work, acceptance, ks, costs, batches)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for k, ys in curves.items():
        ax.plot(list(batches), ys, marker="o", markersize=3, label=f"k = {k}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows decoding per engine (batch size)")
    ax.set_ylabel("generation speedup over plain")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return curves
