"""Conversion between specrl.v1 protobuf messages and the domain types of `sidecar.types`.

The one place where generated protobuf code meets the rest of specrl; the server and the
client both convert here, so the two sides cannot drift apart. `*_to_pb` builds a message,
`*_from_pb` reads one; `*_from_pb` raises `InvalidRequestError` (never a bare protobuf or
ValueError) for a message whose content is not acceptable, naming the field.
"""

from __future__ import annotations

import numpy as np
import torch

from sidecar.errors import InvalidRequestError
from sidecar.protocol.specrl.v1 import common_pb2, control_pb2, rollout_pb2, weights_pb2
from sidecar.types import (
    CollectivePlacement,
    CollectiveRendezvous,
    DeltaEncoding,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    GpuTelemetry,
    LogprobMode,
    ModelInfo,
    PlacedTensor,
    PreparedTransport,
    PushItem,
    PushResult,
    RequestLimits,
    Routes,
    Sample,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    ShmPlacement,
    ShmProbe,
    SidecarInfo,
    SpeculationCounters,
    SpeculationStatus,
    TensorDelta,
    TensorSpec,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightPlaced,
    WeightSelector,
    WeightTransport,
)

_SELECTOR_TO_PB = {
    WeightSelector.ALL: common_pb2.WEIGHT_SELECTOR_ALL,
    WeightSelector.TARGET: common_pb2.WEIGHT_SELECTOR_TARGET,
    WeightSelector.DRAFT: common_pb2.WEIGHT_SELECTOR_DRAFT,
}
_SELECTOR_FROM_PB = {v: k for k, v in _SELECTOR_TO_PB.items()} | {
    common_pb2.WEIGHT_SELECTOR_UNSPECIFIED: WeightSelector.ALL
}
_FINISH_TO_PB = {
    FinishReason.STOP: rollout_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: rollout_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: rollout_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_ROUTES_TO_PB = {
    "off": rollout_pb2.ROUTE_REQUEST_OFF,
    "generated": rollout_pb2.ROUTE_REQUEST_GENERATED,
    "sequence": rollout_pb2.ROUTE_REQUEST_SEQUENCE,
}
_ROUTES_FROM_PB = {v: k for k, v in _ROUTES_TO_PB.items()}
_ID_DTYPES = {1: torch.uint8, 2: torch.int16}  # Routes.id_bytes -> the ids' dtype
_WIRE = {torch.uint8: "<u1", torch.int16: "<i2"}  # their little-endian wire forms
_DTYPE_TO_PB = {
    torch.float32: weights_pb2.D_TYPE_FLOAT32,
    torch.float16: weights_pb2.D_TYPE_FLOAT16,
    torch.bfloat16: weights_pb2.D_TYPE_BFLOAT16,
}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}
_TRANSPORT_TO_PB = {
    WeightTransport.GRPC: weights_pb2.WEIGHT_TRANSPORT_GRPC,
    WeightTransport.SHM: weights_pb2.WEIGHT_TRANSPORT_SHM,
    WeightTransport.COLLECTIVE: weights_pb2.WEIGHT_TRANSPORT_COLLECTIVE,
}
_TRANSPORT_FROM_PB = {v: k for k, v in _TRANSPORT_TO_PB.items()} | {
    weights_pb2.WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport.GRPC
}


def selector_to_pb(selector: WeightSelector) -> common_pb2.WeightSelector:
    return _SELECTOR_TO_PB[selector]


def selector_from_pb(value: int) -> WeightSelector:
    try:
        return _SELECTOR_FROM_PB[value]  # type: ignore[index]
    except KeyError:
        raise InvalidRequestError(
            f"selector {value} is not a WeightSelector value (use ALL, TARGET or DRAFT)"
        ) from None


def dtype_to_pb(dtype: torch.dtype) -> weights_pb2.DType:
    try:
        return _DTYPE_TO_PB[dtype]
    except KeyError:
        raise InvalidRequestError(f"dtype {dtype} cannot be streamed; use float32, float16 or bfloat16") from None


