"""The engine's rows: each sequence's host-side record, and the batch's per-row device tensors.

The round's device work (uniforms, stop detection, the packed result) reads as one piece:
`BatchTensors` is built once per change of the running batch and holds
everything per row that a round needs on the device (sampling parameters, counter-RNG keys, stop
ids, token budgets); `round_outcome` turns a verified round into the one packed tensor the host
copies per step (tokens, log-probs, accepted counts, emitted counts, finish reasons).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sidecar.engine import counter_rng
from sidecar.engine.sampling import RowSampling
from sidecar.types import FinishReason, Routes, Sample, SamplingParams, SpeculationCounters

CATCH_UP_POSITIONS = 8
"""Most pending MTP inputs an auto sequence keeps while the controller chooses k = 0. Resuming
then refreshes at most this many positions (a steady drafting round refreshes a + 1 <= k + 1),
so the price of keeping a draft alive through plain rounds is bounded by one ordinary draft
phase instead of growing with the idle stretch (BENCHMARKS.md, "Adaptive speculation")."""

REASON_NONE, REASON_STOP, REASON_LENGTH = 0, 1, 2


def cost_clock(device: torch.device) -> Callable[[], float]:
    """Seconds for the controller's cost measurements: wall time on CUDA (the engine synchronises
    after each phase); CPU time on a CPU device — this thread's when torch computes on it alone
    (a sidecar's gRPC threads then do not count), the process's when torch has intra-op threads.
    On a shared machine wall time is mostly waiting for other tenants."""
    if device.type == "cuda":
        return time.perf_counter
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


def sequence_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sequence: a hash of (request seed, prompt index, sample index), 63 bits."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def step_counters(drafted: int, accepted: int, generated: int) -> SpeculationCounters:
    """The counters of one row's round: one verify, its drafts, the accepted ones, tokens emitted."""
    counters = SpeculationCounters()
    add_rounds(counters, [drafted], [accepted], generated)
    return counters


def add_rounds(counters: SpeculationCounters, drafted: list[int], accepted: list[int], generated: int) -> None:
    """Add the rounds of rows that drafted `drafted[i]` tokens and had `accepted[i]` accepted
    (one verify each), `generated` tokens emitted in all, in place: what `counters.add` of each
    row's `step_counters` would add, without building them (a round does this once per row and
    once for the batch)."""
    counters.verify_steps += len(drafted)
    counters.drafted_tokens += sum(drafted)
    counters.accepted_tokens += sum(accepted)
    counters.generated_tokens += generated
    for per, counts in ((counters.drafted_per_position, drafted), (counters.accepted_per_position, accepted)):
        top = max(counts, default=0)
        if len(per) < top:
            per.extend([0] * (top - len(per)))
        for i in range(top):
            per[i] += sum(n > i for n in counts)


@dataclass(frozen=True, slots=True)
class Pending:
    """A run of a row's trunk hidden states the MTP layers have not consumed: `base[row, start :
    start + count]`, where `base` (B', P, hidden) is a forward's whole output (a prefill's or a
    verify's). Kept as a reference, not a slice, so a round slices nothing per row:
    `gather_pending` moves every row's runs into the draft's input with one indexing per base."""

    base: Tensor
    row: int
    start: int
    count: int


def gather_pending(seqs: list[Sequence], take: list[int], width: int) -> Tensor:  # (B, width, hidden)
    """Each row's pending hidden states, right-padded with zeros: all of row b's runs when
    take[b] > 0 (then take[b] == its num_pending), nothing otherwise."""
    first = next(p.base for s, n in zip(seqs, take, strict=True) if n and s.pending for p in s.pending)
    out = torch.zeros(len(seqs), width, first.shape[-1], dtype=first.dtype, device=first.device)
    groups: dict[
        int, tuple[Tensor, list[list[int]]]
    ] = {}  # id(base) -> (base, [src rows, src cols, dst rows, dst cols])
    for b, (s, n) in enumerate(zip(seqs, take, strict=True)):
        if not n or s.pending is None:
            continue
        col = 0
        for p in s.pending:
            idx = groups.setdefault(id(p.base), (p.base, [[], [], [], []]))[1]
            idx[0] += [p.row] * p.count
            idx[1] += range(p.start, p.start + p.count)
            idx[2] += [b] * p.count
            idx[3] += range(col, col + p.count)
            col += p.count
    for base, idx in groups.values():
        src_r, src_c, dst_r, dst_c = torch.tensor(idx, device=out.device).unbind(0)
        out[dst_r, dst_c] = base[src_r, src_c]
    return out


@dataclass(kw_only=True, slots=True)
class Sequence:
    request_id: str
    prompt_index: int
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    k: int
    speculation_auto: bool
    """k is chosen per step by the engine's SpeculationController (`k` is then unused)."""
    seed: int
    """`sequence_seed(...)`: the key of the row's counter-based uniforms."""
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    first_version: int = -1
    last_version: int = -1
    pending: list[Pending] | None = None  # runs of trunk states the MTP layers have not consumed, oldest first
    admitted: int = 0
    """When the sequence last joined the running batch (the engine's count): the latest are preempted first."""
    use_prefix_cache: bool = True
    """Its prefill may start from prefix-cache blocks (`prefix_cache`). The hook for requests whose
    prefill must run over the whole prompt (e.g. one that asks for the prompt's expert routes)."""
    kv_version: int = -1
    """The weight version its cached prefix was computed with (set when it joins the batch); its
    blocks enter the prefix cache only while that version still serves."""
    draft_gap: bool = False
    """Its draft caches skipped positions (`CATCH_UP_POSITIONS`): their blocks' draft KV is not the
    prefix's, so none of its blocks is cached."""
    routes: str = "off"
    """Which routes the sample carries (`GenerationRequest.routes`)."""
    route_parts: list[Tensor] = field(default_factory=list)
    """Its routes so far, (sparse layers, n, top k) packed on the host each: the prompt's from its
    prefill ("sequence"), then per round the inputs of the tokens it emitted. A preempted sequence
    keeps them (its re-prefill adds none), so resuming changes no route."""

    @property
    def drafts(self) -> bool:
        """May draft in some step (so its MTP inputs must be kept)."""
        return self.speculation_auto or self.k > 0

    @property
    def wants_prompt_routes(self) -> bool:
        """Its prompt's routes are due from the prefill that admits it (a first prefill, not a
        resumption's). Such a sequence's prompt positions must be computed by that prefill, never
        taken from a prefix cache: cached KV carries no routes (proto GenerateRequest.routes)."""
        return self.routes == "sequence" and not self.output

    def add_routes(self, routes: Tensor) -> None:  # (sparse layers, n, top k) on the host
        """Its next positions' routes (a copy: the round's tensor is not kept alive by a row)."""
        self.route_parts.append(routes.clone())

    @property
    def num_pending(self) -> int:
        return sum(p.count for p in self.pending) if self.pending is not None else 0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def prefix(self) -> list[int]:
        """The tokens whose keys and values the target's cache holds between rounds: the prompt and
        every emitted token but the last (the next round's input). What a preempted sequence's
        prefill recomputes when it resumes."""
        return self.prompt + self.output[:-1]

    def last_tokens(self, n: int) -> list[int]:
        if n <= len(self.output):
            return self.output[len(self.output) - n :]
        return self.prompt[len(self.prompt) - (n - len(self.output)) :] + self.output

    def extend(self, tokens: list[float], logprobs: list[float], version: int) -> None:
        """Append emitted tokens (as the packed copy holds them) and their log-probs."""
        if not self.output:
            self.first_version = version
        self.last_version = version
        self.output.extend(int(t) for t in tokens)
        self.logprobs.extend(logprobs)

    def position_one(self) -> tuple[int, int]:
        """(drafts proposed at position 1, of which accepted) so far."""
        drafted, accepted = self.counters.drafted_per_position, self.counters.accepted_per_position
        return (drafted[0] if drafted else 0, accepted[0] if accepted else 0)

    def to_sample(self, reason: FinishReason) -> Sample:
        return Sample(
            request_id=self.request_id,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=list(self.output),
            logprobs=list(self.logprobs),
            finish_reason=reason,
            weight_version=self.first_version,
            last_weight_version=self.last_version,
            counters=self.counters,
            routes=self._routes(),
        )

    def _routes(self) -> Routes | None:
        if self.routes == "off":
            return None
        ids = torch.cat(self.route_parts, dim=1) if self.route_parts else torch.empty(0, 0, 0, dtype=torch.uint8)
        return Routes(
            expert_ids=ids.transpose(0, 1).contiguous(),  # (positions, sparse layers, top k)
            first_position=0 if self.routes == "sequence" else len(self.prompt),
        )


@dataclass(kw_only=True, slots=True)
class BatchTensors:
    """What a round needs per row on the device, built once per change of the running batch."""

    rows: RowSampling
    keys: Tensor
    """(B, 2) int64 counter-RNG lane states of the rows' seeds (`counter_rng.row_keys`)."""
    stops: Tensor
    """(B, S) int64 stop token ids, padded with -1 (S >= 1)."""
    max_new: Tensor
    """(B,) int64 max_new_tokens."""

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device) -> BatchTensors:
        width = max([1, *(len(s.params.stop_token_ids) for s in seqs)])
        stops = [list(s.params.stop_token_ids) + [-1] * (width - len(s.params.stop_token_ids)) for s in seqs]
        return cls(
            rows=RowSampling.of([s.params for s in seqs], device),
            keys=counter_rng.row_keys(torch.tensor([s.seed for s in seqs], dtype=torch.int64)).to(device),
            stops=torch.tensor(stops, dtype=torch.int64).to(device),
            max_new=torch.tensor([s.params.max_new_tokens for s in seqs], dtype=torch.int64).to(device),
        )

    def round_uniforms(self, out_len: Tensor, k: int) -> Tensor:
        """(B, 2k + 1): k draft samples, k acceptance tests, the final token, keyed by each row's
        output length at the round's start (see `counter_rng`)."""
        return counter_rng.uniforms(self.keys, counter_rng.round_words(out_len, k))


