"""The fleet's error policy and sample seeding, against an oracle, with scripted sidecars.

Each fake sidecar answers every Generate the same scripted way (all samples, or an error with a
given gRPC status after some samples, or a stream that just stops). The oracle says, from the
scripts alone, what the fleet must do: which sidecars end up down (only those whose error means
"unavailable"), whether the caller gets the sidecar's own error (caller errors, never a
"no live sidecar"), and — when the samples come back — that each one is exactly the sample a
lone sidecar would produce for (request seed, global prompt index, sample index), whoever
served it. Fast: no server, no model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.client.client import ClientConfig, SidecarCallError
from sidecar.client.fleet import (
    Disposition,
    Fleet,
    FleetConfig,
    NoLiveSidecarError,
    derive_seed,
    disposition,
)
from sidecar.types import (
    FinishReason,
    GenerationRequest,
    PushResult,
    Sample,
    SamplingParams,
    TensorSpec,
    WeightSelector,
)

Code = grpc.StatusCode
ERROR_CODES = [c for c in Code if c != Code.OK]
CALLER_CODES = [
    Code.INVALID_ARGUMENT,
    Code.UNAUTHENTICATED,
    Code.PERMISSION_DENIED,
    Code.FAILED_PRECONDITION,
    Code.NOT_FOUND,
    Code.OUT_OF_RANGE,
    Code.UNIMPLEMENTED,
    Code.ABORTED,
    Code.ALREADY_EXISTS,
    Code.INTERNAL,
    Code.UNKNOWN,
    Code.DATA_LOSS,
]
DROP = "drop"  # the stream ends OK but early


def engine_token(seed: int | None, prompt_index: int, sample_index: int) -> int:
    """What the fake engine samples: a function of the request seed and the in-request indices
    (the real engine's `sequence_seed` contract)."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def expected_token(seed: int, prompt: int, sample: int) -> int:
    """A lone sidecar serving prompt `prompt` of the fleet's request alone."""
    return engine_token(derive_seed(seed, prompt), 0, sample)


@dataclass
class Script:
    failure: Code | str | None = None
    """None: answer every sample; a status code: fail with it; DROP: end the stream early."""
    after: int = 0
    """Samples emitted before failing (at most all but one of the call's)."""


class FakeSidecar:
    def __init__(self, address: str, config: ClientConfig, script: Script, version: int = 0) -> None:
        self.address, self.config, self.script, self.version = address, config, script, version
        self.calls: list[GenerationRequest] = []
        self.pushed: list[int] = []

    def stream_generate(self, request: GenerationRequest, timeout_s: float | None = None) -> Iterator[Sample]:
        self.calls.append(request)
        if request.min_weight_version > self.version:
            raise SidecarCallError(self.address, "Generate", Code.FAILED_PRECONDITION, "serves an older version")
        n = request.samples_per_prompt
        stop = n if self.script.failure is None else min(self.script.after, n - 1)  # a failure is never complete
        for p in range(len(request.prompts)):
            for i in range(stop):
                yield Sample(
                    request_id=request.request_id,
                    prompt_index=p,
                    sample_index=i,
                    token_ids=[engine_token(request.sampling.seed, p, i)],
                    logprobs=[0.0],
                    finish_reason=FinishReason.LENGTH,
                    weight_version=self.version,
                    last_weight_version=self.version,
                )
        if isinstance(self.script.failure, Code):
            raise SidecarCallError(
                self.address, "Generate", self.script.failure, f"scripted {self.script.failure.name}"
            )

    def health(self) -> bool:
        return self.script.failure is None

    def info(self) -> Any:
        return SimpleNamespace(weight_version=self.version)

    def abort(self, request_id: str) -> tuple[bool, int]:
        return True, 0

    def describe_weights(self, selector: WeightSelector = WeightSelector.ALL) -> tuple[list[TensorSpec], int]:
        if isinstance(self.script.failure, Code):
            raise SidecarCallError(self.address, "DescribeWeights", self.script.failure, "scripted")
        return [TensorSpec(name="w", dtype=torch.float32, shape=(2,))], self.version

    def close(self) -> None:
        pass


def push_ok(version: int) -> PushResult:
    return PushResult(
        version=version, previous_version=0, bytes_received=8, tensors_updated=1, receive_seconds=0.0, apply_seconds=0.0
    )


def fleet_of(scripts: Sequence[Script], **config: Any) -> tuple[Fleet, list[FakeSidecar]]:
    fakes = {f"fake{i}:1": FakeSidecar(f"fake{i}:1", ClientConfig(), s) for i, s in enumerate(scripts)}
    cfg = FleetConfig(busy_backoff_s=1e-3, max_busy_backoff_s=2e-3, busy_retries=2, probe_interval_s=3600.0, **config)
    fleet = Fleet(list(fakes), cfg, connect=lambda address, _config: fakes[address])  # type: ignore[arg-type,return-value]
    return fleet, list(fakes.values())


def request(prompts: int, g: int, seed: int | None = 7) -> GenerationRequest:
    return GenerationRequest(
        prompts=[[p + 1] for p in range(prompts)],
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed),
        samples_per_prompt=g,
    )


