"""The engine's scheduler: the queue, the running rows, the KV block pool and preemption.

What vLLM's scheduler does for its engine core: it decides, the runner (`runner`) computes. The
KV cache is paged (`kv_pages`): a sequence joins while the free blocks hold its prefix and a round's
writes past it (`admissible`); the sequences prefilled from one prefix (the G samples of a GRPO
prompt) share its full blocks (`shareable`, `add_rows`); before each round every row grows into the
blocks the round may write, and where the free blocks do not cover that, the latest admitted rows
are preempted — their blocks released, requeued first — and resume later by prefilling their
prompt and output but the last token (`reserve`). A resumed sequence's tokens are those it would
have had uninterrupted: its uniforms are keyed by output position (`counter_rng`), and its cache
holds the same prefix (recomputed by a prefill rather than step by step, which differs only in
the order of floating-point additions, as rows batched differently do).

It hands the engine one record a round, `StepPlan` (vLLM's `SchedulerOutput`): the rows the round
advances, those it preempted, each row's k.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sidecar.engine.rows import Sequence
from sidecar.model.kv_pages import KVPages, blocks_for
from sidecar.speculation.config import SpeculationDecision
from sidecar.types import KVUsage


@dataclass(kw_only=True, slots=True)
class StepPlan:
    """One decode round as the scheduler and the controller decided it."""

    rows: list[Sequence]
    """The running rows the round advances, in the caches' row order (each holds the blocks the
    round may write)."""
    preempted: list[Sequence]
    """Rows that left the batch for the front of the queue before the round (blocks released)."""
    row_k: list[int]
    """Drafts of each row this round (<= its tokens left - 1; 0 for a row without draft input)."""
    refresh: list[int]
    """Pending draft inputs each row's round refreshes (all of them on a drafting row, else 0)."""
    lengths: list[int]
    """Each row's target cache length before the round (what it rolls back to, plus what it keeps)."""
    decision: SpeculationDecision | None
    """Automatic k's choice for the batch, when a row of automatic k runs."""
    record_routes: bool = False
    """The round returns its routes: a row asked for them, or automatic k measures the experts a
    verify reads (`TorchEngine.UNION_EVERY`)."""

    @property
    def round_k(self) -> int:
        return max(self.row_k)


@dataclass(kw_only=True, slots=True)
class Preemption:
    """`RowScheduler.reserve`'s verdict when the free blocks cannot cover a round."""

    keep: list[int]
    """The rows kept, in their order (the caller moves its caches' rows to match)."""
    preempted: list[Sequence]


def row_order(keep: list[int], n: int) -> list[int]:
    """The rows of a batch of `n` after keeping `keep`: each row that leaves has its place taken by
    a kept row from the end of the batch, so the block table changes one row per leaving row, not
    every row after it (the rows' order is free: a row's tokens do not depend on its batch)."""
    if keep == list(range(n)):
        return keep
    kept = set(keep)
    movers = iter([i for i in range(len(keep), n) if i in kept])
    return [i if i in kept else next(movers) for i in range(len(keep))]


