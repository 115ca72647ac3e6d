"""The round's forwards captured as CUDA graphs (compile="on" on a CUDA device) against oracles.

Runs only where CUDA is (`pytest -m gpu`): CI has no GPU, and tests the same fixed-shape code
eagerly on its CPU (tests/sidecar/engine/test_fixed_shape_forwards.py). Oracles: the plain full forward
decoding one token at a time (greedy), the same engine eager (compile="off": sampled tokens and
log-probs), a request run alone (rows joining and leaving a running batch), and the plain forward
of the pushed weights after a weight push — copying (the graphs read the same storages) and
adopting (new storages: the graphs must be recaptured, never replayed over the old weights).
"""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.eagle3 import build_eagle3
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector
from tests.sidecar.engine.test_static_engine import oracle_greedy
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [4, 4]]
NEW = 14


def on_cuda(model: Qwen3WithMTP) -> Qwen3WithMTP:
    cuda = build_model(model.config, device="cuda")
    cuda.load_state_dict(model_state_dict(model))
    return cuda


@pytest.fixture(scope="module")
def aligned() -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(), seed=2)


def generate(engine: TorchEngine, k: int, temperature: float = 0.0) -> list[tuple[list[int], list[float]]]:
    req = GenerationRequest(
        prompts=PROMPTS,
        sampling=SamplingParams(temperature=temperature, max_new_tokens=NEW, seed=7),
        speculation_k=k,
        samples_per_prompt=2 if temperature else 1,
    )
    return [(s.token_ids, s.logprobs) for s in engine.generate(req)]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_captured_greedy_equals_eager_and_the_plain_forward(aligned: Qwen3WithMTP, k: int) -> None:
    model = on_cuda(aligned)
    graphs = TorchEngine(model, speculation_k=k, compile="on")
    got = generate(graphs, k)
    captured = graphs._rounds.captured
    assert captured > 0  # the rounds ran as graphs
    assert [t for t, _ in got] == [t for t, _ in generate(TorchEngine(model, compile="off"), k)]
    assert [t for t, _ in got] == [oracle_greedy(aligned, p, NEW) for p in PROMPTS]
    again = generate(graphs, k)
    assert again == got and graphs._rounds.captured == captured  # the same shapes replay, nothing recaptured


