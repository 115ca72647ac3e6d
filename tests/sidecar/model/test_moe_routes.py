"""The routes a forward records (`moe.recording_routes`) against transformers' own routers (issue 58).

Oracle: the router modules of transformers' `Qwen3MoeForCausalLM` and `Glm4MoeForCausalLM` on the
checkpoints their `save_pretrained` writes (`test_moe_models`, `test_glm_moe`), hooked in the same
sequence's forward: every sparse layer's experts for every token equal, as sets (a token's k
choices are unordered); a choice may differ only where two router scores tie within float32
rounding, so such near-ties are counted and reported, and the test requires none here. Packed as
uint8 (experts <= 256). What the engine's rounds will return per sample (routes from the verify
pass of the accepted tokens) waits for the round code (`engine-round`); the records here are what
they are made of.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.model.kv_cache import KVCache
from sidecar.model.moe import SparseMoE, recording_routes, sequence_routes
from tests.sidecar.model.test_glm_moe import VARIANTS as GLM_VARIANTS
from tests.sidecar.model.test_glm_moe import add_native_mtp_layer, hf_glm
from tests.sidecar.model.test_moe_models import VARIANTS as QWEN_VARIANTS
from tests.sidecar.model.test_moe_models import hf_qwen3_moe, loaded, moe_target

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def hf_routes(hf: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each sparse layer's (tokens, k) expert ids from transformers' router modules, in layer order."""
    seen: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(lambda _m, _a, out: seen.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def near_ties(hf: Any, ids: torch.Tensor, eps: float = 1e-6) -> int:
    """Tokens whose k-th and (k+1)-th router scores lie within `eps` (where rounding may pick either)."""
    scores: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(lambda _m, _a, out: scores.append(out[0])) for g in gates]
    with torch.no_grad():
        hf(ids)
    for h in handles:
        h.remove()
    k = gates[0].top_k
    return sum(int((s.float().topk(k + 1, -1).values.diff(dim=-1)[:, -1].abs() < eps).sum()) for s in scores)


def compare(ours: torch.Tensor, theirs: list[torch.Tensor]) -> int:
    """Tokens whose expert sets differ, over every sparse layer."""
    assert ours.shape[0] == len(theirs)
    flat = ours.reshape(ours.shape[0], -1, ours.shape[-1]).long()
    return sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum()) for a, b in zip(flat, theirs, strict=True))


@pytest.mark.parametrize("variant", list(QWEN_VARIANTS))
def test_qwen3_moe_routes_are_transformers_routes(tmp_path: Path, variant: str) -> None:
    hf, path = hf_qwen3_moe(tmp_path, **QWEN_VARIANTS[variant])
    model = loaded(path)
    ids = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        routes = sequence_routes(model.model, lambda: model(ids), *ids.shape)
    sparse = sum(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    assert routes.shape == (sparse, 3, 40, 2) and routes.dtype == torch.uint8
    assert near_ties(hf, ids) == 0
    assert compare(routes, hf_routes(hf, ids)) == 0


@pytest.mark.parametrize("variant", list(GLM_VARIANTS))
def test_glm_routes_are_transformers_routes_and_the_draft_records_none(tmp_path: Path, variant: str) -> None:
    hf = hf_glm(tmp_path, **GLM_VARIANTS[variant])
    add_native_mtp_layer(tmp_path)
    model = loaded(tmp_path)
    ids = torch.randint(0, 96, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), recording_routes(model.model) as routes:
        h = model.hidden_states(ids)
        model.mtp_logits(ids, h)  # the draft's own MoE layer runs too: not the trunk's routes
    assert len(routes) == 2  # the two sparse trunk layers (the first is dense), nothing from the draft
    assert near_ties(hf, ids) == 0
    assert compare(torch.stack([r.view(2, 33, -1) for r in routes]), hf_routes(hf, ids)) == 0


def test_a_wrong_route_is_caught() -> None:
    """The comparison can fail: one token's expert changed."""
    theirs = [torch.tensor([[0, 1], [2, 3]])]
    ours = torch.tensor([[[[1, 0], [2, 3]]]], dtype=torch.uint8)
    assert compare(ours, theirs) == 0
    ours[0, 0, 1, 0] = 5
    assert compare(ours, theirs) == 1


@settings(max_examples=12, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=1, max_size=5), seed=st.integers(0, 99)
)
def test_routes_of_a_ragged_cached_batch_are_each_rows_own(steps: list[list[int]], seed: int) -> None:
    """Rows of different lengths extended together through the KV cache (what the engine's rounds
    run): each row's recorded routes are those of its own sequence in the plain forward, never a
    neighbour's, and padding columns are not a row's."""
    model = moe_target()
    gen = torch.Generator().manual_seed(seed)
    rows = 3
    cache = KVCache(
        num_layers=model.config.num_hidden_layers,
        num_kv_heads=model.config.num_key_value_heads,
        head_dim=model.config.head_dim,
        dtype=model.config.dtype,
        device="cpu",
        batch=rows,
        capacity=4,
    )
    seqs: list[list[int]] = [[] for _ in range(rows)]
    got: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # per row: (sparse layers, k) per token
    for counts in [[1, 3, 2], *steps]:
        chunks = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in counts]
        width = max(max(counts), 1)
        ids = torch.tensor([c + [0] * (width - len(c)) for c in chunks])
        plan = cache.plan(counts, width=width)
        with torch.no_grad(), recording_routes(model.model) as routes:
            model.trunk_step(ids, cache, plan)
        cache.commit(plan)
        stacked = torch.stack([r.view(rows, width, -1) for r in routes])  # (layers, rows, width, k)
        for b, c in enumerate(chunks):
            seqs[b] += c
            got[b] += [stacked[:, b, j] for j in range(len(c))]
    mismatches = 0
    for b, seq in enumerate(seqs):
        ids = torch.tensor([seq])
        with torch.no_grad():
            alone = sequence_routes(model.model, lambda ids=ids: model(ids), 1, len(seq))[:, 0]  # (layers, T, k)
        ours = torch.stack(got[b], dim=1)  # (layers, T, k)
        mismatches += int((ours.long().sort(-1).values != alone.long().sort(-1).values).any(-1).sum())
    assert mismatches == 0
