"""Numerically degenerate sampling parameters through the gRPC edge (issue 14, finding 3).

Messages are built directly from the .proto (float32 fields), as a client generated from
`proto/` alone would send them — including values the Python domain types refuse to build.
The rule under test (documented in rollout.proto and the README): temperature is 0 (greedy) or
in [1e-5, max float32]; NaN, ±inf, negatives and (0, 1e-5) — subnormals included — are
INVALID_ARGUMENT naming the rule. top_p in (0, 1]: 0 and 1 + ε are refused, 1 − ε and the
smallest positive float32 serve (the latter keeps only the most likely token); top_k beyond
the vocabulary keeps every token. Every accepted request returns finite log-probs.

Oracles: the plain greedy full forward (a temperature-1e-5 or a top-1 nucleus draw is the
argmax), the uniform distribution (temperature max-float: every log-prob is -log V), and the
same seeded request without the no-op restriction (top_k > V, top_p = 1 − ε at float32).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import rollout_pb2
from sidecar.server.process import Sidecar
from sidecar.types import SamplingParams
from tests.sidecar_fixtures import DEADLINE, greedy_reference, tiny_config, weights

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = [5, 6, 7]
NEW = 6
VOCAB = 64
F32 = np.float32
SUBNORMAL = float(np.finfo(F32).smallest_subnormal)  # 1.4e-45
MAX_F32 = float(np.finfo(F32).max)


@pytest.fixture(scope="module")
def stub(sidecar: Sidecar) -> Iterator[services.RolloutStub]:
    with grpc.insecure_channel(sidecar.address) as ch:
        yield services.RolloutStub(ch)


def generate(stub: services.RolloutStub, **sampling: float) -> list[rollout_pb2.Sample]:
    msg = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=PROMPT)],
        sampling=rollout_pb2.SamplingParams(max_new_tokens=NEW, seed=3, **sampling),  # type: ignore[arg-type]
        samples_per_prompt=2,
    )
    return [r.sample for r in stub.Generate(msg, timeout=DEADLINE)]


REFUSED = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", -1.0),
    ("temperature", SUBNORMAL),
    ("temperature", 1e-38),
    ("temperature", 9e-6),
    ("top_p", 0.0),
    ("top_p", float(np.nextafter(F32(1), F32(2)))),  # 1 + ε in float32
    ("top_p", math.nan),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}={v!r}" for f, v in REFUSED])
def test_degenerate_values_are_refused_with_invalid_argument(stub, field: str, value: float) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, **{field: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert field in err.value.details()


def finite_logprobs(samples: list[rollout_pb2.Sample]) -> None:
    for s in samples:
        assert len(s.token_ids) == NEW and all(math.isfinite(x) and x <= 0 for x in s.logprobs), list(s.logprobs)


def test_the_smallest_temperature_and_the_smallest_nucleus_sample_the_argmax(stub) -> None:  # type: ignore[no-untyped-def]
    expected = greedy_reference(weights(0), PROMPT, NEW)
    for sampling in ({"temperature": 1e-5}, {"temperature": 1.0, "top_p": SUBNORMAL}):
        samples = generate(stub, **sampling)
        finite_logprobs(samples)
        assert [list(s.token_ids) for s in samples] == [expected, expected], sampling


def test_the_largest_temperature_is_uniform(stub) -> None:  # type: ignore[no-untyped-def]
    samples = generate(stub, temperature=MAX_F32)
    finite_logprobs(samples)
    for s in samples:
        np.testing.assert_allclose(s.logprobs, -math.log(VOCAB), atol=1e-4)


def test_no_op_restrictions_change_nothing(stub) -> None:  # type: ignore[no-untyped-def]
    plain = generate(stub, temperature=0.8)
    finite_logprobs(plain)
    one_minus_eps = float(np.nextafter(F32(1), F32(0)))  # the largest float32 below 1
    for sampling in ({"top_k": 2**32 - 1}, {"top_k": VOCAB + 1}, {"top_p": one_minus_eps}):
        got = generate(stub, temperature=0.8, **sampling)
        finite_logprobs(got)
        if "top_k" in sampling:  # beyond the vocabulary: exactly the unrestricted distribution
            assert [s.token_ids for s in got] == [s.token_ids for s in plain], sampling


def test_the_domain_type_applies_the_same_rule() -> None:
    SamplingParams(temperature=1e-5)
    SamplingParams(temperature=float(F32(1e-5)))  # what a float32 field carries for 1e-5
    for bad in (SUBNORMAL, 1e-6, math.nan, math.inf, -0.5, 1e39):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_a_nucleus_that_rounds_to_zero_in_float32_keeps_the_most_likely_token() -> None:
    """In-process callers pass float64: top_p = 1e-300 is valid ((0, 1]) but 0 in the engine's
    float32 tensors, where it used to cut every token (softmax of all -inf: NaN)."""
    from sidecar.engine.torch_engine import TorchEngine
    from sidecar.model.model import build_model
    from sidecar.types import GenerationRequest

    model = build_model(tiny_config())
    model.load_state_dict(weights(0), strict=True)
    req = GenerationRequest(prompts=[PROMPT], sampling=SamplingParams(top_p=1e-300, max_new_tokens=NEW, seed=1))
    (sample,) = TorchEngine(model).generate(req)
    assert sample.token_ids == greedy_reference(weights(0), PROMPT, NEW)
    assert all(math.isfinite(x) for x in sample.logprobs)
