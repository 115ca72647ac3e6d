"""The root configuration of an RL run, composed of the components' own small configs.

A run is a function returning an `RLConfig` (`demo_config()` is the built-in one); YAML/TOML
files and `--set a.b=v` overrides only select and override fields (`sidecar.config_io`), and the
resolved config is written to the run directory so the run can be reproduced from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from muon import HybridOptimizerConfig
from sidecar.client.client import ClientConfig
from sidecar.client.transport import CollectiveConfig, TransportConfig
from sidecar.config_io import field_default, to_mapping
from sidecar.engine.config import EngineConfig
from sidecar.security import SecurityConfig
from sidecar.serve_config import ServeConfig
from trainer.draft.objective import DraftConfig
from trainer.policy.losses import GRPOConfig
from trainer.policy.moe import RouterConfig
from trainer.rl.environments import CalculatorEnvironment, Environment, load_environment
from trainer.rl.episodes import EpisodeLimits
from trainer.rl.rewards import rewards_from_specs
from trainer.rl.tasks import ArithmeticTask, DatasetFields, DatasetTask, Task
from trainer.rl.trackers import TrackersConfig
from trainer.schedules import LRScheduleConfig


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Where problems and rewards come from."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {"reward_fn": "rewards"}

    kind: Literal["arithmetic", "dataset", "calculator", "environment"] = "arithmetic"
    """"arithmetic": the built-in synthetic task; "dataset": a user dataset at `path`; "calculator": the
    built-in multi-turn environment (arithmetic with a calculator the policy calls); "environment": a
    user's multi-turn environment, the class `environment` names (`trainer.rl.environments`)."""
    regime: Literal["zero", "think"] = "zero"
    """Arithmetic regime (short scratchpad or multi-step chains)."""
    digits: int = 2
    """Digits per operand of the arithmetic task."""
    path: str | None = None
    """The dataset when kind is "dataset": a JSONL, parquet, JSON, CSV or arrow file, a `save_to_disk`
    directory, or a hub id (where there is a network)."""
    eval_path: str | None = None
    """A held-out dataset of its own (same formats); null: `eval_fraction` of `path`'s problems."""
    split: str = "train"
    """The split of a saved DatasetDict or a hub dataset to train on."""
    eval_split: str = ""
    """The split of `eval_path` to evaluate on ("": `split`)."""
    fields: DatasetFields = field(default_factory=DatasetFields)
    """Which column holds the prompt, the answer, a reference solution, a conversation."""
    rewards: tuple[str, ...] = ()
    """The reward terms, summed with `reward_weights`: built-in "exact", "gsm8k", "math" (math-verify),
    "format", or a function "package.module:function" / "path/to/file.py:function" taking (prompt,
    completion, answer), or batched (prompts, completions, answers); empty: ["exact"]. The arithmetic
    task always uses "exact"."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward term (empty: 1 each)."""
    system_prompt: str = ""
    """A system turn before every plain prompt of a dataset (through the chat template)."""
    chat_template: bool | None = None
    """Render a dataset's plain prompts with the model's chat template (null: when the tokenizer has
    one; conversational prompts always use it)."""
    filter_rows: bool = False
    """Drop a dataset's bad rows (empty or over-long prompts, bad answers), counting them, instead of
    refusing the run."""
    eval_fraction: float = 0.1
    """Share of problems held out for evaluation (split by prompt hash)."""
    environment: str | None = None
    """The multi-turn environment when kind is "environment": a class "package.module:Class" or
    "path/to/file.py:Class", built with no arguments."""
    max_turns: int = 4
    """Policy turns per episode of a multi-turn environment."""
    max_episode_tokens: int = 512
    """Tokens of a whole multi-turn conversation (prompt, turns, observations); a turn or an
    observation past it is cut there."""

    def __post_init__(self) -> None:
        if self.kind == "dataset" and self.path is None:
            raise ValueError("task.path must name a dataset when task.kind is 'dataset'")
        if self.kind == "environment" and not self.environment:
            raise ValueError(
                "task.environment must name a class ('package.module:Class') when task.kind is 'environment'"
            )
        if self.environment and self.kind != "environment":
            raise ValueError(f"task.environment is set but task.kind is {self.kind!r}: set task.kind=environment")
        if self.kind in ("calculator", "environment") and self.rewards:
            raise ValueError("a multi-turn environment rewards its own episodes: unset task.rewards")
        EpisodeLimits(max_turns=self.max_turns, max_tokens=self.max_episode_tokens)  # checks both
        if self.kind == "arithmetic" and self.rewards and tuple(self.rewards) != ("exact",):
            raise ValueError("the arithmetic task is rewarded by 'exact' alone: unset task.rewards")

    def build(self, *, needs_answers: bool = True) -> Task | Environment:
        if self.kind == "arithmetic":
            return ArithmeticTask(regime=self.regime, digits=self.digits, eval_fraction=self.eval_fraction)
        if self.kind == "calculator":
            return CalculatorEnvironment(digits=self.digits, eval_fraction=self.eval_fraction)
        if self.kind == "environment":
            assert self.environment is not None
            return load_environment(self.environment)
        assert self.path is not None
        path: str | Path = self.path
        if Path(self.path).exists() or Path(self.path).suffix:
            path = Path(self.path)
        return DatasetTask(
            path=path,
            fields=self.fields,
            rewards=rewards_from_specs(self.rewards or ("exact",), self.reward_weights),
            eval_path=None if self.eval_path is None else Path(self.eval_path),
            split=self.split,
            eval_split=self.eval_split,
            eval_fraction=self.eval_fraction,
            system_prompt=self.system_prompt,
            chat_template=self.chat_template,
            filter_rows=self.filter_rows,
            needs_answers=needs_answers,
        )


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How each step samples."""

    prompts_per_step: int = 8
    """Prompts drawn per step (groups)."""
    samples_per_prompt: int = 4
    """G: samples per prompt, for group-relative advantages (>= 2)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same)."""
    max_new_tokens: int = 64
    """Longest response, in tokens."""
    speculation_k: int = field_default(EngineConfig, "speculation_k")
    """Draft tokens per verify step (0: plain decoding); with speculation_auto, the largest k (its
    default is the engine's, `engine.speculation_k`)."""
    speculation_auto: bool = False
    """The sidecars choose k in 0..speculation_k for every engine step from their measured costs
    and acceptance (local sidecars start in that mode; remote ones must be started with
    `specrl serve --speculation-auto`). Lossless, but at temperature > 0 a sample then depends on the
    k chosen per step, so it is not bit-reproducible from the run seed."""

    @property
    def request_k(self) -> int | None:
        """The per-request k override: None (the sidecar's own choice) in automatic mode."""
        return None if self.speculation_auto else self.speculation_k

    measure_plain: bool = False
    """Also generate each step's prompts with speculation off (same weights) and time it: the
    speedup measured side by side in the same run. Costs one extra generation per step."""
    deadline_s: float = 300.0
    """A sidecar that has not answered its share by then is given up on and its prompts re-routed."""
    refill_rounds: int = 2
    """DAPO dynamic sampling: when `algorithm.filter_equal_groups` drops groups whose rewards are
    all equal, draw fresh prompts for the missing groups, for at most this many extra generation
    rounds per step (0: no refill, the step trains on fewer groups). A step left short is reported."""
    max_policy_lag: int = 0
    """Asynchronous RL: generate up to this many weight versions ahead of training (0: the
    synchronous loop, generate -> train -> push). With 1, step t+1's batch generates while step t
    trains; pushes land while it generates (rows continue on the new weights), a sample is never
    trained on more than this many versions after the weights of its first token (older groups
    are regenerated, `rollout/stale_regenerated`), and the loss corrects for the older sampling
    policy with truncated importance weights (`algorithm.importance_cap`)."""

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"rollout.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.samples_per_prompt < 2:
            raise ValueError(f"rollout.samples_per_prompt must be >= 2 (GRPO groups), got {self.samples_per_prompt}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.speculation_k < 0:
            raise ValueError(f"rollout.speculation_k must be >= 0, got {self.speculation_k}")
        if not self.temperature > 0.0:
            raise ValueError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not self.deadline_s > 0:
            raise ValueError(f"rollout.deadline_s must be > 0, got {self.deadline_s}")
        if self.refill_rounds < 0:
            raise ValueError(f"rollout.refill_rounds must be >= 0 (0: no refill), got {self.refill_rounds}")
        if self.max_policy_lag < 0:
            raise ValueError(f"rollout.max_policy_lag must be >= 0 (0: synchronous), got {self.max_policy_lag}")
        if self.max_policy_lag and self.measure_plain:
            raise ValueError(
                "rollout.measure_plain times a plain generation beside each step's, which generation running "
                "ahead of training would overlap; set rollout.measure_plain: false with rollout.max_policy_lag > 0"
            )


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Shaping added to the task's reward before advantages are computed."""

    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment: responses longer than rollout.max_new_tokens minus this many
    tokens lose up to `overlong_penalty`, linearly, reaching it at max_new_tokens (0: off)."""
    overlong_penalty: float = 1.0
    """The penalty at (and beyond) rollout.max_new_tokens."""

    def __post_init__(self) -> None:
        if self.overlong_buffer_len < 0:
            raise ValueError(f"reward.overlong_buffer_len must be >= 0 (0: off), got {self.overlong_buffer_len}")
        if not self.overlong_penalty >= 0:
            raise ValueError(f"reward.overlong_penalty must be >= 0, got {self.overlong_penalty}")


@dataclass(kw_only=True, slots=True)
class WeightTransportConfig:
    """How weight pushes reach the sidecars (see docs/protocol.md, "Weight transport"). Local
    sidecars use shared memory once they prove they share this host; a collective group is
    set up only when `collective_host` is set; gRPC is always the fallback."""

    shm: bool = True
    """Use shared memory with sidecars that prove they run on this host."""
    collective_host: str | None = None
    """An address of this trainer host that the sidecars can reach: set it to push over a
    torch.distributed group (rank 0 here, one group per sidecar); unset: no collective."""
    collective_backend: str = "gloo"
    """"gloo" (CPU tensors) or "nccl" (GPU tensors)."""
    collective_timeout_s: float = 30.0
    """Bound on forming a group and on every broadcast."""
    bucket_mib: int = 64
    """Collective bucket size."""
    sparse_deltas: bool = False
    """Push each tensor as a sparse delta against the sidecar's served version where that is
    smaller (full on first contact, after a refusal and on rejoin). Off by default: it moves
    ~50x fewer bytes only for bfloat16 serving at real-RL update sizes, and on one host costs
    more seconds than it saves (BENCHMARKS.md, "Sparse delta pushes"); the demo serves float32,
    where nearly every element changes every step."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {"deltas": "sparse_deltas"}
    """Keys renamed (refused with their new name: one word, sparse deltas, from the config to the wire)."""

    def __post_init__(self) -> None:
        self.transport_config()  # validates (ValueError names the field)

    def transport_config(self) -> TransportConfig:
        collective = None
        if self.collective_host is not None:
            try:
                collective = CollectiveConfig(
                    host=self.collective_host,
                    backend=self.collective_backend,
                    timeout_s=self.collective_timeout_s,
                    bucket_bytes=self.bucket_mib << 20,
                )
            except ValueError as e:
                raise ValueError(f"sidecars.weight_transport: {e}") from None
        return TransportConfig(shm=self.shm, collective=collective)


TRAINER_OWNED = {
    "model": "model",
    "host": "nothing (local sidecars bind loopback)",
    "port": "nothing (local sidecars bind port 0)",
    "parent_pid": "nothing (the trainer's own pid)",
    "security": "sidecars.security",
    "engine.speculation_k": "rollout.speculation_k",
    "engine.speculation_auto": "rollout.speculation_auto",
    "engine.device": "sidecars.devices",
    "engine.draft": "draft.eagle3",
}
"""`sidecars.serve` keys the trainer sets for its local sidecars from its own settings (the key
to set instead)."""


def trainer_owned(serve: ServeConfig) -> dict[str, str]:
    """The keys of `TRAINER_OWNED` that `serve` sets otherwise than `ServeConfig()` does."""
    default = to_mapping(ServeConfig())
    given = to_mapping(serve)

    def at(data: dict[str, Any], key: str) -> Any:
        for part in key.split("."):
            data = data[part]
        return data

    return {key: where for key, where in TRAINER_OWNED.items() if at(given, key) != at(default, key)}


@dataclass(kw_only=True, slots=True)
class SidecarsConfig:
    """Which sidecars serve the rollouts: remote addresses, or local subprocesses."""

    addresses: list[str] = field(default_factory=list)
    """HOST:PORT of running sidecars (`specrl serve`)."""
    local: int | None = None
    """Start this many local `specrl serve` subprocesses on the run's checkpoint (port 0); unset:
    one when no addresses are given, none when they are."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """What each local sidecar serves with (`specrl serve`'s config, `sidecar.serve_config`):
    e.g. `sidecars.serve.engine.kv_block_size=32`, `sidecars.serve.engine.kind=sglang`. The trainer
    sets what it owns itself: the model (`model`), k (`rollout.speculation_k`,
    `rollout.speculation_auto`), the devices (`sidecars.devices`), the EAGLE-3 draft
    (`draft.eagle3`), the address (loopback, port 0), the token (`sidecars.security`) and the
    parent process; setting those here is refused."""
    threads: int = 1
    """torch threads of each local sidecar (OMP_NUM_THREADS)."""
    startup_timeout_s: float = 120.0
    """How long a local sidecar may take to print `listening on`."""
    call_timeout_s: float = 10.0
    """Deadline of control calls (health, info, stats)."""
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    """torch device of each local sidecar (`specrl serve --device`): one entry for all of them, or
    one per sidecar (e.g. ["cuda:0", "cuda:1"])."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """What the trainer presents to every sidecar: the token's file (`token_file`, else
    $SPECRL_TOKEN; local sidecars are started with the same token), TLS (`peer_ca`, `tls`) and
    its certificate for mutual TLS (`cert`, `key`)."""
    weight_transport: WeightTransportConfig = field(default_factory=WeightTransportConfig)
    """Transports for weight pushes (shm for proven local sidecars; collective when set up)."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "max_batch_size": "serve.engine.max_batch_size",
        "engine": "serve.engine.kind",
        "weight_sync": "weight_transport",  # glossary: refused here
    }
    """Keys that moved (into the `serve` section, or renamed): refused with their new key."""

    def __post_init__(self) -> None:
        owned = trainer_owned(self.serve)
        if owned:
            raise ValueError(
                "sidecars.serve: "
                + "; ".join(f"{key} is the trainer's to set: set {where} instead" for key, where in owned.items())
            )
        if self.local is None:
            self.local = 0 if self.addresses else 1
        if self.local < 0:
            raise ValueError(f"sidecars.local must be >= 0, got {self.local}")
        if not self.devices:
            raise ValueError('sidecars.devices must name at least one device, e.g. ["cpu"] or ["cuda:0"]')
        if self.local and len(self.devices) not in (1, self.local):
            raise ValueError(
                f"sidecars.devices has {len(self.devices)} entries for {self.local} local sidecars: "
                "give one device for all of them or one per sidecar"
            )
        if self.local and self.addresses:
            raise ValueError("give sidecars.addresses or sidecars.local, not both")
        if self.threads < 1:
            raise ValueError(f"sidecars.threads must be >= 1, got {self.threads}")
        if self.local and self.security.client_uses_tls:
            raise ValueError(
                "local sidecars serve plaintext on loopback; sidecars.security TLS settings apply to "
                "sidecars.addresses (start TLS sidecars with `specrl serve --cert ... --key ...` and list them)"
            )

    def client_config(self) -> ClientConfig:
        """The per-sidecar client settings, with the token read now (from `security.token_file` or
        $SPECRL_TOKEN). The files are looked for here, when the run starts, not when the config is
        built: a config names files on the machine that runs it."""
        self.security.check_files("sidecars.security")
        return ClientConfig(
            timeout_s=self.call_timeout_s,
            retries=1,
            security=self.security,
            token=self.security.read_token(),
        )

    def device_of(self, i: int) -> str:
        """The device of local sidecar `i`."""
        return self.devices[i % len(self.devices)]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """How the trainer runs the update: parallel layout and gradient clipping."""

    tensor_parallel: int = 1
    """Tensor-parallel size T of the trainer's policy (must divide heads, kv heads, ffn and vocab)."""
    data_parallel: int = 1
    """Data-parallel replicas D of the (tensor-parallel) policy: `torchrun` starts D x T processes
    (README, "Training on several nodes"); each replica trains a token-balanced share of every
    update's samples, gradients summed over replicas (the update is the D = 1 update)."""
    expert_parallel: int = 1
    """Expert-parallel size E of a mixture-of-experts policy: each group of E ranks shares out every
    sparse layer's experts (num_experts / E each; it must divide num_experts and the processes). 1
    for a dense model (docs/moe.md)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """How an MoE policy's routers train: RL's defaults keep the sampler's routing (no
    load-balancing loss, no expert-bias updates, float32 routing); ignored for a dense model."""
    rank_timeout_s: float = 60.0
    """Multi-process runs: a rank that stops answering (killed, hung) for this long, or that
    fails, stops every rank with one error naming it (`trainer.rl.ranks.RankWatchdog`)."""
    clip_grad: float = 1.0
    """Max global gradient norm of the trunk."""
    micro_batch_rows: int = 0
    """Samples per forward/backward (gradient accumulation; the update equals the unsplit one up to
    float32 summation order). 0: each update's whole batch in one forward."""
    epochs: int = 1
    """Passes over each rollout batch (PPO epochs)."""
    mini_batches: int = 1
    """Updates per pass, each on a shuffled slice of the rollout batch. With epochs x mini_batches
    > 1 the old log-probs come from a separate forward before the first update (implies
    `separate_logprob_pass`)."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Trunk learning-rate schedule (warm-up, constant/linear/cosine decay), per optimizer update."""

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"train.tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.data_parallel < 1:
            raise ValueError(f"train.data_parallel must be >= 1, got {self.data_parallel}")
        if self.expert_parallel < 1:
            raise ValueError(f"train.expert_parallel must be >= 1, got {self.expert_parallel}")
        if not self.rank_timeout_s > 0:
            raise ValueError(f"train.rank_timeout_s must be > 0, got {self.rank_timeout_s}")
        if self.micro_batch_rows < 0:
            raise ValueError(f"train.micro_batch_rows must be >= 0 (0: whole batch), got {self.micro_batch_rows}")
        for name in ("epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")

        if not self.clip_grad > 0.0:
            raise ValueError(f"train.clip_grad must be > 0, got {self.clip_grad}")

    @property
    def updates_per_batch(self) -> int:
        return self.epochs * self.mini_batches


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """One RL run."""

    model: Path
    """Checkpoint directory (config.json + model.safetensors, naming contract) to start from."""
    tokenizer: str | None = None
    """A path to a Hugging Face tokenizer.json (or its directory), "builtin" (the character tokenizer),
    or null: the model's own, i.e. its tokenizer.json, or the built-in one for a checkpoint specrl
    built for it (no tokenizer files, and no end-of-sequence id other than the built-in one's). A
    tokenizer other than the model's own is refused."""
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: GRPOConfig = field(default_factory=GRPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward shaping (DAPO overlong punishment)."""
    reference_model: Path | None = None
    """Checkpoint of the frozen reference policy that `algorithm.kl_coef > 0` keeps the policy
    near, held on the trainer (one more trunk in memory, one more forward per step); None: `model`,
    the checkpoint the run starts from."""
    optimizer: HybridOptimizerConfig = field(default_factory=lambda: HybridOptimizerConfig(lr=1e-5))
    """Trunk optimizer (Muon for hidden matrices, AdamW for the rest)."""
    separate_logprob_pass: bool = False
    """Recompute the old log-probs in a forward pass of their own before the update (the reference
    study's "log-probs" phase). Each rollout batch gets one update, so those log-probs are the
    current policy's: by default they are taken, detached, from the training forward itself (the
    same weights and the same float32 numbers, so the PPO ratio is exactly 1 either way), which
    saves one forward over the batch per step."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """The draft: its kind (MTP layers, or `draft.eagle3`), whether it trains, its objective,
    optimizer, clip and schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Parallel layout, gradient clipping (and, see the README, batching and schedules)."""
    sidecars: SidecarsConfig = field(default_factory=SidecarsConfig)
    steps: int = 10
    """RL steps."""
    eval_every: int = 5
    """Evaluate on the held-out split every this many steps (and before the first); 0: never."""
    eval_size: int = 32
    """Held-out problems per evaluation (greedy, one sample each)."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint every this many steps (0: only at the end)."""
    export: bool = True
    """At the end of the run, write the last step's policy and draft as a Hugging Face checkpoint
    (config.json, model.safetensors, the model's tokenizer files; an EAGLE-3 draft in `eagle3/`)
    to `run_dir`/export, replacing an earlier one; `specrl export` writes any kept step."""
    seed: int = 0
    """Seed of sampling, initialisation and problem draws."""
    run_dir: Path = Path("runs/rl")
    """Run directory: the config, metrics.jsonl, plots, checkpoints."""
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    """Optional TensorBoard / Weights & Biases reporting (metrics.jsonl and plots are always written)."""

    def __post_init__(self) -> None:
        for name in ("steps", "eval_every", "eval_size", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.sidecars.local and not self.sidecars.addresses:
            raise ValueError("no sidecars: set sidecars.local (e.g. 2) or sidecars.addresses (HOST:PORT, ...)")
        rows = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if self.train.mini_batches > rows:
            raise ValueError(
                f"train.mini_batches={self.train.mini_batches} exceeds the {rows} samples of a step "
                f"(rollout.prompts_per_step x rollout.samples_per_prompt); lower it"
            )
        if rows // self.train.mini_batches < self.train.data_parallel:
            raise ValueError(
                f"train.data_parallel={self.train.data_parallel} replicas but updates of "
                f"{rows // self.train.mini_batches} samples (rollout.prompts_per_step x rollout.samples_per_prompt "
                f"/ train.mini_batches): every replica needs a sample; raise rollout.prompts_per_step"
            )
        if self.reward.overlong_buffer_len > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} exceeds rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}; the penalty ramp must fit inside the response length"
            )


