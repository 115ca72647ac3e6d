"""TorchEngine behaviour: reported log-probs, batch independence, continuous batching, counters,
weight updates (all-or-nothing) and bad input. Oracles: the plain full forward, the engine run
alone (unbatched), a freshly built engine on the new weights.

A push is swapped in by `sidecar/engine/served_weights.py`; bad requests are refused by `sidecar/engine/validation.py`.
"""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.errors import InvalidRequestError, StaleVersionError, UnknownTensorError, WeightMismatchError
from sidecar.model.checkpoint import model_state_dict
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import FinishReason, GenerationRequest, Sample, SamplingParams, WeightSelector

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [40, 41]]


def full_forward_logprobs(model: Qwen3WithMTP, prompt: list[int], out: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1].float()
    t = temperature or 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def run_together(engine: TorchEngine, requests: list[GenerationRequest]) -> dict[str, list[Sample]]:
    for r in requests:
        engine.submit(r)
    out: dict[str, list[Sample]] = {r.request_id: [] for r in requests}
    for _ in range(1000):
        for s in engine.step():
            out[s.request_id].append(s)
        if not engine.has_work():
            break
    return {k: sorted(v, key=lambda s: (s.prompt_index, s.sample_index)) for k, v in out.items()}


def requests(k: int | None = 3) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompts=[PROMPTS[0], PROMPTS[1]],
            sampling=SamplingParams(temperature=1.0, max_new_tokens=20, seed=7),
            samples_per_prompt=2,
            request_id="a",
            speculation_k=k,
        ),
        GenerationRequest(
            prompts=[PROMPTS[2]],
            sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=15, seed=8),
            request_id="b",
            speculation_k=k,
        ),
        GenerationRequest(
            prompts=[PROMPTS[3]],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=12),
            request_id="c",
            speculation_k=k,
        ),
    ]


@pytest.mark.parametrize("k", [0, 2, 5])
def test_logprobs_equal_a_fresh_full_forward(random_model: Qwen3WithMTP, aligned_model: Qwen3WithMTP, k: int) -> None:
    for model in (random_model, aligned_model):
        results = run_together(TorchEngine(model, speculation_k=k), requests(k))
        for req in requests(k):
            for s in results[req.request_id]:
                prompt = req.prompts[s.prompt_index]
                expected = full_forward_logprobs(model, prompt, s.token_ids, req.sampling.temperature)
                torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [0, 3])
def test_batched_results_equal_unbatched(aligned_model: Qwen3WithMTP, k: int) -> None:
    together = run_together(TorchEngine(aligned_model, max_batch_size=3), requests(k))  # queueing too
    for req in requests(k):
        (alone,) = run_together(TorchEngine(aligned_model), [req]).values()
        assert [s.token_ids for s in alone] == [s.token_ids for s in together[req.request_id]]
        for x, y in zip(alone, together[req.request_id], strict=True):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    # the same seed reproduces; the samples of one prompt differ from each other
    a = together["a"]
    assert a[0].token_ids != a[1].token_ids


def test_counters_are_raw_and_consistent(aligned_model: Qwen3WithMTP) -> None:
    engine = TorchEngine(aligned_model, speculation_k=3)
    results = run_together(engine, requests())
    samples = [s for v in results.values() for s in v]
    (stats,) = engine.stats()
    c = stats.counters
    assert stats.samples_finished == len(samples) == 6
    assert c.generated_tokens == sum(len(s.token_ids) for s in samples)
    assert c.verify_steps == sum(s.counters.verify_steps for s in samples)
    assert c.accepted_tokens == sum(c.accepted_per_position) <= c.drafted_tokens == sum(c.drafted_per_position)
    assert c.accepted_per_position == sorted(c.accepted_per_position, reverse=True)  # a prefix is accepted
    assert c.acceptance_length > 1.5 and stats.busy_seconds > 0
    for s in samples:  # every token is either accepted or the one emitted per verify step
        assert s.counters.generated_tokens == len(s.token_ids)
        assert s.counters.accepted_tokens + s.counters.verify_steps >= len(s.token_ids)
    plain = TorchEngine(aligned_model, speculation_k=0)
    run_together(plain, requests(None))
    assert plain.stats()[0].counters.acceptance_length == 1.0 and plain.stats()[0].counters.drafted_tokens == 0


def test_abort_returns_partial_samples_and_leaves_others_running(random_model: Qwen3WithMTP) -> None:
    engine = TorchEngine(random_model, max_batch_size=2)
    for r in requests():
        engine.submit(r)
    engine.step()
    engine.step()
    aborted = engine.abort("a")
    assert len(aborted) == 4 and all(s.finish_reason is FinishReason.ABORT for s in aborted)
    assert any(s.token_ids for s in aborted) and engine.abort("a") == [] and engine.abort("nope") == []
    rest = {s.request_id for _ in range(100) for s in engine.step()}
    assert rest == {"b", "c"} and not engine.has_work()


