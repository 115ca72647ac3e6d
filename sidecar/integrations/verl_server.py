"""verl's rollout replica and server actor over specrl sidecars (verl==0.9.1).

verl's agent loop sends every sample to a replica's server actor as
`generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`. `SpecrlReplica` is the
replica verl builds for `actor_rollout_ref.rollout.name=specrl`; its `launch_servers` attaches
to a sidecar that is already running (checked at once: reachable, same model) and starts one
`SpecrlServer` Ray actor that forwards each call to the sidecar's Generate. The actor needs no
GPU: the sidecar owns its device.

Control calls map to the protocol or are no-ops, each said where it is defined. Weights do not
pass through this actor: verl's checkpoint engine hands them to `SpecrlRolloutAdapter`
(`verl_weights.py`), which pushes them to the same sidecar.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from sidecar.client.client import SidecarClient
from sidecar.integrations.verl_config import SpecrlConfigError, SpecrlRolloutOptions, attach
from sidecar.types import FinishReason, GenerationRequest, LogprobMode, Sample, SamplingParams

log = logging.getLogger(__name__)

RECENT_SEQUENCES = 512
"""Finished sequences a server keeps for the draft refit of the next push."""

_STOP_REASON = {FinishReason.STOP: "completed", FinishReason.LENGTH: "length", FinishReason.ABORT: "aborted"}
"""Sidecar finish reasons as verl's TokenOutput.stop_reason spells them."""

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens"}
_SAMPLING_KEYS |= {"seed", "stop_token_ids", "ignore_eos", "min_p"}


def server_name(replica_rank: int, suffix: str = "") -> str:
    """The Ray actor name of replica `replica_rank`'s server (the weight adapter looks it up)."""
    return f"specrl_server_{replica_rank}{suffix}"


