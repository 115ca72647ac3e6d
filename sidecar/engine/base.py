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

from sidecar.types import EngineInfo, GenerationRequest, Sample, TensorSpec, VersionStats, WeightSelector


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

    def has_work(self) -> bool:
        return self.num_queued() + self.num_running() > 0

    @abstractmethod
    def set_speculation_k(self, k: int) -> None:
        """Set the default draft length (0 turns speculation off); ValueError beyond max."""

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

    @abstractmethod
    def stats(self) -> list[VersionStats]:
        """Raw counters per weight version served, oldest first (monotonic, never reset)."""

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