class RowScheduler:
    """Which sequences run, and the blocks they hold (see the module docstring)."""

    def __init__(self, pages: KVPages, *, max_batch_size: int, max_speculation_k: int, drafts: bool) -> None:
        """`drafts`: the engine serves a draft (its rows may hold draft caches)."""
        self.pages = pages
        self.max_batch_size = max_batch_size
        self.max_speculation_k = max_speculation_k
        self.drafts = drafts
        self.queue: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admissions = 0
        """Sequences admitted so far (`Sequence.admitted`: preemption's order)."""
        self.preempted = False
        """The latest round preempted rows (admission waits a step)."""

    def kv_usage(self) -> KVUsage:
        """The pool's blocks now (`Engine.kv_usage`)."""
        p = self.pages
        return KVUsage(
            block_size=p.block_size,
            blocks_total=p.usable,
            blocks_used=p.used,
            blocks_shared=p.shared,
            preemptions=p.preemptions,
            blocks_cached=p.cache.cached if p.cache is not None else 0,
            prefix_cache_evictions=p.cache.counters.evictions if p.cache is not None else 0,
        )

    def keep_rows(self, order: list[int]) -> None:
        """The running rows become `order` (`row_order`'s); the caches move alike (`runner`)."""
        self.running = [self.running[i] for i in order]

    # ---- before a round --------------------------------------------------------------------------
    def reserve(self, target_lengths: list[int], draft_lengths: list[list[int]]) -> Preemption | None:
        """Before a round: every running row holds the blocks the round may write (its target
        cache's k + 1 columns, its draft caches' refresh and chain, at the largest k it may draft).
        Where the free blocks do not cover that, the latest admitted rows are preempted: their
        blocks released and they requeued first, to resume by recomputing their prefix; the rows
        kept are returned (the caller keeps them and reserves again). None: every row's blocks grown."""
        seqs, pages = self.running, self.pages
        k = self.max_speculation_k if any(s.drafts and s.pending is not None for s in seqs) else 0
        width = max((s.num_pending for s in seqs), default=0)
        need = []
        for i, s in enumerate(seqs):
            slots = target_lengths[i] + k + 1
            if k:
                slots = max(slots, *(lengths[i] + max(width, s.num_pending + k) for lengths in draft_lengths))
            need.append(slots)
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].admitted)  # earliest first
        missing = [pages.missing(i, n) for i, n in enumerate(need)]
        want, freed = sum(missing), 0
        holders: dict[int, int] = {}  # block -> preempted rows holding it
        while want > pages.free + freed and len(order) > 1:
            i = order.pop()  # the latest admitted row yields its blocks
            want -= missing[i]
            for b in pages.rows[i]:
                holders[b] = holders.get(b, 0) + 1
                freed += holders[b] == pages.refs[b]  # no row kept holds it: free once they leave
        if len(order) < len(seqs):
            out = sorted(set(range(len(seqs))) - set(order), key=lambda i: seqs[i].admitted, reverse=True)
            for i in out:
                seqs[i].pending = None
                self.queue.appendleft(seqs[i])  # the earliest of them ends up first
            pages.preemptions += len(out)
            self.preempted = True
            return Preemption(keep=sorted(order), preempted=[seqs[i] for i in out])
        for i, slots in enumerate(need):
            pages.grow(i, slots)
        return None

    # ---- admission -------------------------------------------------------------------------------
    def admissible(self) -> list[Sequence]:
        """The queued sequences to admit now, first come first served: while rows are free and the
        free blocks hold each one's prefix and a round's writes past it, beside a round's writes of
        every running row (so that a new row does not preempt an older one at once). Taken off the
        queue. Nothing in a step that preempted (its rows would come straight back)."""
        if self.preempted:
            self.preempted = False
            return []
        room = self.max_batch_size - len(self.running)
        new: list[Sequence] = []
        seen: set[tuple[tuple[int, ...], bool]] = set()
        round_blocks = blocks_for(self.max_speculation_k + 2, self.pages.block_size)
        total = round_blocks * len(self.running)  # the running rows' next round stays covered
        while self.queue and len(new) < room:
            trial = set(seen)
            need = self._row_blocks(self.queue[0], self.max_speculation_k + 2, trial)
            if total + need > self.pages.free:
                break
            total, seen = total + need, trial
            new.append(self.queue.popleft())
        return new

    def fit(self, new: list[Sequence]) -> None:
        """Requeue the last of `new` while admitting them takes more blocks than are free (after
        automatic k refused them a draft: their sharing may have changed)."""
        while self.blocks_needed(new) > self.pages.free:
            self.queue.appendleft(new.pop())

    def add_rows(
        self, seqs: list[Sequence], source: list[int], lengths: list[int], hits: list[list[int]] | None = None
    ) -> None:
        """`seqs` join the running rows after a prefill: sequence i holds the blocks of
        `lengths[source[i]]` prefix tokens, its prefix-cache blocks `hits[i]` first (held already,
        `KVPages.acquire`), sharing the other full ones with the first of them prefilled from the
        same prefix that drafts alike (`KVPages.add_row`)."""
        hits = hits if hits is not None else [[] for _ in seqs]
        leaders: dict[tuple[int, bool], int] = {}  # (prefill row, drafts) -> the first row holding its blocks
        for s, src, held in zip(seqs, source, hits, strict=True):
            n = lengths[src]
            key = (src, s.drafts)
            if key in leaders:
                shared = self.pages.rows[leaders[key]][len(held) : self.shareable(n, s.drafts)]
                self.pages.add_row(n, shared, held=held)
            else:
                leaders[key] = self.pages.add_row(n, held=held)
            self.admissions += 1
            s.admitted = self.admissions
        self.running += seqs

    def shareable(self, n: int, drafts: bool) -> int:
        """Leading blocks of an n-token prefix that the rows prefilled from it may share: those
        every cache the rows write lies wholly below (a drafting row's draft cache holds n - 1
        positions and writes the next one), so nobody ever writes them again."""
        return (n - 1 if drafts and self.drafts else n) // self.pages.block_size

    def blocks_needed(self, seqs: list[Sequence], extra: int = 0) -> int:
        """Blocks admitting `seqs` takes: each row's prefix and `extra` slots past it, less the
        blocks it shares with an earlier one of them (same prefix, drafting alike)."""
        seen: set[tuple[tuple[int, ...], bool]] = set()
        return sum(self._row_blocks(s, extra, seen) for s in seqs)

    def _row_blocks(self, s: Sequence, extra: int, seen: set[tuple[tuple[int, ...], bool]]) -> int:
        """`blocks_needed`'s term for `s` after the rows whose keys are in `seen` (which it joins)."""
        p = s.prefix()
        key = (tuple(p), s.drafts)
        shared = self.shareable(len(p), s.drafts) if key in seen else 0
        seen.add(key)
        return blocks_for(len(p) + extra, self.pages.block_size) - shared

    # ---- the prefix cache (`prefix_cache`) -------------------------------------------------------
    def drafting(self, s: Sequence) -> bool:
        """The row drafts: its blocks hold draft KV (a prefix-cache namespace of their own)."""
        return s.drafts and self.drafts

    def prefix_hits(self, new: list[Sequence], version: int) -> list[list[int]]:
        """Each sequence's cached blocks (its prefix's leading full blocks; none for a sequence
        that may not use them), held at once, before the pool takes a block for anyone."""
        cache = self.pages.cache
        if cache is None:
            return [[] for _ in new]
        hits = [  # a prompt whose routes are due is computed whole: cached KV carries no routes
            cache.lookup(version, self.drafting(s), s.prefix())
            if s.use_prefix_cache and not s.wants_prompt_routes
            else []
            for s in new
        ]
        for h in hits:
            self.pages.acquire(h)
        return hits

    def cache_row(self, row: int, s: Sequence, version: int, lengths: list[int]) -> None:
        """Row `row` (sequence `s`, its caches' `lengths`: the target's, then each draft layer's)
        leaves the batch: its full blocks whose KV (the target's, and the draft's on a drafting row)
        holds its own tokens, computed with `version`, the weights serving now, enter the cache."""
        cache = self.pages.cache
        if cache is None or s.kv_version != version:
            return
        tokens = s.prompt + s.output
        valid = min(lengths[0], len(tokens))  # slots past the tokens: drafts the row did not emit
        drafting = self.drafting(s)
        if drafting:
            if s.draft_gap:
                return
            valid = min(valid, len(tokens) - 1, *lengths[1:])
        cache.insert(version, drafting, tokens, self.pages.rows[row][: valid // self.pages.block_size])
