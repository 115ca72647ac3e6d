"""A batched key/value cache with per-row lengths, rollback and row add/remove.

Continuous batching with speculative decoding needs three things of a KV cache:
- rows of different lengths in one forward (each row appends its own number of new tokens,
  right-padded to the longest; padded positions write scratch slots past the row's length);
- rollback: after verification a row keeps only the accepted prefix — lengths shrink and the
  rejected slots become stale;
- rows join (after prefill) and leave (finished or aborted) between steps.

Two storages behind one interface:
- *paged* (`pages` given: the engine's caches): one pool per k and v of shape (num_layers,
  kv_heads, num_blocks, block_size, head_dim) (a block's slots of one head together, so a gather
  of a row's blocks is its slots in order, with no second copy), shared out by `kv_pages.KVPages`, whose block table
  says which blocks hold each row's slots (one table for the target's cache and every draft
  layer's). A row holds only the blocks its tokens fill; rows join by copying their prefill into
  fresh blocks (`load_rows`; a prompt's samples share its full blocks), leave by releasing their
  blocks and move by permuting table rows (no data moves); a forward reads a row's slots through the
  table (a gather on the host path, one indirection in the fused kernels). The engine grows rows
  before each round and checks a forward never writes past a row's blocks.
- *growable* (no `pages`: prefill scratch, tests, tools): one tensor per k and v of shape
  (num_layers, rows, kv_heads, capacity, head_dim), reallocated as needed: capacity by doubling,
  rows by concatenation.

A forward reads a whole range of slots under an additive mask, and a zero attention weight times
a non-finite value is still NaN: a slot at or past a row's length must hold zeros, or whatever
another request (or a rejected draft) left there reaches the row's output. So the cache keeps,
per row, how far slots may have been written (`_written`, host ints: a plan's writes,
`mark_written` for fixed-shape forwards whose writes the host does not plan), and `scrub` zeroes
every live row's slots in [length, written) — one indexed write for all layers — before the next
forward reads them (`plan` scrubs itself; a fixed-shape round's runner calls it). Blocks a paged
row takes are zeroed before its next forward (`KVPages.sync`), and table entries past a row's
blocks point to a block of zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from sidecar.model.kv_pages import KVPages, blocks_for, upload


@dataclass(kw_only=True, slots=True)
class AttentionPlan:
    """Where a forward's new tokens go: computed once per forward, shared by all layers. One kind
    per storage path: `GrowablePlan`, `GatheredPlan` (a paged cache read through gathered rows) and
    `FusedPlan` (a paged cache the fused kernels write and read through its block table)."""

    positions: Tensor
    """(B, S) int64 cache slot of each new token: length_b + j."""
    kv_len: int
    """Slots [0, kv_len) are read by this forward."""
    num_new: list[int]
    """Valid new tokens per row (the rest of the S columns are padding; empty for a fixed-shape
    forward, whose host side commits its own counts)."""
    keys_in: tuple[Tensor, ...]
    """Per layer, the view the new keys are written through (each kind says which)."""
    values_in: tuple[Tensor, ...]

    @property
    def fixed_shape(self) -> bool:
        """A fixed-shape forward (what CUDA graphs capture): a fused plan, or a grouped masked one."""
        return isinstance(self, FusedPlan) or (isinstance(self, MaskedPlan) and self.grouped)


@dataclass(kw_only=True, slots=True)
class MaskedPlan(AttentionPlan):
    """A plan whose layers attend with `attend` over the slots it reads, under an additive mask."""

    mask: Tensor | None
    """(B, 1, S, kv_len) additive (0 / -inf) in the cache's dtype; None when plain causal-by-length suffices."""
    keys_out: tuple[Tensor, ...]
    """Per layer, the (B, kv_heads, kv_len, head_dim) slots the forward reads."""
    values_out: tuple[Tensor, ...]
    index: tuple[Tensor, Tensor] | None
    """(rows (B, 1), positions (B, S)): where a ragged forward writes (None: a slice write at `start`)."""
    grouped: bool = False
    """Attend with each key/value head's query heads folded into its query rows (`attend`): one
    attention kernel over the cache, no key/value copies per query head. Fixed-shape forwards."""
    group_masks: dict[int, Tensor] = field(default_factory=dict)
    """`mask` repeated for G query heads per key/value head, made once per forward (by `attend`)."""


