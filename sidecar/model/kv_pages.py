"""The paged KV cache's blocks: a pool of fixed-size blocks, a block table per row, reference counts.

Why: a cache that reserves a whole context per row fits few rows (at Qwen3-8B a 40,960-token row
is 5.6 GiB), whatever the rows' real lengths; RL rollouts are long-tailed, so most of that is never
written. Here a row holds only the blocks its tokens fill, `block_size` token slots each, taken from
one pool sized by the memory budget, and the G samples of a prompt share its prompt's full blocks.

`KVPages` is the host's book of the blocks, shared by every cache of an engine (the target's and
each draft layer's: block `i` of each cache's pool belongs to the same row, so one table serves
all of them):

- `rows[r]`: row r's blocks, in slot order (slot t of row r is at offset t % block_size of block
  rows[r][t // block_size]); `refs[b]`: how many rows hold block b (a shared prompt block > 1);
  a free list of the blocks no row holds;
- `table`: the same as a device tensor (max_batch_size, max_blocks) int64, which forwards read (on the
  host a gather; in the fused kernels one indirection per slot). It lives at one address for the
  engine's life, so CUDA graphs capture it; `sync` copies the rows that changed since the last
  forward, one upload for all of them;
- two blocks no row ever holds: `ZERO_BLOCK`, all zeros, where a row's table points past its
  blocks (a masked read of it weighs nothing), and `SCRATCH_BLOCK`, which padded rows of a
  fixed-shape forward point to and write (nothing reads it).

A block taken from the free list may hold what its last owner wrote; `sync` zeroes it in every
registered pool before the next forward, so past a row's written slots every slot reads zero (the
property `KVCache.scrub` keeps within a row). Writing happens only at or past a row's length, and
a shared block lies wholly below the length of every row and cache that shares it (`admit`), so
shared blocks are read-only: no copy on write is ever needed.

With a prefix cache (`prefix_cache`, `cache`), a cached block whose last row releases it is
*idle*, not free: it keeps its KV for a later request (`acquire` takes it back), counts in `free`
(admission may use it) and is taken, least recently used first, only when the free list is empty
(`_take`: an eviction); `drop_cache` (a weight push) frees every idle block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sidecar.model.prefix_cache import PrefixCache

ZERO_BLOCK = 0
"""Never written: a table entry past a row's blocks points here (reads zeros)."""
SCRATCH_BLOCK = 1
"""Written by padded rows only, read by nobody that matters."""
RESERVED_BLOCKS = 2


