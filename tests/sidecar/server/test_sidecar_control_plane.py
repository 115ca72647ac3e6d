"""The control plane answers while many Generate streams are open (issue 14, finding 2).

A thread-pool server held one of its 64 threads per open stream, so with 100 streams open a
health check, GetInfo or Abort waited for a stream to end (2 s in the report; forever while
the sidecar is paused). Here 200 streams are held open on a paused sidecar — every one
admitted, none able to finish — and the control RPCs must each answer within a generous
bound (1 s; the issue asks for "well under a second"), Abort must reach its stream, a weight
push must land, and after Resume every stream must complete with the greedy oracle's tokens.
The latency figures themselves are measured by specrl bench control-plane, not asserted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2

import sidecar.protocol.convert as convert
from sidecar.client.client import SidecarClient
from sidecar.protocol import services
from sidecar.server.scheduler import SchedulerConfig
from sidecar.types import FinishReason, GenerationRequest, RequestLimits, SamplingParams, WeightSelector
from tests.sidecar_fixtures import DEADLINE, greedy_reference, make_checkpoint, start_sidecar, wait_until, weights

STREAMS = 200
BOUND_S = 1.0
T = TypeVar("T")

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def test_control_rpcs_answer_promptly_with_200_open_streams(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", seed=0)
    sidecar = start_sidecar(
        checkpoint,
        max_batch_size=256,
        limits=RequestLimits(max_prompts=4, max_samples=4, max_prompt_tokens=16, max_new_tokens=16),
        scheduler=SchedulerConfig(max_live_sequences=STREAMS + 8),
    )
    try:
        with SidecarClient(sidecar.address) as client, grpc.insecure_channel(sidecar.address) as channel:
            assert not client.pause()
            rollout = services.RolloutStub(channel)
            prompt = [3, 1, 4]
            calls = [
                rollout.Generate(
                    convert.generation_request_to_pb(
                        GenerationRequest(
                            prompts=[prompt],
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=4),
                            request_id=f"s{i}",
                        )
                    ),
                    timeout=60.0,
                )
                for i in range(STREAMS)
            ]
            # Every stream reached the scheduler (a thread-per-stream server gets stuck at its pool size).
            wait_until(lambda: sidecar.scheduler.snapshot().queued == STREAMS, what=f"{STREAMS} admitted streams")

            latencies: dict[str, float] = {}
            reply, latencies["health"] = timed(lambda: client._health.Check(health_pb2.HealthCheckRequest(), timeout=5))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            info, latencies["info"] = timed(client.info)
            stats, latencies["stats"] = timed(client.stats)
            assert info.paused and stats.queued_sequences == STREAMS
            (found, aborted), latencies["abort"] = timed(lambda: client.abort("s0"))
            assert found and aborted == 1
            (specs, _), latencies["describe"] = timed(lambda: client.describe_weights(WeightSelector.ALL))
            assert specs
            new = weights(seed=1)
            result, latencies["push"] = timed(lambda: client.push_weights(new, version=1))
            assert result.version == 1
            assert all(t < BOUND_S for t in latencies.values()), latencies

            (s0,) = [convert.sample_from_pb(m.sample) for m in calls[0]]
            assert s0.finish_reason is FinishReason.ABORT and s0.token_ids == []
            assert client.resume()
            expected = greedy_reference(new, prompt, 4)
            for call in calls[1:]:
                (sample,) = [convert.sample_from_pb(m.sample) for m in call]
                assert sample.token_ids == expected and sample.weight_version == 1
            wait_until(lambda: sidecar.scheduler.snapshot().running == 0, DEADLINE, "an idle engine")
    finally:
        sidecar.stop()


def test_stop_ends_the_open_streams_unavailable_within_the_grace_and_closes_the_port(tmp_path: Path) -> None:
    sidecar = start_sidecar(make_checkpoint(tmp_path / "ckpt", seed=0))
    with SidecarClient(sidecar.address) as client, grpc.insecure_channel(sidecar.address) as channel:
        client.pause()
        rollout = services.RolloutStub(channel)
        request = GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
        calls = [rollout.Generate(convert.generation_request_to_pb(request), timeout=60.0) for _ in range(20)]
        wait_until(lambda: sidecar.scheduler.snapshot().queued == 20, what="20 admitted streams")
        sidecar.stop(1.0)
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "shut down" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # the port is closed now
            client._health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_rpc_handler_is_a_coroutine() -> None:
    """A plain `def` handler still runs on a grpc.aio server — on the event loop's thread, which
    it blocks while it waits (for a step boundary, a transfer): the starvation of issue 14 again,
    for everyone. So every handler of the sidecar must be `async def` (blocking work inside goes
    to `asyncio.to_thread` or awaits the scheduler)."""
    import inspect

    from sidecar.server.servicers import ControlService, RolloutService, WeightService

    for servicer, base in (
        (RolloutService, services.RolloutServicer),
        (WeightService, services.WeightServicer),
        (ControlService, services.ControlServicer),
    ):
        for name, _ in inspect.getmembers(base, inspect.isfunction):
            if name.startswith("_"):
                continue
            handler = getattr(servicer, name)
            assert inspect.iscoroutinefunction(handler) or inspect.isasyncgenfunction(handler), (
                f"{servicer.__name__}.{name} must be `async def`"
            )
