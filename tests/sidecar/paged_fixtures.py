"""Paged caches for tests: rows whose blocks are scattered over the pool, and row-wise access.

`paged_cache` builds a paged `KVCache` of `len(lengths)` rows, each holding `capacity` slots in
blocks taken from a shuffled free list (so a row's blocks are neither contiguous nor in order: the
table's indirection is what every read and write goes through), with random keys and values in
every slot. `row_slots` / `fill_slots` read and write one row's slots through the host's books."""

from __future__ import annotations

import random

import torch
from torch import Tensor

from sidecar.model.kv_cache import KVCache
from sidecar.model.kv_pages import RESERVED_BLOCKS, KVPages, blocks_for


def paged_cache(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    lengths: list[int],
    capacity: int,
    seed: int,
    device: str = "cpu",
    max_batch_size: int | None = None,
    block_size: int = 16,
    spare_blocks: int = 3,
) -> KVCache:
    rows = len(lengths)
    per_row = blocks_for(capacity, block_size)
    pages = KVPages(
        num_blocks=max(rows, 1) * per_row + RESERVED_BLOCKS + spare_blocks,
        block_size=block_size,
        max_batch_size=max_batch_size or max(rows, 1),
        max_slots=capacity,
        device=torch.device(device),
    )
    random.Random(seed).shuffle(pages._free)  # scattered blocks
    cache = KVCache(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        pages=pages,
        owner=True,
    )
    for _ in lengths:
        pages.add_row(capacity)
    pages.sync()
    gen = torch.Generator().manual_seed(seed)
    cache._k.copy_(torch.randn(cache._k.shape, generator=gen))
    cache._v.copy_(torch.randn(cache._v.shape, generator=gen))
    cache.lengths = list(lengths)
    cache._written = list(lengths)  # stale slots stay random: masking (or the kernels) must hide them
    return cache


def _index(cache: KVCache, row: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
    assert cache.pages is not None
    bs = cache.pages.block_size
    slots = list(range(start, stop))
    blocks = [cache.pages.rows[row][t // bs] for t in slots]
    offsets = [t % bs for t in slots]
    return (
        torch.tensor(blocks, dtype=torch.int64, device=cache.device),
        torch.tensor(offsets, dtype=torch.int64, device=cache.device),
    )


def row_slots(cache: KVCache, row: int, start: int = 0, stop: int | None = None) -> tuple[Tensor, Tensor]:
    """Row `row`'s keys and values at slots [start, stop), each (layers, kv_heads, slots, head_dim) (copies)."""
    stop = cache.pages.slots(row) if stop is None else stop  # type: ignore[union-attr]
    b, o = _index(cache, row, start, stop)
    return cache._k[:, :, b, o], cache._v[:, :, b, o]


def fill_slots(cache: KVCache, row: int, start: int, value: float, stop: int | None = None) -> None:
    """Set row `row`'s keys and values at slots [start, stop) to `value`."""
    stop = cache.pages.slots(row) if stop is None else stop  # type: ignore[union-attr]
    b, o = _index(cache, row, start, stop)
    cache._k[:, :, b, o] = value
    cache._v[:, :, b, o] = value
