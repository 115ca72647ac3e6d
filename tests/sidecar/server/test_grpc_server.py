"""A real specrl.v1 server on port 0 answers health checks, reflection and its services over
a real loopback channel."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar.protocol import services
from sidecar.protocol.specrl.v1 import control_pb2
from sidecar.server.grpc_server import EventLoopThread, ServerConfig, create_server

DEADLINE = 10.0


class EchoControl(services.ControlServicer):
    """A test servicer: answers GetInfo with a fixed weight version, refuses SetSpeculation."""

    async def GetInfo(self, request, context):
        return control_pb2.GetInfoResponse(weight_version=41, protocol="specrl.v1")

    async def SetSpeculation(self, request, context):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"speculation_k={request.speculation_k} exceeds max_speculation_k=0; this servicer has no draft",
        )


@pytest.fixture
def channel() -> Iterator[grpc.Channel]:
    loop = EventLoopThread()
    server, port, _ = loop.run(create_server([EchoControl()], ServerConfig(port=0)))
    loop.run(server.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        loop.run(server.stop(grace=1))
        loop.close()


def test_health_reports_serving_overall_and_per_service(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", services.CONTROL):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=DEADLINE)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=DEADLINE)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=services.CONTROL),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=DEADLINE))
    names = {s.name for s in listed.list_services_response.service}
    assert {services.CONTROL, "grpc.health.v1.Health"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    control = next(f for f in files if f.name == "specrl/v1/control.proto")
    assert "GetStats" in {m.name for m in control.service[0].method}


def test_servicer_answers_and_errors_carry_status_and_message(channel: grpc.Channel) -> None:
    stub = services.ControlStub(channel)
    assert stub.GetInfo(control_pb2.GetInfoRequest(), timeout=DEADLINE).weight_version == 41
    with pytest.raises(grpc.RpcError) as err:
        stub.SetSpeculation(control_pb2.SetSpeculationRequest(speculation_k=3), timeout=DEADLINE)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds max_speculation_k" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # unimplemented methods say so instead of hanging
        stub.GetStats(control_pb2.GetStatsRequest(), timeout=DEADLINE)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_registering_a_non_servicer_is_a_clear_error() -> None:
    loop = EventLoopThread()
    with pytest.raises(TypeError, match="implements no specrl.v1 service"):
        loop.run(create_server([object()], ServerConfig()))
    loop.close()
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        ServerConfig(port=70000)
