"""RolloutService.Score (issue 18): teacher-forced log-probs of given sequences. Oracles: the
model's plain full forward (log_softmax(logits / T) computed here), and the log-probs Generate
reported for the same tokens (the engine's incremental, speculative path).

The engine side of Score is `sidecar/engine/scoring.py` (teacher-forced log-probs).
"""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.client.client import SidecarClient
from sidecar.model.model import build_model
from sidecar.types import GenerationRequest, SamplingParams, ScoreRequest
from tests.sidecar_fixtures import tiny_config, weights

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def reference(seq: list[int], start: int, temperature: float) -> list[float]:
    model = build_model(tiny_config())
    model.load_state_dict(weights(0), strict=True)
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0].float() / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[t - 1, seq[t]]) for t in range(start, len(seq))]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.3]),
    n=st.integers(1, 4),
)
def test_score_equals_the_full_forward(client: SidecarClient, data: st.DataObject, temperature: float, n: int) -> None:
    seqs = [data.draw(st.lists(st.integers(0, 63), min_size=2, max_size=40)) for _ in range(n)]
    starts = [data.draw(st.integers(1, len(s) - 1)) for s in seqs]
    result = client.score(ScoreRequest(sequences=seqs, start_indices=starts, temperature=temperature))
    assert result.weight_version == 0
    for seq, start, got in zip(seqs, starts, result.logprobs, strict=True):
        assert len(got) == len(seq) - start
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(reference(seq, start, temperature)), atol=2e-5, rtol=0
        )


def test_score_matches_generate_logprobs(client: SidecarClient) -> None:
    prompts = [[1, 2, 3, 4], [5, 6]]
    samples = client.generate(
        GenerationRequest(
            prompts=prompts, samples_per_prompt=3, sampling=SamplingParams(temperature=0.8, max_new_tokens=16, seed=4)
        )
    )
    seqs = [prompts[s.prompt_index] + s.token_ids for s in samples]
    result = client.score(
        ScoreRequest(sequences=seqs, start_indices=[len(prompts[s.prompt_index]) for s in samples], temperature=0.8)
    )
    for s, got in zip(samples, result.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(s.logprobs), atol=2e-5, rtol=0)


def test_bad_score_requests_are_refused_and_the_sidecar_keeps_serving(client: SidecarClient) -> None:
    with pytest.raises(ValueError, match="start_index 0"):
        ScoreRequest(sequences=[[1, 2]], start_indices=[0])
    from sidecar.protocol import services
    from sidecar.protocol.specrl.v1 import rollout_pb2

    stub = services.RolloutStub(client.channel)
    cases = [
        (rollout_pb2.ScoreRequest(), grpc.StatusCode.INVALID_ARGUMENT, "at least one"),
        (
            rollout_pb2.ScoreRequest(sequences=[rollout_pb2.ScoreSequence(token_ids=[1, 2], start_index=0)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "start_index",
        ),
        (
            rollout_pb2.ScoreRequest(sequences=[rollout_pb2.ScoreSequence(token_ids=[1, 99], start_index=1)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "vocabulary",
        ),
        (
            rollout_pb2.ScoreRequest(
                sequences=[rollout_pb2.ScoreSequence(token_ids=[1, 2], start_index=1)], min_weight_version=5
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "push weights first",
        ),
        (
            rollout_pb2.ScoreRequest(sequences=[rollout_pb2.ScoreSequence(token_ids=[1, 2], start_index=1)] * 65),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceed the limit",
        ),
    ]
    for msg, code, text in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.Score(msg)
        assert info.value.code() == code, info.value.details()
        assert text in info.value.details()
    assert len(client.score(ScoreRequest(sequences=[[1, 2, 3]], start_indices=[1])).logprobs[0]) == 2
