"""The torch engine's admission: which queued sequences join the running batch, their prefill,
the KV blocks they hold and share, and preemption when the blocks run out.

Split from `torch_engine.py` (a mixin `TorchEngine` inherits, as `served_weights`). The KV cache is
paged (`kv_pages`): a sequence joins while the free blocks hold its prefix and a round's writes
past it (`_admissible`); the sequences prefilled from one prefix (the G samples of a GRPO prompt)
share its full blocks (`_shareable`); before each round every row grows into the blocks the round
may write, and where the free blocks do not cover that, the latest admitted rows are preempted —
their blocks released, requeued first — and resume later by prefilling their prompt and output
but the last token (`_reserve_blocks`, `_admit`). A resumed sequence's tokens are those it would
have had uninterrupted: its uniforms are keyed by output position (`counter_rng`), and its cache
holds the same prefix (recomputed by a prefill rather than step by step, which differs only in
the order of floating-point additions, as rows batched differently do).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from sidecar.engine.drafters import Drafter
from sidecar.engine.rows import (
    REASON_LENGTH,
    REASON_STOP,
    BatchTensors,
    Pending,
    Sequence,
    round_outcome,
)
from sidecar.engine.sampling import filtered_probs, reported_logprobs, sample_from
from sidecar.engine.version_ledger import VersionLedger
from sidecar.model.kv_cache import KVCache
from sidecar.model.kv_pages import KVPages, blocks_for
from sidecar.model.model import Qwen3WithMTP
from sidecar.speculation.controller import RowState, SpeculationPolicy
from sidecar.types import FinishReason, KVUsage, Sample

REASONS = {REASON_STOP: FinishReason.STOP, REASON_LENGTH: FinishReason.LENGTH}


class Admission:
    """The admission side of `TorchEngine` (see the module docstring)."""

    model: Qwen3WithMTP
    drafter: Drafter
    device: torch.device
    num_mtp: int
    max_speculation_k: int
    max_batch_size: int
    _version: int
    _stats: VersionLedger
    _policy: SpeculationPolicy | None
    _queue: deque[Sequence]
    _running: list[Sequence]
    _pages: KVPages
    _cache: KVCache
    _mtp_caches: list[KVCache]
    _batch: BatchTensors | None
    _admissions: int
    _preempted: bool
    _clock: Callable[[], float]

    # the engine's own (`TorchEngine`), declared for the type checker
    def _count(self, seq: Sequence, drafted: int, accepted: int, generated: int) -> None:
        raise NotImplementedError

    def _finish(self, seq: Sequence, reason: FinishReason) -> Sample:
        raise NotImplementedError

    def _keep_rows(self, keep: list[int]) -> None:
        raise NotImplementedError

    def _tokens_left(self, seqs: list[Sequence]) -> int | None:
        raise NotImplementedError

    @staticmethod
    def _row_state(s: Sequence) -> RowState:
        raise NotImplementedError

    def kv_usage(self) -> KVUsage:
        """The pool's blocks now (`Engine.kv_usage`)."""
        p = self._pages
        return KVUsage(
            block_size=p.block_size,
            blocks_total=p.usable,
            blocks_used=p.used,
            blocks_shared=p.shared,
            preemptions=p.preemptions,
        )

    def _admit(self) -> list[Sample]:
        """Prefill queued sequences in one target forward and emit each new one's first token.

        Sequences join while the rows and the free KV blocks hold them (`_admissible`). Each
        distinct prefix among them is prefilled once, however many sequences share it (the G
        samples of a GRPO prompt, or equal prompts of different requests): the target's forward and
        the draft's prefill run over the distinct prefixes, and the sequences that share one (and
        draft alike) share its full KV blocks (`KVPages.add_row`); the rest of each row's blocks,
        its first token and its pending draft input are its own. A preempted sequence resuming
        prefills its prompt and output but the last token, which is its next input (it emits
        nothing here: its first token was drawn before)."""
        new = self._admissible()
        if not new:
            return []
        self.drafter.observe([t for s in new if not s.output for t in s.prompt])
        auto = [s for s in new if s.speculation_auto]  # rows that pin k are never refused a draft: not asked
        pinned = [s for s in new if not s.speculation_auto]
        if (
            auto
            and self._policy is not None
            and not self._policy.may_draft(
                len(self._running) + len(new),
                self._tokens_left([*self._running, *new]),
                [self._row_state(s) for s in [*self._running, *pinned, *auto]],
                joining=len(auto),  # the last rows
                prompt_tokens=self._draft_prefill_saved(auto, pinned),
            )
        ):
            for s in auto:  # the controller has measured that this batch decodes best without a draft
                s.speculation_auto, s.k = False, 0
        while self._blocks_needed(new) > self._pages.free:  # drafting changed: sharing may have too
            self._queue.appendleft(new.pop())
        distinct: dict[tuple[int, ...], int] = {}  # prefix -> its row in the prefill
        source = [distinct.setdefault(tuple(s.prefix()), len(distinct)) for s in new]  # each sequence's prefill row
        prompts = list(distinct)
        b, u, lengths = len(new), len(prompts), [len(p) for p in prompts]
        width = max(lengths)
        tokens = torch.zeros(u, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            tokens[i, : lengths[i]] = torch.tensor(p)
        tokens = tokens.to(self.device)
        cache = self.drafter.target_cache(u, width + self.max_speculation_k + 2)
        plan = cache.plan(lengths, width=width)
        hidden, states = self.drafter.target_step(tokens, cache, plan)  # (u, width, hidden), the draft's inputs
        cache.commit(plan)
        stats = self._stats[self._version]
        stats.prompt_tokens += sum(len(s.prompt) for s in new if not s.output)
        stats.prefill_tokens += sum(lengths)
        last = torch.tensor([n - 1 for n in lengths], device=self.device)
        logits = self.model.logits(hidden[torch.arange(u, device=self.device), last]).float()  # (u, V)
        logits = logits[torch.tensor(source, device=self.device)]  # (b, V): each sequence's prefix's
        batch = BatchTensors.of(new, self.device)
        rows = batch.rows
        zero = torch.zeros(b, dtype=torch.int64, device=self.device)
        uniforms = batch.round_uniforms(zero, 0)[:, 0]  # the final-token uniform of output position 0
        first = sample_from(filtered_probs(logits, rows), uniforms)
        logprobs = reported_logprobs(logits[:, None], first[:, None], rows)[:, 0]
        packed = round_outcome(batch, first[:, None], logprobs[:, None], zero, zero).tolist()
        self.drafter.observe([int(row[0]) for row, s in zip(packed, new, strict=True) if not s.output])
        mtp_caches = [self.drafter.new_cache(u, width + self.max_speculation_k + 2) for _ in range(self.num_mtp)]
        drafting = [False] * u  # a prefix is drafted when one of its sequences drafts
        for s, i in zip(new, source, strict=True):
            drafting[i] = drafting[i] or s.drafts
        if any(drafting) and width > 1:
            # MTP positions t = 0..P-2 of the prefix (inputs h_t and x_{t+1}); h_{P-1} stays pending.
            num = [n - 1 if d else 0 for n, d in zip(lengths, drafting, strict=True)]
            timer = self._policy if any(s.speculation_auto for s in new) else None  # learns what a refused draft saves
            if timer is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the prefill's cost, not the trunk's before it
            started = self._clock()
            self.drafter.prefill(mtp_caches, tokens, states, num)
            if timer is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                timer.observe_draft_prefill(sum(num), self._clock() - started)
        finished, keep = [], []
        for i, (s, (tok, lp, _, _, reason)) in enumerate(zip(new, packed, strict=True)):
            if not s.output:  # a resumed sequence drew its first token before it was preempted
                self._count(s, drafted=0, accepted=0, generated=1)
                s.extend([tok], [lp], self._version)
                if reason:
                    finished.append(self._finish(s, REASONS[int(reason)]))
                    continue
            if s.drafts and self.num_mtp:
                s.pending = [Pending(base=states, row=source[i], start=lengths[source[i]] - 1, count=1)]
            keep.append(i)
        if keep:
            leaders: dict[tuple[int, bool], int] = {}  # (prefill row, drafts) -> the first row holding its blocks
            for i in keep:
                s, n = new[i], lengths[source[i]]
                key = (source[i], s.drafts)
                if key in leaders:
                    shared = self._pages.rows[leaders[key]][: self._shareable(n, s.drafts)]
                    self._pages.add_row(n, shared)
                else:
                    leaders[key] = self._pages.add_row(n)
                self._admissions += 1
                s.admitted = self._admissions
            picked = [source[i] for i in keep]
            self._cache.load_rows(cache, picked)
            for mine, mc in zip(self._mtp_caches, mtp_caches, strict=True):
                # a sequence that does not draft has no draft cache (length 0)
                mine.load_rows(mc, picked, [mc.lengths[source[i]] if new[i].drafts else 0 for i in keep])
            self._running += [new[i] for i in keep]
            self._batch = None
        return finished

    def _shareable(self, n: int, drafts: bool) -> int:
        """Leading blocks of an n-token prefix that the rows prefilled from it may share: those
        every cache the rows write lies wholly below (a drafting row's draft cache holds n - 1
        positions and writes the next one), so nobody ever writes them again."""
        return (n - 1 if drafts and self.num_mtp else n) // self._pages.block_size

    def _blocks_needed(self, seqs: list[Sequence], extra: int = 0) -> int:
        """Blocks admitting `seqs` takes: each row's prefix and `extra` slots past it, less the
        blocks it shares with an earlier one of them (same prefix, drafting alike)."""
        seen: set[tuple[tuple[int, ...], bool]] = set()
        return sum(self._row_blocks(s, extra, seen) for s in seqs)

    def _row_blocks(self, s: Sequence, extra: int, seen: set[tuple[tuple[int, ...], bool]]) -> int:
        """`_blocks_needed`'s term for `s` after the rows whose keys are in `seen` (which it joins)."""
        p = s.prefix()
        key = (tuple(p), s.drafts)
        shared = self._shareable(len(p), s.drafts) if key in seen else 0
        seen.add(key)
        return blocks_for(len(p) + extra, self._pages.block_size) - shared

    def _admissible(self) -> list[Sequence]:
        """The queued sequences to admit now, first come first served: while rows are free and the
        free blocks hold each one's prefix and a round's writes past it, beside a round's writes of
        every running row (so that a new row does not preempt an older one at once). Taken off the
        queue. Nothing in a step that preempted (its rows would come straight back)."""
        if self._preempted:
            self._preempted = False
            return []
        room = self.max_batch_size - len(self._running)
        new: list[Sequence] = []
        seen: set[tuple[tuple[int, ...], bool]] = set()
        round_blocks = blocks_for(self.max_speculation_k + 2, self._pages.block_size)
        total = round_blocks * len(self._running)  # the running rows' next round stays covered
        while self._queue and len(new) < room:
            trial = set(seen)
            need = self._row_blocks(self._queue[0], self.max_speculation_k + 2, trial)
            if total + need > self._pages.free:
                break
            total, seen = total + need, trial
            new.append(self._queue.popleft())
        return new

    def _reserve_blocks(self) -> None:
        """Before a round: every running row holds the blocks the round may write (its target
        cache's k + 1 columns, its draft caches' refresh and chain, at the largest k it may draft).
        Where the free blocks do not cover that, the latest admitted rows are preempted: their
        blocks released and they requeued first, to resume by recomputing their prefix (`_admit`)."""
        seqs, pages = self._running, self._pages
        k = self.max_speculation_k if any(s.drafts and s.pending is not None for s in seqs) else 0
        width = max((s.num_pending for s in seqs), default=0)
        need = []
        for i, s in enumerate(seqs):
            slots = self._cache.lengths[i] + k + 1
            if k:
                slots = max(slots, *(c.lengths[i] + max(width, s.num_pending + k) for c in self._mtp_caches))
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
                self._queue.appendleft(seqs[i])  # the earliest of them ends up first
            pages.preemptions += len(out)
            self._preempted = True
            self._keep_rows(sorted(order))
            self._reserve_blocks()  # the rows kept, in their new places (their needs fit now)
            return
        for i, slots in enumerate(need):
            pages.grow(i, slots)

    @staticmethod
    def _draft_prefill_saved(auto: list[Sequence], pinned: list[Sequence]) -> int:
        """Draft prefill tokens that admitting the `auto` rows without a draft saves: their distinct
        prompts' positions, less those a drafting pinned row needs prefilled anyway."""
        needed = {tuple(s.prompt) for s in pinned if s.drafts}
        return sum(len(p) - 1 for p in {tuple(s.prompt) for s in auto} - needed)