def blocks_for(slots: int, block_size: int) -> int:
    """Blocks that hold `slots` token slots."""
    return -(-slots // block_size)


class KVPages:
    """The blocks of one engine's paged caches (see the module docstring)."""

    def __init__(
        self, *, num_blocks: int, block_size: int, max_batch_size: int, max_slots: int, device: torch.device
    ) -> None:
        """`num_blocks` includes the two reserved ones; a row holds at most `max_slots` slots."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"kv block size must be a power of two, got {block_size}")
        if num_blocks <= RESERVED_BLOCKS:
            raise ValueError(f"a KV pool needs more than {RESERVED_BLOCKS} blocks, got {num_blocks}")
        self.num_blocks, self.block_size, self.max_batch_size = num_blocks, block_size, max_batch_size
        self.max_blocks = blocks_for(max_slots, block_size)
        self.device = torch.device(device)
        self.rows: list[list[int]] = []
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, RESERVED_BLOCKS - 1, -1))  # a stack: low ids first
        self.table = torch.full((max_batch_size, self.max_blocks), SCRATCH_BLOCK, dtype=torch.int64, device=self.device)
        self._dirty: set[int] = set()  # table rows that differ from `rows` (and padding rows' SCRATCH)
        self._fresh: list[int] = []  # blocks taken since the last sync, to zero in every pool
        self._pools: list[tuple[Tensor, Tensor]] = []
        self._shared = 0  # blocks with refs > 1, kept as refs change
        self.preemptions = 0
        """Rows preempted (counted by the engine that preempts them)."""
        self.cache: PrefixCache | None = None
        """The prefix cache over these blocks, when the engine keeps one (`prefix_cache`)."""

    # ---- the books ----------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks no row holds (idle cached blocks included: they are taken when needed)."""
        return len(self._free) + (self.cache.idle if self.cache is not None else 0)

    @property
    def usable(self) -> int:
        """Blocks rows may hold (the pool less the reserved two)."""
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def used(self) -> int:
        return self.usable - self.free

    @property
    def shared(self) -> int:
        """Blocks more than one row holds."""
        return self._shared

    def slots(self, row: int) -> int:
        """Token slots row `row`'s blocks hold."""
        return len(self.rows[row]) * self.block_size

    def missing(self, row: int, slots: int) -> int:
        """Blocks row `row` lacks to hold `slots` slots."""
        return max(0, blocks_for(slots, self.block_size) - len(self.rows[row]))

    def register(self, k: Tensor, v: Tensor) -> None:
        """A cache's pools (layers, kv_heads, num_blocks, block_size, head_dim): fresh blocks are zeroed there."""
        self._pools.append((k, v))

    def _take(self, n: int) -> list[int]:
        if n > self.free:
            raise RuntimeError(f"{n} KV blocks wanted, {self.free} free (the engine checks before taking)")
        got = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        for b in got:
            self.refs[b] = 1
        self._fresh += got
        return got

    def _drop(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 1:
                self._shared -= 1
            elif self.refs[b] == 0:
                if self.cache is not None and self.cache.holds(b):
                    self.cache.park(b)
                else:
                    self._free.append(b)

    def _evict(self) -> int:
        assert self.cache is not None
        return self.cache.evict()

    # ---- the prefix cache's blocks ---------------------------------------------------------------
    def acquire(self, blocks: list[int]) -> None:
        """Hold cached `blocks` for a row about to join (`add_row(held=...)`), taking idle ones
        back from the eviction order, before anything takes blocks from the pool."""
        for b in blocks:
            if self.refs[b] == 0:
                assert self.cache is not None
                self.cache.unpark(b)
            self.refs[b] += 1
            if self.refs[b] == 2:
                self._shared += 1

    def release(self, blocks: list[int]) -> None:
        """Undo `acquire` (for a sequence that ended at its prefill)."""
        self._drop(blocks)

    def drop_cache(self) -> None:
        """Forget every cached block (a weight push): idle ones are free again."""
        if self.cache is not None:
            self._free += self.cache.clear()

    # ---- rows ---------------------------------------------------------------------------------
    def add_row(self, slots: int, shared: list[int] | None = None, held: list[int] | None = None) -> int:
        """A new last row holding `held` blocks (cached ones it `acquire`d), then `shared` blocks
        (another row's, now held by both), then fresh blocks up to `slots` slots. The caller
        checked `free`."""
        if len(self.rows) >= self.max_batch_size:
            raise ValueError(f"the KV table holds {self.max_batch_size} rows")
        held = held or []
        shared = shared or []
        for b in shared:
            self.refs[b] += 1
            if self.refs[b] == 2:
                self._shared += 1
        have = len(held) + len(shared)
        blocks = [*held, *shared, *self._take(max(0, blocks_for(slots, self.block_size) - have))]
        self.rows.append(blocks)
        self._dirty.add(len(self.rows) - 1)
        return len(self.rows) - 1

    def grow(self, row: int, slots: int) -> None:
        """Row `row` holds at least `slots` slots (fresh blocks at its end). The caller checked `free`."""
        n = self.missing(row, slots)
        if n:
            if len(self.rows[row]) + n > self.max_blocks:
                raise ValueError(
                    f"row {row} would hold {slots} slots, a row holds at most {self.max_blocks * self.block_size}"
                )
            self.rows[row] += self._take(n)
            self._dirty.add(row)

    def trim(self, row: int, slots: int) -> None:
        """Free row `row`'s blocks past its first `slots` slots (rolled-back tokens' whole blocks)."""
        keep = blocks_for(slots, self.block_size)
        if len(self.rows[row]) > keep:
            self._drop(self.rows[row][keep:])
            del self.rows[row][keep:]
            self._dirty.add(row)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep `rows` in that order (each at most once); the others' blocks are released."""
        kept = set(rows)
        for r, blocks in enumerate(self.rows):
            if r not in kept:
                self._drop(blocks)
        old = self.rows
        self.rows = [old[r] for r in rows]
        self._dirty.update(i for i, r in enumerate(rows) if r != i)
        self._dirty.update(range(len(self.rows), len(old)))  # rows now padding: SCRATCH again

    # ---- the device side ------------------------------------------------------------------------
    def sync(self) -> None:
        """Before a forward: zero the blocks taken since the last sync in every pool, and copy the
        changed table rows to the device (one upload, one indexed write)."""
        if self._fresh:
            fresh = upload(self._fresh, self.device)
            for k, v in self._pools:
                k[:, :, fresh] = 0
                v[:, :, fresh] = 0
            self._fresh = []
        if self._dirty:
            dirty = sorted(self._dirty)
            values = []
            for r in dirty:
                blocks = self.rows[r] if r < len(self.rows) else []
                fill = ZERO_BLOCK if r < len(self.rows) else SCRATCH_BLOCK
                values.append(blocks + [fill] * (self.max_blocks - len(blocks)))
            host = torch.tensor(values, dtype=torch.int64)
            if self.device.type == "cuda":
                host = host.pin_memory()
            self.table[upload(dirty, self.device)] = host.to(self.device, non_blocking=True)
            self._dirty.clear()

    def locate(self, rows: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
        """(block, offset) of each (row, slot), from the host's books."""
        bs = self.block_size
        blocks = [
            self.rows[r][t // bs] if t // bs < len(self.rows[r]) else ZERO_BLOCK
            for r, t in zip(rows, slots, strict=True)
        ]
        return blocks, [t % bs for t in slots]


def upload(values: list[int], device: torch.device) -> Tensor:
    """Host ints as an int64 tensor on `device`. On CUDA through pinned memory, asynchronously: a
    copy from ordinary (pageable) memory waits for the device to finish all the work queued before
    it, so one in the middle of a round would stall the host there every forward."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pool_blocks(
    *, budget: int | None, block_bytes: int, max_batch_size: int, max_slots: int, block_size: int, device: torch.device
) -> int:
    """Blocks (the reserved two included) a pool of `block_bytes` a block may allocate: as many as
    `max_batch_size` full rows of `max_slots` slots need at most, or fewer when `budget` bytes hold fewer
    (default budget on CUDA: 90% of the device memory free now; on CPU none). A budget that holds
    no usable block → ValueError."""
    most = max_batch_size * blocks_for(max_slots, block_size) + RESERVED_BLOCKS
    if budget is None and device.type == "cuda":
        budget = int(0.9 * torch.cuda.mem_get_info(device)[0])
    if budget is None:
        return most
    fit = budget // block_bytes
    if fit < RESERVED_BLOCKS + 1:
        raise ValueError(
            f"the KV cache budget of {budget / 2**30:.3f} GiB holds no block of {block_size} tokens "
            f"({block_bytes / 2**20:.2f} MiB a block, all layers): raise the budget"
        )
    return min(most, fit)