def fresh(seed: int = 21) -> Qwen3WithMTP:
    return build_model(ModelConfig.tiny(), seed=seed)


def greedy(engine: TorchEngine, k: int = 3) -> list[list[int]]:
    req = GenerationRequest(
        prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=10), speculation_k=k
    )
    return [s.token_ids for s in engine.generate(req)]


def test_update_weights_swaps_target_and_draft_and_bumps_the_version() -> None:
    engine, other = TorchEngine(fresh()), fresh(seed=22)
    new = model_state_dict(other)
    assert {s.name for s in engine.weight_specs(WeightSelector.ALL)} == set(new)
    target = {s.name: new[s.name] for s in engine.weight_specs(WeightSelector.TARGET)}
    engine.update_weights(target, WeightSelector.TARGET, version=1)
    draft = {s.name: new[s.name] for s in engine.weight_specs(WeightSelector.DRAFT)}
    engine.update_weights(draft, WeightSelector.DRAFT, version=2)
    assert engine.weight_version == 2 and [v.weight_version for v in engine.stats()] == [0, 1, 2]
    assert greedy(engine) == greedy(TorchEngine(other))
    (s,) = engine.generate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(max_new_tokens=2)))
    assert s.weight_version == s.last_weight_version == 2


def bad_updates(engine: TorchEngine) -> list[tuple[dict, WeightSelector, int, type[Exception], str]]:
    new = model_state_dict(fresh(seed=23))
    target = {s.name: new[s.name] for s in engine.weight_specs(WeightSelector.TARGET)}
    drop = dict(new)
    del drop["model.layers.1.mlp.up_proj.weight"]
    return [
        (new, WeightSelector.ALL, 0, StaleVersionError, "not newer"),
        (
            {**new, "model.layers.7.mlp.up_proj.weight": torch.zeros(1)},
            WeightSelector.ALL,
            1,
            UnknownTensorError,
            "no tensor",
        ),
        (
            {**target, "mtp.layers.0.enorm.weight": torch.ones(64)},
            WeightSelector.TARGET,
            1,
            UnknownTensorError,
            "selector",
        ),
        (drop, WeightSelector.ALL, 1, WeightMismatchError, "lacks 1 tensor"),
        ({**new, "model.norm.weight": torch.ones(65)}, WeightSelector.ALL, 1, WeightMismatchError, "shape"),
        (
            {**new, "lm_head.weight": new["lm_head.weight"].double()},
            WeightSelector.ALL,
            1,
            WeightMismatchError,
            "dtype",
        ),
    ]


def test_failed_updates_change_nothing() -> None:
    engine = TorchEngine(fresh())
    before = greedy(engine)
    params_before = {n: p.clone() for n, p in engine.model.named_parameters()}
    for tensors, selector, version, error, message in bad_updates(engine):
        with pytest.raises(error, match=message):
            engine.update_weights(tensors, selector, version)
        assert engine.weight_version == 0
    assert all(torch.equal(p, params_before[n]) for n, p in engine.model.named_parameters())
    assert greedy(engine) == before


def test_failed_adoptions_change_nothing() -> None:
    engine = TorchEngine(fresh())
    before = greedy(engine)
    storages = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    for tensors, selector, version, error, message in bad_updates(engine):
        with pytest.raises(error, match=message):
            engine.adopt_weights(tensors, selector, version)
        assert engine.weight_version == 0
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == storages
    assert greedy(engine) == before


def test_adopted_tensors_become_the_served_parameters_and_the_displaced_ones_come_back() -> None:
    """The swap takes the staged tensors over (no copy) and hands back what they replaced,
    which nothing serves any more; the model is then exactly the pushed one."""
    engine, other = TorchEngine(fresh()), fresh(seed=22)
    new = {n: t.clone() for n, t in model_state_dict(other).items()}
    old = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    old_ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    free = engine.adopt_weights(new, WeightSelector.ALL, version=1)
    params = dict(engine.model.named_parameters())
    assert all(params[n].data_ptr() == t.data_ptr() for n, t in new.items())
    assert {n: t.data_ptr() for n, t in free.items()} == old_ptrs
    assert all(torch.equal(free[n], old[n]) for n in old)
    assert engine.weight_version == 1 and greedy(engine) == greedy(TorchEngine(other))


def test_a_parameter_that_shares_its_storage_is_copied_into_not_replaced() -> None:
    engine = TorchEngine(fresh())
    name = "model.norm.weight"
    p = dict(engine.model.named_parameters())[name]
    engine.model.register_buffer("alias_of_norm", p.data)  # something else reads that storage
    new = {n: t.clone() for n, t in model_state_dict(fresh(seed=22)).items()}
    free = engine.adopt_weights(new, WeightSelector.ALL, version=1)
    assert p.data_ptr() == engine.model.alias_of_norm.data_ptr() != new[name].data_ptr()
    assert free[name] is new[name] and torch.equal(engine.model.alias_of_norm, new[name])


