"""The engine's runner: the KV caches, the prefill forward and the decode rounds (the device work).

What vLLM's model runner does for its engine core: the scheduler (`row_scheduler`) decides which
rows run and with which k (`StepPlan`); the runner builds the round's inputs from the rows, runs it
(`decode_round` eagerly, or `round_graphs` at fixed shapes, captured as CUDA graphs on CUDA) and
hands back its `RoundOutput` (one packed host copy); a prefill hands back a `Prefill`. It does not
touch the rows' tokens, the statistics or the controller: the engine's commit does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sidecar.engine.decode_round import RoundInput, RoundOutput
from sidecar.engine.drafters import Drafter
from sidecar.engine.round_graphs import FixedRounds, make_rounds
from sidecar.engine.row_scheduler import StepPlan
from sidecar.engine.rows import BatchTensors, Sequence, gather_pending, round_outcome
from sidecar.engine.sampling import AcceptanceRule, filtered_probs, rejection_sample, reported_logprobs, sample_from
from sidecar.model.decode_kernels import DecodeKernels, DecodeOps
from sidecar.model.kv_cache import KVCache
from sidecar.model.kv_pages import KVPages
from sidecar.model.model import Qwen3WithMTP
from sidecar.model.moe import recording_routes, stacked_routes


@dataclass(kw_only=True, slots=True)
class Prefill:
    """A prefill's result: each distinct prefix prefilled once, the first token of each sequence."""

    source: list[int]
    """Each sequence's prefill row (sequences with one prefix share it)."""
    lengths: list[int]
    """Tokens of each prefill row's prefix."""
    cached: list[int]
    """Of those, the leading ones served from prefix-cache blocks (not computed: `tokens` and
    `states` hold the rest)."""
    hits: list[list[int]]
    """Each prefill row's prefix-cache blocks (`cached` = their slots)."""
    tokens: Tensor
    """(U, width) int64 the prefixes' tokens past their cached ones, right-padded."""
    states: Tensor
    """(U, width, draft hidden) the draft's inputs at those positions."""
    packed: list[list[float]]
    """Per sequence its first token, its log-prob, 0, 0, the finish reason (`rows.round_outcome`)."""
    cache: KVCache
    """The prefixes' target cache (growable; `load` copies the rows kept)."""
    draft_caches: list[KVCache]
    """Their draft caches, once `prefill_draft` ran (empty until then)."""
    routes: Tensor | None = None
    """(sparse layers, U, width, top k) the prefixes' packed routes, recorded when a new sequence
    asked for its prompt's (`Sequence.wants_prompt_routes`); None otherwise."""


