"""The specrl.v1 services as gRPC sees them: names, servicer bases, registration and stubs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from sidecar.protocol.specrl.v1 import (
    control_pb2,
    control_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)

ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
WEIGHTS = weights_pb2.DESCRIPTOR.services_by_name["WeightService"].full_name
CONTROL = control_pb2.DESCRIPTOR.services_by_name["ControlService"].full_name

RolloutServicer = rollout_pb2_grpc.RolloutServiceServicer
WeightServicer = weights_pb2_grpc.WeightServiceServicer
ControlServicer = control_pb2_grpc.ControlServiceServicer

RolloutStub = rollout_pb2_grpc.RolloutServiceStub
WeightStub = weights_pb2_grpc.WeightServiceStub
ControlStub = control_pb2_grpc.ControlServiceStub

PUSH_WEIGHTS_METHOD = f"/{WEIGHTS}/PushWeights"


def _add_weight_servicer(servicer: Any, server: grpc.Server) -> None:
    """Like the generated adder, except that PushWeights requests are read by
    `weight_wire.push_item_from_wire` (zero-copy chunks; a malformed message reaches the servicer as
    an InvalidRequestError instead of failing in gRPC's deserializer with INTERNAL). The
    servicer's PushWeights therefore receives domain push items, not messages."""
    from sidecar.protocol.weight_wire import push_item_from_wire

    handlers = {
        "PushWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PushWeights,
            request_deserializer=push_item_from_wire,
            response_serializer=weights_pb2.PushWeightsResponse.SerializeToString,
        ),
        "DescribeWeights": grpc.unary_unary_rpc_method_handler(
            servicer.DescribeWeights,
            request_deserializer=weights_pb2.DescribeWeightsRequest.FromString,
            response_serializer=weights_pb2.DescribeWeightsResponse.SerializeToString,
        ),
        "PrepareTransport": grpc.unary_unary_rpc_method_handler(
            servicer.PrepareTransport,
            request_deserializer=weights_pb2.PrepareTransportRequest.FromString,
            response_serializer=weights_pb2.PrepareTransportResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WEIGHTS, handlers),))
    server.add_registered_method_handlers(WEIGHTS, handlers)


_ADDERS: dict[type, tuple[str, Callable[[Any, grpc.Server], None]]] = {
    RolloutServicer: (ROLLOUT, rollout_pb2_grpc.add_RolloutServiceServicer_to_server),
    WeightServicer: (WEIGHTS, _add_weight_servicer),
    ControlServicer: (CONTROL, control_pb2_grpc.add_ControlServiceServicer_to_server),
}


def register(servicer: object, server: grpc.Server) -> str:
    """Add `servicer` (a subclass of one of the servicer bases) to `server`; return its name."""
    for base, (name, add) in _ADDERS.items():
        if isinstance(servicer, base):
            add(servicer, server)
            return name
    raise TypeError(
        f"{type(servicer).__name__} implements no specrl.v1 service; subclass RolloutServicer, "
        "WeightServicer or ControlServicer"
    )
