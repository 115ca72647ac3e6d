"""A batched key/value cache with per-row lengths, rollback and row add/remove.

Continuous batching with speculative decoding needs three things of a KV cache:
- rows of different lengths in one forward (each row appends its own number of new tokens,
  right-padded to the longest; padded positions write scratch slots past the row's length);
- rollback: after verification a row keeps only the accepted prefix — lengths shrink and the
  rejected slots become stale;
- rows join (after prefill) and leave (finished or aborted) between steps.

Storage is one tensor per k and v of shape (num_layers, rows, kv_heads, capacity, head_dim).
A forward reads a whole range of slots under an additive mask, and a zero attention weight times
a non-finite value is still NaN: a slot at or past a row's length must hold zeros, or whatever
another request (or a rejected draft) left there reaches the row's output. So the cache keeps,
per storage row, how far slots may have been written (`_written`, host ints: a plan's writes,
`mark_written` for fixed-shape forwards whose writes the host does not plan), and `scrub` zeroes
every live row's slots in [length, written) — one indexed write for all layers — before the
next forward reads them (`plan` scrubs itself; a fixed-shape round's runner calls it). A row
that takes a storage row inherits the old occupant's written extent, so it is scrubbed too. A
*static* cache (`max_batch` given: the engine's) is
allocated once, `max_batch` rows of `capacity` slots, and never reallocated: a forward reads a
view of its first `batch` rows and its first kv_len slots, rollback moves lengths only, a row
leaving moves the rows after it down by one copy of theirs, a row joining is copied into the
first free row; a forward that would need more slots or rows than it has is an error (the engine
checks admission against `capacity` and `max_batch`, so it never happens there). A growable
cache (no `max_batch`: prefill scratch, tests, tools) reallocates instead: capacity by doubling,
rows by concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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
    keys_in: tuple[Tensor, ...] = ()
    """Per layer, the view the new keys are written through: (B, S, kv_heads, head_dim) slots
    [start, start + S) when `start` is set, else the whole (B, capacity, kv_heads, head_dim) row
    written at `index`. Made once per forward (one `unbind` for all layers), so a layer's write
    is one operation."""
    values_in: tuple[Tensor, ...] = ()
    keys_out: tuple[Tensor, ...] = ()
    """Per layer, the (B, kv_heads, kv_len, head_dim) slots the forward reads."""
    values_out: tuple[Tensor, ...] = ()
    index: tuple[Tensor, Tensor] | None = None
    """(rows (B, 1), positions (B, S)): where a ragged forward (no common `start`) writes."""
    grouped: bool = False
    """Attend with each key/value head's query heads folded into its query rows (`attend`): one
    attention kernel over the cache, no key/value copies per query head. Fixed-shape forwards."""
    group_masks: dict[int, Tensor] = field(default_factory=dict)
    """`mask` repeated for G query heads per key/value head, made once per forward (by `attend`)."""


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
        max_batch: int | None = None,
    ) -> None:
        """`max_batch` None: a growable cache; an int: a static one of that many rows (see the module docstring)."""
        if max_batch is not None and max_batch < max(batch, 1):
            raise ValueError(f"max_batch ({max_batch}) must be >= max(batch, 1) ({max(batch, 1)})")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.static = max_batch is not None
        rows = max_batch if max_batch is not None else batch
        shape = (num_layers, rows, num_kv_heads, max(capacity, 1), head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.lengths: list[int] = [0] * batch
        self._written: list[int] = [0] * rows
        """Per storage row: slots [0, written) may hold values, those past it are zeros (module docstring)."""

    @property
    def k(self) -> Tensor:
        """(num_layers, batch, kv_heads, capacity, head_dim): the live rows' keys (a view)."""
        return self._k[:, : self.batch]

    @property
    def v(self) -> Tensor:
        return self._v[:, : self.batch]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def max_batch(self) -> int:
        """Rows the storage holds (a static cache's limit)."""
        return int(self._k.shape[1])

    @property
    def capacity(self) -> int:
        return int(self._k.shape[3])

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if self.static:
            raise ValueError(
                f"a forward needs {needed} KV slots per row, the static cache holds {self.capacity}: "
                "the engine admits only sequences that fit (prompt + max_new_tokens <= its max_context)"
            )
        new_cap = max(needed, 2 * self.capacity)
        pad = (0, 0, 0, new_cap - self.capacity)
        self._k = torch.nn.functional.pad(self._k, pad)
        self._v = torch.nn.functional.pad(self._v, pad)

    def plan(self, num_new: list[int], width: int | None = None) -> AttentionPlan:
        """Plan a forward that appends num_new[b] tokens to row b (padded to `width` columns).

        Row b's query j sees slots t <= length_b + j: its cached prefix and its own new tokens
        up to itself. Lengths change only on `commit` / `truncate`.
        """
        if len(num_new) != self.batch:
            raise ValueError(f"num_new has {len(num_new)} rows, the cache has {self.batch}")
        s = width if width is not None else max(num_new, default=0)
        s = max(s, 1)
        kv_len = (max(self.lengths) if self.lengths else 0) + s
        self._grow(kv_len)
        self.scrub()
        self.mark_written([n + s for n in self.lengths])
        lengths = upload(self.lengths, self.device)  # (B,)
        offsets = torch.arange(s, device=self.device)  # (S,)
        positions = lengths[:, None] + offsets[None, :]  # (B, S)
        uniform = len(set(self.lengths)) <= 1
        start = self.lengths[0] if uniform and self.lengths else (0 if uniform else None)
        mask: Tensor | None = None
        if not (uniform and s == 1):
            slots = torch.arange(kv_len, device=self.device)  # (T,)
            allowed = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (B, 1, S, T)
            # additive (0 / -inf) in the cache's dtype: what SDPA would convert a bool mask to, once per forward
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, -torch.inf)
        b = self.batch
        k5, v5 = self._k[:, :b], self._v[:, :b]  # (L, B, kv_heads, capacity, head_dim)
        index: tuple[Tensor, Tensor] | None = None
        if start is not None:
            k_in, v_in = k5[:, :, :, start : start + s], v5[:, :, :, start : start + s]
        else:
            k_in, v_in = k5, v5
            index = (torch.arange(b, device=self.device)[:, None], positions)
        return AttentionPlan(
            positions=positions,
            mask=mask,
            kv_len=kv_len,
            start=start,
            num_new=list(num_new),
            keys_in=k_in.transpose(2, 3).unbind(0),
            values_in=v_in.transpose(2, 3).unbind(0),
            keys_out=k5[:, :, :, :kv_len].unbind(0),
            values_out=v5[:, :, :, :kv_len].unbind(0),
            index=index,
        )

    def plan_fixed(self, lengths: Tensor, width: int, read: int, *, masked: bool = True) -> AttentionPlan:
        """A forward of fixed shape: rows [0, R) of the static storage (R = lengths' size, the live
        rows first, then free rows padded with length 0), `width` new columns each, every row
        reading slots [0, read) under an additive mask. Row lengths come from the device tensor
        `lengths` (R,), not from the host list: nothing here reads a tensor's value or depends on
        it, so the forward is one fixed sequence of device work for a given (R, width, read) —
        what a CUDA graph captures once and replays. Writes go by index (a padded row writes
        slots [0, width) of its free row, which a joining row overwrites). Host lengths are not
        touched: the caller commits them (`commit_counts`). `masked` False: no mask, for a forward
        whose layers all attend with `triton_kernels.decode_attention`, which selects by position
        itself (`attend` refuses such a plan)."""
        r = int(lengths.shape[0])
        if not self.static:
            raise ValueError("plan_fixed needs a static cache (max_batch given)")
        if r > self.max_batch or read > self.capacity or width < 1:
            raise ValueError(
                f"a fixed forward of {r} rows reading {read} slots does not fit the static cache "
                f"({self.max_batch} rows of {self.capacity} slots)"
            )
        positions = lengths[:, None] + torch.arange(width, device=self.device)[None, :]  # (R, S)
        mask: Tensor | None = None
        if masked:
            slots = torch.arange(read, device=self.device)
            allowed = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (R, 1, S, read)
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, -torch.inf)
        k5, v5 = self._k[:, :r], self._v[:, :r]
        return AttentionPlan(
            positions=positions,
            mask=mask,
            kv_len=read,
            start=None,
            num_new=[],
            keys_in=k5.transpose(2, 3).unbind(0),
            values_in=v5.transpose(2, 3).unbind(0),
            keys_out=k5[:, :, :, :read].unbind(0),
            values_out=v5[:, :, :, :read].unbind(0),
            index=(torch.arange(r, device=self.device)[:, None], positions) if masked else None,
            grouped=True,
        )

    def mark_written(self, extents: list[int]) -> None:
        """Storage rows [0, len(extents)) may now hold values in slots [0, extents[r]): what a
        fixed-shape forward writes (`plan_fixed` runs only when a graph is captured, so the
        round's host side says what each replay wrote)."""
        for r, e in enumerate(extents):
            if e > self._written[r]:
                self._written[r] = min(e, self.capacity)

    def scrub(self) -> None:
        """Zero every live row's slots in [length, written): stale keys and values (rejected
        drafts, padding columns, a former occupant's tokens) then weigh exactly nothing under
        the mask, even where they were not finite. One indexed write per k and v for all layers,
        nothing when no slot is stale."""
        rows: list[int] = []
        slots: list[int] = []
        for b, n in enumerate(self.lengths):
            w = self._written[b]
            if w > n:
                rows += [b] * (w - n)
                slots += range(n, w)
                self._written[b] = n
        if rows:
            r, t = upload(rows, self.device), upload(slots, self.device)
            self._k[:, r, :, t] = 0
            self._v[:, r, :, t] = 0

    def commit_counts(self, num_new: list[int]) -> None:
        """`commit` of a fixed forward: each live row keeps its num_new[b] new tokens."""
        if len(num_new) != self.batch:
            raise ValueError(f"num_new has {len(num_new)} rows, the cache has {self.batch}")
        self.lengths = [n + a for n, a in zip(self.lengths, num_new, strict=True)]

    def write_and_read(
        self,
        layer: int,
        k: Tensor,  # (B, S, kv_heads, head_dim)
        v: Tensor,  # (B, S, kv_heads, head_dim)
        plan: AttentionPlan,
    ) -> tuple[Tensor, Tensor]:  # each (B, kv_heads, kv_len, head_dim)
        """Store the new keys/values at the planned slots; return the slots this forward reads
        (views of the storage made by `plan`, which must be this cache's latest)."""
        if plan.grouped and plan.mask is None:
            raise ValueError("this fixed plan has no mask (plan_fixed(masked=False)): only the fused kernels write it")
        if plan.index is None:
            plan.keys_in[layer].copy_(k)
            plan.values_in[layer].copy_(v)
        else:
            plan.keys_in[layer].index_put_(plan.index, k)
            plan.values_in[layer].index_put_(plan.index, v)
        return plan.keys_out[layer], plan.values_out[layer]

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
        if not self.static:
            self.select_rows(rows)
            return
        moved = [(i, r) for i, r in enumerate(rows) if r != i]  # only rows whose place changes move
        if moved:  # (the source rows are gathered first)
            dst = torch.tensor([i for i, _ in moved], dtype=torch.int64, device=self.device)
            src = torch.tensor([r for _, r in moved], dtype=torch.int64, device=self.device)
            used = max(self.lengths[r] for _, r in moved)  # slots past a row's length are stale
            self._k[:, dst, :, :used] = self._k[:, src, :, :used]
            self._v[:, dst, :, :used] = self._v[:, src, :, :used]
            for i, _ in moved:  # past `used` the row still holds what its former occupant wrote
                self._written[i] = max(self._written[i], used)
        self.lengths = [self.lengths[r] for r in rows]

    def select_rows(self, rows: list[int]) -> None:
        """Make row i a copy of row rows[i]: rows may repeat (the G samples of one prompt share its
        prefill, which is then copied to each of them) or be left out. A growable cache's (a static
        one keeps its storage: `keep_rows`); one gather per k and v."""
        if self.static:
            raise ValueError("select_rows is for growable caches: a static cache moves rows with keep_rows")
        if rows == list(range(self.batch)):
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._k = self._k.index_select(1, index)
        self._v = self._v.index_select(1, index)
        self._written = [self._written[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]

    def append_rows(self, other: KVCache) -> None:
        """Append `other`'s rows after this cache's rows (same layers, heads, dtype)."""
        if other.batch == 0:
            return
        if self.static:
            n, b = other.batch, self.batch
            if b + n > self.max_batch:
                raise ValueError(f"{b} rows + {n} joining exceed the static cache's {self.max_batch} rows")
            cap = max(other.lengths)  # only slots below other's lengths matter
            self._grow(cap)
            self._k[:, b : b + n, :, :cap] = other._k[:, :n, :, :cap]
            self._v[:, b : b + n, :, :cap] = other._v[:, :n, :, :cap]
            for r in range(b, b + n):  # past `cap` the row may hold what a former occupant wrote
                self._written[r] = max(self._written[r], cap)
            self.lengths = self.lengths + list(other.lengths)
            return
        if self.batch == 0:
            self._k, self._v, self.lengths = other.k, other.v, list(other.lengths)
            self._written = list(other._written[: other.batch])
            return
        self._grow(other.capacity)  # may double past other.capacity: pad other to ours below
        cap = self.capacity
        ok, ov = other.k, other.v
        if other.capacity < cap:
            pad = (0, 0, 0, cap - other.capacity)
            ok, ov = torch.nn.functional.pad(ok, pad), torch.nn.functional.pad(ov, pad)
        self._k = torch.cat([self.k, ok], dim=1)
        self._v = torch.cat([self.v, ov], dim=1)
        self._written = self._written[: self.batch] + other._written[: other.batch]
        self.lengths = self.lengths + list(other.lengths)

    @staticmethod
    def slot_bytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token's keys and values in one layer."""
        return 2 * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def nbytes(self) -> int:
        """Bytes of the storage (a static cache's whole allocation)."""
        return self._k.numel() * self._k.element_size() * 2


def attend(
    q: Tensor,  # (B, S, heads, head_dim) the new positions' queries
    keys: Tensor,  # (B, kv_heads, T, head_dim) from `KVCache.write_and_read`
    values: Tensor,
    plan: AttentionPlan,
) -> Tensor:  # (B, S, heads * head_dim)
    """Grouped-query attention of new positions over the cached slots the plan reads (query head
    i uses key/value head i // G, G = heads / kv_heads). A grouped plan folds each key/value head's
    G query heads into its query rows — (B, kv_heads, G * S, head_dim) against the mask repeated G
    times — so the attention is one kernel with no copies of keys and values per query head; the
    arithmetic is the same (each query row meets the same keys, values and mask)."""
    b, s, h, d = q.shape
    kv = keys.shape[1]
    if plan.grouped and plan.mask is None:
        raise ValueError("this fixed plan has no mask (plan_fixed(masked=False)): only the fused attention reads it")
    if plan.grouped and plan.mask is not None and h != kv:
        g = h // kv
        mask = plan.group_masks.get(g)
        if mask is None:
            mask = plan.group_masks[g] = plan.mask.repeat(1, 1, g, 1)  # row j * S + s is query s
        folded = q.view(b, s, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * s, d)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
        return out.view(b, kv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=plan.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, s, h * d)


def upload(values: list[int], device: torch.device) -> Tensor:
    """Host ints as an int64 tensor on `device`. On CUDA through pinned memory, asynchronously: a
    copy from ordinary (pageable) memory waits for the device to finish all the work queued before
    it, so one in the middle of a round would stall the host there every forward."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def rows_within_budget(*, wanted: int, row_bytes: int, slots: int, budget: int | None, device: torch.device) -> int:
    """Rows of `slots` tokens (`row_bytes` a token, all layers) a static cache may allocate:
    `wanted`, or fewer when `budget` bytes hold fewer (default budget on CUDA: 90% of the device
    memory free now; on CPU none — pages are touched only when used). Not one row → ValueError."""
    per_row = row_bytes * slots
    if budget is None and device.type == "cuda":
        budget = int(0.9 * torch.cuda.mem_get_info(device)[0])
    if budget is None or budget >= wanted * per_row:
        return wanted
    if budget < per_row:
        raise ValueError(
            f"the KV cache budget of {budget / 2**30:.2f} GiB holds no row of {slots} tokens "
            f"({per_row / 2**30:.3f} GiB a row): raise the budget or lower max_context"
        )
    return budget // per_row
