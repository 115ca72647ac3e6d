"""One decode round, draft → verify → accept → the packed result, written once for both of its forms.

`draft_phase` (the round's uniforms, the draft refresh and chain) and `verify_phase` (the target
forward over the k + 1 columns, acceptance, the packed result) take how their forwards are placed
in the KV caches as an input (`attention_lengths.RoundLengths`):

- eagerly (`decode_round`, behind `EagerRounds`: `compile: off`, and `auto` on CPUs) with
  `HostLengths`: every forward reads the KV slots its rows need at the rows' host-known lengths, so
  it does no more arithmetic than the batch needs — the fastest form on a CPU;
- at fixed shapes (`round_graphs.FixedRounds`, captured as CUDA graphs on CUDA) with
  `DeviceLengths`: rows padded to a bucket, reads at bucketed widths, every length a device tensor,
  nothing read back — so the code a CPU runs in CI is the code a GPU captures.

Neither form reads anything back during the round: the engine builds the `RoundInput` before it and
reads the one packed result after it (`rows.round_outcome`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sidecar.engine.attention_lengths import HostLengths, RoundLengths
from sidecar.engine.drafters import Drafter
from sidecar.engine.rows import BatchTensors, round_outcome
from sidecar.engine.sampling import AcceptanceRule, reported_logprobs
from sidecar.engine.speculative import DraftInput, VerifyInput, draft, verify
from sidecar.model.decode_kernels import DecodeKernels
from sidecar.model.kv_cache import KVCache
from sidecar.model.moe import recording_routes, stacked_routes


@dataclass(kw_only=True, slots=True)
class RoundInput:
    """What a round of B rows drafting up to `round_k` tokens needs, built by the runner; both
    forms read it (the fixed-shape one pads its tensors' rows)."""

    round_k: int
    out_len: Tensor
    """(B,) int64 tokens each row has emitted (the counter-RNG position of the round)."""
    last: Tensor
    """(B,) int64 each row's last token (the first verified column)."""
    num_draft: Tensor
    """(B,) int64 drafts per row, <= round_k."""
    next_position: Tensor
    """(B,) int64 index of each row's last token in its sequence."""
    num_refresh: Tensor
    """(B,) int64 pending draft positions per row (0 on rows that do not draft, and when round_k = 0)."""
    refresh_tokens: Tensor | None = None
    """(B, S) int64 (round_k > 0): the draft inputs x_{t+1} of each row's pending positions, right-padded."""
    refresh_hidden: Tensor | None = None
    """(B, S, draft hidden) the pending states h_t, right-padded."""
    refresh_positions: Tensor | None = None
    """(B, S) int64 their draft positions t."""
    num_new: list[int]
    """Host mirror: verified columns per row (its drafts + 1)."""
    refresh_counts: list[int]
    """Host mirror of `num_refresh`."""
    record_routes: bool = False
    """Return the verified columns' routes (`RoundOutput.routes`): a row of the round asked for them."""


@dataclass(kw_only=True, slots=True)
class RoundOutput:
    packed: Tensor
    """(B, 2(round_k + 1) + 3) float64: `rows.round_outcome`, the round's one host copy."""
    hidden: Tensor
    """(B, round_k + 1, draft hidden) the draft's inputs at the verified positions (the next round's
    pending inputs: the target's hidden states for MTP, fused taps for EAGLE-3)."""
    routes: Tensor | None = None
    """(sparse layers, B, round_k + 1, top k) packed expert ids of the verified columns as inputs,
    from the verify pass (`RoundInput.record_routes`; the engine keeps each row's first n columns,
    the inputs of its n emitted tokens); None when not recorded."""


def draft_phase(
    drafter: Drafter,  # the draft kind, holding the target model
    caches: list[KVCache],  # one per draft layer (MTP or EAGLE-3)
    batch: BatchTensors,
    inp: RoundInput,
    lengths: RoundLengths,
) -> tuple[Tensor, Tensor, Tensor]:  # drafts (B, k) int64, their distributions q (B, k, V), uniforms (B, 2k + 1)
    """The round's uniforms, then the draft refresh and chain (`speculative.draft`)."""
    kernels, k = drafter.model.kernels, inp.round_k
    if isinstance(kernels, DecodeKernels):  # one kernel for the ~35 operators of the hash, bit for bit
        u = kernels.round_uniforms(batch.keys, inp.out_len, k)
    else:
        u = batch.round_uniforms(inp.out_len, k)  # a row uses its first num_draft of each role
    if k == 0:
        b, vocab = inp.last.shape[0], drafter.model.config.vocab_size
        return inp.last.new_zeros(b, 0), torch.zeros(b, 0, vocab, device=u.device), u
    assert inp.refresh_tokens is not None and inp.refresh_hidden is not None and inp.refresh_positions is not None
    phase = DraftInput(
        refresh_tokens=inp.refresh_tokens,
        refresh_hidden=inp.refresh_hidden,
        num_refresh=inp.num_refresh,
        refresh_positions=inp.refresh_positions,
        next_position=inp.next_position,
        num_draft=inp.num_draft,
        uniforms=u[:, :k],
    )
    out = draft(drafter, caches, phase, batch.rows, lengths)
    return out.tokens, out.probs, u


def verify_phase(
    drafter: Drafter,
    cache: KVCache,  # the target's
    batch: BatchTensors,
    inp: RoundInput,
    lengths: RoundLengths,
    accept: AcceptanceRule,
    drafts: Tensor,  # (B, k)
    q: Tensor,  # (B, k, V)
    u: Tensor,  # (B, 2k + 1)
) -> tuple[Tensor, Tensor, Tensor | None]:  # packed (B, 2(k+1) + 3) f64, draft inputs (B, k+1, dh), routes
    """The target forward over each row's last token and its drafts (`speculative.verify`), then
    acceptance and the packed result; with `inp.record_routes` the routes of the verified columns
    (`RoundOutput.routes`), recorded in this forward (so a captured round returns them too)."""
    tokens = torch.cat([inp.last[:, None], drafts], dim=1)
    routes = None
    if inp.record_routes:
        with recording_routes(drafter.model.model) as recorded:
            out = verify(drafter, cache, VerifyInput(tokens=tokens), batch.rows, lengths)
        routes = stacked_routes(recorded, *tokens.shape)
    else:
        out = verify(drafter, cache, VerifyInput(tokens=tokens), batch.rows, lengths)
    packed = accept_round(batch, accept, drafts, q, out.logits, out.probs, inp.num_draft, inp.out_len, u)
    return packed, out.states, routes


def accept_round(
    batch: BatchTensors,
    accept: AcceptanceRule,
    draft_tokens: Tensor,  # (B, k)
    q: Tensor,  # (B, k, V) the draft distributions
    logits: Tensor,  # (B, k + 1, V) float32 target logits at the verified positions
    probs: Tensor,  # (B, k + 1, V) their filtered distributions p
    num_draft: Tensor,  # (B,)
    out_len: Tensor,  # (B,)
    u: Tensor,  # (B, 2k + 1) the round's uniforms
) -> Tensor:  # (B, 2(k + 1) + 3) the packed result (`rows.round_outcome`)
    """Accept or reject the drafts, emit the tokens and their log-probs: the round's tail."""
    b, k = draft_tokens.shape
    acc = accept(draft_tokens, q, probs, num_draft, u[:, k : 2 * k], u[:, 2 * k])
    emitted = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)
    emitted.scatter_(1, acc.num_accepted[:, None], acc.next_token[:, None])
    logprobs = reported_logprobs(logits, emitted, batch.rows)
    return round_outcome(batch, emitted, logprobs, acc.num_accepted, out_len)


