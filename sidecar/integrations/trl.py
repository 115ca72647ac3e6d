"""TRL's GRPOTrainer generating and syncing weights through a specrl sidecar (the `trl` extra).

A TRL user swaps `GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="server"))` for
`SpecrlGRPOTrainer(..., args=GRPOConfig(...), sidecar="host:port")` and gets lossless
speculative rollouts; nothing else in the training script changes, and no NCCL group is
needed (weights go over specrl.v1's verified `PushWeights` stream).

The seam, pinned to TRL 1.16 (`trl==1.16.0`, tested by tools/test-trl):

- `SpecrlVLLMClient` has the public method surface of `trl.generation.vllm_client.VLLMClient`
  that server mode uses (`generate`, `update_named_params`, `update_named_param` inside
  `weight_update()`, `reset_prefix_cache`, `init_communicator`, `close_communicator`,
  `get_server_info`, `get_world_size`, `check_server`) and speaks gRPC to a sidecar.
- `SpecrlVLLMGeneration` is TRL's own `VLLMGeneration` with one override, `_init_vllm`, the
  method that builds the client: it attaches a `SpecrlVLLMClient` instead of requiring vLLM.
  Everything else (gathering under FSDP/DeepSpeed, PEFT merging, the name fixes, the process
  broadcast) is TRL's code, unchanged.
- `SpecrlGRPOTrainer` builds GRPOTrainer without vLLM (vLLM need not be installed) and then
  takes the server-mode path: `use_vllm`, `vllm_mode`, `vllm_generation`, `_last_loaded_step`.
  `check_trl_seam()` verifies these names against the installed TRL before anything runs, so
  a TRL release that moves them fails loudly at construction, never silently.

Unsupported vLLM-server features raise `UnsupportedBySidecar` (a ValueError) naming the feature
and what to do; the README lists them ("Use specrl from TRL").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sidecar.client.client import ClientConfig, SidecarClient
from sidecar.client.draft_alarm import DraftAlarms
from sidecar.integrations.draft_alignment import DraftAligner
from sidecar.integrations.weight_session import SessionConfig, WeightUpdateSession
from sidecar.types import (
    DraftCollapse,
    GenerationRequest,
    LogprobMode,
    PushResult,
    SamplingParams,
    ScoreRequest,
    SpeculationCounters,
    TensorSpec,
    WeightSelector,
)

try:
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("sidecar.integrations.trl needs TRL: pip install 'specrl[trl]' (pins trl==1.16.0)") from e

log = logging.getLogger(__name__)

TRL_VERSION = "1.16.0"
"""The TRL release this seam is written and tested against."""


class UnsupportedBySidecar(ValueError):
    """A vLLM-server feature a specrl sidecar does not offer (the message says what to do)."""


@dataclass(kw_only=True, slots=True)
class SidecarGenerationConfig:
    """How the TRL adapter talks to its sidecar."""

    logprob_mode: LogprobMode = LogprobMode.RAW
    """RAW (default): log_softmax(logits / T) before top-k/top-p, exactly what GRPOTrainer
    recomputes for its importance-sampling correction. PROCESSED: vLLM's processed_logprobs."""
    speculation_k: int | None = None
    """Draft length per request; None uses the sidecar's default."""
    seed: int | None = None
    """Base seed of generation requests (request i uses seed + i); None draws fresh seeds."""
    client: ClientConfig | None = None
    """Deadlines, token and TLS of the gRPC client."""
    session: SessionConfig | None = None
    """Chunking of weight updates."""

    def __post_init__(self) -> None:
        if self.speculation_k is not None and self.speculation_k < 0:
            raise ValueError(f"speculation_k must be >= 0 or None, got {self.speculation_k}")


_GENERATION_KWARGS = {"seed", "stop_token_ids", "ignore_eos"}
"""vLLM SamplingParams keys that `generation_kwargs` may carry; everything else is refused."""