def test_disposition_reads_every_status_code() -> None:
    assert {c for c in ERROR_CODES if disposition(c) is Disposition.UNAVAILABLE} == {
        Code.UNAVAILABLE,
        Code.DEADLINE_EXCEEDED,
        Code.CANCELLED,
    }
    assert {c for c in ERROR_CODES if disposition(c) is Disposition.BUSY} == {Code.RESOURCE_EXHAUSTED}
    assert {c for c in ERROR_CODES if disposition(c) is Disposition.CALLER} == set(CALLER_CODES)
    assert disposition(None) is Disposition.UNAVAILABLE  # a dropped stream


def test_invalid_argument_from_every_sidecar_surfaces_and_marks_nothing_down() -> None:
    fleet, fakes = fleet_of([Script(Code.INVALID_ARGUMENT)] * 3)
    for _ in range(3):  # again and again: the fleet stays whole
        with pytest.raises(SidecarCallError) as err:
            fleet.generate(request(6, 2))
        assert err.value.code == Code.INVALID_ARGUMENT and err.value.details == "scripted INVALID_ARGUMENT"
        assert fleet.down() == []
    fakes[1].script = Script()
    with pytest.raises(SidecarCallError):
        fleet.generate(request(6, 2))
    for f in fakes:
        f.script = Script()
    assert len(fleet.generate(request(6, 2)).samples) == 12


