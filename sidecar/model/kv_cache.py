"""A batched key/value cache with per-row lengths, rollback and row add/remove.

Continuous batching with speculative decoding needs three things of a KV cache:
- rows of different lengths in one forward (each row appends its own number of new tokens,
  right-padded to the longest; padded positions write scratch slots past the row's length);
- rollback: after verification a row keeps only the accepted prefix — lengths shrink and the
  stale slots are simply overwritten later (they are masked until then);
- rows join (after prefill) and leave (finished or aborted) between steps.

Storage is one tensor per k and v of shape (num_layers, B, kv_heads, capacity, head_dim),
zero-initialised so that masked scratch slots are always finite (a NaN under a zero
attention weight would still poison the output). Rows are kept compact: removing rows
copies the survivors, adding rows concatenates; capacity grows by doubling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(kw_only=True, slots=True)
class AttentionPlan:
    """Where a forward's new tokens go: computed once per forward, shared by all layers."""

    positions: Tensor
    """(B, S) int64 cache slot of each new token: length_b + j."""
    mask: Tensor | None
    """(B, 1, S, kv_len) bool, True = may attend; None when plain causal-by-length suffices."""
    kv_len: int
    """Slots [0, kv_len) are read by this forward."""
    start: int | None
    """The common start slot when every row has the same length (a slice write), else None."""
    num_new: list[int]
    """Valid new tokens per row (the rest of the S columns are padding)."""


class KVCache:
    """Keys and values of `num_layers` attention layers for a compact batch of rows."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        batch: int = 0,
        capacity: int = 64,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, batch, num_kv_heads, max(capacity, 1), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.lengths: list[int] = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        pad = (0, 0, 0, new_cap - self.capacity)
        self.k = torch.nn.functional.pad(self.k, pad)
        self.v = torch.nn.functional.pad(self.v, pad)

    def plan(self, num_new: list[int], width: int | None = None) -> AttentionPlan:
        """Plan a forward that appends num_new[b] tokens to row b (padded to `width` columns).

        Row b's query j sees slots t <= length_b + j: its cached prefix and its own new tokens
        up to itself. Lengths change only on `commit` / `truncate`.
        """
        if len(num_new) != self.batch:
            raise ValueError(f"num_new has {len(num_new)} rows, the cache has {self.batch}")
        s = width if width is not None else max(num_new, default=0)
        s = max(s, 1)
        kv_len = max(self.lengths, default=0) + s
        self._grow(kv_len)
        lengths = torch.tensor(self.lengths, dtype=torch.int64, device=self.device)  # (B,)
        offsets = torch.arange(s, device=self.device)  # (S,)
        positions = lengths[:, None] + offsets[None, :]  # (B, S)
        uniform = len(set(self.lengths)) <= 1
        start = self.lengths[0] if uniform and self.lengths else (0 if uniform else None)
        mask: Tensor | None = None
        if not (uniform and s == 1):
            slots = torch.arange(kv_len, device=self.device)  # (T,)
            mask = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (B, 1, S, T)
        return AttentionPlan(positions=positions, mask=mask, kv_len=kv_len, start=start, num_new=list(num_new))

    def write_and_read(
        self,
        layer: int,
        k: Tensor,  # (B, kv_heads, S, head_dim)
        v: Tensor,  # (B, kv_heads, S, head_dim)
        plan: AttentionPlan,
    ) -> tuple[Tensor, Tensor]:  # each (B, kv_heads, kv_len, head_dim)
        """Store the new keys/values at the planned slots; return the slots this forward reads."""
        s = k.shape[2]
        if plan.start is not None:
            self.k[layer, :, :, plan.start : plan.start + s] = k
            self.v[layer, :, :, plan.start : plan.start + s] = v
        else:
            rows = torch.arange(self.batch, device=self.device)[:, None]  # (B, 1)
            self.k[layer][rows, :, plan.positions] = k.transpose(1, 2)
            self.v[layer][rows, :, plan.positions] = v.transpose(1, 2)
        return self.k[layer, :, :, : plan.kv_len], self.v[layer, :, :, : plan.kv_len]

    def commit(self, plan: AttentionPlan) -> None:
        """Make each row's planned new tokens part of its cached prefix."""
        self.lengths = [n + a for n, a in zip(self.lengths, plan.num_new, strict=True)]

    def truncate(self, lengths: list[int]) -> None:
        """Roll rows back to `lengths` (each <= the current length): rejected slots become stale."""
        for b, (old, new) in enumerate(zip(self.lengths, lengths, strict=True)):
            if not 0 <= new <= old:
                raise ValueError(f"row {b}: cannot truncate length {old} to {new}")
        self.lengths = list(lengths)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order), dropping the others."""
        if rows == list(range(self.batch)):
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        self.lengths = [self.lengths[r] for r in rows]

    def append_rows(self, other: KVCache) -> None:
        """Append `other`'s rows after this cache's rows (same layers, heads, dtype)."""
        if other.batch == 0:
            return
        if self.batch == 0:
            self.k, self.v, self.lengths = other.k, other.v, list(other.lengths)
            return
        self._grow(other.capacity)  # may double past other.capacity: pad other to ours below
        cap = self.capacity
        ok, ov = other.k, other.v
        if other.capacity < cap:
            pad = (0, 0, 0, cap - other.capacity)
            ok, ov = torch.nn.functional.pad(ok, pad), torch.nn.functional.pad(ov, pad)
        self.k = torch.cat([self.k, ok], dim=1)
        self.v = torch.cat([self.v, ov], dim=1)
        self.lengths = self.lengths + list(other.lengths)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
