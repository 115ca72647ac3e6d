"""The draft phase's MTP refresh over a window of pending positions (automatic k resumes drafting
after plain rounds by refreshing only the latest positions, leaving a gap in the MTP cache).

Oracle: the MTP layer run without a cache (`mtp(x, cos, sin)`, causal over the sequence order)
over exactly the positions the cached layer has seen, each at its rotary position t + 1; with no
gap that is `Qwen3WithMTP.mtp_logits` over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.attention_lengths import HostLengths
from sidecar.engine.drafters import Drafter
from sidecar.engine.sampling import RowSampling
from sidecar.engine.speculative import DraftInput, draft
from sidecar.model.kv_cache import KVCache
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import SamplingParams

N = 20  # tokens x_0 .. x_{N-1}; the draft predicts x_N


def mtp_cache(model: Qwen3WithMTP) -> KVCache:
    c = model.config
    return KVCache(
        num_layers=1,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
        device="cpu",
        batch=1,
        capacity=64,
    )


def oracle_q1(model: Qwen3WithMTP, ids: torch.Tensor, hidden: torch.Tensor, seen: list[int]) -> torch.Tensor:
    """Draft distribution of x_N from an MTP layer that has seen MTP positions `seen` (ascending)."""
    t = torch.tensor(seen)
    mtp = model.mtp_layer(0)
    cos, sin = model.rope((t + 1)[None])
    x = mtp.combine(model.model.embed_tokens(ids[:, t + 1]), hidden[:, t])
    out = mtp(x, cos, sin)[:, -1]
    return torch.softmax(model.mtp_head(0, out).float(), dim=-1)[0]


@pytest.mark.parametrize(("cached", "window"), [(16, 3), (5, 3), (0, 1), (10, 9)])
@torch.inference_mode()
def test_refresh_over_a_window_attends_to_what_the_cache_holds_at_the_true_positions(cached: int, window: int) -> None:
    model = build_model(ModelConfig.tiny(), seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, N), generator=torch.Generator().manual_seed(1))
    hidden = model.hidden_states(ids)  # h_t for t = 0 .. N-1; the engine knows them up to N-2
    cache = mtp_cache(model)
    if cached:  # MTP positions 0 .. cached-1 (as the admission prefill writes them)
        plan = cache.plan([cached], width=cached)
        model.mtp_step(0, ids[:, 1 : cached + 1], hidden[:, :cached], cache, plan)
        cache.commit(plan)
    pending = list(range(N - 1 - window, N - 1))  # the latest `window` positions, ending at N-2
    assert pending[0] >= cached
    t = torch.tensor(pending)
    rows = RowSampling.of([SamplingParams(temperature=1.0)])
    out = draft(
        Drafter(model),
        [cache],
        DraftInput(
            refresh_tokens=ids[:, t + 1],
            refresh_hidden=hidden[:, t],
            num_refresh=torch.tensor([window]),
            refresh_positions=t[None],
            next_position=torch.tensor([N - 1]),
            num_draft=torch.tensor([1]),
            uniforms=torch.full((1, 1), 0.5),
        ),
        rows,
        HostLengths(num_refresh=[window], num_new=[]),
    )
    expected = oracle_q1(model, ids, hidden, list(range(cached)) + pending)
    torch.testing.assert_close(out.probs[0, 0], expected, atol=1e-5, rtol=1e-4)
    if cached + window == N - 1:  # no gap: the plain no-cache MTP forward over the whole sequence
        full = torch.softmax(model.mtp_logits(ids, hidden)[0, -1].float(), dim=-1)
        torch.testing.assert_close(out.probs[0, 0], full, atol=1e-5, rtol=1e-4)
    assert cache.lengths == [cached + window]  # the refresh stays cached, the chain does not
