"""Temperature 0: speculative decoding must reproduce plain greedy decoding token for token.

Oracle: a naive greedy loop over the plain full forward (no KV cache, no engine), plus the
engine's own plain path (k = 0). Both an aligned draft (high acceptance, exercises long
accepted runs and bonus tokens) and a random draft (mostly rejections, exercises rollback)
are checked, batched (ragged prompts in one batch) and unbatched.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import ModelConfig, Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.engine_fixtures import aligned_draft_model

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [40, 41]]
NEW = 24


def naive_greedy(model: Qwen3WithMTP, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def run(engine: TorchEngine, prompts: list[list[int]], k: int) -> list[list[int]]:
    """Submit every prompt as its own request, all at once (one batch), and collect outputs."""
    reqs = [
        GenerationRequest(
            prompts=[p],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW),
            speculation_k=k,
            request_id=f"r{i}",
        )
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.submit(r)
    out: dict[str, list[int]] = {}
    for _ in range(10 * NEW):
        for s in engine.step():
            out[s.request_id] = s.token_ids
        if not engine.has_work():
            break
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def oracles(random_model: Qwen3WithMTP, aligned_model: Qwen3WithMTP) -> dict[str, list[list[int]]]:
    return {
        "random": [naive_greedy(random_model, p, NEW) for p in PROMPTS],
        "aligned": [naive_greedy(aligned_model, p, NEW) for p in PROMPTS],
    }


@pytest.mark.parametrize("draft", ["random", "aligned"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_greedy_speculation_equals_plain_decoding(request, oracles, draft: str, k: int) -> None:
    model = request.getfixturevalue(f"{draft}_model")
    batched = TorchEngine(model, speculation_k=3)
    assert run(batched, PROMPTS, k) == oracles[draft]
    counters = batched.stats()[0].counters
    assert counters.generated_tokens == len(PROMPTS) * NEW
    if k and draft == "aligned":  # the aligned draft really is aligned: most drafts accepted
        assert counters.acceptance_rate > 0.8, counters
    if k and draft == "random":  # and the random one really is not: rollback is exercised
        assert counters.acceptance_rate < 0.3, counters
    for i, p in enumerate(PROMPTS[:2]):  # unbatched
        assert run(TorchEngine(model), [p], k) == [oracles[draft][i]]


def test_mixed_k_and_multiple_mtp_layers_stay_lossless() -> None:
    """Rows with different k in one batch, and a model with two MTP layers (chain uses both)."""
    config = ModelConfig.tiny(num_nextn_predict_layers=2)
    model = aligned_draft_model(config, seed=5)
    engine = TorchEngine(model, speculation_k=3)
    expected = [naive_greedy(model, p, NEW) for p in PROMPTS]
    reqs = [
        GenerationRequest(prompts=[p], sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW), speculation_k=k)
        for p, k in zip(PROMPTS, [0, 1, 4, 7], strict=True)
    ]
    for i, r in enumerate(reqs):
        r.request_id = f"r{i}"
        engine.submit(r)
    out = {}
    for _ in range(10 * NEW):
        out.update({s.request_id: s.token_ids for s in engine.step()})
        if not engine.has_work():
            break
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert engine.stats()[0].counters.acceptance_rate > 0.8


def test_stop_tokens_and_max_new_tokens_cut_accepted_runs() -> None:
    model = aligned_draft_model(ModelConfig.tiny(), seed=2)
    full = naive_greedy(model, PROMPTS[0], NEW)
    stop = full[5]
    cut = full[: full.index(stop) + 1]
    engine = TorchEngine(model, speculation_k=5)
    req = GenerationRequest(
        prompts=[PROMPTS[0]], sampling=SamplingParams(temperature=0.0, max_new_tokens=NEW, stop_token_ids=(stop,))
    )
    (s,) = engine.generate(req)
    assert s.token_ids == cut and s.finish_reason.value == "stop"
    for n in (1, 2, 7):
        req = GenerationRequest(prompts=[PROMPTS[0]], sampling=SamplingParams(temperature=0.0, max_new_tokens=n))
        (s,) = engine.generate(req)
        assert s.token_ids == full[:n] and s.finish_reason.value == "length"