def dtype_from_pb(value: int) -> torch.dtype:
    try:
        return _DTYPE_FROM_PB[value]  # type: ignore[index]
    except KeyError:
        raise InvalidRequestError(
            f"tensor dtype {value} is not supported; use D_TYPE_FLOAT32, D_TYPE_FLOAT16 or D_TYPE_BFLOAT16"
        ) from None


# --- rollout -------------------------------------------------------------------------------


_LOGPROB_MODE_TO_PB = {
    LogprobMode.RAW: rollout_pb2.LOGPROB_MODE_RAW,
    LogprobMode.PROCESSED: rollout_pb2.LOGPROB_MODE_PROCESSED,
}


def logprob_mode_from_pb(value: int) -> LogprobMode:
    if value in (rollout_pb2.LOGPROB_MODE_UNSPECIFIED, rollout_pb2.LOGPROB_MODE_RAW):
        return LogprobMode.RAW
    if value == rollout_pb2.LOGPROB_MODE_PROCESSED:
        return LogprobMode.PROCESSED
    raise InvalidRequestError(
        f"sampling: unknown logprob_mode {value}; use LOGPROB_MODE_RAW (1) or LOGPROB_MODE_PROCESSED (2)"
    )


def sampling_to_pb(params: SamplingParams) -> rollout_pb2.SamplingParams:
    msg = rollout_pb2.SamplingParams(
        temperature=params.temperature,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        stop_at_eos=params.stop_at_eos,
        logprob_mode=_LOGPROB_MODE_TO_PB[params.logprob_mode],
    )
    if params.top_p != 1.0:
        msg.top_p = params.top_p
    if params.top_k:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: rollout_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=msg.temperature,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k if msg.HasField("top_k") else 0,
            max_new_tokens=msg.max_new_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            seed=msg.seed if msg.HasField("seed") else None,
            stop_at_eos=msg.stop_at_eos,
            logprob_mode=logprob_mode_from_pb(msg.logprob_mode),
        )
    except ValueError as e:
        raise InvalidRequestError(f"sampling: {e}") from None


def generation_request_to_pb(request: GenerationRequest) -> rollout_pb2.GenerateRequest:
    msg = rollout_pb2.GenerateRequest(
        request_id=request.request_id,
        prompts=[rollout_pb2.Prompt(token_ids=p) for p in request.prompts],
        sampling=sampling_to_pb(request.sampling),
        samples_per_prompt=request.samples_per_prompt,
        min_weight_version=request.min_weight_version,
        session_ids=request.session_ids,
        routes=_ROUTES_TO_PB[request.routes],
    )
    if request.speculation_k is not None:
        msg.speculation_k = request.speculation_k
    return msg


def generation_request_from_pb(msg: rollout_pb2.GenerateRequest) -> GenerationRequest:
    if not msg.HasField("sampling"):
        raise InvalidRequestError("sampling is missing; set at least sampling.max_new_tokens")
    sampling = sampling_from_pb(msg.sampling)
    if msg.routes not in _ROUTES_FROM_PB:
        raise InvalidRequestError(f"routes is {msg.routes}, not a known RouteRequest (OFF, GENERATED or SEQUENCE)")
    try:
        return GenerationRequest(
            prompts=[list(p.token_ids) for p in msg.prompts],
            sampling=sampling,
            samples_per_prompt=max(1, msg.samples_per_prompt),
            request_id=msg.request_id,
            min_weight_version=msg.min_weight_version,
            speculation_k=msg.speculation_k if msg.HasField("speculation_k") else None,
            session_ids=list(msg.session_ids),
            routes=_ROUTES_FROM_PB[msg.routes],
        )
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def score_request_to_pb(request: ScoreRequest) -> rollout_pb2.ScoreRequest:
    return rollout_pb2.ScoreRequest(
        sequences=[
            rollout_pb2.ScoreSequence(token_ids=list(seq), start_index=start)
            for seq, start in zip(request.sequences, request.start_indices, strict=True)
        ],
        temperature=request.temperature,
        min_weight_version=request.min_weight_version,
    )


