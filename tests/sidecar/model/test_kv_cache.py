"""The batched KV cache against the plain full forward: ragged rows, rollback, rows leaving and
joining. Oracle: `Qwen3WithMTP.hidden_states` of each row's whole sequence, no cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.model.kv_cache import KVCache
from sidecar.model.kv_pages import RESERVED_BLOCKS, SCRATCH_BLOCK, ZERO_BLOCK, KVPages, blocks_for
from sidecar.model.model import Qwen3WithMTP
from tests.sidecar.paged_fixtures import fill_slots, row_slots


def new_cache(model: Qwen3WithMTP, batch: int) -> KVCache:
    c = model.config
    return KVCache(
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
        device="cpu",
        batch=batch,
        capacity=4,  # small on purpose: growth is exercised
    )


def extend(model: Qwen3WithMTP, cache: KVCache, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Append chunks[b] to row b in one forward; return each row's new hidden states."""
    width = max(len(c) for c in chunks)
    ids = torch.tensor([c + [0] * (width - len(c)) for c in chunks])
    plan = cache.plan([len(c) for c in chunks], width=width)
    with torch.no_grad():
        h = model.trunk_step(ids, cache, plan)
    cache.commit(plan)
    return [h[b, : len(c)] for b, c in enumerate(chunks)]