class SpecrlVLLMClient:
    """`trl.generation.vllm_client.VLLMClient`'s server-mode surface over one specrl sidecar."""

    def __init__(self, address: str, config: SidecarGenerationConfig | None = None) -> None:
        self.config = config or SidecarGenerationConfig()
        self.sidecar = SidecarClient(address, self.config.client)
        self._info = self.sidecar.info()
        self._version = self._info.weight_version
        self._requests = 0
        self._session: WeightUpdateSession | None = None
        self._dtypes: dict[str, torch.dtype] | None = None
        self._lock = threading.Lock()
        self.counters: list[SpeculationCounters] = []
        """Summed speculation counters of each `generate` call (τ per TRL step)."""
        self.push_results: list[PushResult] = []
        """The result of each committed weight update (policy and draft)."""
        self.draft_aligner: DraftAligner | None = None
        """Refits and pushes the draft after policy syncs (see `SpecrlGRPOTrainer(draft_aligner=)`)."""
        self._last_sequences: list[list[int]] = []
        self.draft_collapse: DraftCollapse | None = None
        """The sidecar's draft-collapse alarm as of the latest `generate` (None: the draft works);
        warned once per collapse, and it makes the `draft_aligner`'s refit due at the next sync."""
        self._alarms = DraftAlarms()

    # --- server ---------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def sidecar_dtype(self) -> str:
        """The served weights' dtype, e.g. "float32"."""
        return self._info.engine.model.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._info.engine.model.eos_token_ids

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        if not self.sidecar.health():
            raise ConnectionError(f"the specrl sidecar at {self.sidecar.address} is not serving")

    def get_server_info(self) -> dict[str, Any]:
        """A vLLM-shaped `/server_info` (only the keys TRL reads), plus the sidecar's own info."""
        mode = "processed_logprobs" if self.config.logprob_mode is LogprobMode.PROCESSED else "specrl_raw_logprobs"
        return {"model_config": {"logprobs_mode": mode}, "specrl": self.sidecar.info()}

    def get_world_size(self) -> int:
        return 1

    def init_communicator(self, device: Any = 0) -> None:
        """No-op: weights travel over gRPC, there is no NCCL group to join."""

    def close_communicator(self) -> None:
        """No-op (see init_communicator)."""

    def reset_prefix_cache(self) -> None:
        """No-op: a sidecar keeps no KV prefix cache across requests, so nothing can go stale."""

    # --- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        features: list[dict | None] | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
    ) -> dict[str, Any]:
        """VLLMClient.generate: n completions per prompt, prompt-major, with the sampled tokens'
        log-probs as (completion, token, 1) lists."""
        if features is not None:
            raise UnsupportedBySidecar("image features (multimodal prompts) are not supported by specrl sidecars")
        if prompts and isinstance(prompts[0], str):
            raise UnsupportedBySidecar(
                "text prompts are not supported: a sidecar takes token ids (GRPOTrainer sends token ids already)"
            )
        if repetition_penalty != 1.0:
            raise UnsupportedBySidecar(
                f"repetition_penalty={repetition_penalty} is not supported (lossless speculation samples the "
                "unmodified target distribution); set repetition_penalty=1.0"
            )
        if min_p:
            raise UnsupportedBySidecar(f"min_p={min_p} is not supported; use top_k/top_p, or min_p=0")
        if structured_outputs_regex is not None:
            raise UnsupportedBySidecar("structured outputs (vllm_structured_outputs_regex) are not supported")
        if logprobs not in (0, None):
            raise UnsupportedBySidecar(
                f"logprobs={logprobs} (top-N alternatives) is not supported; a sidecar reports the sampled "
                "token's log-prob only (logprobs=0)"
            )
        extra = dict(generation_kwargs or {})
        unknown = sorted(set(extra) - _GENERATION_KWARGS)
        if unknown:
            raise UnsupportedBySidecar(
                f"generation_kwargs {unknown} are not supported by specrl sidecars; supported: "
                f"{sorted(_GENERATION_KWARGS)}"
            )
        seed = extra.get("seed")
        if seed is None and self.config.seed is not None:
            seed = self.config.seed + self._requests
        self._requests += 1
        sampling = SamplingParams(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k) if top_k and top_k > 0 else 0,  # vLLM's -1 and 0 both disable
            max_new_tokens=int(max_tokens),
            stop_token_ids=tuple(int(t) for t in extra.get("stop_token_ids") or ()),
            stop_at_eos=not extra.get("ignore_eos", False),
            seed=None if seed is None else int(seed),
            logprob_mode=self.config.logprob_mode,
        )
        token_prompts = [list(map(int, p)) for p in prompts]
        request = GenerationRequest(
            prompts=token_prompts,
            sampling=sampling,
            samples_per_prompt=n,
            min_weight_version=self._version,
            speculation_k=self.config.speculation_k,
        )
        samples = sorted(self.sidecar.generate(request), key=lambda s: (s.prompt_index, s.sample_index))
        total = SpeculationCounters()
        for s in samples:
            total.add(s.counters)
        self.counters.append(total)
        stats = self.sidecar.stats()  # the draft-collapse alarm (a warning once per collapse)
        self._alarms.observe(self.sidecar.address, stats)
        self.draft_collapse = stats.draft_collapsed
        self._last_sequences = [token_prompts[s.prompt_index] + list(s.token_ids) for s in samples]
        return {
            "prompt_ids": token_prompts,
            "completion_ids": [list(s.token_ids) for s in samples],
            "logprobs": [[[lp] for lp in s.logprobs] for s in samples],
            "logprob_token_ids": [[[t] for t in s.token_ids] for s in samples],
        }

    def chat(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedBySidecar(
            "chat() is not supported: apply the chat template on the trainer and send token ids "
            "(GRPOTrainer does so for conversational datasets)"
        )

    def image_features(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedBySidecar("image features (multimodal prompts) are not supported by specrl sidecars")

    def get_sequence_logprobs(
        self,
        sequences: list[list[int]],
        prompt_lengths: list[int],
        top_logprobs: int = 100,
        temperature: float = 1.0,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
    ) -> dict[str, list]:
        """VLLMClient.get_sequence_logprobs through RolloutService.Score: the log-prob of each
        completion token (`actual_logprobs`). Top-N alternatives are not available, so
        top_logprobs must be 0 (then `logprobs` repeats the actual tokens' log-probs)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if top_logprobs:
            raise UnsupportedBySidecar(
                f"top_logprobs={top_logprobs} (top-N teacher alternatives) is not supported; a sidecar scores "
                "the given tokens only: pass top_logprobs=0 and use 'actual_logprobs'"
            )
        result = self.sidecar.score(
            ScoreRequest(
                sequences=[list(map(int, s)) for s in sequences],
                start_indices=list(prompt_lengths),
                temperature=temperature,
            )
        )
        actual = [[[lp] for lp in lps] for lps in result.logprobs]
        ids = [[[int(t)] for t in s[p:]] for s, p in zip(sequences, prompt_lengths, strict=True)]
        return {"logprobs": actual, "logprob_token_ids": ids, "actual_logprobs": actual, "actual_token_ids": ids}

    # --- weights --------------------------------------------------------------------------

    def _served_dtype(self, name: str) -> torch.dtype:
        """The dtype the sidecar serves `name` in (tensors are converted one at a time to it).
        An unknown name keeps float32 here and is refused by the sidecar with NOT_FOUND."""
        if self._dtypes is None:
            specs, _ = self.sidecar.describe_weights(WeightSelector.ALL)
            self._dtypes = {s.name: s.dtype for s in specs}
        return self._dtypes.get(name, torch.float32)

    def _open(self, specs: list[TensorSpec] | None) -> WeightUpdateSession:
        return WeightUpdateSession(
            self.sidecar,
            version=self._version + 1,
            selector=WeightSelector.TARGET,
            specs=specs,
            config=self.config.session,
        )

    def _finish(self, session: WeightUpdateSession) -> PushResult:
        result = session.commit()
        self._version = result.version
        self.push_results.append(result)
        return result

    def _after_policy_sync(self) -> None:
        """Refit the draft to the just-synced policy on the latest rollouts and push it (DRAFT)."""
        aligner = self.draft_aligner
        if aligner is None or not aligner.due(collapsed=self.draft_collapse is not None) or not self._last_sequences:
            return
        aligner.fit(self._last_sequences)
        tensors = aligner.draft_tensors()
        specs = [TensorSpec(name=n, dtype=self._served_dtype(n), shape=tuple(t.shape)) for n, t in tensors]
        session = WeightUpdateSession(
            self.sidecar,
            version=self._version + 1,
            selector=WeightSelector.DRAFT,
            specs=specs,
            config=self.config.session,
        )
        try:
            for name, t in tensors:
                session.send(name, t)
        except BaseException:
            session.abort()
            raise
        self._finish(session)

    def update_named_params(
        self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        """One atomic update of the tensors `metadata` announces (name, dtype, shape), streamed
        from `named_params` one tensor at a time (no copy of the model is gathered). The policy
        (target) part only: TRL does not train the MTP draft (see `keep_draft_aligned`)."""
        if self._session is not None:  # inside weight_update(): feed the open session
            for name, tensor in named_params:
                self._session.send(name, tensor)
            return
        specs = [TensorSpec(name=n, dtype=self._served_dtype(n), shape=tuple(shape)) for n, _, shape in metadata]
        session = self._open(specs)
        try:
            for name, tensor in named_params:
                session.send(name, tensor)
        except BaseException:
            session.abort()
            raise
        self._finish(session)
        self._after_policy_sync()

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """Inside `weight_update()`: add one tensor to the open session. Outside it the sidecar
        would need every policy tensor in one update, so a lone tensor is refused."""
        if self._session is None:
            raise UnsupportedBySidecar(
                f"update_named_param({name!r}) outside `with client.weight_update():` is not supported: a sidecar "
                "applies the policy atomically, so wrap the per-tensor calls in weight_update()"
            )
        self._session.send(name, weights)

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """Group `update_named_param` calls into one atomic update: every policy tensor must be
        sent before the block ends; an exception (or a missing tensor) applies nothing."""
        with self._lock:
            if self._session is not None:
                raise RuntimeError("weight_update() is already open; updates do not nest")
            self._session = self._open(None)
        try:
            yield
        except BaseException:
            self._session.abort()
            raise
        else:
            self._finish(self._session)
            self._after_policy_sync()
        finally:
            self._session = None

    def update_model_params(self, model: torch.nn.Module) -> None:
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
        self.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))

    def close(self) -> None:
        self.sidecar.close()


class SpecrlVLLMGeneration(VLLMGeneration):
    """TRL's VLLMGeneration in server mode, with a `SpecrlVLLMClient` as its client."""

    def __init__(self, *args: Any, specrl_client: SpecrlVLLMClient, **kwargs: Any) -> None:
        self._specrl_client = specrl_client
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise UnsupportedBySidecar(f"vllm_mode={self.mode!r}: a sidecar is a server; use vllm_mode='server'")
        if self.accelerator.is_main_process:
            self.vllm_client = self._specrl_client


_TRAINER_ATTRS = ("use_vllm", "vllm_mode", "vllm_generation", "_last_loaded_step")


def check_trl_seam() -> None:
    """Fail loudly unless the installed TRL has the seam this module fills (see module doc)."""
    import trl

    problems = []
    if trl.__version__ != TRL_VERSION:
        problems.append(f"TRL {trl.__version__} is installed, this integration is tested with {TRL_VERSION}")
    if not callable(getattr(VLLMGeneration, "_init_vllm", None)):
        problems.append("trl.generation.vllm_generation.VLLMGeneration has no _init_vllm")
    for method in ("generate", "sync_weights"):
        if not callable(getattr(VLLMGeneration, method, None)):
            problems.append(f"VLLMGeneration has no {method}()")
    params = inspect.signature(VLLMGeneration.__init__).parameters
    for name in ("model", "accelerator", "processing_class", "mode", "temperature", "max_completion_length"):
        if name not in params:
            problems.append(f"VLLMGeneration.__init__ takes no {name}=")
    source = inspect.getsource(GRPOTrainer)
    for attr in _TRAINER_ATTRS:
        if f"self.{attr}" not in source:
            problems.append(f"GRPOTrainer no longer uses self.{attr}")
    if problems:
        raise RuntimeError(
            "specrl's TRL seam does not match the installed TRL: "
            + "; ".join(problems)
            + f". Install trl=={TRL_VERSION} (pip install 'specrl[trl]')"
        )


class SpecrlGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose rollouts and weight syncs go to a specrl sidecar.

    Takes GRPOTrainer's arguments plus `sidecar` (an address "host:port", or a ready
    `SpecrlVLLMClient`), `sidecar_config`, and optionally `draft_aligner` (a
    `sidecar.integrations.draft_alignment.DraftAligner`: after each policy sync, refit the MTP
    draft to the new policy on the latest rollouts and push it, since TRL never trains it). `args.use_vllm`/`args.vllm_mode` may be left as
    they are; the trainer runs TRL's vLLM server-mode path either way.
    """

    _specrl_generation_args: ClassVar[tuple[str, ...]] = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "max_completion_length",
    )

    def __init__(
        self,
        *args: Any,
        sidecar: str | SpecrlVLLMClient,
        sidecar_config: SidecarGenerationConfig | None = None,
        draft_aligner: DraftAligner | None = None,
        **kwargs: Any,
    ) -> None:
        check_trl_seam()
        training_args = kwargs.get("args")
        if training_args is None:
            raise ValueError("SpecrlGRPOTrainer needs args=GRPOConfig(...) as a keyword argument")
        if training_args.use_vllm and training_args.vllm_mode != "server":
            raise UnsupportedBySidecar(
                f"vllm_mode={training_args.vllm_mode!r}: a sidecar is a server; use vllm_mode='server'"
            )
        client = sidecar if isinstance(sidecar, SpecrlVLLMClient) else SpecrlVLLMClient(sidecar, sidecar_config)
        # GRPOTrainer builds vLLM itself when use_vllm is set (and requires vLLM installed); build it
        # without, then take the server-mode path with the sidecar client.
        was = training_args.use_vllm
        training_args.use_vllm = False
        try:
            super().__init__(*args, **kwargs)
        finally:
            training_args.use_vllm = was
        served = client.sidecar_dtype
        trained = "bfloat16" if training_args.bf16 else "float16" if training_args.fp16 else "float32"
        if served != trained:
            log.warning(
                "the sidecar serves %s weights but GRPOTrainer computes in %s: TRL's sampling log-prob mismatch "
                "will show %s rounding, not a sidecar error (set bf16=False/fp16=False, or serve a %s checkpoint)",
                served,
                trained,
                "bfloat16" if "bfloat16" in (served, trained) else "float16",
                trained,
            )
        self.specrl_client = client
        self.use_vllm = True
        self.vllm_mode = "server"
        self.vllm_generation = SpecrlVLLMGeneration(
            model=self.model,
            accelerator=self.accelerator,
            processing_class=self.processing_class,
            mode="server",
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_completion_length=self.max_completion_length,
            logprobs=0,
            generation_kwargs=training_args.generation_kwargs,
            specrl_client=client,
        )
        self._last_loaded_step = -1
        if draft_aligner is not None:
            if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
                raise UnsupportedBySidecar(
                    "draft_aligner with FSDP or DeepSpeed is not supported: it runs the policy forward on the main "
                    "process alone, which sharded parameters cannot do; train without it (the draft then goes stale)"
                )
            draft_aligner.bind(self.accelerator.unwrap_model(self.model))
            client.draft_aligner = draft_aligner
