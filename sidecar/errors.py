"""Specific exceptions of the rollout side. The gRPC edge maps each to one status code."""

from __future__ import annotations


class SpecrlError(Exception):
    """Base of specrl's own errors; the message says what was wrong and what to do."""


class InvalidRequestError(SpecrlError, ValueError):
    """A generation request the engine cannot serve as given (INVALID_ARGUMENT)."""


class NonFiniteWeightsError(InvalidRequestError):
    """Pushed weights holding a NaN or an infinity (INVALID_ARGUMENT): refused before anything is
    applied, so the served weights and version stay as they were."""


class UnknownTensorError(SpecrlError, KeyError):
    """A weight name the model does not have (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class WeightMismatchError(SpecrlError, ValueError):
    """Weights that do not fit the model: dtype, shape or missing tensors (FAILED_PRECONDITION)."""


class StaleVersionError(SpecrlError, ValueError):
    """A weight version that is not newer than the served one (FAILED_PRECONDITION)."""


class DeltaBaseError(SpecrlError, ValueError):
    """A delta push whose base is not what the sidecar serves or holds (FAILED_PRECONDITION):
    nothing applied; the sender pushes the full tensors instead."""


class CheckpointError(SpecrlError, ValueError):
    """A checkpoint directory that cannot be loaded (missing or malformed files)."""


class ServedVersionTooOldError(SpecrlError):
    """The sidecar serves an older weight version than a request demands (FAILED_PRECONDITION)."""


class DuplicateRequestError(InvalidRequestError):
    """A request_id already used by a live request (INVALID_ARGUMENT)."""


class OverloadedError(SpecrlError):
    """The bounded admission queue is full; retry with backoff (RESOURCE_EXHAUSTED)."""


class KVCacheCapacityError(OverloadedError):
    """A sequence longer than a KV cache row holds (the engine's max_context, set by its memory
    budget): RESOURCE_EXHAUSTED, like a full queue, but retrying the same request cannot help —
    shorten prompt + max_new_tokens or serve with a larger max_context / KV budget."""


class PushInProgressError(SpecrlError):
    """Another weight push is being received or applied; retry after it ends (ABORTED)."""


class PushCancelledError(SpecrlError):
    """The pushing client went away before the push was complete (CANCELLED)."""


class ShuttingDownError(SpecrlError):
    """The sidecar is stopping and admits no new work (UNAVAILABLE)."""


class ApplyTimeoutError(SpecrlError):
    """A verified weight update did not reach an engine step boundary in time (DEADLINE_EXCEEDED)."""


class NotSupportedError(SpecrlError):
    """A call the serving engine does not implement (UNIMPLEMENTED)."""


class EngineFailure(SpecrlError):
    """The engine raised while stepping; the requests of that batch fail (INTERNAL)."""


class TransportUnavailableError(SpecrlError):
    """A weight transport (shm region, collective group) that cannot be used here or failed
    mid-transfer; nothing was applied, and the sender's next push negotiates again, falling back
    to grpc if need be (UNAVAILABLE: retry)."""