def round_outcome(
    batch: BatchTensors,
    emitted: Tensor,  # (B, K+1) accepted drafts, then the residual/bonus token, then padding
    logprobs: Tensor,  # (B, K+1) float32
    num_accepted: Tensor,  # (B,) int64
    out_len: Tensor,  # (B,) int64 tokens each row had emitted before the round
) -> Tensor:  # (B, 2(K+1) + 3) float64
    """The round's result packed for one host copy: per row the K+1 token columns, their K+1
    log-probs, then accepted drafts a, tokens emitted n (<= a + 1: a stop token or the row's
    max_new_tokens ends it early) and the finish reason (REASON_*). Float64 holds token ids and
    float32 log-probs exactly."""
    width = emitted.shape[1]
    col = torch.arange(width, device=emitted.device)[None, :]
    is_stop = (emitted[:, :, None] == batch.stops[:, None, :]).any(-1) & (col <= num_accepted[:, None])
    first_stop = torch.where(is_stop, col, width).amin(dim=1)  # width: none
    left = batch.max_new - out_len
    n = torch.minimum(torch.minimum(num_accepted + 1, first_stop + 1), left)
    reason = torch.where(
        first_stop < n, REASON_STOP, torch.where(n >= left, REASON_LENGTH, REASON_NONE)
    )  # a stop token wins over the length limit on the same token, as one-token-at-a-time decoding
    return torch.cat(
        [
            emitted.double(),
            logprobs.double(),
            num_accepted[:, None].double(),
            n[:, None].double(),
            reason[:, None].double(),
        ],
        dim=1,
    )
