from sidecar.protocol.specrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeltaEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_ENCODING_UNSPECIFIED: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_INDEX: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_BITMASK: _ClassVar[DeltaEncoding]

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GRPC: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_COLLECTIVE: _ClassVar[WeightTransport]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
DELTA_ENCODING_UNSPECIFIED: DeltaEncoding
DELTA_ENCODING_INDEX: DeltaEncoding
DELTA_ENCODING_BITMASK: DeltaEncoding
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_GRPC: WeightTransport
WEIGHT_TRANSPORT_SHM: WeightTransport
WEIGHT_TRANSPORT_COLLECTIVE: WeightTransport
D_TYPE_UNSPECIFIED: DType
D_TYPE_FLOAT32: DType
D_TYPE_FLOAT16: DType
D_TYPE_BFLOAT16: DType

class TensorDelta(_message.Message):
    __slots__ = ("encoding", "changed", "payload_length", "payload_crc32")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CRC32_FIELD_NUMBER: _ClassVar[int]
    encoding: DeltaEncoding
    changed: int
    payload_length: int
    payload_crc32: int
    def __init__(self, encoding: _Optional[_Union[DeltaEncoding, str]] = ..., changed: _Optional[int] = ..., payload_length: _Optional[int] = ..., payload_crc32: _Optional[int] = ...) -> None: ...

class ShmPlacement(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: str
    def __init__(self, region: _Optional[str] = ...) -> None: ...

class CollectivePlacement(_message.Message):
    __slots__ = ("group_id", "bucket_bytes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    bucket_bytes: int
    def __init__(self, group_id: _Optional[str] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class PlacedTensor(_message.Message):
    __slots__ = ("tensor_index", "offset", "byte_length", "crc32")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    byte_length: int
    crc32: int
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., byte_length: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class WeightPlaced(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[PlacedTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[PlacedTensor, _Mapping]]] = ...) -> None: ...

class ShmProbe(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: str
    def __init__(self, region: _Optional[str] = ...) -> None: ...

class CollectiveRendezvous(_message.Message):
    __slots__ = ("group_id", "backend", "host", "port", "rank", "world_size", "timeout_seconds")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    backend: str
    host: str
    port: int
    rank: int
    world_size: int
    timeout_seconds: float
    def __init__(self, group_id: _Optional[str] = ..., backend: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class PrepareTransportRequest(_message.Message):
    __slots__ = ("shm", "collective")
    SHM_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    shm: ShmProbe
    collective: CollectiveRendezvous
    def __init__(self, shm: _Optional[_Union[ShmProbe, _Mapping]] = ..., collective: _Optional[_Union[CollectiveRendezvous, _Mapping]] = ...) -> None: ...

class PrepareTransportResponse(_message.Message):
    __slots__ = ("shm_nonce", "group_id")
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    shm_nonce: bytes
    group_id: str
    def __init__(self, shm_nonce: _Optional[bytes] = ..., group_id: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "byte_length", "crc32", "delta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_length: int
    crc32: int
    delta: TensorDelta
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., byte_length: _Optional[int] = ..., crc32: _Optional[int] = ..., delta: _Optional[_Union[TensorDelta, _Mapping]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "selector", "tensors", "shm", "collective", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    selector: _common_pb2.WeightSelector
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    shm: ShmPlacement
    collective: CollectivePlacement
    base_version: int
    def __init__(self, version: _Optional[int] = ..., selector: _Optional[_Union[_common_pb2.WeightSelector, str]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., shm: _Optional[_Union[ShmPlacement, _Mapping]] = ..., collective: _Optional[_Union[CollectivePlacement, _Mapping]] = ..., base_version: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("tensor_index", "offset", "data", "crc32", "tensor_crc32")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TENSOR_CRC32_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    crc32: int
    tensor_crc32: int
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., tensor_crc32: _Optional[int] = ...) -> None: ...

class WeightCommit(_message.Message):
    __slots__ = ("chunk_count",)
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    chunk_count: int
    def __init__(self, chunk_count: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "commit", "placed")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    chunk: WeightChunk
    commit: WeightCommit
    placed: WeightPlaced
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ..., commit: _Optional[_Union[WeightCommit, _Mapping]] = ..., placed: _Optional[_Union[WeightPlaced, _Mapping]] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("version", "previous_version", "bytes_received", "tensors_updated", "receive_seconds", "apply_seconds", "transport")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    version: int
    previous_version: int
    bytes_received: int
    tensors_updated: int
    receive_seconds: float
    apply_seconds: float
    transport: WeightTransport
    def __init__(self, version: _Optional[int] = ..., previous_version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., tensors_updated: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., apply_seconds: _Optional[float] = ..., transport: _Optional[_Union[WeightTransport, str]] = ...) -> None: ...

class DescribeWeightsRequest(_message.Message):
    __slots__ = ("selector", "include_checksums")
    SELECTOR_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    selector: _common_pb2.WeightSelector
    include_checksums: bool
    def __init__(self, selector: _Optional[_Union[_common_pb2.WeightSelector, str]] = ..., include_checksums: _Optional[bool] = ...) -> None: ...

class DescribeWeightsResponse(_message.Message):
    __slots__ = ("tensors", "weight_version", "transports", "accepts_deltas")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_DELTAS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    weight_version: int
    transports: _containers.RepeatedScalarFieldContainer[WeightTransport]
    accepts_deltas: bool
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., weight_version: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[WeightTransport, str]]] = ..., accepts_deltas: _Optional[bool] = ...) -> None: ...