def decode_round(
    drafter: Drafter,
    cache: KVCache,  # the target's; on return every row holds its num_new verified positions
    draft_caches: list[KVCache],
    batch: BatchTensors,
    inp: RoundInput,
    accept: AcceptanceRule,
    drafted: Callable[[], None] | None = None,  # called between draft and verify (the controller's clock)
) -> RoundOutput:
    """The round eagerly at the batch's own shapes: both phases with host lengths."""
    lengths = HostLengths(num_refresh=inp.refresh_counts, num_new=inp.num_new)
    drafts, q, u = draft_phase(drafter, draft_caches, batch, inp, lengths)
    if drafted is not None:
        drafted()
    packed, states, routes = verify_phase(drafter, cache, batch, inp, lengths, accept, drafts, q, u)
    return RoundOutput(packed=packed, hidden=states, routes=routes)


class EagerRounds:
    """`decode_round` behind the interface of `round_graphs.FixedRounds` (`compile: off`, and
    `auto` on CPUs): nothing is captured."""

    capture = False
    captured = 0

    def run(
        self,
        drafter: Drafter,
        cache: KVCache,
        draft_caches: list[KVCache],
        batch: BatchTensors,
        inp: RoundInput,
        accept: AcceptanceRule,
        drafted: Callable[[], None] | None = None,
    ) -> RoundOutput:
        return decode_round(drafter, cache, draft_caches, batch, inp, accept, drafted)
