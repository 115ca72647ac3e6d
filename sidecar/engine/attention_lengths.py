"""How a decode round's forwards are placed in their KV caches: the one input that differs between
the round run eagerly and the round captured as a CUDA graph.

The round (`decode_round.draft_phase`, `verify_phase`) is written once; each of its forwards asks a
`RoundLengths` for its attention plan:

- `HostLengths` (the eager round, `compile: off` and `auto` on CPUs): each forward is planned from
  the caches' host row lengths (`KVCache.plan`: reads as wide as the longest row, nothing more),
  committed as it is planned, and the draft chain's entries are rolled back after the chain.
- `DeviceLengths` (the fixed-shape round, `round_graphs.FixedRounds`, captured on CUDA): each forward
  is planned from device row lengths at a `FixedShape` (`KVCache.plan_fixed`): nothing is read
  back and no host length moves during the round, so the device work is one fixed sequence a
  CUDA graph captures once and replays; the host commits the lengths after the replay.

The arithmetic is the same row by row: a fixed shape only adds masked slots and padded rows no live
row depends on (tests/sidecar/engine/test_fixed_shape_forwards.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from sidecar.model.kv_cache import AttentionPlan, KVCache


class RoundLengths(Protocol):
    """Plans a round's forwards (see the module docstring)."""

    def refresh(self, j: int, cache: KVCache, width: int) -> AttentionPlan:
        """Draft layer j's refresh over its pending positions (`width` columns)."""
        ...

    def chain(self, j: int, cache: KVCache) -> AttentionPlan:
        """One draft chain step in draft layer j (one column a row, after what the layer holds)."""
        ...

    def end_chain(self, caches: list[KVCache]) -> None:
        """The chain is drafted: its entries are not part of any row's confirmed prefix."""
        ...

    def verify(self, cache: KVCache, width: int) -> AttentionPlan:
        """The target forward over each row's last token and its drafts (`width` = k + 1 columns)."""
        ...


@dataclass(kw_only=True, slots=True)
class HostLengths:
    """The eager round's plans, from host row lengths (each forward committed as planned)."""

    num_refresh: list[int]
    """Pending draft positions per row (0 on rows that do not draft)."""
    num_new: list[int]
    """Verified columns per row: its drafts + 1."""
    confirmed: dict[int, list[int]] = field(default_factory=dict, init=False)
    """Each draft layer's row lengths after its refresh (what `end_chain` rolls back to)."""

    def refresh(self, j: int, cache: KVCache, width: int) -> AttentionPlan:
        plan = cache.plan(self.num_refresh, width=width)
        cache.commit(plan)  # the forward reads the plan, not the host lengths
        self.confirmed[j] = list(cache.lengths)
        return plan

    def chain(self, j: int, cache: KVCache) -> AttentionPlan:
        plan = cache.plan([1] * cache.batch, width=1)
        cache.commit(plan)
        return plan

    def end_chain(self, caches: list[KVCache]) -> None:
        for j, cache in enumerate(caches):
            cache.truncate(self.confirmed[j])  # the chain's entries were computed from draft states

    def verify(self, cache: KVCache, width: int) -> AttentionPlan:
        plan = cache.plan(self.num_new, width=width)
        cache.commit(plan)
        return plan


@dataclass(frozen=True, slots=True)
class FixedShape:
    """The host ints that fix a round's shapes (part of its graphs' keys)."""

    rows: int
    """Rows of every tensor (the live rows, then padding)."""
    k: int
    """Drafts per row (rows drafting fewer mask the rest)."""
    width: int
    """Refresh columns (0 when k = 0)."""
    read_draft: int
    """KV slots each draft forward reads (0 when k = 0)."""
    read_target: int
    """KV slots the verify forward reads."""


@dataclass(kw_only=True, slots=True)
class DeviceLengths:
    """The fixed-shape round's plans, from device row lengths: no host length is read or moved
    (the round's host side commits them after the replay, `FixedRounds`)."""

    target: Tensor
    """(rows,) int64 the target cache's row lengths (0 on padded rows)."""
    drafts: Tensor
    """(draft layers, rows) int64 each draft cache's row lengths before the refresh."""
    confirmed: Tensor
    """(draft layers, rows) int64 the same after the refresh (+ each row's pending positions)."""
    shape: FixedShape
    masked_draft: bool
    """False where every draft layer attends with the fused kernel, which selects by position."""
    masked_target: bool
    chained: list[int] = field(default_factory=list, init=False)
    """Chain entries written to each draft layer so far this round (state of one round's run:
    not an input, so `dataclasses.replace` starts it afresh)."""

    def refresh(self, j: int, cache: KVCache, width: int) -> AttentionPlan:
        return cache.plan_fixed(self.drafts[j], width, self.shape.read_draft, masked=self.masked_draft)

    def chain(self, j: int, cache: KVCache) -> AttentionPlan:
        if not self.chained:
            self.chained.extend([0] * self.drafts.shape[0])
        lengths = self.confirmed[j] + self.chained[j]  # a Python constant: the same every replay
        self.chained[j] += 1
        return cache.plan_fixed(lengths, 1, self.shape.read_draft, masked=self.masked_draft)

    def end_chain(self, caches: list[KVCache]) -> None:
        """Nothing to roll back: the chain's slots lie past the lengths the host commits."""

    def verify(self, cache: KVCache, width: int) -> AttentionPlan:
        return cache.plan_fixed(self.target, width, self.shape.read_target, masked=self.masked_target)
