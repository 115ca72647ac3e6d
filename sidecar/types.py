"""Plain-Python domain types of specrl's rollout side.

These are what the engines, the sidecar server, the client library and the trainer pass
around. Protobuf never crosses into them: `sidecar.protocol.convert` translates at the gRPC
edge, in both directions, with one function per message pair.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch


class WeightSelector(enum.Enum):
    """Which part of the served model a weight update addresses."""

    ALL = "all"  # target and draft together (the default: a stale draft destroys acceptance)
    TARGET = "target"
    DRAFT = "draft"


class WeightTransport(enum.Enum):
    """How the bulk bytes of a weight push travel (the PushWeights stream is always the control
    plane). Ordered from the most to the least preferred where several work."""

    SHM = "shm"  # a shared-memory region on the same host (proven by a nonce probe)
    COLLECTIVE = "collective"  # a torch.distributed broadcast group (gloo on CPU, NCCL on GPU)
    GRPC = "grpc"  # WeightChunk messages on the stream itself (always available)


class FinishReason(enum.Enum):
    """Why a sample stopped."""

    STOP = "stop"  # emitted a stop token (included in the output)
    LENGTH = "length"  # reached max_new_tokens
    ABORT = "abort"  # aborted; the output holds the tokens generated so far


class LogprobMode(enum.Enum):
    """Which distribution reported log-probs come from (proto LogprobMode)."""

    RAW = "raw"
    """log_softmax(logits / T) before top-k/top-p: what an RL trainer recomputes. The default."""
    PROCESSED = "processed"
    """log of the distribution actually sampled from (after top-k/top-p; vLLM's processed_logprobs)."""


MIN_SAMPLING_TEMPERATURE = 1e-5
"""The smallest temperature that samples. Below it softmax(logits / T) is numerically a one-hot
(float32 logits / T overflow to inf at T ~ 1e-38 and give NaN; well before that the distribution
is argmax up to rounding), so temperatures in (0, 1e-5) are refused rather than silently turned
into greedy decoding: greedy reports log-probs at T = 1, the caller asked for T, and the two
disagree. 1e-5 is also the greedy cut-off of vLLM and SGLang, so no engine samples differently."""
_MIN_TEMPERATURE_FLOAT32 = float(torch.tensor(MIN_SAMPLING_TEMPERATURE, dtype=torch.float32))  # what proto carries
MAX_SAMPLING_TEMPERATURE = float(torch.finfo(torch.float32).max)
"""The largest temperature: the largest finite float32 (the engines scale float32 logits)."""


def temperature_problem(temperature: object) -> str:
    """Why `temperature` cannot be served ('' when it can): the one rule of every entry point."""
    if not isinstance(temperature, int | float) or math.isnan(temperature):
        return f"temperature must be a number, got {temperature!r}"
    if temperature == 0.0:
        return ""
    if temperature < 0.0 or temperature > MAX_SAMPLING_TEMPERATURE:
        return (
            f"temperature must be 0 (greedy) or in [{MIN_SAMPLING_TEMPERATURE:g}, {MAX_SAMPLING_TEMPERATURE:.4g}] "
            f"(finite, non-negative), got {temperature}"
        )
    if temperature < _MIN_TEMPERATURE_FLOAT32:
        return (
            f"temperature {temperature:g} is below the smallest sampling temperature {MIN_SAMPLING_TEMPERATURE:g} "
            "(softmax(logits / T) is numerically one-hot or NaN there); send 0 for greedy decoding or a "
            f"temperature >= {MIN_SAMPLING_TEMPERATURE:g}"
        )
    return ""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample: from softmax(logits / temperature), restricted by top_k then top_p."""

    temperature: float = 1.0
    """0 means greedy; otherwise in [MIN_SAMPLING_TEMPERATURE, MAX_SAMPLING_TEMPERATURE]."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables. The most likely token is always kept."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 disables; beyond the vocabulary keeps them all."""
    max_new_tokens: int = 256
    """Most tokens generated per sample, > 0."""
    stop_token_ids: tuple[int, ...] = ()
    """A sample stops after emitting any of these (the stop token is kept)."""
    seed: int | None = None
    """Seed of the request's random stream; None draws a fresh one."""
    stop_at_eos: bool = False
    """Also stop after the model's EOS ids (ModelInfo.eos_token_ids), as vLLM does by default."""
    logprob_mode: LogprobMode = LogprobMode.RAW
    """Which log-probs samples report; never changes which tokens are sampled."""

    def __post_init__(self) -> None:
        problem = temperature_problem(self.temperature)
        if problem:
            raise ValueError(problem)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")
        self.stop_token_ids = tuple(self.stop_token_ids)


ROUTE_REQUESTS = ("off", "generated", "sequence")
"""What `GenerationRequest.routes` may ask (proto RouteRequest): no routes, the generated tokens',
or the prompt's and the generated tokens' (`Routes`)."""


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    """A batch of tokenised prompts, each sampled `samples_per_prompt` times."""

    prompts: list[list[int]]
    """Token ids of each prompt; non-empty."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    samples_per_prompt: int = 1
    """G in group-relative RL."""
    request_id: str = ""
    """Unique among live requests; used by abort. Empty: the server assigns one."""
    min_weight_version: int = 0
    """Refuse unless the served weight version is at least this."""
    speculation_k: int | None = None
    """None: the engine's current k; 0: plain decoding; n: draft n tokens per step."""
    session_ids: list[str] = field(default_factory=list)
    """Per prompt, the conversation it continues ("" for none); empty: no sessions. A fleet sends
    every request of a session to the sidecar that served it first, while that one is live."""
    routes: str = "off"
    """Which positions' routes each sample carries (`Sample.routes`, one of ROUTE_REQUESTS): "off",
    "generated" (the generated tokens') or "sequence" (the prompt's too). Mixture-of-experts models only."""

    def __post_init__(self) -> None:
        if self.routes not in ROUTE_REQUESTS:
            raise ValueError(
                f"routes must be one of {', '.join(map(repr, ROUTE_REQUESTS))}, got {self.routes!r}: 'generated' "
                "returns the generated tokens' routes, 'sequence' the prompt's too"
            )
        if not self.prompts:
            raise ValueError("prompts must hold at least one prompt")
        if self.session_ids and len(self.session_ids) != len(self.prompts):
            raise ValueError(
                f"session_ids has {len(self.session_ids)} entries for {len(self.prompts)} prompts; give one a prompt "
                "('' for a prompt of no session) or none"
            )
        for i, prompt in enumerate(self.prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.min_weight_version < 0:
            raise ValueError(f"min_weight_version must be >= 0, got {self.min_weight_version}")
        if self.speculation_k is not None and self.speculation_k < 0:
            raise ValueError(f"speculation_k must be >= 0 or None, got {self.speculation_k}")


@dataclass(kw_only=True, slots=True)
class ScoreRequest:
    """Token sequences to score teacher-forced (RolloutService.Score)."""

    sequences: list[list[int]]
    """Whole sequences (prompt + completion)."""
    start_indices: list[int]
    """Per sequence, the first position scored (>= 1)."""
    temperature: float = 1.0
    """log_softmax(logits / temperature); 0 means 1."""
    min_weight_version: int = 0

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("sequences must hold at least one sequence to score")
        if len(self.start_indices) != len(self.sequences):
            raise ValueError(
                f"start_indices has {len(self.start_indices)} entries for {len(self.sequences)} sequences; give one each"
            )
        for i, (seq, start) in enumerate(zip(self.sequences, self.start_indices, strict=True)):
            if not 1 <= start <= len(seq) - 1:
                raise ValueError(
                    f"sequences[{i}] has {len(seq)} tokens; start_index {start} must be in [1, {len(seq) - 1}] "
                    "(token 0 has no context, and at least one token must be scored)"
                )
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0 (0 means 1), got {self.temperature}")
        if self.min_weight_version < 0:
            raise ValueError(f"min_weight_version must be >= 0, got {self.min_weight_version}")


@dataclass(kw_only=True, slots=True)
class ScoreResult:
    """Log-probs of each scored sequence's tokens from its start index on."""

    logprobs: list[list[float]]
    weight_version: int


@dataclass(kw_only=True, slots=True)
class SpeculationCounters:
    """Raw, monotonically increasing speculation counters (see proto/specrl/v1/common.proto).

    tau (acceptance length) = generated_tokens / verify_steps, bonus token included;
    acceptance rate = accepted_tokens / drafted_tokens.
    """

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, other: SpeculationCounters) -> None:
        """Accumulate `other` into self (position lists grow to the longer length)."""
        self.verify_steps += other.verify_steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.generated_tokens += other.generated_tokens
        for mine, theirs in (
            (self.drafted_per_position, other.drafted_per_position),
            (self.accepted_per_position, other.accepted_per_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def minus(self, earlier: SpeculationCounters) -> SpeculationCounters:
        """The counts accumulated since the reading `earlier`."""
        n = max(len(self.drafted_per_position), len(earlier.drafted_per_position))

        def sub(a: list[int], b: list[int]) -> list[int]:
            return [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]

        return SpeculationCounters(
            verify_steps=self.verify_steps - earlier.verify_steps,
            drafted_tokens=self.drafted_tokens - earlier.drafted_tokens,
            accepted_tokens=self.accepted_tokens - earlier.accepted_tokens,
            generated_tokens=self.generated_tokens - earlier.generated_tokens,
            drafted_per_position=sub(self.drafted_per_position, earlier.drafted_per_position),
            accepted_per_position=sub(self.accepted_per_position, earlier.accepted_per_position),
        )

    @property
    def acceptance_length(self) -> float:
        """tau = generated tokens per verify step (1.0 for plain decoding; 0 when empty)."""
        return self.generated_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(frozen=True, slots=True, eq=False)
class Routes:
    """The experts a sample's positions were routed to in every sparse layer of the target (proto
    Routes): row i is sequence position first_position + i as an input token (prompt and generated
    tokens counted together), from the pass that computed it (the prefill, the verify pass of the
    accepted tokens, the decode step). The last generated token is never an input: P prompt and T
    generated tokens give P + T - 1 rows from 0 ("sequence") or T - 1 rows from P ("generated")."""

    expert_ids: torch.Tensor
    """(positions, sparse_layers, top_k) uint8 (at most 256 experts) or int16, on the CPU; a row's
    top_k ids are a set (in the router's order)."""
    first_position: int

    def __post_init__(self) -> None:
        if self.expert_ids.dtype not in (torch.uint8, torch.int16) or self.expert_ids.dim() != 3:
            raise ValueError(
                "Routes.expert_ids must be a (positions, sparse_layers, top_k) uint8 or int16 tensor, got "
                f"{self.expert_ids.dtype} of shape {list(self.expert_ids.shape)}"
            )
        if self.first_position < 0:
            raise ValueError(f"Routes.first_position must be >= 0, got {self.first_position}")

    @property
    def positions(self) -> int:
        return self.expert_ids.shape[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Routes):
            return NotImplemented
        a, b = self.expert_ids, other.expert_ids
        return self.first_position == other.first_position and a.dtype == b.dtype and torch.equal(a, b)


@dataclass(kw_only=True, slots=True)
class Sample:
    """One finished sample."""

    request_id: str
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    """Generated tokens only."""
    logprobs: list[float]
    """Target log-prob of each token under log_softmax(logits / T), T = temperature or 1 if 0."""
    finish_reason: FinishReason
    weight_version: int
    """Weight version that produced the first token."""
    last_weight_version: int
    """Weight version that produced the last token (differs if a push landed mid-sample)."""
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    routes: Routes | None = None
    """The experts its positions were routed to, when the request asked (`GenerationRequest.routes`)."""

    @property
    def nonfinite(self) -> bool:
        """A log-prob is NaN or infinite: the weights that served it, or their activations, are broken."""
        return not all(math.isfinite(x) for x in self.logprobs)


class DeltaEncoding(enum.IntEnum):
    """How a sparse delta names its changed positions (sidecar.weight_transport.delta)."""

    INDEX = 1
    BITMASK = 2


@dataclass(kw_only=True, slots=True, frozen=True)
class TensorDelta:
    """A manifest tensor sent as a sparse delta against the push's base version."""

    encoding: DeltaEncoding
    changed: int
    """Number of elements whose bit pattern changed."""
    payload_length: int
    """Bytes of the payload on the transport (instead of the tensor's byte_length)."""
    payload_crc32: int = 0
    """CRC-32 of the payload bytes."""


@dataclass(kw_only=True, slots=True)
class TensorSpec:
    """A named tensor's layout, as a weight push announces it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: int = 0
    """CRC-32 (zlib) of the tensor's C-contiguous little-endian bytes; 0 when unknown. For a
    delta: of the reconstructed tensor, required."""
    delta: TensorDelta | None = None
    """Set when the bytes on the transport are a sparse delta (see WeightManifest.base_version)."""

    @property
    def wire_length(self) -> int:
        """Bytes of this tensor on the transport: the delta payload's, or the whole tensor's."""
        return self.delta.payload_length if self.delta is not None else self.byte_length

    @property
    def byte_length(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize  # not torch.empty(...).element_size(): ~4 µs a call, per tensor, per push


@dataclass(kw_only=True, slots=True)
class VersionStats:
    """Counters accumulated while one weight version served."""

    weight_version: int
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    samples_finished: int = 0
    busy_seconds: float = 0.0
    samples_nonfinite: int = 0
    """Finished samples whose log-probs hold a NaN or an infinity (`Sample.nonfinite`)."""
    prompt_tokens: int = 0
    """Prompt tokens of the sequences admitted (each sample counts its prompt)."""
    prefill_tokens: int = 0
    """Prompt tokens the admission prefills computed: each distinct prompt admitted in one step
    once, so `prefill_tokens / prompt_tokens` is about 1/G for GRPO groups of G samples."""
    prefix_cache_hit_tokens: int = 0
    """Prefix tokens the admission prefills took from prefix-cache blocks instead of computing
    (counted as `prefill_tokens` is: once a distinct prefix). The prefix cache's hit rate is
    `prefix_cache_hit_tokens / (prefix_cache_hit_tokens + prefill_tokens)`."""


@dataclass(kw_only=True, slots=True)
class ModelInfo:
    """Shape of the served model (the engine reports it; GetInfo publishes it)."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    rope_type: str = "default"
    rope_factor: float = 1.0
    num_mtp_layers: int = 0
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    """The checkpoint's end-of-sequence ids (config.json eos_token_id); SamplingParams.stop_at_eos stops at them."""
    family: str = ""
    """The architecture's family (config.json's model_type: "qwen3", "qwen2", "llama", "mimo", "qwen3_moe",
    "glm4_moe")."""
    num_experts: int = 0
    """Routed experts per sparse layer of a mixture-of-experts model (0: dense)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top k); 0 for a dense model."""
    router: str = ""
    """The router kind (`sidecar.model.moe.ROUTER_KINDS`); empty for a dense model."""
    num_sparse_layers: int = 0
    """Decoder layers that route to experts (the rest are dense)."""


@dataclass(kw_only=True, slots=True)
class SpeculationStatus:
    """The draft length in use and why (GetInfo, GetStats, Prometheus)."""

    speculation_auto: bool = False
    """True: the engine chooses k per step (automatic mode, up to EngineInfo.speculation_k)."""
    speculation_k: int = 0
    """k of the latest decode step of automatic-mode sequences (the fixed default k otherwise)."""
    reason: str = "fixed"
    """"fixed" (not auto), "model" (best predicted k), "probe" (measuring another k), "guard"
    (backed off to plain: realised throughput fell below plain's), "collapsed" (k = 0: the served
    version's draft collapsed, until the next weight version), "off" (max k is 0)."""
    detail: str = ""
    """The numbers behind `reason`, human-readable."""
    expected_speedup: float = 1.0
    """Predicted tokens/s of k over plain decoding's at the step's batch size."""
    batch_size: int = 0
    """Rows of the step the decision was made for."""
    acceptance: list[float] = field(default_factory=list)
    """Estimated acceptance per draft position (given all earlier ones accepted), current weights."""
    guard_trips: int = 0
    """Times the guard has backed off to plain decoding (monotonic)."""


@dataclass(kw_only=True, slots=True)
class EngineInfo:
    """What an engine is, where it runs, and how it speculates."""

    model: ModelInfo
    engine: str
    """"torch" or "sglang"."""
    engine_version: str
    device_kind: str
    """torch device type: "cpu" or "cuda"."""
    device_name: str
    speculation_method: str
    """The draft kind: "mtp" (the model's MTP layers), "eagle3" (a separate EAGLE-3 draft), or "" (none)."""
    speculation_k: int
    """The fixed default k, or in auto mode the largest k the controller may choose."""
    max_speculation_k: int
    speculation_status: SpeculationStatus = field(default_factory=SpeculationStatus)


@dataclass(kw_only=True, slots=True)
class RequestLimits:
    """Per-request limits a sidecar enforces with INVALID_ARGUMENT."""

    max_prompts: int = 1024
    max_samples: int = 4096
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 32768

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_samples", "max_prompt_tokens", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RequestLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class GpuTelemetry:
    """One GPU's live readings (NVML)."""

    index: int
    name: str
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    utilization_percent: int = 0
    temperature_celsius: int = 0
    power_watts: float = 0.0


@dataclass(kw_only=True, slots=True)
class SidecarInfo:
    """Everything GetInfo reports about a sidecar."""

    engine: EngineInfo
    weight_version: int
    paused: bool
    limits: RequestLimits
    gpus: list[GpuTelemetry] = field(default_factory=list)
    protocol: str = "specrl.v1"
    specrl_version: str = ""


@dataclass(kw_only=True, slots=True)
class DraftCollapse:
    """A weight version whose draft stopped working: its tau over drafting verify steps fell to
    ~1.0 where an earlier version's was well above (`sidecar.speculation.collapse`). Raised from
    the first collapsed version until a later version's draft works again."""

    weight_version: int
    """The first collapsed version of this collapse (the alarm's identity: one per collapse)."""
    latest_version: int
    """The newest version judged collapsed (later versions that stayed collapsed move it)."""
    reference_version: int
    """The newest version whose draft worked before the collapse."""
    tau_before: float
    """tau over drafting verify steps of `reference_version`."""
    tau_after: float
    """tau over drafting verify steps of `latest_version`."""
    verify_steps: int
    """Drafting verify steps (row rounds) of `latest_version` behind `tau_after`."""

    def describe(self) -> str:
        """One line for a log: what collapsed, from what to what, on how much evidence."""
        later = f" (still at version {self.latest_version})" if self.latest_version != self.weight_version else ""
        return (
            f"draft collapsed at weight version {self.weight_version}{later}: tau over drafting verify steps "
            f"{self.tau_after:.3f} over {self.verify_steps} steps, was {self.tau_before:.3f} at version "
            f"{self.reference_version}; the draft weights are stale or lost (push the draft with the target: "
            "selector ALL, or DRAFT after a target push)"
        )


@dataclass(kw_only=True, slots=True)
class KVUsage:
    """The engine's paged KV cache (`sidecar.model.kv_pages`): a pool of blocks of `block_size`
    token slots each; a running row holds the blocks its tokens fill, and the G samples of a prompt
    share its prompt's full blocks. All zeros for an engine without one (SGLang reports its own)."""

    block_size: int = 0
    """Token slots a block holds."""
    blocks_total: int = 0
    """Blocks of the pool (`blocks_total * block_size` tokens fit at once, over all rows)."""
    blocks_used: int = 0
    """Blocks held by running rows now (a shared block counted once)."""
    blocks_shared: int = 0
    """Blocks held by more than one row now (a prompt's blocks shared by its samples)."""
    preemptions: int = 0
    """Rows preempted since the engine started (monotonic): their blocks freed when the pool ran
    out mid-generation, requeued, resumed later by recomputing their prefix."""
    blocks_cached: int = 0
    """Blocks the prefix cache indexes now (held by rows or idle; idle ones count as free)."""
    prefix_cache_evictions: int = 0
    """Idle cached blocks taken for other tokens since the engine started (monotonic)."""


@dataclass(kw_only=True, slots=True)
class SidecarStats:
    """Everything GetStats reports: raw counters per weight version and the load."""

    versions: list[VersionStats]
    total: SpeculationCounters
    weight_version: int
    queued_sequences: int = 0
    running_sequences: int = 0
    uptime_seconds: float = 0.0
    speculation: SpeculationStatus = field(default_factory=SpeculationStatus)
    """The k in use and why, as of the latest engine step."""
    draft_collapsed: DraftCollapse | None = None
    """The draft-collapse alarm while raised (`sidecar.speculation.collapse`), else None."""
    draft_collapses: int = 0
    """Collapses raised since the sidecar started (monotonic)."""
    kv: KVUsage = field(default_factory=KVUsage)
    """The engine's KV blocks, as of the latest engine step."""


@dataclass(kw_only=True, slots=True)
class WeightManifest:
    """First item of a weight push: the version to serve and the tensors that follow, in order."""

    version: int
    selector: WeightSelector
    tensors: list[TensorSpec]
    data_plane: ShmPlacement | CollectivePlacement | None = None
    """Where the bytes travel; None: WeightChunk items on the stream."""
    base_version: int = 0
    """The served version the push's delta tensors were computed against (0: no deltas)."""

    @property
    def transport(self) -> WeightTransport:
        if isinstance(self.data_plane, ShmPlacement):
            return WeightTransport.SHM
        if isinstance(self.data_plane, CollectivePlacement):
            return WeightTransport.COLLECTIVE
        return WeightTransport.GRPC


@dataclass(kw_only=True, slots=True)
class ShmPlacement:
    """The push's bytes are in this shared-memory region (a name under /dev/shm)."""

    region: str


@dataclass(kw_only=True, slots=True)
class CollectivePlacement:
    """The push's bytes are broadcast over this collective group, in buckets."""

    group_id: str
    bucket_bytes: int


@dataclass(kw_only=True, slots=True)
class WeightPlaced:
    """Tensors whose bytes travel on the manifest's transport, announced together."""

    tensors: list[PlacedTensor]

    @property
    def byte_length(self) -> int:
        return sum(t.byte_length for t in self.tensors)


@dataclass(kw_only=True, slots=True)
class PlacedTensor:
    """One tensor of a WeightPlaced."""

    tensor_index: int
    offset: int
    """shm: the tensor's byte offset in the region; collective: 0."""
    byte_length: int
    crc32: int
    """CRC-32 (zlib) of the tensor's bytes as the sender placed them."""


@dataclass(kw_only=True, slots=True)
class ShmProbe:
    """PrepareTransport(shm): read back the nonce in this probe region (proves same host/user)."""

    region: str


@dataclass(kw_only=True, slots=True)
class CollectiveRendezvous:
    """PrepareTransport(collective): join this torch.distributed group as `rank`."""

    group_id: str
    backend: str
    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float


@dataclass(kw_only=True, slots=True)
class PreparedTransport:
    """PrepareTransport's answer: the probe's bytes as read (shm), or the group joined."""

    shm_nonce: bytes = b""
    group_id: str = ""


@dataclass(kw_only=True, slots=True)
class WeightChunk:
    """A slice of one tensor's bytes (in order within the tensor)."""

    tensor_index: int
    offset: int
    data: bytes | memoryview
    """The payload (a memoryview of the received message on the server: no copy)."""
    crc32: int
    """CRC-32 (zlib) of `data`."""
    tensor_crc32: int | None = None
    """On a tensor's last chunk: CRC-32 of the whole tensor, for senders that stream tensors as
    they produce them and so sent 0 in the manifest. None when the manifest carries it."""


@dataclass(kw_only=True, slots=True)
class WeightCommit:
    """Last item of a weight push: verify and apply."""

    chunk_count: int


PushItem = WeightManifest | WeightChunk | WeightPlaced | WeightCommit


@dataclass(kw_only=True, slots=True)
class PushResult:
    """Outcome of a successful weight push."""

    version: int
    previous_version: int
    bytes_received: int
    tensors_updated: int
    receive_seconds: float
    apply_seconds: float
    transport: WeightTransport = WeightTransport.GRPC
    """The transport that carried the bytes."""
