from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WeightSelector(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_SELECTOR_UNSPECIFIED: _ClassVar[WeightSelector]
    WEIGHT_SELECTOR_ALL: _ClassVar[WeightSelector]
    WEIGHT_SELECTOR_TARGET: _ClassVar[WeightSelector]
    WEIGHT_SELECTOR_DRAFT: _ClassVar[WeightSelector]
WEIGHT_SELECTOR_UNSPECIFIED: WeightSelector
WEIGHT_SELECTOR_ALL: WeightSelector
WEIGHT_SELECTOR_TARGET: WeightSelector
WEIGHT_SELECTOR_DRAFT: WeightSelector

class SpeculationCounters(_message.Message):
    __slots__ = ("verify_steps", "drafted_tokens", "accepted_tokens", "generated_tokens", "drafted_per_position", "accepted_per_position")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    generated_tokens: int
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, verify_steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...
