"""Pure sampling functions: filtering, inverse-CDF sampling, exact rejection sampling, log-probs.

Every random choice here is made from uniforms the caller passes in (the engine's are
counter-based, keyed by the row's seed and output position: `counter_rng`), so a row's tokens
never depend on which other rows share its batch.

The sampling distribution of a row (SamplingParams): softmax(logits / temperature),
restricted to the top_k most likely tokens (ties at the k-th value kept, as Hugging Face
does), then to the smallest prefix of the sorted distribution whose mass reaches top_p, and
renormalised. Temperature 0 is greedy: the distribution is one-hot on argmax(logits). The
draft (q) and the target (p) go through exactly the same processing, which makes greedy
speculation a special case of rejection sampling: with one-hot p and q a draft is accepted
iff it equals argmax p, and the residual max(0, p − q) is one-hot on argmax p.

Rejection sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): draft token d_i ~ q_i is accepted with probability min(1, p_i(d_i) /
q_i(d_i)); at the first rejection the emitted token is drawn from norm(max(0, p_i − q_i)); if
all drafts are accepted a bonus token is drawn from p_k. The emitted tokens are distributed
exactly as sampling from p one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from sidecar.types import LogprobMode, SamplingParams


@dataclass(kw_only=True, slots=True)
class RowSampling:
    """Per-row sampling parameters of a batch, as tensors (built once per batch change)."""

    temperature: Tensor
    """(B,) float32; 1.0 on greedy rows (their distribution is one-hot anyway)."""
    greedy: Tensor
    """(B,) bool: temperature 0."""
    top_k: Tensor
    """(B,) int64; 0 disables."""
    top_p: Tensor
    """(B,) float32; 1 disables."""
    processed: Tensor
    """(B,) bool: the row reports LogprobMode.PROCESSED log-probs."""
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_processed: bool = False

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> RowSampling:
        greedy = [p.temperature == 0.0 for p in params]
        return cls(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            processed=torch.tensor(
                [p.logprob_mode is LogprobMode.PROCESSED for p in params], dtype=torch.bool, device=device
            ),
            any_processed=any(p.logprob_mode is LogprobMode.PROCESSED for p in params),
            any_greedy=any(greedy),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
        )


def _per_row(x: Tensor, like: Tensor) -> Tensor:
    """Reshape a (B,) tensor to broadcast against `like` (B, ..., V)."""
    return x.view(-1, *([1] * (like.dim() - 1)))


def _filtered_scaled(logits: Tensor, rows: RowSampling) -> Tensor:
    """logits / T with the tokens top-k and top-p remove set to -inf (float32)."""
    scaled = logits.float() / _per_row(rows.temperature, logits)
    if rows.any_top_k or rows.any_top_p:
        sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)
        remove_sorted = torch.zeros_like(sorted_vals, dtype=torch.bool)
        if rows.any_top_k:
            k = _per_row(rows.top_k, logits)
            kth_index = (k.clamp(min=1, max=logits.shape[-1]) - 1).expand(*logits.shape[:-1], 1)
            kth = sorted_vals.gather(-1, kth_index)  # (B, ..., 1) value of the k-th largest
            remove_sorted |= (sorted_vals < kth) & (k > 0)
        if rows.any_top_p:
            probs_sorted = torch.softmax(sorted_vals.masked_fill(remove_sorted, float("-inf")), dim=-1)
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            top_p = _per_row(rows.top_p, logits)
            remove_sorted |= (mass_before >= top_p) & (top_p < 1.0)  # top_p = 1 never cuts (rounding)
            remove_sorted[..., 0].fill_(
                False
            )  # (no host scalar copied: capturable) the most likely token stays even if top_p rounds to 0 in float32
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


def filtered_probs(
    logits: Tensor,  # (B, ..., V) any float dtype
    rows: RowSampling,
) -> Tensor:  # (B, ..., V) float32, each distribution sums to 1
    """The distribution each row samples from: temperature, then top-k, then top-p, renormalised."""
    logits = logits.float()
    probs = torch.softmax(_filtered_scaled(logits, rows), dim=-1)
    if rows.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(_per_row(rows.greedy, probs), one_hot, probs)
    return probs


def sample_from(
    weights: Tensor,  # (N, V) non-negative, not necessarily normalised; each row has mass > 0
    uniforms: Tensor,  # (N,) in [0, 1)
) -> Tensor:  # (N,) int64
    """Inverse-CDF sampling: the first token whose cumulative weight exceeds u * total.

    A token of weight 0 is never chosen (its cumulative weight equals its predecessor's).
    """
    cdf = weights.cumsum(dim=-1)  # (N, V)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype) * total, right=True)[:, 0]
    # u * total can round up to total; fall back to the last token with positive weight.
    last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(idx, last_positive)


@dataclass(kw_only=True, slots=True)
class Acceptance:
    """Outcome of rejection sampling for a batch of rows."""

    num_accepted: Tensor
    """(B,) int64: leading draft tokens accepted, 0..num_draft[b]."""
    next_token: Tensor
    """(B,) int64: the token emitted after the accepted drafts (residual sample or bonus)."""


def rejection_sample(
    draft_tokens: Tensor,  # (B, K) proposed ids (columns >= num_draft[b] are padding)
    q: Tensor,  # (B, K, V) the draft distributions the drafts were sampled from
    p: Tensor,  # (B, K+1, V) the target distributions (same filtering as q)
    num_draft: Tensor,  # (B,) int64 valid drafts per row, <= K
    accept_uniforms: Tensor,  # (B, K) in [0, 1)
    final_uniforms: Tensor,  # (B,) in [0, 1)
) -> Acceptance:
    """Exact speculative sampling: accept d_i w.p. min(1, p_i(d_i)/q_i(d_i)), then residual or bonus."""
    b, k = draft_tokens.shape
    rows = torch.arange(b, device=p.device)
    if k:
        idx = draft_tokens.unsqueeze(-1)
        p_draft = p[:, :k].gather(-1, idx).squeeze(-1)  # (B, K)
        q_draft = q.gather(-1, idx).squeeze(-1)  # (B, K)
        # u < p/q without dividing (q_draft > 0: the draft was sampled from q)
        ok = accept_uniforms * q_draft < p_draft
        ok &= torch.arange(k, device=p.device)[None, :] < num_draft[:, None]
        num_accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)  # (B,)
    else:
        num_accepted = torch.zeros(b, dtype=torch.int64, device=p.device)
    p_at = p[rows, num_accepted]  # (B, V) target distribution at the first non-accepted slot
    rejected = num_accepted < num_draft
    if k:  # no host read of `rejected`: rows with nothing rejected take p_at below
        q_at = q[rows, num_accepted.clamp(max=k - 1)]
        residual = (p_at - q_at).clamp(min=0.0)
        # An all-zero residual (p == q up to rounding) cannot follow a real rejection; use p.
        degenerate = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(degenerate, p_at, residual)
        weights = torch.where(rejected[:, None], residual, p_at)
    else:
        weights = p_at
    return Acceptance(num_accepted=num_accepted, next_token=sample_from(weights, final_uniforms))


def token_logprobs(
    logits: Tensor,  # (B, S, V) target logits
    tokens: Tensor,  # (B, S) ids whose log-prob is wanted
    temperature: Tensor,  # (B,) float32, 1.0 for greedy rows
) -> Tensor:  # (B, S) float32
    """log_softmax(logits / T)[token] in float32, before top-k/top-p (the reported log-prob)."""
    scaled = logits.float() / _per_row(temperature, logits)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def reported_logprobs(
    logits: Tensor,  # (B, S, V) target logits
    tokens: Tensor,  # (B, S) emitted ids
    rows: RowSampling,
) -> Tensor:  # (B, S) float32
    """The log-probs samples report, per row's LogprobMode.

    RAW rows: `token_logprobs` (before top-k/top-p). PROCESSED rows: the log-prob under the
    distribution actually sampled from, log_softmax of the filtered logits (vLLM's
    processed_logprobs); on greedy rows that distribution is one-hot, so the emitted argmax
    gets 0.
    """
    raw = token_logprobs(logits, tokens, rows.temperature)
    if not rows.any_processed:
        return raw
    processed = torch.log_softmax(_filtered_scaled(logits, rows), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if rows.any_greedy:
        is_argmax = logits.argmax(dim=-1) == tokens
        one_hot = torch.where(is_argmax, 0.0, float("-inf"))
        processed = torch.where(_per_row(rows.greedy, processed), one_hot, processed)
    return torch.where(_per_row(rows.processed, processed), processed, raw)


class AcceptanceRule(Protocol):
    """The signature of `sampling.rejection_sample` (see its docstring for the shapes)."""

    def __call__(
        self,
        draft_tokens: Tensor,  # (B, K)
        q: Tensor,  # (B, K, V)
        p: Tensor,  # (B, K+1, V)
        num_draft: Tensor,  # (B,)
        accept_uniforms: Tensor,  # (B, K)
        final_uniforms: Tensor,  # (B,)
    ) -> Acceptance: ...