def score_request_from_pb(msg: rollout_pb2.ScoreRequest) -> ScoreRequest:
    try:
        return ScoreRequest(
            sequences=[list(s.token_ids) for s in msg.sequences],
            start_indices=[s.start_index for s in msg.sequences],
            temperature=msg.temperature,
            min_weight_version=msg.min_weight_version,
        )
    except ValueError as e:
        raise InvalidRequestError(f"score: {e}") from None


def score_result_to_pb(result: ScoreResult) -> rollout_pb2.ScoreResponse:
    return rollout_pb2.ScoreResponse(
        scores=[rollout_pb2.SequenceScore(logprobs=lps) for lps in result.logprobs],
        weight_version=result.weight_version,
    )


def score_result_from_pb(msg: rollout_pb2.ScoreResponse) -> ScoreResult:
    return ScoreResult(logprobs=[list(s.logprobs) for s in msg.scores], weight_version=msg.weight_version)


def counters_to_pb(counters: SpeculationCounters) -> common_pb2.SpeculationCounters:
    return common_pb2.SpeculationCounters(
        verify_steps=counters.verify_steps,
        drafted_tokens=counters.drafted_tokens,
        accepted_tokens=counters.accepted_tokens,
        generated_tokens=counters.generated_tokens,
        drafted_per_position=counters.drafted_per_position,
        accepted_per_position=counters.accepted_per_position,
    )


def counters_from_pb(msg: common_pb2.SpeculationCounters) -> SpeculationCounters:
    return SpeculationCounters(
        verify_steps=msg.verify_steps,
        drafted_tokens=msg.drafted_tokens,
        accepted_tokens=msg.accepted_tokens,
        generated_tokens=msg.generated_tokens,
        drafted_per_position=list(msg.drafted_per_position),
        accepted_per_position=list(msg.accepted_per_position),
    )


def sample_to_pb(sample: Sample) -> rollout_pb2.Sample:
    return rollout_pb2.Sample(
        request_id=sample.request_id,
        prompt_index=sample.prompt_index,
        sample_index=sample.sample_index,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        finish_reason=_FINISH_TO_PB[sample.finish_reason],
        weight_version=sample.weight_version,
        last_weight_version=sample.last_weight_version,
        counters=counters_to_pb(sample.counters),
        routes=None if sample.routes is None else routes_to_pb(sample.routes),
    )


def routes_to_pb(routes: Routes) -> rollout_pb2.Routes:
    ids = routes.expert_ids.contiguous()
    raw = ids.numpy().astype(_WIRE[ids.dtype], copy=False).tobytes()
    p, layers, top = ids.shape
    return rollout_pb2.Routes(
        expert_ids=raw,
        positions=p,
        sparse_layers=layers,
        top_k=top,
        first_position=routes.first_position,
        id_bytes=ids.element_size(),
    )


def routes_from_pb(msg: rollout_pb2.Routes) -> Routes:
    dtype, shape = _ID_DTYPES.get(msg.id_bytes), (msg.positions, msg.sparse_layers, msg.top_k)
    if dtype is None or len(msg.expert_ids) != msg.id_bytes * shape[0] * shape[1] * shape[2]:
        raise InvalidRequestError(
            f"routes: {len(msg.expert_ids)} bytes do not hold {shape} ids of id_bytes={msg.id_bytes} (1 or 2)"
        )
    wire = np.frombuffer(msg.expert_ids, dtype=_WIRE[dtype]).astype(_WIRE[dtype][1:])  # to this host's byte order
    return Routes(expert_ids=torch.from_numpy(wire).view(shape), first_position=msg.first_position)


