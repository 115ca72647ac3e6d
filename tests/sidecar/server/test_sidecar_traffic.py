"""Real traffic on one sidecar over gRPC: overlapping Generate calls, aborts and client
cancellations (issue 14, finding 1, end to end).

Hypothesis draws, per request: when it arrives (0–300 ms), its prompt length (1 … the context
limit), samples per prompt, its own speculation k (None = the sidecar's default, 0 = plain,
up to the maximum), greedy or seeded sampling, and whether it is left alone, aborted (Abort
RPC) or cancelled by its client some milliseconds after it started. Every request runs on its
own client thread against one long-lived sidecar.

Oracle: the same request run alone on an idle engine loaded from the same checkpoint. A request
left alone returns exactly the oracle's samples; an aborted one returns every sample, the
finished ones equal to the oracle's and the ABORT ones a prefix of them; a cancelled one ends
CANCELLED (or had already finished), and whatever it received equals the oracle. Afterwards the
sidecar is idle with no live request, so aborts and cancellations freed their slots, and it
still serves. (The engine-level property tests in tests/sidecar/engine/test_continuous_batching.py
cover step-exact interleavings and the sampled chi-square check; this one covers the
scheduler and the server.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sidecar.protocol.convert as convert
from sidecar.client.client import SidecarClient
from sidecar.engine.torch_engine import TorchEngine
from sidecar.protocol import services
from sidecar.server.process import Sidecar
from sidecar.server.scheduler import SchedulerConfig
from sidecar.types import FinishReason, GenerationRequest, RequestLimits, Sample, SamplingParams
from tests.sidecar_fixtures import CONTEXT, DEADLINE, wait_until

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_K = 4
MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoint_seed() -> int:
    return 4


@pytest.fixture(scope="module")
def sidecar_settings() -> dict[str, Any]:
    return dict(
        speculation_k=2,
        max_batch_size=6,  # small: requests also wait in the engine's queue
        limits=RequestLimits(max_prompts=4, max_samples=16, max_prompt_tokens=CONTEXT, max_new_tokens=MAX_NEW),
        scheduler=SchedulerConfig(max_live_sequences=256),
    )


@pytest.fixture(scope="module")
def oracle_engine(checkpoint: Path) -> TorchEngine:
    return TorchEngine.from_checkpoint(checkpoint, speculation_k=2)


@dataclass(frozen=True)
class Planned:
    request: GenerationRequest
    arrival_s: float
    action: str  # "none", "abort" or "cancel"
    after_s: float


@st.composite
def planned(draw: st.DrawFn, index: int) -> Planned:
    max_new = draw(st.integers(1, MAX_NEW))
    lengths = draw(st.lists(st.integers(1, CONTEXT - max_new), min_size=1, max_size=2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    temperature = draw(st.sampled_from([0.0, 1.0]))
    return Planned(
        request=GenerationRequest(
            prompts=[torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths],
            sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=index),
            samples_per_prompt=draw(st.integers(1, 3)),
            speculation_k=draw(st.none() | st.integers(0, MAX_K)),
        ),
        arrival_s=draw(st.integers(0, 300)) / 1000,
        action=draw(st.sampled_from(["none", "none", "abort", "cancel"])),
        after_s=draw(st.integers(0, 100)) / 1000,
    )


_ORACLE: dict[bytes, dict[tuple[int, int], Sample]] = {}


def alone(engine: TorchEngine, request: GenerationRequest) -> dict[tuple[int, int], Sample]:
    """The request's samples on an idle engine (nothing else in its batch), memoised."""
    key = convert.generation_request_to_pb(request).SerializeToString(deterministic=True)
    if key not in _ORACLE:
        samples = engine.generate(replace(request, request_id=""))
        _ORACLE[key] = {(s.prompt_index, s.sample_index): s for s in samples}
    return _ORACLE[key]


@dataclass
class Outcome:
    samples: list[Sample]
    code: grpc.StatusCode | None = None  # None: the stream ended OK


def run_one(stub: services.RolloutStub, client: SidecarClient, p: Planned, rid: str) -> Outcome:
    time.sleep(p.arrival_s)
    msg = convert.generation_request_to_pb(replace(p.request, request_id=rid))
    call = stub.Generate(msg, timeout=60.0)
    timer: threading.Timer | None = None
    if p.action == "cancel":
        timer = threading.Timer(p.after_s, call.cancel)
    elif p.action == "abort":
        timer = threading.Timer(p.after_s, lambda: client.abort(rid))
    if timer is not None:
        timer.start()
    out = Outcome(samples=[])
    try:
        for reply in call:
            out.samples.append(convert.sample_from_pb(reply.sample))
    except grpc.RpcError as e:
        out.code = e.code()
    if timer is not None:
        timer.join()
    return out


_runs = iter(range(10**9))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(plan=st.integers(2, 6).flatmap(lambda n: st.tuples(*[planned(i) for i in range(n)])))
def test_overlapping_requests_aborts_and_cancellations(
    sidecar: Sidecar, oracle_engine: TorchEngine, plan: tuple[Planned, ...]
) -> None:
    run = next(_runs)
    outcomes: dict[int, Outcome] = {}
    with SidecarClient(sidecar.address) as client, grpc.insecure_channel(sidecar.address) as channel:
        stub = services.RolloutStub(channel)
        threads = [
            threading.Thread(target=lambda i=i, p=p: outcomes.__setitem__(i, run_one(stub, client, p, f"x{run}-{i}")))
            for i, p in enumerate(plan)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE * 3)
    assert len(outcomes) == len(plan), "a client thread hung"
    for i, p in enumerate(plan):
        out, want = outcomes[i], alone(oracle_engine, p.request)
        if p.action == "cancel":
            assert out.code in (None, grpc.StatusCode.CANCELLED), (i, out.code)
        else:
            assert out.code is None, (i, out.code)
        if out.code is None:
            assert sorted((s.prompt_index, s.sample_index) for s in out.samples) == sorted(want), i
        for s in out.samples:
            w = want[(s.prompt_index, s.sample_index)]
            if s.finish_reason is FinishReason.ABORT:
                assert p.action == "abort", (i, "aborted but nobody aborted it")
                assert s.token_ids == w.token_ids[: len(s.token_ids)], i
            else:
                assert (s.token_ids, s.finish_reason) == (w.token_ids, w.finish_reason), i
    wait_until(
        lambda: sidecar.scheduler.snapshot().running == sidecar.scheduler.snapshot().queued == 0,
        what="an idle sidecar",
    )
    assert not sidecar.scheduler._live  # every request, cancelled ones included, freed its slots