def sampling_from_verl(params: dict[str, Any], *, default_max_tokens: int, seed: int | None) -> SamplingParams:
    """verl's (vLLM-style) sampling dict -> SamplingParams; what a sidecar cannot do is refused by name."""
    unknown = sorted(set(params) - _SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling parameters {unknown} are not supported by specrl sidecars")
    if float(params.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError(
            "repetition_penalty != 1.0 is not supported (lossless speculation samples the unmodified target); "
            "set actor_rollout_ref.rollout.repetition_penalty=1.0"
        )
    if float(params.get("min_p") or 0.0):
        raise ValueError("min_p is not supported by specrl sidecars; use top_k / top_p")
    top_k = int(params.get("top_k", 0) or 0)
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    request_seed = params.get("seed", seed)
    return SamplingParams(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else 0,  # vLLM's -1 and 0 both disable
        max_new_tokens=max(1, int(max_tokens if max_tokens is not None else default_max_tokens)),
        stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()),
        stop_at_eos=not params.get("ignore_eos", False),
        seed=None if request_seed is None else int(request_seed),
        logprob_mode=LogprobMode.RAW,
    )


def token_output(sample: Sample, seconds: float, global_steps: int | None) -> TokenOutput:
    """One sample as verl's TokenOutput; `extra_fields` carries the weight version and the raw
    speculation counters (summed into τ and per-position acceptance by `verl_metrics`)."""
    c = sample.counters
    return TokenOutput(
        token_ids=list(sample.token_ids),
        log_probs=list(sample.logprobs),
        stop_reason=_STOP_REASON[sample.finish_reason],
        extra_fields={
            "global_steps": global_steps,
            "specrl_weight_version": sample.weight_version,
            "specrl_last_weight_version": sample.last_weight_version,
            "specrl_verify_steps": c.verify_steps,
            "specrl_drafted_tokens": c.drafted_tokens,
            "specrl_accepted_tokens": c.accepted_tokens,
            "specrl_generated_tokens": c.generated_tokens,
            "specrl_drafted_per_position": list(c.drafted_per_position),
            "specrl_accepted_per_position": list(c.accepted_per_position),
            "specrl_generate_s": seconds,
        },
    )


class SpecrlServer:
    """The server actor of one replica: verl's token-in-token-out calls on one sidecar."""

    def __init__(self, address: str, options: SpecrlRolloutOptions, replica_rank: int, response_length: int) -> None:
        self.address = address
        self.options = options
        self.replica_rank = replica_rank
        self.response_length = response_length
        self.client = SidecarClient(address, options.client_config())
        self.global_steps: int | None = None
        self._requests = 0
        self._live: set[str] = set()
        self._recent: collections.deque[list[int]] = collections.deque(maxlen=RECENT_SEQUENCES)

    def get_server_address(self) -> str:
        return self.address

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("multimodal prompts are not supported by specrl sidecars (token ids only)")
        seed = None if self.options.seed is None else self.options.seed + self._requests
        self._requests += 1
        sampling = sampling_from_verl(dict(sampling_params), default_max_tokens=self.response_length, seed=seed)
        prompt = [int(t) for t in prompt_ids]
        request = GenerationRequest(
            prompts=[prompt],
            sampling=sampling,
            request_id=request_id,
            speculation_k=self.options.speculation_k,
            # verl's affinity: an agent loop sends every turn under one request id, which its
            # router keeps on one replica; as the session, its turns find their prefix cached
            session_ids=[request_id],
        )
        self._live.add(request_id)
        start = time.perf_counter()
        try:
            samples = await asyncio.to_thread(self.client.generate, request)
        finally:
            self._live.discard(request_id)
        seconds = time.perf_counter() - start
        (sample,) = samples
        self._recent.append(prompt + list(sample.token_ids))
        return token_output(sample, seconds, self.global_steps)

    def recent_sequences(self) -> list[list[int]]:
        """Prompt + completion of the latest samples, oldest first (the draft refit's data)."""
        return list(self._recent)

    def set_global_steps(self, global_steps: int | None) -> None:
        """The trainer step of the weights just pushed (verl's `global_steps` of later outputs)."""
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """RolloutService.Abort of every live request: their samples return with the tokens so far
        and stop_reason "aborted" (verl resumes them as partial rollouts). `reject_request` is
        not supported: later requests are served as usual."""
        for request_id in list(self._live):
            await asyncio.to_thread(self.client.abort, request_id)

    async def resume_generation(self) -> None:
        """No-op: aborting does not block later requests."""

    async def wake_up(self) -> None:
        """No-op: a sidecar keeps its weights and KV pool on its own device."""

    async def sleep(self) -> None:
        """No-op (see wake_up): a sidecar shares no GPU with the trainer."""

    async def clear_kv_cache(self) -> None:
        """No-op: a sidecar keeps no prefix cache across requests, so nothing can go stale."""

    async def release_kv_cache(self) -> None:
        """No-op (see sleep)."""

    async def resume_kv_cache(self) -> None:
        """No-op (see sleep)."""

    async def start_profile(self, **kwargs: Any) -> None:
        """No-op: profile the sidecar process itself."""

    async def stop_profile(self) -> None:
        """No-op (see start_profile)."""


class SpecrlReplica(RolloutReplica):
    """A verl rollout replica backed by one running sidecar (`engine_kwargs.specrl.sidecars[rank]`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = SpecrlRolloutOptions.from_mapping(self.config.engine_kwargs.get("specrl"))
        if self.is_teacher_model or self.is_reward_model:
            raise SpecrlConfigError("rollout.name=specrl serves the policy only; use vllm or sglang for reward/teacher")

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self) -> None:
        """Attach to the sidecar without taking GPUs from verl. Weight sync needs the hybrid
        engine (the trainer pushes): see the README, "Use specrl from verl"."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        raise SpecrlConfigError(
            "rollout.name=specrl does not run colocated (LLM-as-judge) servers; use it for the policy "
            "with actor_rollout_ref.hybrid_engine=True"
        )

    async def launch_servers(self) -> None:
        address = self.options.sidecar_for(self.replica_rank)
        model_path = getattr(self.model_config, "local_path", None) or getattr(self.model_config, "path", None)
        info = await asyncio.to_thread(attach, address, self.options, model_path)
        log.info(
            "specrl replica %d attached to %s (%s, weight version %d, k=%d)",
            self.replica_rank,
            address,
            info.engine.model.name,
            info.weight_version,
            info.engine.speculation_k,
        )
        actor = ray.remote(SpecrlServer).options(
            name=server_name(self.replica_rank, self.name_suffix),
            num_cpus=0,
            max_concurrency=self.max_concurrency,
        )
        server = actor.remote(address, self.options, self.replica_rank, int(self.config.response_length))
        self.servers.append(server)
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()
