"""Where speculation pays on a mixture of experts: the union of experts a verify reads, by batch.

A plain round of B rows reads the experts of B tokens; a round drafting k reads those of B·(k + 1)
(`sidecar.speculation.expert_union`: under uniform routing E·(1 − (1 − top/E)^T) per sparse layer).
At small batch the union grows almost k + 1-fold and the verify costs several plain rounds; at large
batch every expert is read anyway and the verify costs little more than a plain round. `specrl
plan` prints this table for an MoE model next to its step projection: per batch, the experts a
plain and a speculative round read, the round's cost over plain, the per-round speedup bound
τ · plain / round (stragglers and admission left aside, as the step table is not), and the
batches where that bound crosses 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.planning.shapes import ModelShape
from trainer.planning.step_model import Acceptance, RoundCosts

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class UnionRow:
    """One batch size's experts read and round cost, plain against k drafts."""

    batch: int
    plain_experts: float
    """Distinct experts per sparse layer a plain round of `batch` rows reads."""
    verify_experts: float
    """... a round drafting k reads (its verify's `batch` × (k + 1) tokens)."""
    round_ratio: float
    """Seconds of a k round over a plain round's."""
    speedup: float
    """τ_k × plain / round: tokens per second of the k round over plain's, per row."""


def union_rows(
    shape: ModelShape, costs: RoundCosts, acceptance: Acceptance, k: int, kv_per_row: float, max_batch_size: int
) -> list[UnionRow]:
    """The table for batches up to `max_batch_size` (each row's context `kv_per_row` tokens)."""
    reads = shape.expert_reads()
    rows = []
    for b in [b for b in BATCHES if b <= max_batch_size] or [max_batch_size]:
        kv = np.array([b * kv_per_row])
        plain = float(costs.round_seconds(np.array([b]), 0, kv)[0])
        spec = float(costs.round_seconds(np.array([b]), k, kv)[0])
        rows.append(
            UnionRow(
                batch=b,
                plain_experts=reads.union(b),
                verify_experts=reads.union(b * (k + 1)),
                round_ratio=spec / plain,
                speedup=acceptance.tau(k) * plain / spec,
            )
        )
    return rows


def pays_where(rows: list[UnionRow], margin: float) -> str:
    """In words: at which of the table's batches the bound says k pays (by more than `margin`,
    the step table's: within it, a loss)."""
    paying = [r.batch for r in rows if r.speedup > 1.0 + margin]
    if not paying:
        return "at none of these batch sizes"
    if len(paying) == len(rows):
        return "at every batch size here"
    if paying == [r.batch for r in rows if r.batch >= paying[0]]:
        last_loss = max(r.batch for r in rows if r.speedup <= 1.0 + margin)
        return f"from batch {paying[0]} up (it loses at batch {last_loss} and below)"
    if paying == [r.batch for r in rows if r.batch <= paying[-1]]:
        return f"up to batch {paying[-1]} (it stops paying above)"
    return "at batch sizes " + ", ".join(str(b) for b in paying)


def render_union(shape: ModelShape, rows: list[UnionRow], k: int, tau: float, margin: float) -> list[str]:
    """The report's lines for an MoE shape."""
    lines = [
        f"experts read per round ({shape.experts} routed experts, top {shape.experts_per_token}, "
        f"{shape.sparse_layers} sparse layers; uniform routing): k = {k}, tau {tau:.2f}",
        f"| batch | experts read, plain | experts read, k = {k} | round x plain | bound tau x plain / round |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.batch} | {r.plain_experts:.1f} | {r.verify_experts:.1f} | {r.round_ratio:.2f}x | {r.speedup:.2f}x |"
        )
    lines.append(f"speculation at k = {k} pays {pays_where(rows, margin)} (bound above {1 + margin:.2f}x)")
    return lines
