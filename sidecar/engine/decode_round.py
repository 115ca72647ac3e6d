"""One decode round at the batch's own shapes: draft → verify → accept → the packed result.

The eager round (`compile: off`, and `auto` on CPUs): every forward reads the KV slots its rows
need and writes at the rows' host-known lengths, so it does no more arithmetic than the batch
needs — the fastest form on a CPU. Its device work reads nothing back: the engine builds the input
before it and reads the one packed result after it (`rows.round_outcome`). On CUDA the engine runs
the same round at fixed shapes instead (`fixed_round`, captured as CUDA graphs by
`round_graphs`); `accept_round`, the round's tail, is shared by both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sidecar.engine.drafters import Drafter
from sidecar.engine.rows import BatchTensors, round_outcome
from sidecar.engine.sampling import AcceptanceRule, reported_logprobs
from sidecar.engine.speculative import DraftInput, VerifyInput, draft, verify
from sidecar.model.kv_cache import KVCache


@dataclass(kw_only=True, slots=True)
class RoundInput:
    """What a round of B rows drafting up to `round_k` tokens needs, built by the engine."""

    out_len: Tensor
    """(B,) int64 tokens each row has emitted (the counter-RNG position of the round)."""
    last: Tensor
    """(B,) int64 each row's last token (the first verified column)."""
    num_draft: Tensor
    """(B,) int64 drafts per row, <= round_k."""
    next_position: Tensor
    """(B,) int64 index of each row's last token in its sequence."""
    round_k: int
    num_new: list[int]
    """Verified columns per row: its drafts + 1."""
    refresh_tokens: Tensor | None = None
    """(B, S) int64 (round_k > 0): the MTP inputs x_{t+1} of each row's pending positions, right-padded."""
    refresh_hidden: Tensor | None = None
    """(B, S, hidden) the pending trunk states h_t, right-padded."""
    refresh_positions: Tensor | None = None
    """(B, S) int64 their MTP positions t."""
    num_refresh: list[int] | None = None
    """Pending positions per row (0 on rows that do not draft)."""


@dataclass(kw_only=True, slots=True)
class RoundOutput:
    packed: Tensor
    """(B, 2(round_k + 1) + 3) float64: `rows.round_outcome`, the round's one host copy."""
    hidden: Tensor
    """(B, round_k + 1, draft hidden) the draft's inputs at the verified positions (the next round's
    pending inputs: the target's hidden states for MTP, fused taps for EAGLE-3)."""


def decode_round(
    drafter: Drafter,  # the draft kind, holding the target model
    cache: KVCache,  # the target's; on return every row holds its num_new verified positions
    draft_caches: list[KVCache],  # one per draft layer (MTP or EAGLE-3)
    batch: BatchTensors,
    inp: RoundInput,
    accept: AcceptanceRule,
    drafted: Callable[[], None] | None = None,  # called between draft and verify (the controller's clock)
) -> RoundOutput:
    b, k, dev = inp.last.shape[0], inp.round_k, inp.last.device
    rows = batch.rows
    u = batch.round_uniforms(inp.out_len, k)  # (B, 2k + 1); a row uses its first num_draft of each role
    if k > 0:
        assert inp.refresh_tokens is not None and inp.refresh_hidden is not None
        assert inp.refresh_positions is not None and inp.num_refresh is not None
        out = draft(
            drafter,
            draft_caches,
            DraftInput(
                refresh_tokens=inp.refresh_tokens,
                refresh_hidden=inp.refresh_hidden,
                num_refresh=inp.num_refresh,
                refresh_positions=inp.refresh_positions,
                next_position=inp.next_position,
                num_draft=inp.num_draft,
                uniforms=u[:, :k],
            ),
            rows,
        )
        draft_tokens, q = out.tokens, out.probs
        verify_tokens = torch.cat([inp.last[:, None], draft_tokens], dim=1)
    else:
        draft_tokens = inp.last.new_zeros(b, 0)
        q = torch.zeros(b, 0, drafter.model.config.vocab_size, device=dev)
        verify_tokens = inp.last[:, None]
    if drafted is not None:
        drafted()
    vout = verify(drafter, cache, VerifyInput(tokens=verify_tokens, num_new=inp.num_new), rows)
    packed = accept_round(batch, accept, draft_tokens, q, vout.logits, vout.probs, inp.num_draft, inp.out_len, u)
    return RoundOutput(packed=packed, hidden=vout.states)


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
    """Accept or reject the drafts, emit the tokens and their log-probs: the round's tail, the same
    whether its forwards ran at the batch's own shapes or at fixed ones (`fixed_round`)."""
    b, k = draft_tokens.shape
    acc = accept(draft_tokens, q, probs, num_draft, u[:, k : 2 * k], u[:, 2 * k])
    emitted = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)
    emitted.scatter_(1, acc.num_accepted[:, None], acc.next_token[:, None])
    logprobs = reported_logprobs(logits, emitted, batch.rows)
    return round_outcome(batch, emitted, logprobs, acc.num_accepted, out_len)


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
