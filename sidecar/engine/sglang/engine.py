"""The SGLang engine: specrl's step-driven `Engine` over `sglang.Engine` (pinned 0.5.23; GPU, or CPU).

SGLang serves speculative decoding itself (NEXTN for a model's built-in MTP layer, EAGLE /
EAGLE3 for a separate draft; Leviathan et al. 2023, https://arxiv.org/abs/2211.17192; Li et
al. 2024, EAGLE, https://arxiv.org/abs/2401.15077). This adapter translates, nothing more:

- ``build_server_args(config)``: one pure function from `SGLangEngineConfig` to the keyword
  arguments of ``sglang.Engine`` / ``ServerArgs`` (top-k 1, draft tokens = k + 1).
- ``sample_from_meta_info(...)``: one pure function from a finished request's output dict
  (``output_ids`` + ``meta_info``) to specrl's `Sample` with raw `SpeculationCounters`.
- `SGLangEngine`: submit / step / abort / update_weights on top of SGLang's asyncio API.

What a "step" means here. SGLang schedules internally (its own continuous batching in a
scheduler process). ``submit`` starts one ``async_generate`` task per sequence on SGLang's
event loop; ``step`` runs that loop for at most ``step_wait_s`` (returning as soon as one
sequence finished) and returns what finished since the last call. So a step is a collection
point, not one target forward; ``num_queued`` is always 0 and ``num_running`` counts the
sequences handed to SGLang. Everything runs on the caller's (the sidecar scheduler's) thread:
between two steps the loop is idle and SGLang's scheduler keeps generating.

Weight updates (`update_weights`), exactly as SGLang 0.5.23 allows:
pause_generation(retract) → begin_weight_update(selector) → update_weights_from_tensor
(selector "target", then "draft", the last call carrying weight_version and flushing the
cache) → end_weight_update → draft checksum proof → continue_generation. Retract mode puts
running requests back in SGLang's queue and drops their KV, so tokens after the push are
computed with the new weights (SGLang reports the split in ``meta_info["weight_versions"]``).

Sampling on CPU. SGLang 0.5.23 verifies drafts greedily on CPU whatever the temperature
(``speculative/eagle_utils.py``, ``_verify_uses_greedy``), and its PyTorch sampler applies top-p
before top-k renormalisation; `validate` refuses the requests whose samples would therefore not
follow specrl's distribution (tests/with_sglang/test_sglang_sampling.py shows both).

What SGLang can and cannot guarantee. specrl validates names, dtypes, shapes and the version
BEFORE calling SGLang, so those errors leave everything untouched (the ABC's all-or-nothing
contract). Past that point SGLang loads tensors in place, one runner after the other: a failure
inside SGLang can leave the target or the draft partly updated, and SGLang's loaders skip
unknown names silently (the stale-draft failure). So after every push that changes draft
tensors the adapter compares SGLang's per-parameter weight checksums
(``CheckWeightsReqInput(action="checksum", selector="draft")``) before and after, and requires
every draft parameter fed by a changed tensor to have changed. Any failure after the first
SGLang call marks the engine broken: it stays paused, `submit`/`step` raise
`SGLangEngineError`, and only a successful push of the broken part(s) (or "all") clears it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sidecar.engine.base import Engine
from sidecar.engine.config import EngineConfig
from sidecar.engine.sglang import names
from sidecar.engine.sglang.backend import SGLangBackend, SGLangEngineError, import_sglang, sampling_params_dict
from sidecar.engine.sglang.meta import sample_from_meta_info
from sidecar.engine.validation import check_weights, validate_request
from sidecar.engine.version_ledger import VersionLedger
from sidecar.errors import InvalidRequestError
from sidecar.model.checkpoint import draft_tensor_shapes, load_checkpoint, target_tensor_shapes
from sidecar.model.eagle3_checkpoint import load_eagle3_draft
from sidecar.model.model import ModelConfig
from sidecar.types import (
    EngineInfo,
    FinishReason,
    GenerationRequest,
    LogprobMode,
    ModelInfo,
    Sample,
    TensorSpec,
    VersionStats,
    WeightSelector,
)

log = logging.getLogger("specrl.sglang")

SGLANG_VERSION = "0.5.23"
ALGORITHMS = ("NEXTN", "EAGLE", "EAGLE3")

__all__ = [
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangEngineError",
    "StaleDraftError",
    "build_server_args",
    "sample_from_meta_info",
]


@dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """How to launch SGLang; `build_server_args` turns it into ``ServerArgs`` keywords."""

    model_path: str
    """Target directory in SGLang's layout (see `names.write_sglang_checkpoint`)."""
    speculative_algorithm: str | None = "NEXTN"
    """NEXTN (the model's MTP layer, via the draft directory), EAGLE, EAGLE3, or None (no draft)."""
    speculation_k: int = 3
    """Draft steps per verify (``speculative_num_steps``); fixed for the engine's lifetime."""
    draft_model_path: str | None = None
    """Draft directory; required with a speculative algorithm (NEXTN: the shim directory)."""
    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache; None lets SGLang choose."""
    tp_size: int = 1
    """Tensor-parallel GPUs."""
    dtype: str = "auto"
    """"auto" (the checkpoint's torch_dtype), "bfloat16", "float16" or "float32"."""
    seed: int = 0
    """SGLang's ``random_seed``."""
    max_running_requests: int | None = 64
    """Sequences SGLang runs at once (its speculative default would be 48)."""
    context_length: int | None = None
    """Override of the model context (None: max_position_embeddings)."""
    disable_cuda_graph: bool = False
    """True skips CUDA-graph capture (faster start, slower decode; handy in tests). Always on for CPU."""
    device: str = "cuda"
    """"cuda", "cuda:N" (SGLang's ``base_gpu_id`` = N) or "cpu" (SGLang's CPU engine, see `build_server_args`)."""
    rejection_sampling: bool = False
    """SGLang's ``speculative_use_rejection_sampling`` (sampled drafts + min(1, p/q)). False
    keeps SGLang's default target-only verification of greedy drafts, which is also lossless."""
    step_wait_s: float = 0.02
    """Longest a `step` waits for a sequence to finish before returning []."""
    abort_wait_s: float = 10.0
    """Longest `abort` waits for SGLang to hand back partial outputs."""
    served_name: str = ""
    """Model name reported by `info` ("" = the last component of model_path)."""
    extra_server_args: dict[str, Any] = field(default_factory=dict)
    """Further ``ServerArgs`` keywords, passed as given (they win over the ones built here)."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty; give SGLang's target directory")
        if self.speculative_algorithm is not None and self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {ALGORITHMS} or None, got {self.speculative_algorithm!r}"
            )
        if self.speculative_algorithm is not None:
            if self.speculation_k < 1:
                raise ValueError(
                    f"speculation_k must be >= 1 with {self.speculative_algorithm}, got {self.speculation_k}"
                )
            if not self.draft_model_path:
                raise ValueError(
                    f"draft_model_path is required with {self.speculative_algorithm}; for NEXTN use the draft "
                    "directory of names.write_sglang_checkpoint"
                )
        elif self.speculation_k != 0:
            raise ValueError(f"speculation_k must be 0 without a speculative algorithm, got {self.speculation_k}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1) or None, got {self.mem_fraction_static}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1 or None, got {self.max_running_requests}")
        if not self.step_wait_s > 0 or not self.abort_wait_s > 0:
            raise ValueError("step_wait_s and abort_wait_s must be > 0 (bounded waits)")


def build_server_args(config: SGLangEngineConfig) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine(**kw)`` (= ``ServerArgs(**kw)``) for `config`.

    Fixed choices: token ids in and out (``skip_tokenizer_init``), weight version "0" until the
    first push, top-k 1 chain drafting with ``speculative_num_draft_tokens = k + 1``. On
    ``device="cpu"`` CUDA graphs are off and SGLang chooses its CPU attention backend.
    """
    args: dict[str, Any] = {
        "model_path": config.model_path,
        "skip_tokenizer_init": True,
        "dtype": config.dtype,
        "tp_size": config.tp_size,
        "random_seed": config.seed,
        "weight_version": "0",
        "trust_remote_code": False,
        "disable_cuda_graph": config.disable_cuda_graph,
        "log_level": "error",
    }
    if config.device == "cpu":
        # SGLang's CPU engine (also needs SGLANG_USE_CPU_ENGINE=1, set by SGLangBackend.launch);
        # SGLang picks its CPU attention backend itself (intel_amx on x86).
        args.update(device="cpu", disable_cuda_graph=True)
    elif config.device.startswith("cuda:"):
        args["base_gpu_id"] = int(config.device.split(":", 1)[1])
    if config.mem_fraction_static is not None:
        args["mem_fraction_static"] = config.mem_fraction_static
    if config.max_running_requests is not None:
        args["max_running_requests"] = config.max_running_requests
    if config.context_length is not None:
        args["context_length"] = config.context_length
    if config.speculative_algorithm is not None:
        args.update(
            speculative_algorithm=config.speculative_algorithm,
            speculative_draft_model_path=config.draft_model_path,
            speculative_num_steps=config.speculation_k,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=config.speculation_k + 1,
        )
        if config.rejection_sampling:
            args["speculative_use_rejection_sampling"] = True
    args.update(config.extra_server_args)
    return args


def tensor_digest(t: torch.Tensor) -> str:
    """A content hash of a tensor's bytes (dtype and shape included)."""
    data = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}".encode(), digest_size=16)
    h.update(data.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer: no copy
    return h.hexdigest()


@dataclass(slots=True)
class _Seq:
    request_id: str
    prompt_index: int
    sample_index: int
    task: asyncio.Task[Any]


class SGLangEngine(Engine):
    """specrl's `Engine` over a running ``sglang.Engine`` (see the module docstring)."""

    def __init__(
        self,
        config: SGLangEngineConfig,
        model: ModelConfig,
        *,
        backend: SGLangBackend | None = None,
        draft_digests: Mapping[str, str] | None = None,
    ) -> None:
        """Launch SGLang for `config` (or use `backend`), serving a model shaped like `model`.

        `draft_digests` ({draft name: `tensor_digest`}) describe the draft SGLang loaded at
        launch; the stale-draft proof compares pushes against them. Without them every pushed
        draft tensor counts as changed (fail closed).
        """
        names.check_servable(model)
        self.config = config
        self.model = model
        self._k = config.speculation_k
        self._contract_draft = config.speculative_algorithm == "NEXTN"
        self._target_specs = {n: s for n, s in target_tensor_shapes(model).items()}
        self._draft_specs = self._read_draft_specs()
        self._draft_digest: dict[str, str] = dict(draft_digests or {})
        self._backend = backend if backend is not None else SGLangBackend.launch(build_server_args(config))
        self._seqs: dict[str, _Seq] = {}
        self._live: dict[str, int] = {}
        self._version = 0
        self._stats = VersionLedger()
        self._broken: set[str] = set()
        self._broken_why = ""

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str | Path, config: EngineConfig, **options: Any) -> SGLangEngine:
        """`create_engine`'s entry: `from_checkpoint` with the settings SGLang reads from `config`
        (device, k, batch, an EAGLE-3 draft); `options` as there. SGLang fixes k at launch: no
        automatic k (refused before anything starts)."""
        if config.speculation_auto:
            raise ValueError("the sglang engine has no automatic speculation mode; set a fixed k")
        return cls.from_checkpoint(
            path,
            device=config.device,
            speculation_k=config.speculation_k,
            max_speculation_k=config.max_speculation_k,
            max_batch_size=config.max_batch_size,
            draft=config.draft,
            **options,
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: str = "cuda",
        speculation_k: int = 3,
        max_speculation_k: int | None = None,
        max_batch_size: int = 64,
        work_dir: str | Path | None = None,
        draft: str | Path | None = None,
        **options: Any,
    ) -> SGLangEngine:
        """Serve a specrl checkpoint (naming contract) with SGLang NEXTN, or with SGLang EAGLE3 and
        `draft`, an EAGLE-3 draft directory (`eagle3_checkpoint`; the target has no MTP layers).

        Writes SGLang's target and draft directories under `work_dir` (default:
        ``<path>/sglang``), then launches SGLang. SGLang fixes k at launch, so
        `max_speculation_k` is ignored (the engine reports max = k); `max_batch_size` becomes
        ``max_running_requests``; `options` go to `SGLangEngineConfig`.
        """
        import_sglang(device)  # fail before writing SGLang's directories next to the checkpoint
        if max_speculation_k is not None and max_speculation_k != speculation_k:
            log.info(
                "SGLang fixes k at launch: serving k=%d, max_speculation_k=%d ignored", speculation_k, max_speculation_k
            )
        model, tensors = load_checkpoint(path)
        if draft is not None:
            if model.num_nextn_predict_layers:
                raise ValueError("the target has MTP layers and an EAGLE-3 draft was given too: serve one draft kind")
            eagle3 = load_eagle3_draft(draft, target=model)  # fail before SGLang starts: names, shapes, fit
        tp = int(options.get("tp_size", 1))
        layout = names.write_sglang_checkpoint(model, tensors, Path(work_dir or Path(path) / "sglang"), num_experts=tp)
        draft_dir = layout.draft_dir if draft is None else Path(draft)
        spec = draft_dir is not None and speculation_k > 0
        config = SGLangEngineConfig(
            model_path=str(layout.target_dir),
            speculative_algorithm=("NEXTN" if draft is None else "EAGLE3") if spec else None,
            speculation_k=speculation_k if spec else 0,
            draft_model_path=str(draft_dir) if spec else None,
            max_running_requests=max_batch_size,
            served_name=Path(path).name,
            device=device,
            **options,
        )
        if draft is not None:
            return cls(config, model, draft_digests={n: tensor_digest(t) for n, t in eagle3.state_dict().items()})
        _, contract_draft = names.split_contract(model, tensors)
        return cls(config, model, draft_digests={n: tensor_digest(t) for n, t in contract_draft.items()})

    def _read_draft_specs(self) -> dict[str, tuple[int, ...]]:
        if self.config.speculative_algorithm is None:
            return {}
        if self._contract_draft:
            return dict(draft_tensor_shapes(self.model))
        # EAGLE / EAGLE3: a separate draft checkpoint, pushed under its own names.
        path = Path(str(self.config.draft_model_path))
        specs: dict[str, tuple[int, ...]] = {}
        for file in sorted(path.glob("*.safetensors")):
            with file.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            specs.update({n: tuple(v["shape"]) for n, v in header.items() if n != "__metadata__"})
        return specs

    # ---- Engine: description ---------------------------------------------------------------
    def info(self) -> EngineInfo:
        m = self.model
        scaling = m.rope_scaling or {}
        return EngineInfo(
            model=ModelInfo(
                name=self.config.served_name or Path(self.config.model_path).name,
                architecture=names.TARGET_ARCHITECTURE,
                vocab_size=m.vocab_size,
                hidden_size=m.hidden_size,
                num_layers=m.num_hidden_layers,
                max_position_embeddings=m.max_position_embeddings,
                rope_type=str(scaling.get("rope_type", scaling.get("type", "default"))),
                rope_factor=float(scaling.get("factor", 1.0)),
                num_mtp_layers=m.num_nextn_predict_layers,
                dtype=m.torch_dtype,
                family=m.family,
            ),
            engine="sglang",
            engine_version=SGLANG_VERSION,
            device_kind="cpu" if self.config.device == "cpu" else "cuda",
            device_name=self._backend.device_name(),
            speculation_method=("eagle3" if self.config.speculative_algorithm == "EAGLE3" else "mtp")
            if self._k
            else "",
            speculation_k=self._k,
            max_speculation_k=self._k,
        )

    @property
    def weight_version(self) -> int:
        return self._version

    def num_queued(self) -> int:
        return 0

    def num_running(self) -> int:
        return len(self._seqs)

    def stats(self) -> list[VersionStats]:
        return self._stats.recent()

    def earlier_stats(self) -> VersionStats:
        return self._stats.earlier

    def set_speculation_k(self, k: int) -> None:
        if k != self._k:
            raise ValueError(
                f"speculation k is fixed at {self._k} for SGLang (speculative_num_steps and its CUDA graphs are set "
                f"at launch), got {k}; restart the sidecar with --speculation-k {k}"
            )

    def weight_specs(self, selector: WeightSelector) -> list[TensorSpec]:
        dtype = self.model.dtype
        return [TensorSpec(name=n, dtype=dtype, shape=s) for n, s in self._expected(selector).items()]

    def _expected(self, selector: WeightSelector) -> dict[str, tuple[int, ...]]:
        if selector is WeightSelector.TARGET:
            return dict(self._target_specs)
        if selector is WeightSelector.DRAFT:
            return dict(self._draft_specs)
        return self._target_specs | self._draft_specs

    # ---- Engine: requests -------------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        validate_request(request, self.model, self._k)
        if self._k and self.config.device == "cpu" and request.sampling.temperature > 0:
            raise InvalidRequestError(
                f"temperature={request.sampling.temperature} with speculation is refused on CPU: SGLang 0.5.23 "
                "verifies drafts greedily there (sglang/srt/speculative/eagle_utils.py, _verify_uses_greedy), so "
                "its samples would not follow the target distribution; use temperature 0, serve with --speculation-k 0, "
                "or run on a GPU"
            )
        sp = request.sampling
        if self.config.device == "cpu" and sp.temperature > 0 and sp.top_k > 0 and sp.top_p < 1.0:
            raise InvalidRequestError(
                f"top_k={sp.top_k} together with top_p={sp.top_p} is refused on CPU: SGLang's PyTorch sampler applies "
                "top-p to the probabilities before top-k renormalisation (sglang/srt/layers/sampler.py), specrl "
                "after it, so the served distribution would differ; use one of the two"
            )
        # Not mapped onto SGLang yet: refused rather than silently answered differently.
        if request.sampling.logprob_mode is not LogprobMode.RAW:
            raise InvalidRequestError(
                "logprob_mode PROCESSED is not available on the sglang engine (it reports log-probs before "
                "top-k/top-p only); use LOGPROB_MODE_RAW, or the torch engine"
            )
        if request.sampling.stop_at_eos:
            raise InvalidRequestError(
                "stop_at_eos is not available on the sglang engine yet; list the model's EOS ids "
                "(GetInfo model.eos_token_ids) in stop_token_ids instead"
            )
        if request.speculation_k is not None and request.speculation_k != self._k:
            raise InvalidRequestError(
                f"speculation_k={request.speculation_k} is not available: SGLang drafts exactly k={self._k} tokens "
                "per step (fixed at launch); omit speculation_k"
            )

    def submit(self, request: GenerationRequest) -> None:
        self._require_usable()
        self.validate(request)
        if not request.request_id:
            raise InvalidRequestError("request_id is empty; the server assigns one before submit")
        if request.request_id in self._live:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
        for p, prompt in enumerate(request.prompts):
            for s in range(request.samples_per_prompt):
                rid = f"{request.request_id}#{p}.{s}"
                params = sampling_params_dict(request.sampling, prompt_index=p, sample_index=s)
                task = self._backend.start_generate(rid, list(prompt), params)
                self._seqs[rid] = _Seq(request.request_id, p, s, task)
        self._live[request.request_id] = len(request.prompts) * request.samples_per_prompt

    def step(self) -> list[Sample]:
        self._require_usable()
        if not self._seqs:
            return []
        start = time.perf_counter()
        self._backend.wait_any([s.task for s in self._seqs.values()], self.config.step_wait_s)
        out = [self._finish(rid) for rid in [r for r, s in self._seqs.items() if s.task.done()]]
        self._stats[self._version].busy_seconds += time.perf_counter() - start
        return out

    def abort(self, request_id: str) -> list[Sample]:
        rids = [r for r, s in self._seqs.items() if s.request_id == request_id]
        if request_id not in self._live:
            return []
        for rid in rids:
            self._backend.abort(rid)
        self._backend.wait_all([self._seqs[r].task for r in rids], self.config.abort_wait_s)
        out = []
        for rid in rids:
            seq = self._seqs[rid]
            if not seq.task.done():
                seq.task.cancel()
            out.append(self._finish(rid))  # SGLang reports "abort"; one that just finished keeps its reason
        self._live.pop(request_id, None)
        return out

    def _finish(self, rid: str) -> Sample:
        seq = self._seqs.pop(rid)
        left = self._live.get(seq.request_id, 0) - 1
        if left > 0:
            self._live[seq.request_id] = left
        else:
            self._live.pop(seq.request_id, None)
        if seq.task.cancelled() or seq.task.exception() is not None:
            why = "cancelled" if seq.task.cancelled() else repr(seq.task.exception())
            log.warning("SGLang request %s ended without output (%s); returned as ABORT", rid, why)
            return Sample(
                request_id=seq.request_id,
                prompt_index=seq.prompt_index,
                sample_index=seq.sample_index,
                token_ids=[],
                logprobs=[],
                finish_reason=FinishReason.ABORT,
                weight_version=self._version,
                last_weight_version=self._version,
            )
        sample = sample_from_meta_info(
            seq.task.result(),
            request_id=seq.request_id,
            prompt_index=seq.prompt_index,
            sample_index=seq.sample_index,
            speculation_k=self._k,
        )
        stats = self._stats[sample.last_weight_version]
        stats.counters.add(sample.counters)
        stats.samples_finished += 1
        stats.samples_nonfinite += sample.nonfinite
        return sample

    def _require_usable(self) -> None:
        if self._broken:
            raise SGLangEngineError(
                f"the SGLang engine is unusable after a failed weight push ({self._broken_why}); it stays paused "
                f"until a push of {sorted(self._broken)} succeeds"
            )

    # ---- Engine: weights ---------------------------------------------------------------------
    def update_weights(self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int) -> None:
        expected = self._expected(selector)
        check_weights(
            tensors,
            selector=selector,
            version=version,
            served_version=self._version,
            expected=expected,
            all_names=set(self._expected(WeightSelector.ALL)),
            dtype=self.model.dtype,
        )
        target = {n: t for n, t in tensors.items() if n in self._target_specs}
        draft = {n: t for n, t in tensors.items() if n in self._draft_specs}
        digests = {n: tensor_digest(t) for n, t in draft.items()}
        # Unknown baseline (engine not built from a checkpoint): count as changed, fail closed.
        changed = sorted(n for n, d in digests.items() if self._draft_digest.get(n) != d)
        calls: list[tuple[str, dict[str, torch.Tensor]]] = []
        if target:
            calls.append(("target", names.to_sglang_target(target)))
        if draft:
            calls.append(("draft", self._sglang_draft(draft)))
        roles = {role for role, _ in calls}
        b = self._backend
        before = b.draft_checksums() if changed else None
        try:
            b.pause()
            b.begin(selector.value)
            for i, (role, named) in enumerate(calls):
                last = i == len(calls) - 1
                b.push(named, selector=role, weight_version=str(version) if last else None, flush_cache=last)
            b.end()
            if before is not None:
                self._prove_draft_changed(before, b.draft_checksums(), changed, digests)
            b.resume()
        except Exception as e:
            self._broken |= roles
            self._broken_why = f"push of version {version} failed: {e}"
            log.error("weight push of version %d failed; SGLang stays paused: %s", version, e)
            if isinstance(e, SGLangEngineError):
                raise
            raise SGLangEngineError(self._broken_why) from e
        self._broken -= roles
        if not self._broken:
            self._broken_why = ""
        self._draft_digest.update(digests)
        self._version = version
        self._stats.serve(version)

    def _sglang_draft(self, draft: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self._contract_draft:
            return dict(draft)
        return names.to_sglang_draft(draft, hidden_size=self.model.hidden_size, num_experts=self.config.tp_size)

    def _prove_draft_changed(
        self,
        before: Mapping[str, str],
        after: Mapping[str, str],
        changed: list[str],
        digests: Mapping[str, str],
    ) -> None:
        """Raise StaleDraftError unless SGLang's draft checksums show the pushed change.

        Tensors SGLang did load are recorded as served (`_draft_digest`) even when the push
        fails, so that retrying the same push proves only what is still missing (SGLang loads
        in place: what it loaded before the failure stays loaded).
        """
        if not self._contract_draft:
            if before == after:
                raise StaleDraftError("SGLang's draft checksums are unchanged after pushing new draft tensors")
            return
        params = {
            n: {names.runtime_parameter(sg, draft=True) for sg in names.draft_names(n, num_experts=self.config.tp_size)}
            for n in changed
        }
        loaded = [
            n for n, ps in params.items() if all(p in before and p in after and before[p] != after[p] for p in ps)
        ]
        self._draft_digest.update({n: digests[n] for n in loaded})
        want = set().union(*params.values()) if params else set()
        missing = sorted(p for p in want if p not in after or p not in before)
        if missing:
            raise StaleDraftError(
                f"SGLang reports no checksum for draft parameter(s) {missing[:3]}; the name mapping does not match "
                f"the served {names.DRAFT_CLASS} (names.runtime_parameter)"
            )
        stale = sorted(p for p in want if before[p] == after[p])
        if stale:
            raise StaleDraftError(
                f"{len(stale)} draft parameter(s) did not change although their tensors did, e.g. {stale[:3]}: "
                "SGLang skipped them while loading (stale draft)"
            )

    def close(self) -> None:
        """Shut SGLang down (its scheduler and detokenizer processes)."""
        self._backend.shutdown()


class StaleDraftError(SGLangEngineError):
    """A push whose draft tensors changed but SGLang's served draft did not."""