scripts = st.lists(
    st.builds(
        Script,
        failure=st.one_of(st.none(), st.none(), st.sampled_from(ERROR_CODES), st.just(DROP)),
        after=st.integers(0, 3),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts=scripts, extra_prompts=st.integers(0, 4), g=st.integers(1, 3), seed=st.integers(0, 2**40))
def test_policy_against_the_oracle(scripts: list[Script], extra_prompts: int, g: int, seed: int) -> None:
    fleet, fakes = fleet_of(scripts)
    n_prompts = len(scripts) + extra_prompts  # every sidecar gets work in the first round
    kinds = {f.address: disposition(None if f.script.failure == DROP else f.script.failure) for f in fakes}
    for f in fakes:
        if f.script.failure is None:
            kinds.pop(f.address)
    unavailable = {a for a, k in kinds.items() if k is Disposition.UNAVAILABLE}
    caller = {a for a, k in kinds.items() if k is Disposition.CALLER}
    busy = {a for a, k in kinds.items() if k is Disposition.BUSY}
    healthy = [f.address for f in fakes if f.script.failure is None]
    try:
        result = fleet.generate(request(n_prompts, g, seed))
    except SidecarCallError as e:
        if caller:
            assert e.code not in (Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED), e
            assert e.address in caller and e.details == f"scripted {e.code.name}"  # the sidecar's own message
        else:
            assert not healthy and busy and e.code == Code.RESOURCE_EXHAUSTED, e
    except NoLiveSidecarError:
        assert not healthy and not caller and not busy, kinds
    else:
        assert healthy and not caller, kinds
        keys = [(s.prompt_index, s.sample_index) for s in result.samples]
        assert keys == [(p, i) for p in range(n_prompts) for i in range(g)]  # each exactly once, in order
        assert all(s.token_ids == [expected_token(seed, s.prompt_index, s.sample_index)] for s in result.samples)
        assert result.duplicates == 0
    assert set(fleet.down()) == unavailable  # only unavailable sidecars, and all that were asked
    assert not (set(fleet.down()) & (caller | busy))


@settings(max_examples=60, deadline=None)
@given(
    first=st.lists(st.booleans(), min_size=1, max_size=4),
    second=st.lists(st.booleans(), min_size=1, max_size=4),
    prompts=st.integers(1, 9),
    g=st.integers(1, 3),
    seed=st.integers(0, 2**40),
)
def test_samples_do_not_depend_on_the_fleet(
    first: list[bool], second: list[bool], prompts: int, g: int, seed: int
) -> None:
    """Any two fleets (sizes, which sidecars drop their streams) give the same samples, which
    are those of the prompt run alone; re-asking the same request gives them again."""
    results = []
    for alive in (first, second):
        scripts = [Script() if ok else Script(DROP, after=1) for ok in alive]
        scripts[0] = Script()  # at least one healthy sidecar
        fleet, _ = fleet_of(scripts)
        results.append(
            [(s.prompt_index, s.sample_index, s.token_ids) for s in fleet.generate(request(prompts, g, seed)).samples]
        )
        results.append(
            [(s.prompt_index, s.sample_index, s.token_ids) for s in fleet.generate(request(prompts, g, seed)).samples]
        )
    assert all(r == results[0] for r in results)
    assert [t for _, _, t in results[0]] == [[expected_token(seed, p, i)] for p in range(prompts) for i in range(g)]


def test_busy_sidecars_are_backed_off_not_marked_down() -> None:
    fleet, fakes = fleet_of([Script(Code.RESOURCE_EXHAUSTED), Script()])
    result = fleet.generate(request(4, 2))
    assert len(result.samples) == 8 and fleet.down() == []
    assert any("busy" in e for e in result.events)
    fakes[1].script = Script(Code.RESOURCE_EXHAUSTED)
    with pytest.raises(SidecarCallError) as err:  # all busy: waits out its back-offs, then says so
        fleet.generate(request(4, 2))
    assert err.value.code == Code.RESOURCE_EXHAUSTED and fleet.down() == []
    for f in fakes:
        f.script = Script()
    assert len(fleet.generate(request(4, 2)).samples) == 8


def test_a_sidecar_behind_the_fleets_version_is_down_not_a_caller_error() -> None:
    fleet, fakes = fleet_of([Script(), Script()])
    fleet.send = lambda client, tensors, version, selector, specs: (  # type: ignore[assignment]
        list(tensors),
        setattr(client, "version", version),
        push_ok(version),
    )[-1]
    fleet.push_weights({"w": torch.zeros(2)}, 1)
    fakes[1].version = 0  # restarted unseen, with its initial weights
    result = fleet.generate(request(4, 1))
    assert len(result.samples) == 4 and fleet.down() == [fakes[1].address]
    assert all(s.weight_version == 1 for s in result.samples)


@pytest.mark.parametrize(
    ("code", "raises", "down"),
    [
        (Code.UNAVAILABLE, None, True),
        (Code.DEADLINE_EXCEEDED, None, True),
        (Code.UNAUTHENTICATED, SidecarCallError, False),
        (Code.FAILED_PRECONDITION, SidecarCallError, False),
        (Code.INVALID_ARGUMENT, SidecarCallError, False),
    ],
)
def test_push_policy(code: Code, raises: type[Exception] | None, down: bool) -> None:
    fleet, fakes = fleet_of([Script(), Script()])

    def send(client: Any, tensors: Iterator[Any], version: int, selector: Any, specs: Any) -> PushResult:
        list(tensors)
        if client is fakes[1]:
            raise SidecarCallError(client.address, "PushWeights", code, "scripted push failure")
        return push_ok(version)

    fleet.send = send  # type: ignore[assignment]
    if raises is None:
        report = fleet.push_weights({"w": torch.zeros(2)}, 3)
        assert set(report.results) == {fakes[0].address} and fleet.version == 3
    else:
        with pytest.raises(raises) as err:
            fleet.push_weights({"w": torch.zeros(2)}, 3)
        assert "scripted push failure" in str(err.value) and fleet.version == 0
    assert fleet.down() == ([fakes[1].address] if down else [])
    fakes[0].script = Script(Code.UNAVAILABLE)
    fakes[1].script = Script(Code.UNAVAILABLE)
    if not down:
        fleet.send = lambda c, t, v, s, sp: (_ for _ in ()).throw(  # type: ignore[assignment]
            SidecarCallError(c.address, "PushWeights", Code.UNAVAILABLE, "gone")
        )
        with pytest.raises(NoLiveSidecarError, match="no sidecar accepted weight version 4"):
            fleet.push_weights({"w": torch.zeros(2)}, 4)


def test_an_unavailable_sidecar_gets_no_more_calls_in_its_round() -> None:
    """Queued prompts of a sidecar that just failed as unavailable are not sent to it (a hung
    sidecar would otherwise cost one deadline per queued prompt)."""
    fleet, fakes = fleet_of([Script(), Script(Code.UNAVAILABLE)], max_streams_per_sidecar=1)
    result = fleet.generate(request(10, 2))
    assert len(result.samples) == 20 and fleet.down() == [fakes[1].address]
    assert len(fakes[1].calls) == 1