def oracle(model: Qwen3WithMTP, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.hidden_states(torch.tensor([seq]))[0]


def test_ragged_extend_rollback_and_row_changes_match_full_forward(random_model: Qwen3WithMTP) -> None:
    gen = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(0, 64, (n,), generator=gen).tolist()

    seqs = [toks(5), toks(1), toks(9)]
    cache = new_cache(random_model, 3)
    for b, h in enumerate(extend(random_model, cache, seqs)):
        torch.testing.assert_close(h, oracle(random_model, seqs[b]), atol=1e-5, rtol=0)
    for step in range(4):  # ragged decode: rows append 0..3 tokens each
        chunks = [toks((step + b) % 4) for b in range(3)]
        hs = extend(random_model, cache, chunks)
        for b in range(3):
            seqs[b] += chunks[b]
            if chunks[b]:
                torch.testing.assert_close(hs[b], oracle(random_model, seqs[b])[-len(chunks[b]) :], atol=1e-5, rtol=0)
    assert cache.lengths == [len(s) for s in seqs]
    # rollback: append junk, keep a prefix of it, then continue
    junk = [toks(3), toks(2), toks(4)]
    extend(random_model, cache, junk)
    keep = [1, 0, 2]
    cache.truncate([len(s) + k for s, k in zip(seqs, keep, strict=True)])
    for b in range(3):
        seqs[b] += junk[b][: keep[b]]
    nxt = [toks(2), toks(2), toks(2)]
    hs = extend(random_model, cache, nxt)
    for b in range(3):
        seqs[b] += nxt[b]
        torch.testing.assert_close(hs[b], oracle(random_model, seqs[b])[-2:], atol=1e-5, rtol=0)
    # a row leaves, a freshly prefilled row joins, all continue
    cache.keep_rows([2, 0])
    seqs = [seqs[2], seqs[0]]
    joining = new_cache(random_model, 1)
    seqs.append(toks(6))
    extend(random_model, joining, [seqs[2]])
    cache.append_rows(joining)
    nxt = [toks(1), toks(3), toks(2)]
    hs = extend(random_model, cache, nxt)
    for b in range(3):
        seqs[b] += nxt[b]
        torch.testing.assert_close(hs[b], oracle(random_model, seqs[b])[-len(nxt[b]) :], atol=1e-5, rtol=0)


def test_append_rows_from_a_cache_of_larger_but_not_double_capacity(random_model: Qwen3WithMTP) -> None:
    """A longer prompt admitted while other rows decode: its prefill cache (capacity 25) is
    larger than the running cache (20) but less than double. Growing the running cache doubles
    it (40); the joining rows must be padded to that, not to 25 (regression: `cat` failed with
    "Sizes of tensors must match", issue 14 finding 1)."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (3,), generator=gen).tolist(), torch.randint(0, 64, (9,), generator=gen).tolist()]
    cache, joining = new_cache(random_model, 1), new_cache(random_model, 1)
    cache._grow(20)
    joining._grow(25)
    extend(random_model, cache, [seqs[0]])
    extend(random_model, joining, [seqs[1]])
    cache.append_rows(joining)
    assert cache.lengths == [3, 9] and cache.capacity >= 25
    nxt = [[5], [7, 9]]
    hs = extend(random_model, cache, nxt)
    for b in range(2):
        seqs[b] += nxt[b]
        torch.testing.assert_close(hs[b], oracle(random_model, seqs[b])[-len(nxt[b]) :], atol=1e-5, rtol=0)


def test_slots_past_a_rows_length_read_as_zeros_whatever_was_written_there() -> None:
    """Stale slots — a former owner's tokens in a block taken again, rejected drafts, padding
    columns — are zeroed before any forward reads them (`KVCache.scrub`, `KVPages.sync`), so a NaN
    written there weighs nothing under the attention mask. Paged storage in blocks of 4: a row
    writes NaN past its length, leaves; a joining row takes its blocks; a fixed-shape forward's
    writes are marked by the caller. Oracle: every slot at or past a live row's length, within its
    blocks, is exactly 0 when a plan is made."""
    nan = float("nan")
    pages = KVPages(num_blocks=12, block_size=4, max_batch_size=3, max_slots=16, device=torch.device("cpu"))
    cache = KVCache(
        num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", pages=pages, owner=True
    )

    def join(lengths: list[int]) -> None:
        other = KVCache(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", batch=len(lengths))
        other.lengths = list(lengths)
        other._grow(max(lengths))
        other._k.fill_(1.0)
        other._v.fill_(1.0)
        for n in lengths:
            pages.add_row(n)
        cache.load_rows(other, list(range(len(lengths))))

    def stale_is_zero() -> bool:
        return all(bool((t[:, :, n:] == 0).all()) for b, n in enumerate(cache.lengths) for t in row_slots(cache, b))

    join([3, 5])
    assert pages.rows == [[2], [3, 4]] and pages.free == 12 - 2 - 3
    for b, n in enumerate([8, 9]):
        pages.grow(b, n)
    plan = cache.plan([4, 1], width=4)  # row 1 writes 3 padding columns past what it commits
    for layer in range(2):
        cache.write_and_read(layer, torch.full((2, 4, 1, 4), nan), torch.full((2, 4, 1, 4), nan), plan)
    cache.commit(plan)
    cache.truncate([4, 5])  # row 0 rolls back 3 of its 4 new slots: NaN past its length
    cache.plan([1, 1])
    assert stale_is_zero()
    cache.keep_rows([1])  # row 0 leaves: its blocks (NaN past its length) go back to the pool
    assert pages.rows == [[3, 4, 6]] and pages.refs[2] == pages.refs[5] == 0
    join([2])  # takes a block where NaN stood
    pages.grow(0, 6)
    pages.grow(1, 3)
    cache.plan([1, 1])
    assert stale_is_zero()
    pages.grow(0, 9)
    pages.grow(1, 9)
    cache.plan_fixed(torch.tensor([6, 2, 0]), 3, 16)  # what a replayed graph writes, the host marks
    for b in range(2):
        fill_slots(cache, b, 0, nan, 9)
    cache.mark_written([9, 9, 9])
    cache.scrub()
    assert stale_is_zero()
    with pytest.raises(ValueError, match=r"row 1 writes 13 KV slots, its blocks hold 12: grow it first"):
        cache.mark_written([9, 13])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "share", "grow", "trim", "keep"]), st.integers(0, 40)), max_size=30)
)
def test_the_pages_books_balance_and_the_table_follows_them(ops: list[tuple[str, int]]) -> None:
    """`KVPages` against its own books, whatever rows come and go: every block is free or held,
    a block's reference count is the number of rows holding it, no two rows hold a block unless
    it was shared, and after `sync` each live table row lists its blocks then the zero block, each
    row past them the scratch block."""
    pages = KVPages(num_blocks=20, block_size=4, max_batch_size=5, max_slots=40, device=torch.device("cpu"))
    for op, n in ops:
        rows = len(pages.rows)
        if op in ("add", "share") and rows < pages.max_batch_size:
            shared = pages.rows[n % rows][: n % 3] if op == "share" and rows else []
            if max(0, blocks_for(n, 4) - len(shared)) <= pages.free:
                pages.add_row(n, shared)
        elif op == "grow" and rows and pages.missing(n % rows, n) <= pages.free:
            pages.grow(n % rows, n)
        elif op == "trim" and rows:
            pages.trim(n % rows, max(n - 10, len([b for b in pages.rows[n % rows] if pages.refs[b] > 1]) * 4))
        elif op == "keep" and rows:
            order = list(range(rows))
            order = order[n % rows :] + order[: n % rows]
            pages.keep_rows(order[: max(0, rows - n % 2)])
        held = [b for r in pages.rows for b in r]
        assert pages.free + len(set(held)) == pages.usable
        assert all(pages.refs[b] == held.count(b) for b in range(RESERVED_BLOCKS, pages.num_blocks))
        assert not set(held) & {ZERO_BLOCK, SCRATCH_BLOCK}
        assert pages.shared == sum(1 for b in set(held) if held.count(b) > 1)
        pages.sync()
        for r in range(pages.max_batch_size):
            want = (
                pages.rows[r] + [ZERO_BLOCK] * (pages.max_blocks - len(pages.rows[r]))
                if r < len(pages.rows)
                else [SCRATCH_BLOCK] * pages.max_blocks
            )
            assert pages.table[r].tolist() == want


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    picks=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_selected_rows_with_repeats_continue_as_their_source_rows(
    random_model: Qwen3WithMTP, lengths: list[int], picks: list[int], seed: int
) -> None:
    """`select_rows` with an index that repeats and drops rows (one prefill copied to the samples
    sharing its prompt): each selected row then decodes its own continuation as if its source's
    sequence had been cached alone, and the written extents travel with the rows (stale slots
    still read as zeros); then the same rows in a paged cache, rows of one source sharing its full
    blocks, each decode their own continuation. Oracle: the full forward."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]
    rows = [p % len(prompts) for p in picks]
    cache = new_cache(random_model, len(prompts))
    extend(random_model, cache, prompts)
    cache.select_rows(rows)
    assert cache.lengths == [lengths[r] for r in rows]
    cache.scrub()  # the shorter prompts' padding columns are stale in their copies too
    assert all(bool((t[:, b, :, n:] == 0).all()) for t in (cache.k, cache.v) for b, n in enumerate(cache.lengths))
    seqs = [list(prompts[r]) for r in rows]
    pages = KVPages(
        num_blocks=2 + 4 * len(rows), block_size=4, max_batch_size=len(rows), max_slots=16, device=torch.device("cpu")
    )
    paged = KVCache(
        num_layers=cache.num_layers,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        dtype=cache.dtype,
        device="cpu",
        pages=pages,
        owner=True,
    )
    first: dict[int, int] = {}
    for r in rows:  # rows with one source share its full blocks
        n = lengths[r]
        if r in first:
            pages.add_row(n, pages.rows[first[r]][: n // 4])
        else:
            first[r] = pages.add_row(n)
    paged.load_rows(cache, list(range(len(rows))))
    assert pages.shared == sum(lengths[r] // 4 for r in first if rows.count(r) > 1)
    for c in (cache, paged):
        chunks = [torch.randint(0, 64, (1 + i % 3,), generator=gen).tolist() for i in range(len(rows))]
        if c is paged:
            for b, n in enumerate(c.lengths):
                pages.grow(b, n + 3)
        hs = extend(random_model, c, chunks)
        for b, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
            torch.testing.assert_close(hs[b], oracle(random_model, seq + chunk)[-len(chunk) :], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="growable"):
        paged.select_rows([0])
