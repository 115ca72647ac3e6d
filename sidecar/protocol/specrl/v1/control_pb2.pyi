from sidecar.protocol.specrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "hidden_size", "num_layers", "max_position_embeddings", "rope_type", "rope_factor", "num_mtp_layers", "dtype", "eos_token_ids", "family", "num_experts", "num_experts_per_tok", "router", "num_sparse_layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NUM_MTP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    NUM_SPARSE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    rope_type: str
    rope_factor: float
    num_mtp_layers: int
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    family: str
    num_experts: int
    num_experts_per_tok: int
    router: str
    num_sparse_layers: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., rope_type: _Optional[str] = ..., rope_factor: _Optional[float] = ..., num_mtp_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., family: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., router: _Optional[str] = ..., num_sparse_layers: _Optional[int] = ...) -> None: ...

class SpeculationInfo(_message.Message):
    __slots__ = ("method", "speculation_k", "max_speculation_k", "speculation_auto", "decision")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    MAX_SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_AUTO_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    method: str
    speculation_k: int
    max_speculation_k: int
    speculation_auto: bool
    decision: SpeculationDecision
    def __init__(self, method: _Optional[str] = ..., speculation_k: _Optional[int] = ..., max_speculation_k: _Optional[int] = ..., speculation_auto: _Optional[bool] = ..., decision: _Optional[_Union[SpeculationDecision, _Mapping]] = ...) -> None: ...

class SpeculationDecision(_message.Message):
    __slots__ = ("speculation_k", "reason", "detail", "expected_speedup", "batch_size", "position_acceptance", "guard_trips")
    SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    POSITION_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    GUARD_TRIPS_FIELD_NUMBER: _ClassVar[int]
    speculation_k: int
    reason: str
    detail: str
    expected_speedup: float
    batch_size: int
    position_acceptance: _containers.RepeatedScalarFieldContainer[float]
    guard_trips: int
    def __init__(self, speculation_k: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., expected_speedup: _Optional[float] = ..., batch_size: _Optional[int] = ..., position_acceptance: _Optional[_Iterable[float]] = ..., guard_trips: _Optional[int] = ...) -> None: ...

class RequestLimits(_message.Message):
    __slots__ = ("max_prompts", "max_samples", "max_prompt_tokens", "max_new_tokens")
    MAX_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_prompts: int
    max_samples: int
    max_prompt_tokens: int
    max_new_tokens: int
    def __init__(self, max_prompts: _Optional[int] = ..., max_samples: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class GpuTelemetry(_message.Message):
    __slots__ = ("index", "name", "memory_total_bytes", "memory_used_bytes", "utilization_percent", "temperature_celsius", "power_watts")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_CELSIUS_FIELD_NUMBER: _ClassVar[int]
    POWER_WATTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int
    temperature_celsius: int
    power_watts: float
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., utilization_percent: _Optional[int] = ..., temperature_celsius: _Optional[int] = ..., power_watts: _Optional[float] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("kind", "name", "gpus")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuTelemetry]
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuTelemetry, _Mapping]]] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "speculation", "engine", "engine_version", "device", "weight_version", "paused", "limits", "protocol", "specrl_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SPECRL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    speculation: SpeculationInfo
    engine: str
    engine_version: str
    device: DeviceInfo
    weight_version: int
    paused: bool
    limits: RequestLimits
    protocol: str
    specrl_version: str
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationInfo, _Mapping]] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., weight_version: _Optional[int] = ..., paused: _Optional[bool] = ..., limits: _Optional[_Union[RequestLimits, _Mapping]] = ..., protocol: _Optional[str] = ..., specrl_version: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionStats(_message.Message):
    __slots__ = ("weight_version", "counters", "samples_finished", "busy_seconds", "samples_nonfinite", "prompt_tokens", "prefill_tokens", "prefix_cache_hit_tokens")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    counters: _common_pb2.SpeculationCounters
    samples_finished: int
    busy_seconds: float
    samples_nonfinite: int
    prompt_tokens: int
    prefill_tokens: int
    prefix_cache_hit_tokens: int
    def __init__(self, weight_version: _Optional[int] = ..., counters: _Optional[_Union[_common_pb2.SpeculationCounters, _Mapping]] = ..., samples_finished: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., samples_nonfinite: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("versions", "total", "weight_version", "queued_sequences", "running_sequences", "uptime_seconds", "speculation", "draft_collapsed", "draft_collapses", "kv")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COLLAPSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COLLAPSES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionStats]
    total: _common_pb2.SpeculationCounters
    weight_version: int
    queued_sequences: int
    running_sequences: int
    uptime_seconds: float
    speculation: SpeculationDecision
    draft_collapsed: DraftCollapse
    draft_collapses: int
    kv: KVUsage
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionStats, _Mapping]]] = ..., total: _Optional[_Union[_common_pb2.SpeculationCounters, _Mapping]] = ..., weight_version: _Optional[int] = ..., queued_sequences: _Optional[int] = ..., running_sequences: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., speculation: _Optional[_Union[SpeculationDecision, _Mapping]] = ..., draft_collapsed: _Optional[_Union[DraftCollapse, _Mapping]] = ..., draft_collapses: _Optional[int] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ...) -> None: ...

class KVUsage(_message.Message):
    __slots__ = ("block_size", "blocks_total", "blocks_used", "blocks_shared", "preemptions", "blocks_cached", "prefix_cache_evictions")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_shared: int
    preemptions: int
    blocks_cached: int
    prefix_cache_evictions: int
    def __init__(self, block_size: _Optional[int] = ..., blocks_total: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_shared: _Optional[int] = ..., preemptions: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ...) -> None: ...

class DraftCollapse(_message.Message):
    __slots__ = ("weight_version", "latest_version", "reference_version", "tau_before", "tau_after", "verify_steps")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TAU_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TAU_AFTER_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    latest_version: int
    reference_version: int
    tau_before: float
    tau_after: float
    verify_steps: int
    def __init__(self, weight_version: _Optional[int] = ..., latest_version: _Optional[int] = ..., reference_version: _Optional[int] = ..., tau_before: _Optional[float] = ..., tau_after: _Optional[float] = ..., verify_steps: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("was_paused",)
    WAS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    was_paused: bool
    def __init__(self, was_paused: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("was_paused",)
    WAS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    was_paused: bool
    def __init__(self, was_paused: _Optional[bool] = ...) -> None: ...

class SetSpeculationRequest(_message.Message):
    __slots__ = ("speculation_k", "speculation_auto")
    SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_AUTO_FIELD_NUMBER: _ClassVar[int]
    speculation_k: int
    speculation_auto: bool
    def __init__(self, speculation_k: _Optional[int] = ..., speculation_auto: _Optional[bool] = ...) -> None: ...

class SetSpeculationResponse(_message.Message):
    __slots__ = ("previous_speculation_k", "speculation_k", "previous_speculation_auto", "speculation_auto")
    PREVIOUS_SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SPECULATION_AUTO_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_AUTO_FIELD_NUMBER: _ClassVar[int]
    previous_speculation_k: int
    speculation_k: int
    previous_speculation_auto: bool
    speculation_auto: bool
    def __init__(self, previous_speculation_k: _Optional[int] = ..., speculation_k: _Optional[int] = ..., previous_speculation_auto: _Optional[bool] = ..., speculation_auto: _Optional[bool] = ...) -> None: ...
