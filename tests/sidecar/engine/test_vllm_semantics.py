"""The specrl.v1 additions a vLLM-style client needs (issue 18): the model's EOS ids in GetInfo
with `stop_at_eos`, and the selectable log-prob mode. Oracles: plain greedy decoding with the full
forward pass (stop_at_eos), and the log of the distribution actually sampled from
(`filtered_probs`, computed independently of the masked log-softmax the engine reports)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.client.client import SidecarClient
from sidecar.engine.sampling import RowSampling, filtered_probs, reported_logprobs, token_logprobs
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import save_checkpoint
from sidecar.model.model import ModelConfig, build_model
from sidecar.protocol import convert
from sidecar.types import FinishReason, GenerationRequest, LogprobMode, SamplingParams
from tests.sidecar_fixtures import greedy_reference, start_sidecar

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def eos_model(eos: list[int]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig.tiny(max_position_embeddings=256, eos_token_id=eos)
    model = build_model(config, seed=0)
    return config, {n: t.detach().clone() for n, t in model.state_dict().items()}


# --- EOS -----------------------------------------------------------------------------------


def test_config_reads_eos_as_int_or_list_and_rejects_out_of_vocab() -> None:
    base = ModelConfig.tiny().to_hf_dict()
    assert ModelConfig.from_hf_dict(base | {"eos_token_id": 5}).eos_token_id == [5]
    assert ModelConfig.from_hf_dict(base | {"eos_token_id": [5, 9]}).eos_token_id == [5, 9]
    assert ModelConfig.from_hf_dict(base | {"eos_token_id": None}).eos_token_id == []
    with pytest.raises(ValueError, match="eos_token_id"):
        ModelConfig.tiny(eos_token_id=[64])


@settings(max_examples=8, deadline=None)
@given(prompt=st.lists(st.integers(0, 63), min_size=1, max_size=6), cut=st.integers(0, 9), k=st.integers(0, 3))
def test_stop_at_eos_matches_greedy_reference_truncated_at_eos(prompt: list[int], cut: int, k: int) -> None:
    """EOS = the reference's token at position `cut`: with stop_at_eos the sample is the reference
    up to and including its first EOS; without it (the old default) generation runs on."""
    _, plain_state = eos_model([])
    reference = greedy_reference(plain_state, prompt, 10)
    eos = reference[cut]
    config, state = eos_model([eos])
    model = build_model(config)
    model.load_state_dict(state)
    engine = TorchEngine(model, speculation_k=k)
    stop = engine.generate(
        GenerationRequest(
            prompts=[prompt], sampling=SamplingParams(temperature=0.0, max_new_tokens=10, stop_at_eos=True)
        )
    )[0]
    assert stop.token_ids == reference[: reference.index(eos) + 1]
    assert stop.finish_reason is FinishReason.STOP
    run_on = engine.generate(
        GenerationRequest(prompts=[prompt], sampling=SamplingParams(temperature=0.0, max_new_tokens=10))
    )[0]
    assert run_on.token_ids == reference
    assert run_on.finish_reason is FinishReason.LENGTH


def test_get_info_publishes_eos_and_stop_at_eos_crosses_the_wire(tmp_path: Path) -> None:
    config, state = eos_model([7, 9])
    save_checkpoint(tmp_path / "ckpt", config, state)
    sidecar = start_sidecar(tmp_path / "ckpt", speculation_k=2)
    try:
        with SidecarClient(sidecar.address) as client:
            assert client.info().engine.model.eos_token_ids == (7, 9)
            samples = client.generate(
                GenerationRequest(
                    prompts=[[1, 2, 3]],
                    samples_per_prompt=16,
                    sampling=SamplingParams(temperature=1.5, max_new_tokens=40, stop_at_eos=True, seed=3),
                )
            )
    finally:
        sidecar.stop()
    for s in samples:
        eos_at = [i for i, t in enumerate(s.token_ids) if t in (7, 9)]
        if s.finish_reason is FinishReason.STOP:
            assert eos_at == [len(s.token_ids) - 1]
        else:
            assert eos_at == [] and len(s.token_ids) == 40
    assert any(s.finish_reason is FinishReason.STOP for s in samples)


# --- log-prob mode ---------------------------------------------------------------------------


def test_logprob_mode_round_trips_and_defaults_to_raw() -> None:
    for mode in LogprobMode:
        sp = SamplingParams(logprob_mode=mode, stop_at_eos=True)
        assert convert.sampling_from_pb(convert.sampling_to_pb(sp)) == sp
    from sidecar.protocol.specrl.v1 import rollout_pb2

    assert convert.sampling_from_pb(rollout_pb2.SamplingParams(max_new_tokens=1)).logprob_mode is LogprobMode.RAW


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3]),
    processed=st.booleans(),
)
def test_reported_logprobs_follow_the_row_mode(
    seed: int, temperature: float, top_k: int, top_p: float, processed: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 16, generator=gen) * 3
    tokens = torch.randint(0, 16, (2, 3), generator=gen)
    mode = LogprobMode.PROCESSED if processed else LogprobMode.RAW
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, logprob_mode=mode), SamplingParams()]
    rows = RowSampling.of(params)
    # Row 1 is always RAW with default sampling: untouched by row 0's mode.
    raw = token_logprobs(logits, tokens, rows.temperature)
    got = reported_logprobs(logits, tokens, rows)
    torch.testing.assert_close(got[1], raw[1])
    if not processed:
        torch.testing.assert_close(got[0], raw[0])
        return
    # Oracle: the log of the distribution the row samples from.
    sampled = filtered_probs(logits, rows)[0].gather(-1, tokens[0].unsqueeze(-1)).squeeze(-1)
    want = torch.log(sampled)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got[0]), finite)
    torch.testing.assert_close(got[0][finite], want[finite], atol=1e-5, rtol=1e-5)
    if temperature > 0 and top_k == 0 and top_p == 1.0:
        torch.testing.assert_close(got[0], raw[0])  # nothing filtered: the modes agree


def test_engine_mode_changes_reported_logprobs_never_tokens() -> None:
    config = ModelConfig.tiny(max_position_embeddings=256)
    model = build_model(config, seed=1)
    engine = TorchEngine(model, speculation_k=2)

    def run(mode: LogprobMode, top_k: int) -> list:
        sp = SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=12, seed=11, logprob_mode=mode)
        out = engine.generate(GenerationRequest(prompts=[[1, 2, 3], [4, 5]], samples_per_prompt=3, sampling=sp))
        return sorted(out, key=lambda s: (s.prompt_index, s.sample_index))

    for top_k in (0, 5):
        raw, processed = run(LogprobMode.RAW, top_k), run(LogprobMode.PROCESSED, top_k)
        for a, b in zip(raw, processed, strict=True):
            assert a.token_ids == b.token_ids
            la, lb = torch.tensor(a.logprobs), torch.tensor(b.logprobs)
            if top_k == 0:
                torch.testing.assert_close(la, lb)
            else:  # renormalised over the kept tokens: never lower, here strictly higher
                assert bool((lb > la).all())