def sample_from_pb(msg: rollout_pb2.Sample) -> Sample:
    if msg.finish_reason not in _FINISH_FROM_PB:
        raise InvalidRequestError(f"sample has finish_reason {msg.finish_reason}, not a known FinishReason")
    return Sample(
        request_id=msg.request_id,
        prompt_index=msg.prompt_index,
        sample_index=msg.sample_index,
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        finish_reason=_FINISH_FROM_PB[msg.finish_reason],
        weight_version=msg.weight_version,
        last_weight_version=msg.last_weight_version,
        counters=counters_from_pb(msg.counters),
        routes=routes_from_pb(msg.routes) if msg.HasField("routes") else None,
    )


# --- weights -------------------------------------------------------------------------------


def tensor_spec_to_pb(spec: TensorSpec) -> weights_pb2.TensorSpec:
    return weights_pb2.TensorSpec(
        name=spec.name,
        dtype=dtype_to_pb(spec.dtype),
        shape=list(spec.shape),
        byte_length=spec.byte_length,
        crc32=spec.crc32,
        delta=delta_to_pb(spec.delta) if spec.delta is not None else None,
    )


_DELTA_ENCODING_TO_PB = {
    DeltaEncoding.INDEX: weights_pb2.DELTA_ENCODING_INDEX,
    DeltaEncoding.BITMASK: weights_pb2.DELTA_ENCODING_BITMASK,
}


def delta_to_pb(delta: TensorDelta) -> weights_pb2.TensorDelta:
    return weights_pb2.TensorDelta(
        encoding=_DELTA_ENCODING_TO_PB[delta.encoding],
        changed=delta.changed,
        payload_length=delta.payload_length,
        payload_crc32=delta.payload_crc32,
    )


def delta_from_pb(name: str, msg: weights_pb2.TensorDelta) -> TensorDelta:
    try:
        encoding = DeltaEncoding(msg.encoding)
    except ValueError:
        raise InvalidRequestError(
            f"tensor {name!r}: delta encoding {msg.encoding} is not INDEX (1) or BITMASK (2)"
        ) from None
    return TensorDelta(
        encoding=encoding, changed=msg.changed, payload_length=msg.payload_length, payload_crc32=msg.payload_crc32
    )


def tensor_spec_from_pb(msg: weights_pb2.TensorSpec) -> TensorSpec:
    if not msg.name:
        raise InvalidRequestError("a manifest tensor has an empty name; name every tensor")
    spec = TensorSpec(
        name=msg.name,
        dtype=dtype_from_pb(msg.dtype),
        shape=tuple(msg.shape),
        crc32=msg.crc32,
        delta=delta_from_pb(msg.name, msg.delta) if msg.HasField("delta") else None,
    )
    if spec.byte_length != msg.byte_length:
        raise InvalidRequestError(
            f"tensor {msg.name!r}: byte_length {msg.byte_length} does not match shape {list(msg.shape)} "
            f"of {spec.dtype} ({spec.byte_length} bytes)"
        )
    return spec


def manifest_to_pb(manifest: WeightManifest) -> weights_pb2.WeightManifest:
    msg = weights_pb2.WeightManifest(
        version=manifest.version,
        selector=selector_to_pb(manifest.selector),
        tensors=[tensor_spec_to_pb(t) for t in manifest.tensors],
        base_version=manifest.base_version,
    )
    where = manifest.data_plane
    if isinstance(where, ShmPlacement):
        msg.shm.region = where.region
    elif isinstance(where, CollectivePlacement):
        msg.collective.group_id = where.group_id
        msg.collective.bucket_bytes = where.bucket_bytes
    return msg