SMALL = SamplingParams(max_new_tokens=5)
BAD_REQUESTS = [
    (lambda: GenerationRequest(prompts=[[1, 2]]), "prompts", [[]], "prompts\\[0\\] is empty"),
    (lambda: GenerationRequest(prompts=[[1, 2]]), "prompts", [[1, 64]], "outside the vocabulary"),
    (lambda: GenerationRequest(prompts=[[1, 2]]), "prompts", [[-1]], "outside the vocabulary"),
    (lambda: GenerationRequest(prompts=[[1] * 500], sampling=SamplingParams(max_new_tokens=13)), None, None, "context"),
    (lambda: GenerationRequest(prompts=[[1]], sampling=SMALL, speculation_k=9), None, None, "max_speculation_k is 8"),
    (
        lambda: GenerationRequest(prompts=[[1]], sampling=SamplingParams(max_new_tokens=5, stop_token_ids=(99,))),
        None,
        None,
        "stop_token",
    ),
]


@pytest.mark.parametrize("case", range(len(BAD_REQUESTS)))
def test_bad_requests_raise_clear_errors_and_engine_stays_usable(random_model: Qwen3WithMTP, case: int) -> None:
    engine = TorchEngine(random_model)
    expected = greedy(engine)
    make, field, value, message = BAD_REQUESTS[case]
    req = make()
    if field:
        setattr(req, field, value)
    req.request_id = "bad"
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(req)
    assert not engine.has_work()
    assert greedy(engine) == expected


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -1.0, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
        ("max_new_tokens", 0, "max_new_tokens"),
    ],
)
def test_invalid_sampling_values_are_rejected(random_model: Qwen3WithMTP, field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
    engine = TorchEngine(random_model)
    expected = greedy(engine)
    req = GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(max_new_tokens=5), request_id="x")
    setattr(req.sampling, field, value)
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(req)
    assert greedy(engine) == expected


def test_duplicate_request_id_info_and_speculation_k(random_model: Qwen3WithMTP) -> None:
    engine = TorchEngine(random_model, speculation_k=2, max_speculation_k=4)
    engine.submit(GenerationRequest(prompts=[[1]], request_id="dup"))
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.submit(GenerationRequest(prompts=[[1]], request_id="dup"))
    with pytest.raises(InvalidRequestError, match="request_id is empty"):
        engine.submit(GenerationRequest(prompts=[[1]]))
    info = engine.info()
    assert (info.engine, info.speculation_method, info.speculation_k, info.max_speculation_k) == ("torch", "mtp", 2, 4)
    assert info.model.vocab_size == 64 and info.model.num_mtp_layers == 1 and info.device_kind == "cpu"
    engine.set_speculation_k(0)
    assert engine.info().speculation_k == 0
    with pytest.raises(ValueError, match="max_speculation_k is 4"):
        engine.set_speculation_k(5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu_greedy_and_logprobs(random_model: Qwen3WithMTP) -> None:
    cuda_model = build_model(ModelConfig.tiny(), device="cuda")
    cuda_model.load_state_dict(model_state_dict(random_model))
    cpu, gpu = TorchEngine(random_model, speculation_k=3), TorchEngine(cuda_model, speculation_k=3)
    assert gpu.info().device_kind == "cuda"
    req = GenerationRequest(prompts=PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=16))
    a, b = cpu.generate(req), gpu.generate(GenerationRequest(prompts=PROMPTS, sampling=req.sampling))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("k", [1, 3])
def test_a_longer_prompt_joining_running_speculative_rows_decodes_as_alone(aligned_model: Qwen3WithMTP, k: int) -> None:
    """Issue 14 finding 1: a 10-token prompt decoding with speculation, then a 15-token prompt
    admitted two steps later (its prefill cache is larger than the running one, but less than
    double). Both must finish, each with the tokens it gets alone."""
    engine = TorchEngine(aligned_model, speculation_k=k)
    greedy_params = SamplingParams(temperature=0.0, max_new_tokens=20)
    first = GenerationRequest(prompts=[list(range(1, 11))], sampling=greedy_params, request_id="a")
    second = GenerationRequest(prompts=[list(range(1, 16))], sampling=greedy_params, request_id="b")
    engine.submit(first)
    got: dict[str, list[int]] = {}
    for step in range(200):
        if step == 2:
            engine.submit(second)
        got |= {s.request_id: s.token_ids for s in engine.step()}
        if step > 2 and not engine.has_work():
            break
    for req in (first, second):
        (alone,) = TorchEngine(aligned_model, speculation_k=k).generate(
            GenerationRequest(prompts=req.prompts, sampling=greedy_params)
        )
        assert got[req.request_id] == alone.token_ids
