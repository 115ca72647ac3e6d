"""The engine interface: what a sidecar needs from a model server.

An engine is driven step by step by one scheduler thread (the sidecar's), never
concurrently. Between two `step()` calls the scheduler may submit requests, abort them,
change k, or swap weights — so a weight update always lands on a step boundary and no
token is ever computed from half-applied weights.

Implementations: `sidecar.engine.torch_engine.TorchEngine` (embedded PyTorch, the default,
CPU and CUDA) and `sidecar.engine.sglang.engine.SGLangEngine` (GPU clusters).
Protobuf never appears here: the server converts at the edge.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from sidecar.errors import NotSupportedError
from sidecar.types import (
    EngineInfo,
    GenerationRequest,
    KVUsage,
    Sample,
    ScoreRequest,
    SpeculationStatus,
    TensorSpec,
    VersionStats,
    WeightSelector,
)


class Engine(ABC):
    """A model server with speculative decoding, driven one step at a time."""

    @abstractmethod
    def info(self) -> EngineInfo:
        """Model, device and speculation settings."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights being served (0 until the first update)."""

    @abstractmethod
    def validate(self, request: GenerationRequest) -> None:
        """Raise `InvalidRequestError` naming the problem if `request` cannot be served.

        Checks token ids against the vocabulary, prompt + max_new_tokens against the
        context, and speculation_k against the maximum. Changes nothing.
        """

    @abstractmethod
    def submit(self, request: GenerationRequest) -> None:
        """Queue every sequence of `request` (validated first; request_id must be set and
        unique among live requests). Sequences join the running batch in later steps."""

    @abstractmethod
    def step(self) -> list[Sample]:
        """Advance every running sequence by one target forward (admitting queued ones
        first) and return the samples that finished in this step."""

    @abstractmethod
    def abort(self, request_id: str) -> list[Sample]:
        """Remove a request's unfinished sequences; return them as ABORT samples holding
        the tokens generated so far. Unknown ids return []."""

    @abstractmethod
    def num_queued(self) -> int:
        """Sequences submitted but not yet running."""

    @abstractmethod
    def num_running(self) -> int:
        """Sequences in the running batch."""

    def kv_usage(self) -> KVUsage:
        """The engine's KV blocks now (`KVUsage`; zeros where the engine pages none itself)."""
        return KVUsage()

    def has_work(self) -> bool:
        return self.num_queued() + self.num_running() > 0

    @abstractmethod
    def set_speculation_k(self, k: int) -> None:
        """Set the default draft length (0 turns speculation off); ValueError beyond max."""

    def set_speculation_auto(self, k: int) -> None:
        """Automatic mode: a k in [0, k] chosen per engine step (see
        `sidecar.speculation.controller`). ValueError where the engine has none."""
        raise ValueError(f"the {self.info().engine} engine has no automatic speculation mode; set a fixed k")

    def hold_drafting(self, why: str) -> bool:
        """Automatic k drafts nothing until the next weight version (the served version's draft
        collapsed: `sidecar.speculation.collapse`); fixed and request-pinned k are left alone.
        True if new requests get automatic k (now held); False where they get a fixed k (and on
        engines without automatic k, as here)."""
        return False

    def speculation_status(self) -> SpeculationStatus:
        """The k in use and why (engines without automatic mode: the fixed default k)."""
        k = self.info().speculation_k
        return SpeculationStatus(speculation_auto=False, speculation_k=k, reason="fixed", detail=f"fixed default k={k}")

    @abstractmethod
    def weight_specs(self, selector: WeightSelector) -> list[TensorSpec]:
        """The tensors (naming contract names, dtypes, shapes) an update of `selector` must
        contain."""

    @abstractmethod
    def update_weights(self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int) -> None:
        """Replace the `selector` part of the model with `tensors` and serve `version`.

        All-or-nothing: raises `StaleVersionError` if version <= weight_version,
        `UnknownTensorError` for a name the model lacks, `WeightMismatchError` for a dtype or
        shape mismatch or a missing tensor — in every case before touching the served
        weights. Called only between steps.
        """

    def adopt_weights(
        self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int
    ) -> dict[str, torch.Tensor]:
        """`update_weights`, allowed to take `tensors` over as the served weights instead of
        copying them (a 1 GiB copy is ~0.1 s on a CPU core; a weight receiver stages tensors
        that nothing else holds). Returns the buffers the caller may now overwrite: the ones
        it displaced, or, for an engine that copies (this default), `tensors` themselves.
        The same checks, all-or-nothing, before anything changes."""
        self.update_weights(tensors, selector, version)
        return dict(tensors)

    def weight_checksums(self, selector: WeightSelector) -> dict[str, int] | None:
        """CRC-32 of each served tensor of `selector` (naming-contract names; the bytes a push of
        it would carry), or None when the engine cannot read its weights back. Called between
        steps; lets a client prove which weights are served (`specrl verify`)."""
        return None

    def score(self, request: ScoreRequest) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence's tokens from its start index on
        (RolloutService.Score), with the weights served now. Engines that cannot score raise
        NotSupportedError (UNIMPLEMENTED)."""
        raise NotSupportedError(
            f"the {type(self).__name__} engine cannot score sequences; serve with --engine torch for Score"
        )

    @abstractmethod
    def stats(self) -> list[VersionStats]:
        """Raw counters of the recent weight versions served, oldest first (monotonic, never
        reset; at most `version_ledger.RECENT_VERSIONS` of them)."""

    @abstractmethod
    def earlier_stats(self) -> VersionStats:
        """The sum of the counters of every version served before those `stats()` lists."""

    def generate(self, request: GenerationRequest) -> list[Sample]:
        """Run one request to completion (a convenience for tests, tools and the trainer).

        Samples come back sorted by (prompt_index, sample_index).
        """
        if not request.request_id:
            request.request_id = f"generate-{id(request):x}"
        self.submit(request)
        done: list[Sample] = []
        expected = len(request.prompts) * request.samples_per_prompt
        while len(done) < expected:
            done.extend(s for s in self.step() if s.request_id == request.request_id)
        return sorted(done, key=lambda s: (s.prompt_index, s.sample_index))

    def close(self) -> None:
        """Release what the engine holds outside this process (SGLang: its scheduler processes).

        The embedded engine holds nothing of the kind; `specrl serve` calls this on shutdown.
        """
        return None
