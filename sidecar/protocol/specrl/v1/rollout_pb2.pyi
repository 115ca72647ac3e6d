from sidecar.protocol.specrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogprobMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_MODE_UNSPECIFIED: _ClassVar[LogprobMode]
    LOGPROB_MODE_RAW: _ClassVar[LogprobMode]
    LOGPROB_MODE_PROCESSED: _ClassVar[LogprobMode]

class RouteRequest(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_REQUEST_OFF: _ClassVar[RouteRequest]
    ROUTE_REQUEST_GENERATED: _ClassVar[RouteRequest]
    ROUTE_REQUEST_SEQUENCE: _ClassVar[RouteRequest]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
LOGPROB_MODE_UNSPECIFIED: LogprobMode
LOGPROB_MODE_RAW: LogprobMode
LOGPROB_MODE_PROCESSED: LogprobMode
ROUTE_REQUEST_OFF: RouteRequest
ROUTE_REQUEST_GENERATED: RouteRequest
ROUTE_REQUEST_SEQUENCE: RouteRequest
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ScoreSequence(_message.Message):
    __slots__ = ("token_ids", "start_index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., start_index: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("sequences", "temperature", "min_weight_version")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ScoreSequence]
    temperature: float
    min_weight_version: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[ScoreSequence, _Mapping]]] = ..., temperature: _Optional[float] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class SequenceScore(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "weight_version")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[SequenceScore]
    weight_version: int
    def __init__(self, scores: _Optional[_Iterable[_Union[SequenceScore, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "stop_at_eos", "logprob_mode")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_MODE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    stop_at_eos: bool
    logprob_mode: LogprobMode
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., stop_at_eos: _Optional[bool] = ..., logprob_mode: _Optional[_Union[LogprobMode, str]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "sampling", "samples_per_prompt", "min_weight_version", "speculation_k", "session_ids", "routes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_K_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    samples_per_prompt: int
    min_weight_version: int
    speculation_k: int
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    routes: RouteRequest
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., samples_per_prompt: _Optional[int] = ..., min_weight_version: _Optional[int] = ..., speculation_k: _Optional[int] = ..., session_ids: _Optional[_Iterable[str]] = ..., routes: _Optional[_Union[RouteRequest, str]] = ...) -> None: ...

class Routes(_message.Message):
    __slots__ = ("expert_ids", "positions", "sparse_layers", "top_k", "first_position", "id_bytes")
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ID_BYTES_FIELD_NUMBER: _ClassVar[int]
    expert_ids: bytes
    positions: int
    sparse_layers: int
    top_k: int
    first_position: int
    id_bytes: int
    def __init__(self, expert_ids: _Optional[bytes] = ..., positions: _Optional[int] = ..., sparse_layers: _Optional[int] = ..., top_k: _Optional[int] = ..., first_position: _Optional[int] = ..., id_bytes: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("request_id", "prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "weight_version", "last_weight_version", "counters", "routes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_index: int
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    weight_version: int
    last_weight_version: int
    counters: _common_pb2.SpeculationCounters
    routes: Routes
    def __init__(self, request_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., last_weight_version: _Optional[int] = ..., counters: _Optional[_Union[_common_pb2.SpeculationCounters, _Mapping]] = ..., routes: _Optional[_Union[Routes, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: Sample
    def __init__(self, sample: _Optional[_Union[Sample, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found", "aborted_samples")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ABORTED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    found: bool
    aborted_samples: int
    def __init__(self, found: _Optional[bool] = ..., aborted_samples: _Optional[int] = ...) -> None: ...