@dataclass(kw_only=True, slots=True)
class GrowablePlan(MaskedPlan):
    """A growable cache's forward: `keys_in` per layer is (B, S, kv_heads, head_dim) slots
    [start, start + S) when `start` is set, else the whole (B, capacity, kv_heads, head_dim) row
    written at `index`. Made once per forward (one `unbind` for all layers), so a layer's write is
    one operation."""

    start: int | None
    """The common start slot when every row has the same length (a slice write), else None."""


@dataclass(kw_only=True, slots=True)
class GatheredPlan(MaskedPlan):
    """A paged cache's host-path forward: every layer's read slots gathered from the blocks once
    (`rows_read`); the layers write and read those as a growable cache's forward does, and the last
    layer's write copies the new tokens into their blocks (`write_at`)."""

    rows_read: tuple[Tensor, Tensor]
    """Keys and values of every layer's read slots, (L, B, kv_heads, kv_len, head_dim) each."""
    write_at: tuple[Tensor, Tensor]
    """(block, offset) of each new token, each (B, S)."""
    read_table: Tensor
    """(B, kv_len / block_size) the blocks it reads."""


@dataclass(kw_only=True, slots=True)
class FusedPlan(AttentionPlan):
    """A paged cache's fixed-shape forward for the fused kernels (`plan_fixed(masked=False)`): no
    mask (the kernels select by position), `keys_in` / `values_in` each layer's pool viewed
    (num_blocks, block_size, kv_heads, head_dim), written and read through `table`."""

    table: Tensor
    """(B, max_blocks) the rows' block table (`kv_pages`)."""
    block_size: int


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
        pages: KVPages | None = None,
        owner: bool = False,
    ) -> None:
        """`pages` None: a growable cache of `batch` rows; else a paged one over those blocks
        (`owner`: this cache's `keep_rows` moves the shared table's rows; the engine's target
        cache), starting with no rows. See the module docstring."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.pages, self.owner = pages, owner
        if pages is None:
            shape: tuple[int, ...] = (num_layers, batch, num_kv_heads, max(capacity, 1), head_dim)
        else:
            if batch:
                raise ValueError("a paged cache starts empty: rows join with load_rows")
            shape = (num_layers, num_kv_heads, pages.num_blocks, pages.block_size, head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)
        if pages is not None:
            pages.register(self._k, self._v)
        self._buffers = [torch.empty(0, dtype=dtype, device=self.device) for _ in range(2)]  # `_gather`'s, on CPU
        self.lengths: list[int] = [0] * batch
        self._written: list[int] = [0] * batch
        """Per row: slots [0, written) may hold values, those past it are zeros (module docstring)."""

    @property
    def k(self) -> Tensor:
        """(num_layers, batch, kv_heads, capacity, head_dim): a growable cache's rows' keys."""
        if self.pages is not None:
            raise ValueError("a paged cache's keys live in blocks: read them through a plan")
        return self._k[:, : self.batch]

    @property
    def v(self) -> Tensor:
        if self.pages is not None:
            raise ValueError("a paged cache's values live in blocks: read them through a plan")
        return self._v[:, : self.batch]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def max_batch_size(self) -> int:
        """Rows a paged cache's table holds (a growable cache: its rows now)."""
        return self.pages.max_batch_size if self.pages is not None else self.batch

    @property
    def capacity(self) -> int:
        """Slots a row may hold (a paged cache: the table's width)."""
        if self.pages is not None:
            return self.pages.max_blocks * self.pages.block_size
        return int(self._k.shape[3])

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if self.pages is not None:
            raise ValueError(
                f"a forward needs {needed} KV slots per row, a row holds at most {self.capacity}: "
                "the engine admits only sequences that fit (prompt + max_new_tokens <= its max_context)"
            )
        new_cap = max(needed, 2 * self.capacity)
        pad = (0, 0, 0, new_cap - self.capacity)
        self._k = torch.nn.functional.pad(self._k, pad)
        self._v = torch.nn.functional.pad(self._v, pad)

    def _check_blocks(self, extents: list[int]) -> None:
        """A paged forward writes row r's slots below extents[r]: its blocks must hold them (a
        write past them would land in the shared zero block)."""
        assert self.pages is not None
        for r, e in enumerate(extents[: self.batch]):
            if e > self.pages.slots(r):
                raise ValueError(
                    f"row {r} writes {e} KV slots, its blocks hold {self.pages.slots(r)}: grow it first (KVPages.grow)"
                )

    def plan(self, num_new: list[int], width: int | None = None) -> GrowablePlan | GatheredPlan:
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
        extents = [n + s for n in self.lengths]
        if self.pages is not None:
            self._check_blocks(extents)
        self.scrub()
        self.mark_written(extents)
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
        if self.pages is not None:
            return self._paged_plan(positions, mask, kv_len, self.pages.table[:b], list(num_new))
        k5, v5 = self._k[:, :b], self._v[:, :b]  # (L, B, kv_heads, capacity, head_dim)
        index: tuple[Tensor, Tensor] | None = None
        if start is not None:
            k_in, v_in = k5[:, :, :, start : start + s], v5[:, :, :, start : start + s]
        else:
            k_in, v_in = k5, v5
            index = (torch.arange(b, device=self.device)[:, None], positions)
        return GrowablePlan(
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

    def _paged_plan(
        self,
        positions: Tensor,
        mask: Tensor | None,
        read: int,
        table: Tensor,
        num_new: list[int],
        grouped: bool = False,
    ) -> GatheredPlan:
        """A paged cache's host-path plan: where each new token goes, which blocks the forward
        reads, and those blocks' slots gathered once for every layer."""
        assert self.pages is not None
        bs = self.pages.block_size
        # the host path: every layer's read slots gathered once into rows as a growable cache holds
        # them; the layers write and read those (as a growable cache's forward does), and the last
        # layer's write puts the new tokens of all layers into their blocks (`write_and_read`)
        read_table = table[:, : blocks_for(read, bs)]
        k, v = self._gather(0, read_table, read), self._gather(1, read_table, read)  # (L, B, kv, read, d) views
        rows = torch.arange(positions.shape[0], device=self.device)[:, None]
        return GatheredPlan(
            positions=positions,
            mask=mask,
            kv_len=read,
            num_new=num_new,
            keys_in=k.transpose(2, 3).unbind(0),
            values_in=v.transpose(2, 3).unbind(0),
            keys_out=k.unbind(0),
            values_out=v.unbind(0),
            index=(rows, positions),
            grouped=grouped,
            write_at=(table.gather(1, positions // bs), positions % bs),
            read_table=read_table,
            rows_read=(k, v),
        )

    def _gather(self, which: int, table: Tensor, read: int) -> Tensor:  # (L, B, kv_heads, read, head_dim)
        """Every layer's slots [0, read) of each row of the keys (0) or values (1), through its
        block table (B, blocks): one gather (a block holds one head's slots together, so a row's
        blocks side by side are its slots in order). On a CPU into a buffer kept across forwards:
        a fresh one of this size a forward (hundreds of MB at large batches) costs page faults."""
        pool = self._k if which == 0 else self._v
        layers, kv, _, bs, d = pool.shape
        b, n = table.shape
        if (
            self.device.type == "cuda" or torch.compiler.is_compiling()
        ):  # the caching allocator reuses memory; graphs own theirs
            rows = pool.index_select(2, table.reshape(-1))
        else:
            need = layers * kv * b * n * bs * d
            if self._buffers[which].numel() < need:
                self._buffers[which] = torch.empty(need, dtype=pool.dtype, device=self.device)
            rows = self._buffers[which][:need].view(layers, kv, b * n, bs, d)
            torch.index_select(pool, 2, table.reshape(-1), out=rows)
        return rows.view(layers, kv, b, n * bs, d).transpose(1, 2)[:, :, :, :read]

    def plan_fixed(self, lengths: Tensor, width: int, read: int, *, masked: bool = True) -> GatheredPlan | FusedPlan:
        """A forward of fixed shape: rows [0, R) of the table (R = lengths' size, the live rows
        first, then padded rows of length 0, whose table rows point to the scratch block), `width`
        new columns each, every row reading slots [0, read) under an additive mask. Row lengths
        come from the device tensor `lengths` (R,), not from the host list: nothing here reads a
        tensor's value or depends on it, so the forward is one fixed sequence of device work for a
        given (R, width, read) — what a CUDA graph captures once and replays (the table is one
        tensor at a fixed address, brought up to date before each forward by `scrub`). Host lengths
        are not touched: the caller commits them (`commit_counts`). `masked` False: no mask, for a
        forward whose layers all attend with `triton_kernels.decode_attention`, which selects by
        position itself (`attend` refuses such a plan)."""
        r = int(lengths.shape[0])
        if self.pages is None:
            raise ValueError("plan_fixed needs a paged cache (pages given)")
        if r > self.max_batch_size or read > self.capacity or width < 1:
            raise ValueError(
                f"a fixed forward of {r} rows reading {read} slots does not fit the paged cache "
                f"({self.max_batch_size} rows of {self.capacity} slots)"
            )
        positions = lengths[:, None] + torch.arange(width, device=self.device)[None, :]  # (R, S)
        table = self.pages.table[:r]
        if not masked:  # fused kernels: they write and read the pool through the table
            return FusedPlan(
                positions=positions,
                kv_len=read,
                num_new=[],
                keys_in=self._k.permute(0, 2, 3, 1, 4).unbind(0),  # each (num_blocks, block_size, kv_heads, head_dim)
                values_in=self._v.permute(0, 2, 3, 1, 4).unbind(0),
                table=table,
                block_size=self.pages.block_size,
            )
        slots = torch.arange(read, device=self.device)
        allowed = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # (R, 1, S, read)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, -torch.inf)
        return self._paged_plan(positions, mask, read, table, [], grouped=True)

    def mark_written(self, extents: list[int]) -> None:
        """Rows [0, len(extents)) may now hold values in slots [0, extents[r]): what a fixed-shape
        forward writes (`plan_fixed` runs only when a graph is captured, so the round's host side
        says what each replay wrote). A paged cache checks its rows' blocks hold them; padded rows
        (past the live ones) write the scratch block and are not tracked."""
        if self.pages is not None:
            self._check_blocks(extents)
        for r, e in enumerate(extents[: self.batch]):
            if e > self._written[r]:
                self._written[r] = min(e, self.capacity)

    def scrub(self) -> None:
        """Zero every live row's slots in [length, written): stale keys and values (rejected
        drafts, padding columns) then weigh exactly nothing under the mask, even where they were
        not finite. One indexed write per k and v for all layers, nothing when no slot is stale. A
        paged cache first brings its blocks' table up to date (`KVPages.sync`)."""
        if self.pages is not None:
            self.pages.sync()
        rows: list[int] = []
        slots: list[int] = []
        for b, n in enumerate(self.lengths):
            w = self._written[b]
            if self.pages is not None:
                w = min(w, self.pages.slots(b))  # blocks past a row's are zeroed when taken again
            if w > n:
                rows += [b] * (w - n)
                slots += range(n, w)
            self._written[b] = min(self._written[b], n)
        if not rows:
            return
        if self.pages is not None:
            blocks, offsets = self.pages.locate(rows, slots)
            i, t = upload(blocks, self.device), upload(offsets, self.device)
            self._k[:, :, i, t] = 0
            self._v[:, :, i, t] = 0
            return
        i, t = upload(rows, self.device), upload(slots, self.device)
        self._k[:, i, :, t] = 0
        self._v[:, i, :, t] = 0

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
        (views of the storage made by `plan`, which must be this cache's latest; a paged cache's
        read slots gathered from its blocks)."""
        if not isinstance(plan, MaskedPlan):
            raise ValueError("this fixed plan has no mask (plan_fixed(masked=False)): only the fused kernels write it")
        if isinstance(plan, GatheredPlan):
            assert plan.index is not None
            plan.keys_in[layer].index_put_(plan.index, k)
            plan.values_in[layer].index_put_(plan.index, v)
            if layer == self.num_layers - 1:  # every layer's new tokens into their blocks at once
                blocks, offsets = plan.write_at
                rows, positions = plan.index
                for pool, read in zip((self._k, self._v), plan.rows_read, strict=True):
                    pool[:, :, blocks, offsets] = read[:, rows, :, positions].permute(2, 3, 0, 1, 4)
            return plan.keys_out[layer], plan.values_out[layer]
        if plan.index is None:
            plan.keys_in[layer].copy_(k)
            plan.values_in[layer].copy_(v)
        else:
            plan.keys_in[layer].index_put_(plan.index, k)
            plan.values_in[layer].index_put_(plan.index, v)
        return plan.keys_out[layer], plan.values_out[layer]

    def read_slots(self, layer: int, plan: AttentionPlan) -> tuple[Tensor, Tensor]:
        """A paged host-path plan's read slots of `layer`, each (B, kv_heads, kv_len, head_dim):
        what its blocks held when the plan gathered them, and the forward's writes since."""
        if not isinstance(plan, GatheredPlan):
            raise ValueError("read_slots reads through a paged host-path plan")
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
        """Keep only `rows` (in that order), dropping the others. A paged cache moves no data: the
        table's rows move (by the owner), a dropped row's blocks are released."""
        if rows == list(range(self.batch)):
            return
        if self.pages is None:
            self.select_rows(rows)
            return
        if len(set(rows)) != len(rows):
            raise ValueError("a paged cache keeps each row at most once (rows share blocks only through load_rows)")
        if self.owner:
            self.pages.keep_rows(rows)
        self.lengths = [self.lengths[r] for r in rows]
        self._written = [self._written[r] for r in rows]

    def select_rows(self, rows: list[int]) -> None:
        """Make row i a copy of row rows[i]: rows may repeat or be left out. A growable cache's (a
        paged one keeps rows with keep_rows, and its rows share a prompt through load_rows); one
        gather per k and v."""
        if self.pages is not None:
            raise ValueError("select_rows is for growable caches: a paged cache moves rows with keep_rows")
        if rows == list(range(self.batch)):
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._k = self._k.index_select(1, index)
        self._v = self._v.index_select(1, index)
        self._written = [self._written[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]

    def load_rows(
        self, other: KVCache, sources: list[int], lengths: list[int] | None = None, cached: set[int] | None = None
    ) -> None:
        """A paged cache's rows join: new row i (after this cache's rows; its blocks already added
        to the pages by the engine, `KVPages.add_row`) holds the first lengths[i] slots (default
        other's length) of growable `other`'s row sources[i]. Blocks it shares with an earlier row
        (refs > 1 and already filled) and `cached` blocks (prefix-cache hits, which hold their KV)
        are not written again. One gather and one indexed write per k and v for all rows."""
        if self.pages is None or other.pages is not None:
            raise ValueError("load_rows copies a growable cache's rows into a paged one")
        pages, bs = self.pages, self.pages.block_size
        pages.sync()  # fresh blocks zeroed now, not after they are filled
        lengths = [other.lengths[s] for s in sources] if lengths is None else lengths
        first = self.batch
        if first + len(sources) > len(pages.rows):
            raise ValueError(f"{len(sources)} rows join, the pages hold {len(pages.rows) - first} new rows")
        filled: set[int] = set(cached or ())
        for r in range(first):
            filled.update(pages.rows[r])
        src_rows: list[int] = []
        src_slots: list[int] = []
        dst_blocks: list[int] = []
        dst_offsets: list[int] = []
        for i, (s, n) in enumerate(zip(sources, lengths, strict=True)):
            blocks = pages.rows[first + i]
            if n > len(blocks) * bs:
                raise ValueError(f"joining row {i} has {n} slots, its blocks hold {len(blocks) * bs}")
            for j, block in enumerate(blocks[: blocks_for(n, bs)]):
                if block in filled:  # a shared block an earlier row (or an earlier cache's load) wrote
                    continue
                filled.add(block)
                span = range(j * bs, min(n, (j + 1) * bs))
                src_rows += [s] * len(span)
                src_slots += span
                dst_blocks += [block] * len(span)
                dst_offsets += [t - j * bs for t in span]
        if src_rows:
            sr, st = upload(src_rows, self.device), upload(src_slots, self.device)
            db, do = upload(dst_blocks, self.device), upload(dst_offsets, self.device)
            self._k[:, :, db, do] = other._k[:, sr, :, st].permute(1, 2, 0, 3)  # (L, kv_heads, slots, head_dim)
            self._v[:, :, db, do] = other._v[:, sr, :, st].permute(1, 2, 0, 3)
        self.lengths = self.lengths + list(lengths)
        self._written = self._written + list(lengths)

    def load_prefix(self, paged: KVCache, blocks: list[list[int]]) -> None:
        """`load_rows`' inverse for prefix-cache hits: growable row r (length 0) takes the slots of
        paged `paged`'s `blocks[r]` (full blocks, in slot order) as its first len(blocks[r]) *
        block_size slots, and that length. One gather and one indexed write per k and v."""
        if self.pages is not None or paged.pages is None:
            raise ValueError("load_prefix copies a paged cache's blocks into a growable one")
        if len(blocks) != self.batch or any(self.lengths):
            raise ValueError(f"load_prefix fills the {self.batch} empty rows of a fresh prefill cache")
        bs = paged.pages.block_size
        lengths = [len(b) * bs for b in blocks]
        self._grow(max(lengths, default=0))
        rows = [r for r, n in enumerate(lengths) for _ in range(n)]
        if rows:
            slots = [t for n in lengths for t in range(n)]
            flat = [b for bl in blocks for b in bl for _ in range(bs)]
            offsets = [t % bs for t in slots]
            sr, st = upload(rows, self.device), upload(slots, self.device)
            db, do = upload(flat, self.device), upload(offsets, self.device)
            self._k[:, sr, :, st] = paged._k[:, :, db, do].permute(2, 0, 1, 3)  # (slots, L, kv_heads, head_dim)
            self._v[:, sr, :, st] = paged._v[:, :, db, do].permute(2, 0, 1, 3)
        self.lengths = list(lengths)
        self._written = list(lengths)

    def append_rows(self, other: KVCache) -> None:
        """Append growable `other`'s rows after this growable cache's rows (same layers, heads,
        dtype); a paged cache's rows join with `load_rows`."""
        if self.pages is not None:
            raise ValueError("a paged cache's rows join with load_rows")
        if other.batch == 0:
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
        """Bytes of the storage (a paged cache's whole pool)."""
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
    if not isinstance(plan, MaskedPlan):
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