def manifest_from_pb(m: weights_pb2.WeightManifest) -> WeightManifest:
    plane = m.WhichOneof("data_plane")
    data_plane: ShmPlacement | CollectivePlacement | None = None
    if plane == "shm":
        if not m.shm.region:
            raise InvalidRequestError("manifest.shm.region is empty; name the shared-memory region")
        data_plane = ShmPlacement(region=m.shm.region)
    elif plane == "collective":
        if not m.collective.group_id or m.collective.bucket_bytes == 0:
            raise InvalidRequestError("manifest.collective needs a group_id and bucket_bytes > 0")
        data_plane = CollectivePlacement(group_id=m.collective.group_id, bucket_bytes=m.collective.bucket_bytes)
    return WeightManifest(
        version=m.version,
        selector=selector_from_pb(m.selector),
        tensors=[tensor_spec_from_pb(t) for t in m.tensors],
        data_plane=data_plane,
        base_version=m.base_version,
    )


def transport_to_pb(transport: WeightTransport) -> weights_pb2.WeightTransport:
    return _TRANSPORT_TO_PB[transport]


def prepare_transport_to_pb(request: ShmProbe | CollectiveRendezvous) -> weights_pb2.PrepareTransportRequest:
    if isinstance(request, ShmProbe):
        return weights_pb2.PrepareTransportRequest(shm=weights_pb2.ShmProbe(region=request.region))
    return weights_pb2.PrepareTransportRequest(
        collective=weights_pb2.CollectiveRendezvous(
            group_id=request.group_id,
            backend=request.backend,
            host=request.host,
            port=request.port,
            rank=request.rank,
            world_size=request.world_size,
            timeout_seconds=request.timeout_s,
        )
    )


def prepare_transport_from_pb(msg: weights_pb2.PrepareTransportRequest) -> ShmProbe | CollectiveRendezvous:
    kind = msg.WhichOneof("transport")
    if kind == "shm":
        return ShmProbe(region=msg.shm.region)
    if kind == "collective":
        c = msg.collective
        if not c.group_id or not c.host or not 0 < c.port < 65536:
            raise InvalidRequestError("collective rendezvous needs a group_id, a host and a port in 1..65535")
        return CollectiveRendezvous(
            group_id=c.group_id,
            backend=c.backend,
            host=c.host,
            port=c.port,
            rank=c.rank,
            world_size=c.world_size,
            timeout_s=c.timeout_seconds,
        )
    raise InvalidRequestError("a PrepareTransportRequest sets neither shm nor collective; set one")


def prepared_to_pb(answer: PreparedTransport) -> weights_pb2.PrepareTransportResponse:
    return weights_pb2.PrepareTransportResponse(shm_nonce=answer.shm_nonce, group_id=answer.group_id)


def prepared_from_pb(msg: weights_pb2.PrepareTransportResponse) -> PreparedTransport:
    return PreparedTransport(shm_nonce=bytes(msg.shm_nonce), group_id=msg.group_id)


def push_item_to_pb(item: PushItem) -> weights_pb2.PushWeightsRequest:
    """One domain push item as the PushWeights stream message that carries it."""
    if isinstance(item, WeightManifest):
        return weights_pb2.PushWeightsRequest(manifest=manifest_to_pb(item))
    if isinstance(item, WeightPlaced):
        return weights_pb2.PushWeightsRequest(
            placed=weights_pb2.WeightPlaced(
                tensors=[
                    weights_pb2.PlacedTensor(
                        tensor_index=t.tensor_index, offset=t.offset, byte_length=t.byte_length, crc32=t.crc32
                    )
                    for t in item.tensors
                ]
            )
        )
    if isinstance(item, WeightChunk):
        chunk = weights_pb2.WeightChunk(
            tensor_index=item.tensor_index, offset=item.offset, data=bytes(item.data), crc32=item.crc32
        )
        if item.tensor_crc32 is not None:
            chunk.tensor_crc32 = item.tensor_crc32
        return weights_pb2.PushWeightsRequest(chunk=chunk)
    return weights_pb2.PushWeightsRequest(commit=weights_pb2.WeightCommit(chunk_count=item.chunk_count))