def demo_config(model: Path, run_dir: Path) -> RLConfig:
    """The demo's RL phase: short "zero"-regime arithmetic, two local sidecars, speculation k=3,
    and a plain-decoding pass per step to measure the speedup side by side.

    Sized so that the held-out reward rises well beyond its noise every time (BENCHMARKS.md,
    "Learning"): 8 prompts x G=8 per step. With 4 x 4 the 16-sample gradient is mostly noise that
    Muon's orthogonalised update follows at full size: 40 steps at this learning rate wandered
    (0.52 -> 0.63 -> 0.54 -> 0.63 -> 0.52) and 1e-3 collapsed the policy to 0.01; with 64 samples
    per step, G = 8 leaves nearly every group with both right and wrong answers (GRPO's signal) at
    the warm-up's ~0.35 sampled reward, and 20 steps lift the held-out reward by ~0.3. The
    held-out set is 256 distinct problems (standard error <= 0.031), evaluated every 5 steps.
    Each sidecar decodes 32 rows per step: there a k+1-token verify costs more than a one-token
    step on this CPU, so the measured generation speedup is lower than at 8 rows
    (BENCHMARKS.md, "RL loop").
    """
    return RLConfig(
        model=model,
        task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
        rollout=RolloutConfig(
            prompts_per_step=8, samples_per_prompt=8, temperature=1.0, max_new_tokens=40, measure_plain=True
        ),
        optimizer=HybridOptimizerConfig(lr=3e-4),
        draft=DraftConfig(chain_depth=4, optimizer=HybridOptimizerConfig(lr=1e-3)),
        sidecars=SidecarsConfig(local=2),
        steps=20,
        eval_every=5,
        eval_size=256,
        seed=0,
        run_dir=run_dir,
    )