@pytest.mark.parametrize("k", [0, 3])
def test_captured_sampling_equals_eager(aligned: Qwen3WithMTP, k: int) -> None:
    model = on_cuda(aligned)
    graphs = generate(TorchEngine(model, compile="on"), k, temperature=1.0)
    eager = generate(TorchEngine(model, compile="off"), k, temperature=1.0)
    assert [t for t, _ in graphs] == [t for t, _ in eager]
    for (_, a), (_, b) in zip(graphs, eager, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_rows_joining_a_captured_batch_decode_as_alone(aligned: Qwen3WithMTP) -> None:
    model = on_cuda(aligned)
    engine = TorchEngine(model, speculation_k=3, compile="on")
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    engine.submit(GenerationRequest(prompts=PROMPTS[:2], sampling=sp, speculation_k=3, request_id="a"))
    out = engine.step() + engine.step()
    engine.submit(GenerationRequest(prompts=PROMPTS[2:], sampling=sp, speculation_k=1, request_id="b"))
    while engine.has_work():
        out += engine.step()
    got = {(s.request_id, s.prompt_index): s.token_ids for s in out}
    want = {("a", i): oracle_greedy(aligned, p, NEW) for i, p in enumerate(PROMPTS[:2])}
    want |= {("b", i): oracle_greedy(aligned, p, NEW) for i, p in enumerate(PROMPTS[2:])}
    assert got == want


@pytest.mark.parametrize("adopt", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_push_then_generate_on_captured_graphs_equals_the_pushed_oracle(adopt: bool, k: int) -> None:
    old, new = build_model(ModelConfig.tiny(), seed=31), build_model(ModelConfig.tiny(), seed=32)
    engine = TorchEngine(on_cuda(old), speculation_k=k, compile="on")
    before = generate(engine, k)
    captured = engine.runner.rounds.captured
    tensors = {n: t.to("cuda").clone() for n, t in model_state_dict(new).items()}
    if adopt:
        engine.adopt_weights(tensors, WeightSelector.ALL, version=1)
    else:
        engine.update_weights(tensors, WeightSelector.ALL, version=1)
    after = [t for t, _ in generate(engine, k)]
    assert after == [oracle_greedy(new, p, NEW) for p in PROMPTS]
    assert after != [t for t, _ in before]
    if adopt:  # new storages: every graph was dropped and captured again
        assert engine.runner.rounds.captured > captured
    else:  # copied into the storages the graphs read: replayed, nothing captured again
        assert engine.runner.rounds.captured == captured


def test_captured_rounds_with_an_eagle3_draft_equal_the_plain_forward() -> None:
    target = eagle3_target()
    draft = aligned_eagle3(target)
    cuda_draft = build_eagle3(draft.config, device="cuda")
    cuda_draft.load_state_dict(draft.state_dict())
    engine = TorchEngine(on_cuda(target), speculation_k=3, draft=cuda_draft, compile="on")
    got = [t for t, _ in generate(engine, 3)]
    assert engine.runner.rounds.captured > 0 and engine.stats()[-1].counters.acceptance_rate > 0.5
    assert got == [oracle_greedy(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("adopt", [False, True])
def test_captured_rounds_with_a_reduced_draft_vocabulary_follow_its_changes(
    aligned: Qwen3WithMTP, adopt: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`draft_vocab_size`: the subset is re-chosen every few tokens and the output weight pushed, so
    captured graphs replay over ids and rows that changed in place. A graph reading a stale subset
    would still decode greedily right (the target decides) but draft differently: so sampled tokens,
    log-probs and acceptance must equal the eager engine's, which sees the same tokens, and greedy
    the plain forward's of the pushed weights."""
    from sidecar.engine import draft_vocab

    monkeypatch.setattr(draft_vocab, "RECHOOSE_TOKENS", 16)
    pushed = {n: t.to("cuda") for n, t in model_state_dict(aligned_draft_model(ModelConfig.tiny(), seed=3)).items()}
    engines = {
        mode: TorchEngine(on_cuda(aligned), speculation_k=3, compile=mode, draft_vocab_size=24)
        for mode in ("on", "off")
    }
    outputs = {}
    for mode, engine in engines.items():
        got = [generate(engine, 3, temperature=1.0)]
        if adopt:
            engine.adopt_weights({n: t.clone() for n, t in pushed.items()}, WeightSelector.ALL, version=1)
        else:
            engine.update_weights({n: t.clone() for n, t in pushed.items()}, WeightSelector.ALL, version=1)
        got += [generate(engine, 3, temperature=1.0), generate(engine, 3)]
        counters = [(c.weight_version, c.counters.accepted_tokens, c.counters.verify_steps) for c in engine.stats()]
        outputs[mode] = (got, counters)
    graphs, eager = outputs["on"], outputs["off"]
    assert engines["on"]._rounds.captured > 0 and engines["on"].drafter.vocab.chosen >= 4
    assert graphs[1] == eager[1]  # the same acceptance, version by version
    for g, e in zip(graphs[0], eager[0], strict=True):
        assert [t for t, _ in g] == [t for t, _ in e]
        for (_, a), (_, b) in zip(g, e, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    new = aligned_draft_model(ModelConfig.tiny(), seed=3)
    assert [t for t, _ in graphs[0][2]] == [oracle_greedy(new, p, NEW) for p in PROMPTS]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_graphs_on_a_second_device_equal_the_plain_forward(aligned: Qwen3WithMTP) -> None:
    """A sidecar serving cuda:1 while cuda:0 is the current device captures on cuda:1's streams."""
    model = build_model(aligned.config, device="cuda:1")
    model.load_state_dict(model_state_dict(aligned))
    engine = TorchEngine(model, speculation_k=3, compile="on")
    assert [t for t, _ in generate(engine, 3)] == [oracle_greedy(aligned, p, NEW) for p in PROMPTS]