def push_item_from_pb(msg: weights_pb2.PushWeightsRequest) -> PushItem:
    """Read one PushWeights stream message; InvalidRequestError for an empty one or a bad manifest."""
    kind = msg.WhichOneof("item")
    if kind == "manifest":
        return manifest_from_pb(msg.manifest)
    if kind == "placed":
        return WeightPlaced(
            tensors=[
                PlacedTensor(tensor_index=t.tensor_index, offset=t.offset, byte_length=t.byte_length, crc32=t.crc32)
                for t in msg.placed.tensors
            ]
        )
    if kind == "chunk":
        c = msg.chunk
        return WeightChunk(
            tensor_index=c.tensor_index,
            offset=c.offset,
            data=c.data,
            crc32=c.crc32,
            tensor_crc32=c.tensor_crc32 if c.HasField("tensor_crc32") else None,
        )
    if kind == "commit":
        return WeightCommit(chunk_count=msg.commit.chunk_count)
    raise InvalidRequestError("a PushWeightsRequest sets none of manifest, chunk, placed or commit; set exactly one")


def push_result_to_pb(result: PushResult) -> weights_pb2.PushWeightsResponse:
    return weights_pb2.PushWeightsResponse(
        version=result.version,
        previous_version=result.previous_version,
        bytes_received=result.bytes_received,
        tensors_updated=result.tensors_updated,
        receive_seconds=result.receive_seconds,
        apply_seconds=result.apply_seconds,
        transport=transport_to_pb(result.transport),
    )


def push_result_from_pb(msg: weights_pb2.PushWeightsResponse) -> PushResult:
    return PushResult(
        version=msg.version,
        previous_version=msg.previous_version,
        bytes_received=msg.bytes_received,
        tensors_updated=msg.tensors_updated,
        receive_seconds=msg.receive_seconds,
        apply_seconds=msg.apply_seconds,
        transport=_TRANSPORT_FROM_PB.get(msg.transport, WeightTransport.GRPC),
    )


def describe_weights_to_pb(
    specs: list[TensorSpec],
    weight_version: int,
    transports: list[WeightTransport] | None = None,
    accepts_deltas: bool = False,
) -> weights_pb2.DescribeWeightsResponse:
    return weights_pb2.DescribeWeightsResponse(
        tensors=[tensor_spec_to_pb(s) for s in specs],  # crc32: 0 unless the served values were checksummed
        weight_version=weight_version,
        transports=[transport_to_pb(t) for t in transports or [WeightTransport.GRPC]],
        accepts_deltas=accepts_deltas,
    )


def transports_from_pb(msg: weights_pb2.DescribeWeightsResponse) -> list[WeightTransport]:
    """The transports a sidecar offers (grpc always; unknown future values are skipped)."""
    offered = [_TRANSPORT_FROM_PB[t] for t in msg.transports if t in _TRANSPORT_FROM_PB]
    return offered if WeightTransport.GRPC in offered else [WeightTransport.GRPC, *offered]


def describe_weights_from_pb(msg: weights_pb2.DescribeWeightsResponse) -> tuple[list[TensorSpec], int]:
    return [tensor_spec_from_pb(t) for t in msg.tensors], msg.weight_version


# --- control -------------------------------------------------------------------------------


def speculation_status_to_pb(s: SpeculationStatus) -> control_pb2.SpeculationDecision:
    return control_pb2.SpeculationDecision(
        speculation_k=s.speculation_k,
        reason=s.reason,
        detail=s.detail,
        expected_speedup=s.expected_speedup,
        batch_size=s.batch_size,
        position_acceptance=s.acceptance,
        guard_trips=s.guard_trips,
    )


def speculation_status_from_pb(msg: control_pb2.SpeculationDecision, speculation_auto: bool) -> SpeculationStatus:
    return SpeculationStatus(
        speculation_auto=speculation_auto,
        speculation_k=msg.speculation_k,
        reason=msg.reason or "fixed",
        detail=msg.detail,
        expected_speedup=msg.expected_speedup,
        batch_size=msg.batch_size,
        acceptance=list(msg.position_acceptance),
        guard_trips=msg.guard_trips,
    )