class Runner:
    """Caches, prefill and rounds of one engine (see the module docstring)."""

    def __init__(
        self, model: Qwen3WithMTP, drafter: Drafter, pages: KVPages, *, slots: int, max_speculation_k: int, compile: str
    ) -> None:
        """`slots`: a row's KV capacity (its context and the scratch columns a verify writes past it)."""
        self.model, self.drafter = model, drafter
        self.device = model.output_weight().device
        self.max_speculation_k = max_speculation_k
        self.cache = drafter.target_cache(0, slots, pages=pages)
        self.draft_caches = [drafter.new_cache(0, slots, pages=pages) for _ in range(drafter.num_layers)]
        self.rounds = make_rounds(compile, self.device)
        self.kernels: DecodeOps = (
            DecodeKernels.for_device(self.device) if isinstance(self.rounds, FixedRounds) else DecodeOps()
        )
        """What the cached forwards run (`decode_kernels`): fused Triton kernels with fixed-shape
        rounds on CUDA where Triton is installed, else torch's operators (the eager rounds of
        `compile: off` are the reference). Set on the model at every step: engines may share a model."""
        self.acceptance_rule: AcceptanceRule = rejection_sample  # only `wrong_rules.with_acceptance_rule` changes it
        self.batch: BatchTensors | None = None
        self.timed_drafts = False
        """Rounds of pinned k as automatic k's (two graphs): `TorchEngine.warm_up` in auto mode."""
        self._weights_checked: tuple[int, int] | None = None  # (swaps, decode-weight builds) last checked

    def keep_rows(self, order: list[int]) -> None:
        """The caches' rows become `order` (`row_scheduler.row_order`)."""
        self.cache.keep_rows(order)
        for c in self.draft_caches:
            c.keep_rows(order)
        self.batch = None

    # ---- a round ---------------------------------------------------------------------------------
    def round_input(self, plan: StepPlan) -> RoundInput:
        """The round's inputs from its rows: the last token and the output length of each, and for
        a round that drafts the draft's pending inputs (`rows.Pending`), right-padded."""
        seqs, row_k, dev = plan.rows, plan.row_k, self.device
        num_refresh = plan.refresh if plan.round_k > 0 else [0] * len(seqs)
        host = torch.tensor(
            [
                [len(s.output), s.last_tokens(1)[0], k, len(s.prompt) - 1, n]
                for s, k, n in zip(seqs, row_k, num_refresh, strict=True)
            ]
        ).to(dev)
        inp = RoundInput(
            round_k=plan.round_k,
            out_len=host[:, 0],
            last=host[:, 1],
            num_draft=host[:, 2],
            next_position=host[:, 0] + host[:, 3],
            num_refresh=host[:, 4],
            num_new=[k + 1 for k in row_k],
            refresh_counts=num_refresh,
            record_routes=plan.record_routes,
        )
        if plan.round_k > 0:
            width = max(num_refresh)
            # draft position t of each pending entry: they end at t = n - 2 (n = the row's length)
            ends = [s.length - 1 - n for s, n in zip(seqs, num_refresh, strict=True)]
            inp.refresh_tokens = torch.tensor(
                [s.last_tokens(n) + [0] * (width - n) for s, n in zip(seqs, num_refresh, strict=True)]
            ).to(dev)
            inp.refresh_hidden = gather_pending(seqs, num_refresh, width)
            inp.refresh_positions = (torch.tensor(ends)[:, None] + torch.arange(width)[None, :]).to(dev)
        return inp

    def round(
        self,
        plan: StepPlan,
        inp: RoundInput,
        read_tensors: Callable[[], list[Tensor]],
        swaps: int,
        drafted: Callable[[], None] | None,
    ) -> RoundOutput:
        """Run one round (draft → verify → accept) over the plan's rows. `swaps`: weight updates
        so far; with the decode weights' builds, when it moved, captured rounds check the
        addresses of what they read (`read_tensors`). `drafted`: called between draft and verify."""
        if self.batch is None:
            self.batch = BatchTensors.of(plan.rows, self.device)
        if plan.round_k > 0:
            self.drafter.prepare()  # a reduced draft vocabulary: re-chosen when due, its rows current
        moved = (swaps, self.model.decode_builds)  # weights move only by a push or a rebuild
        if isinstance(self.rounds, FixedRounds) and self.rounds.capture and moved != self._weights_checked:
            self.rounds.check_weights(read_tensors())
            self._weights_checked = moved
        return self.rounds.run(
            self.drafter,
            self.cache,
            self.draft_caches,
            self.batch,
            inp,
            self.acceptance_rule,
            drafted,
        )

    def roll_back(self, old_lengths: list[int], num_accepted: list[int], pages: KVPages) -> None:
        """After a round: the target cache keeps each row's accepted drafts and its last input; the
        whole blocks of rejected drafts past what the next round writes go back to the pool."""
        self.cache.truncate([n + a + 1 for n, a in zip(old_lengths, num_accepted, strict=True)])
        reserve = self.max_speculation_k + 2  # what the next round writes: those blocks are kept
        for i in range(len(old_lengths)):
            pages.trim(i, max(c.lengths[i] for c in [self.cache, *self.draft_caches]) + reserve)

    # ---- a prefill -------------------------------------------------------------------------------
    def prefill(self, new: list[Sequence], hits: list[list[int]] | None = None) -> Prefill:
        """The target forward over the distinct prefixes of `new` (the G samples of a GRPO prompt,
        or equal prompts of different requests, are prefilled once) and each sequence's first token,
        drawn with the uniform of its output position 0. `hits[i]`: the prefix-cache blocks that
        hold sequence i's leading full blocks (held by the caller): its prefill row starts from
        their KV and computes only the rest of its prefix, attending to them."""
        hits = hits if hits is not None else [[] for _ in new]
        distinct: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}  # (prefix, hits) -> its row in the prefill
        source = [
            distinct.setdefault((tuple(s.prefix()), tuple(h)), len(distinct)) for s, h in zip(new, hits, strict=True)
        ]
        rows = list(distinct)
        b, u = len(new), len(rows)
        bs = self.cache.pages.block_size if self.cache.pages is not None else 1
        lengths = [len(p) for p, _ in rows]
        cached = [len(h) * bs for _, h in rows]
        todo = [n - c for n, c in zip(lengths, cached, strict=True)]
        width = max(todo)
        tokens = torch.zeros(u, width, dtype=torch.int64)
        for i, (p, _) in enumerate(rows):
            tokens[i, : todo[i]] = torch.tensor(p[cached[i] :])
        tokens = tokens.to(self.device)
        cache = self.drafter.target_cache(u, max(lengths) + self.max_speculation_k + 2)
        if any(cached):
            cache.load_prefix(self.cache, [list(h) for _, h in rows])
        attention = cache.plan(todo, width=width)
        record = any(s.wants_prompt_routes for s in new)  # such a sequence took no cached block: its row is whole
        with recording_routes(self.model.model if record else None) as recorded:
            hidden, states = self.drafter.target_step(tokens, cache, attention)  # (u, width, hidden), draft inputs
        cache.commit(attention)
        last = torch.tensor([n - 1 for n in todo], device=self.device)
        logits = self.model.logits(hidden[torch.arange(u, device=self.device), last]).float()  # (u, V)
        logits = logits[torch.tensor(source, device=self.device)]  # (b, V): each sequence's prefix's
        batch = BatchTensors.of(new, self.device)
        zero = torch.zeros(b, dtype=torch.int64, device=self.device)
        uniforms = batch.round_uniforms(zero, 0)[:, 0]  # the final-token uniform of output position 0
        first = sample_from(filtered_probs(logits, batch.rows), uniforms)
        logprobs = reported_logprobs(logits[:, None], first[:, None], batch.rows)[:, 0]
        packed = round_outcome(batch, first[:, None], logprobs[:, None], zero, zero).tolist()
        return Prefill(
            source=source,
            lengths=lengths,
            cached=cached,
            hits=[list(h) for _, h in rows],
            tokens=tokens,
            states=states,
            packed=packed,
            cache=cache,
            draft_caches=[],
            routes=stacked_routes(recorded, u, width) if record else None,
        )

    def prefill_draft(
        self, new: list[Sequence], prefill: Prefill, clock: Callable[[], float] | None = None
    ) -> tuple[int, float] | None:
        """The draft caches of the prefixes a sequence of which drafts: draft positions t = 0..P-2
        (inputs h_t and x_{t+1}); h_{P-1} stays pending; a prefix served from cached blocks starts
        from their draft KV and computes positions c..P-2. With a `clock`: (positions prefilled,
        the seconds the draft's prefill took), for automatic k, when one ran."""
        width = prefill.tokens.shape[1]
        capacity = max(prefill.lengths) + self.max_speculation_k + 2
        prefill.draft_caches = [
            self.drafter.new_cache(len(prefill.lengths), capacity) for _ in range(self.drafter.num_layers)
        ]
        drafting = [False] * len(prefill.lengths)  # a prefix is drafted when one of its sequences drafts
        for s, i in zip(new, prefill.source, strict=True):
            drafting[i] = drafting[i] or s.drafts
        if not any(drafting):
            return None
        if any(prefill.cached):  # a drafting row's cached blocks hold its draft KV too (`prefix_cache`)
            loaded = [h if d else [] for h, d in zip(prefill.hits, drafting, strict=True)]
            for mine, fresh in zip(self.draft_caches, prefill.draft_caches, strict=True):
                fresh.load_prefix(mine, loaded)
        if width == 1:
            return None
        num = [n - 1 - c if d else 0 for n, c, d in zip(prefill.lengths, prefill.cached, drafting, strict=True)]
        if clock is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the prefill's cost, not the trunk's before it
        started = clock() if clock is not None else 0.0
        self.drafter.prefill(prefill.draft_caches, prefill.tokens, prefill.states, num)
        if clock is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sum(num), clock() - started

    def load(self, prefill: Prefill, seqs: list[Sequence], picked: list[int]) -> None:
        """Rows for `seqs` join the caches (their blocks added already, `RowScheduler.add_rows`):
        sequence i the prefill row picked[i]; a sequence that does not draft has no draft cache.
        Cached blocks (hits) are not written: they hold their KV."""
        cached = {b for p in picked for b in prefill.hits[p]}
        self.cache.load_rows(prefill.cache, picked, cached=cached)
        for mine, mc in zip(self.draft_caches, prefill.draft_caches, strict=True):
            draft_lengths = [mc.lengths[p] if s.drafts else 0 for s, p in zip(seqs, picked, strict=True)]
            mine.load_rows(mc, picked, draft_lengths, cached=cached)
        self.batch = None
