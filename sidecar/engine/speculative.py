"""The pure steps of speculative decoding: draft, verify (accept is `sampling.rejection_sample`).

Written for the MTP draft below; an EAGLE-3 draft runs the same steps through the same
`drafters.Drafter` interface, with "h_t" its fused low/middle/high target states and one layer.

Per row, with n tokens so far (x_0 .. x_{n-1}, the last one not yet seen by the target):
the target's KV cache holds positions 0..n-2, and its final-normed hidden states h_t are known
up to t = n-2. The MTP layer's cache holds its own earlier positions; the hidden states
h_m .. h_{n-2} it has not consumed yet are the row's *pending* hidden states (a row that skipped
drafting for many rounds keeps only the latest of them, so its MTP cache may have a gap).

1. **Draft** (`draft`): refresh each MTP layer's cache over the pending positions t (inputs
   h_t and x_{t+1}, rotary position t + 1); the output at t = n-2 gives q_1, the draft
   distribution of x_n. Chain:
   draft step d >= 1 feeds the previous MTP output back in as h together with the token just
   drafted, in MTP layer min(d, L-1), at rotary position n-1+d; each step's distribution is
   filtered exactly like the target's (sampling.filtered_probs) and sampled with the row's
   pre-drawn uniform. The chain entries are rolled back afterwards (only confirmed positions
   stay cached).
2. **Verify** (`verify`): one target forward over [x_{n-1}, d_1, .., d_k] (k+1 positions per
   row) gives p_1 .. p_{k+1} and the hidden states of those positions.
3. **Accept** (`sampling.rejection_sample`), then the orchestrator keeps the target's KV of
   the accepted prefix (rollback) and makes the accepted positions' hidden states pending.

Rows may draft different numbers of tokens (per-request k, tokens left): shorter rows are
padded, and padding never reaches a valid row (masks, per-row counts).

Each forward takes its attention plan from a `attention_lengths.RoundLengths`: host lengths on the
eager round, device lengths at a fixed shape on the round a GPU captures; the steps and their input
records are the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sidecar.engine.attention_lengths import RoundLengths
from sidecar.engine.drafters import Drafter
from sidecar.engine.sampling import RowSampling, filtered_probs, sample_from
from sidecar.model.kv_cache import KVCache


@dataclass(kw_only=True, slots=True)
class DraftInput:
    """What the draft phase needs for a batch of B rows drafting up to K tokens."""

    refresh_tokens: Tensor
    """(B, S) x_{t+1} for each pending position t, right-padded."""
    refresh_hidden: Tensor
    """(B, S, hidden) the pending h_t, right-padded."""
    num_refresh: Tensor
    """(B,) int64 pending positions per row (>= 1 on rows that draft; 0 on rows that do not)."""
    refresh_positions: Tensor
    """(B, S) int64 the MTP position t of each pending entry (its rotary position is t + 1).
    Pending positions are consecutive and end at n - 2, but need not start right after the MTP
    cache's last entry: a row that did not draft for a while refreshes only its latest positions
    (the MTP layer then attends to its older entries and these; the draft distribution q is
    whatever it computes, so acceptance stays exact)."""
    next_position: Tensor
    """(B,) int64 n - 1: index of each row's last token (the first chain step's rotary position is n)."""
    num_draft: Tensor
    """(B,) int64 drafts wanted per row, <= K."""
    uniforms: Tensor
    """(B, K) uniforms in [0, 1) for sampling the drafts."""


@dataclass(kw_only=True, slots=True)
class DraftOutput:
    tokens: Tensor
    """(B, K) drafted ids (columns >= num_draft[b] are padding)."""
    probs: Tensor
    """(B, K, V) float32 the filtered draft distributions q the tokens were sampled from."""


@dataclass(kw_only=True, slots=True)
class VerifyInput:
    tokens: Tensor
    """(B, K+1) each row's last token followed by its drafts (a row's valid columns: its drafts
    + 1, which the round's `RoundLengths` plan)."""


@dataclass(kw_only=True, slots=True)
class VerifyOutput:
    hidden: Tensor
    """(B, K+1, hidden) the target's final-normed hidden states at the verified positions."""
    states: Tensor
    """(B, K+1, draft hidden) the draft's inputs at those positions (`Drafter.target_step`)."""
    logits: Tensor
    """(B, K+1, V) float32 target logits."""
    probs: Tensor
    """(B, K+1, V) float32 filtered target distributions p."""


def draft(
    drafter: Drafter,
    caches: list[KVCache],  # one per MTP layer, rows aligned with the batch
    inp: DraftInput,
    rows: RowSampling,
    lengths: RoundLengths,  # how each forward is planned: host lengths (eager) or device ones (fixed shapes)
) -> DraftOutput:
    """Refresh the MTP caches on confirmed positions, then chain-draft K tokens per row."""
    b, k = inp.uniforms.shape
    width = inp.refresh_tokens.shape[1]
    out0: Tensor | None = None
    for j, cache in enumerate(caches):
        plan = lengths.refresh(j, cache, width)
        out = drafter.step(j, inp.refresh_tokens, inp.refresh_hidden, cache, plan, inp.refresh_positions + 1)
        out0 = out if j == 0 else out0
    assert out0 is not None
    last = (inp.num_refresh - 1).clamp(min=0)
    g = out0[torch.arange(b, device=inp.uniforms.device), last]  # (B, hidden) MTP output at t = n-2
    q = filtered_probs(drafter.head(0, g), rows)  # (B, V)
    token = sample_from(q, inp.uniforms[:, 0])
    tokens, probs = [token], [q]
    for d in range(1, k):
        j = min(d, len(caches) - 1)
        rope = (inp.next_position + d)[:, None]  # (B, 1): MTP position t = n-2+d, rotary t+1
        g = drafter.step(j, token[:, None], g[:, None], caches[j], lengths.chain(j, caches[j]), rope)[:, 0]
        q = filtered_probs(drafter.head(j, g), rows)
        token = sample_from(q, inp.uniforms[:, d])
        tokens.append(token)
        probs.append(q)
    lengths.end_chain(caches)  # the chain entries were computed from draft states: not confirmed
    return DraftOutput(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1))


def verify(
    drafter: Drafter,
    cache: KVCache,  # the target's cache; on return rows hold num_new more positions
    inp: VerifyInput,
    rows: RowSampling,
    lengths: RoundLengths,
) -> VerifyOutput:
    """One target forward over each row's last token and its drafts."""
    hidden, states = drafter.target_step(inp.tokens, cache, lengths.verify(cache, inp.tokens.shape[1]))
    logits = drafter.model.logits(hidden).float()
    return VerifyOutput(hidden=hidden, states=states, logits=logits, probs=filtered_probs(logits, rows))