def info_to_pb(info: SidecarInfo) -> control_pb2.GetInfoResponse:
    e, m = info.engine, info.engine.model
    return control_pb2.GetInfoResponse(
        model=control_pb2.ModelInfo(
            name=m.name,
            architecture=m.architecture,
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            max_position_embeddings=m.max_position_embeddings,
            rope_type=m.rope_type,
            rope_factor=m.rope_factor,
            num_mtp_layers=m.num_mtp_layers,
            dtype=m.dtype,
            eos_token_ids=list(m.eos_token_ids),
            family=m.family,
            num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok,
            router=m.router,
            num_sparse_layers=m.num_sparse_layers,
        ),
        speculation=control_pb2.SpeculationInfo(
            method=e.speculation_method,
            speculation_k=e.speculation_k,
            max_speculation_k=e.max_speculation_k,
            speculation_auto=e.speculation_status.speculation_auto,
            decision=speculation_status_to_pb(e.speculation_status),
        ),
        engine=e.engine,
        engine_version=e.engine_version,
        device=control_pb2.DeviceInfo(
            kind=e.device_kind,
            name=e.device_name,
            gpus=[
                control_pb2.GpuTelemetry(
                    index=g.index,
                    name=g.name,
                    memory_total_bytes=g.memory_total_bytes,
                    memory_used_bytes=g.memory_used_bytes,
                    utilization_percent=g.utilization_percent,
                    temperature_celsius=g.temperature_celsius,
                    power_watts=g.power_watts,
                )
                for g in info.gpus
            ],
        ),
        weight_version=info.weight_version,
        paused=info.paused,
        limits=control_pb2.RequestLimits(
            max_prompts=info.limits.max_prompts,
            max_samples=info.limits.max_samples,
            max_prompt_tokens=info.limits.max_prompt_tokens,
            max_new_tokens=info.limits.max_new_tokens,
        ),
        protocol=info.protocol,
        specrl_version=info.specrl_version,
    )


def info_from_pb(msg: control_pb2.GetInfoResponse) -> SidecarInfo:
    m = msg.model
    return SidecarInfo(
        engine=EngineInfo(
            model=ModelInfo(
                name=m.name,
                architecture=m.architecture,
                vocab_size=m.vocab_size,
                hidden_size=m.hidden_size,
                num_layers=m.num_layers,
                max_position_embeddings=m.max_position_embeddings,
                rope_type=m.rope_type,
                rope_factor=m.rope_factor,
                num_mtp_layers=m.num_mtp_layers,
                dtype=m.dtype,
                eos_token_ids=tuple(m.eos_token_ids),
                family=m.family,
                num_experts=m.num_experts,
                num_experts_per_tok=m.num_experts_per_tok,
                router=m.router,
                num_sparse_layers=m.num_sparse_layers,
            ),
            engine=msg.engine,
            engine_version=msg.engine_version,
            device_kind=msg.device.kind,
            device_name=msg.device.name,
            speculation_method=msg.speculation.method,
            speculation_k=msg.speculation.speculation_k,
            max_speculation_k=msg.speculation.max_speculation_k,
            speculation_status=speculation_status_from_pb(msg.speculation.decision, msg.speculation.speculation_auto),
        ),
        weight_version=msg.weight_version,
        paused=msg.paused,
        limits=RequestLimits(
            max_prompts=msg.limits.max_prompts,
            max_samples=msg.limits.max_samples,
            max_prompt_tokens=msg.limits.max_prompt_tokens,
            max_new_tokens=msg.limits.max_new_tokens,
        ),
        gpus=[
            GpuTelemetry(
                index=g.index,
                name=g.name,
                memory_total_bytes=g.memory_total_bytes,
                memory_used_bytes=g.memory_used_bytes,
                utilization_percent=g.utilization_percent,
                temperature_celsius=g.temperature_celsius,
                power_watts=g.power_watts,
            )
            for g in msg.device.gpus
        ],
        protocol=msg.protocol,
        specrl_version=msg.specrl_version,
    )
