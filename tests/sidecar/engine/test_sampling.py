"""Pure sampling functions against independent oracles: Hugging Face's logits warpers for the
filtered distribution, and closed forms for inverse-CDF and rejection sampling."""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.sampling import RowSampling, filtered_probs, rejection_sample, sample_from, token_logprobs
from sidecar.types import SamplingParams
from tests.sidecar.engine_fixtures import hf_probs

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.6),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=100),  # k beyond the vocabulary: no-op
]


def test_filtered_probs_match_hugging_face_warpers_per_row() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS), 3, 32, generator=gen) * 2  # (B, positions, V)
    ours = filtered_probs(logits, RowSampling.of(PARAMS))
    for b, sp in enumerate(PARAMS):
        torch.testing.assert_close(ours[b], hf_probs(logits[b], sp), atol=1e-6, rtol=0)
    assert torch.allclose(ours.sum(-1), torch.ones(len(PARAMS), 3))


def test_sample_from_matches_the_distribution_and_never_picks_zero_mass() -> None:
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    u = torch.linspace(0, 1, 100_001)[:-1]  # a uniform grid: frequencies are p up to 1e-4
    tokens = sample_from(p.expand(len(u), -1), u)
    freq = torch.bincount(tokens, minlength=6).float() / len(u)
    torch.testing.assert_close(freq, p, atol=1e-4, rtol=0)
    edge = sample_from(p[None], torch.tensor([1.0 - 2**-24]))
    assert int(edge) == 4


def exact_output_distribution(p: torch.Tensor, q: torch.Tensor, residual_from_p: bool = False) -> torch.Tensor:
    """Closed form of one speculative position: P(x) = q(x) min(1, p/q) + (1 - beta) r(x)."""
    accept = torch.minimum(q, p)
    beta = accept.sum()
    r = p if residual_from_p else (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
    return accept + (1 - beta) * r


def test_rejection_sampling_emits_exactly_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    v, n = 6, 400_000
    p = torch.softmax(torch.randn(v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(v, generator=gen) * 1.5, -1)
    # the closed form of the rule equals p, and the "resample from p" mistake does not
    torch.testing.assert_close(exact_output_distribution(p, q), p)
    assert (exact_output_distribution(p, q, residual_from_p=True) - p).abs().max() > 0.01
    draft = sample_from(q.expand(n, v), torch.rand(n, generator=gen))[:, None]  # (n, 1)
    acc = rejection_sample(
        draft,
        q.expand(n, 1, v),
        p.expand(n, 2, v),
        torch.ones(n, dtype=torch.int64),
        torch.rand(n, 1, generator=gen),
        torch.rand(n, generator=gen),
    )
    first = torch.where(acc.num_accepted == 1, draft[:, 0], acc.next_token)
    freq = torch.bincount(first, minlength=v).float() / n
    torch.testing.assert_close(freq, p, atol=4e-3, rtol=0)  # 5 sigma of a 400k-sample frequency
    rate = (acc.num_accepted == 1).float().mean()
    assert abs(float(rate) - float(torch.minimum(p, q).sum())) < 4e-3  # acceptance rate = sum min(p, q)
    bonus = acc.next_token[acc.num_accepted == 1]
    torch.testing.assert_close(torch.bincount(bonus, minlength=v).float() / len(bonus), p, atol=6e-3, rtol=0)


def test_greedy_rows_accept_iff_draft_is_argmax_and_respect_num_draft() -> None:
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]]).expand(3, -1, -1)
    rows = RowSampling.of([SamplingParams(temperature=0.0)] * 3)
    p = filtered_probs(logits, rows)  # argmax per position: 1, 0, 2
    q = filtered_probs(torch.randn(3, 2, 3), rows)
    draft = torch.tensor([[1, 0], [1, 2], [2, 0]])
    # q is one-hot on argmax of random logits; make it one-hot on the drafts as the engine would
    q = torch.nn.functional.one_hot(draft, 3).float()
    u = torch.full((3, 2), 0.999)
    acc = rejection_sample(draft, q, p, torch.tensor([2, 2, 1]), u, torch.full((3,), 0.5))
    assert acc.num_accepted.tolist() == [2, 1, 0]
    assert acc.next_token.tolist() == [2, 0, 1]  # bonus argmax; corrected argmax; corrected argmax


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_token_logprobs_are_log_softmax_over_temperature(temperature: float) -> None:
    logits = torch.randn(2, 4, 10)
    tokens = torch.randint(0, 10, (2, 4))
    rows = RowSampling.of([SamplingParams(temperature=temperature, top_k=2)] * 2)
    t = temperature or 1.0
    expected = torch.log_softmax(logits / t, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens, rows.temperature), expected)
