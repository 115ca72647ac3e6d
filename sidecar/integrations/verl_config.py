"""What verl's `actor_rollout_ref.rollout.engine_kwargs.specrl` holds, and the checks that run at
verl's start so that a wrong setting fails there with one message (what was wrong, what to do).

Pure Python (no verl import): the verl plugin (`sidecar.integrations.verl`) parses its options
here, and the default test suite checks the parsing without verl installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sidecar import config_io
from sidecar.client.client import ClientConfig, SidecarCallError, SidecarClient
from sidecar.integrations.draft_alignment import DraftAlignConfig, read_draft_tensors
from sidecar.model.model import ModelConfig
from sidecar.security import SecurityConfig
from sidecar.types import SidecarInfo, WeightSelector

CONFIG_KEY = "actor_rollout_ref.rollout.engine_kwargs.specrl"
"""Where the options live in verl's Hydra config (one place, named in every error)."""


class SpecrlConfigError(ValueError):
    """A setting of the verl plugin is wrong; the message says which and what to do."""


@dataclass(kw_only=True, slots=True)
class SpecrlRolloutOptions:
    """The plugin's options: which sidecars to attach to, how to reach them, how to speculate."""

    sidecars: tuple[str, ...]
    """One "host:port" per rollout replica verl makes (replica i drives sidecars[i])."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """How the replicas reach their sidecars: `security.token_file` (else $SPECRL_TOKEN),
    `security.peer_ca` / `security.tls` (TLS), `security.cert` and `security.key` (mutual TLS);
    the same `SecurityConfig` as the trainer's `sidecars.security`."""
    speculation_k: int | None = None
    """Draft length per request; None keeps each sidecar's default."""
    seed: int | None = None
    """Base seed: request n of replica r uses seed + n (reproducible rollouts); None draws fresh seeds."""
    draft_checkpoint: Path | None = None
    """The served checkpoint (HF Qwen3 + mtp.*): when set, the draft is refitted to each new
    policy on the latest rollouts (DraftAligner) and pushed with it in the same update."""
    draft_align_steps: int = 20
    """Adam steps per draft refit."""
    connect_timeout_s: float = 30.0
    """Deadline of each control call (GetInfo, health) to a sidecar."""

    def __post_init__(self) -> None:
        if not self.sidecars:
            raise SpecrlConfigError(
                f"{CONFIG_KEY}.sidecars is empty: list the address (host:port) of each running `specrl serve`, "
                f"e.g. +{CONFIG_KEY}.sidecars=[10.0.0.5:50051]"
            )
        for address in self.sidecars:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise SpecrlConfigError(f"{CONFIG_KEY}.sidecars has {address!r}; write each as host:port")
        if len(set(self.sidecars)) != len(self.sidecars):
            raise SpecrlConfigError(
                f"{CONFIG_KEY}.sidecars lists an address twice: {list(self.sidecars)}; each replica needs its own "
                "sidecar (two replicas pushing weights to one sidecar would advance its version twice a step)"
            )
        if self.speculation_k is not None and self.speculation_k < 0:
            raise SpecrlConfigError(f"{CONFIG_KEY}.speculation_k must be >= 0 or null, got {self.speculation_k}")
        if self.draft_align_steps < 1:
            raise SpecrlConfigError(f"{CONFIG_KEY}.draft_align_steps must be >= 1, got {self.draft_align_steps}")
        if self.connect_timeout_s <= 0:
            raise SpecrlConfigError(f"{CONFIG_KEY}.connect_timeout_s must be > 0, got {self.connect_timeout_s}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> SpecrlRolloutOptions:
        """Parse `engine_kwargs.specrl` (an OmegaConf node or a dict); unknown keys are refused."""
        if raw is None or not raw:
            raise SpecrlConfigError(
                f"rollout.name=specrl needs {CONFIG_KEY}.sidecars: add "
                f"+{CONFIG_KEY}.sidecars=[host:port,...] (one running `specrl serve` per rollout replica)"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpecrlConfigError(f"{CONFIG_KEY} has unknown option(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = dict(raw)
        sidecars = values.get("sidecars")
        if isinstance(sidecars, str):
            sidecars = [s for s in sidecars.split(",") if s]
        values["sidecars"] = tuple(str(s).strip() for s in (sidecars or ()))
        if values.get("draft_checkpoint") is not None:
            values["draft_checkpoint"] = Path(str(values["draft_checkpoint"]))
        security = values.get("security")
        if security is not None:
            if not isinstance(security, Mapping):
                raise SpecrlConfigError(
                    f"{CONFIG_KEY}.security must be a mapping, e.g. +{CONFIG_KEY}.security.peer_ca=/path/ca.pem"
                )
            try:
                values["security"] = config_io.from_mapping(
                    SecurityConfig, {str(k): v for k, v in security.items()}, path=f"{CONFIG_KEY}.security."
                )
            except ValueError as e:
                raise SpecrlConfigError(str(e)) from None
        return cls(**values)

    def client_config(self) -> ClientConfig:
        """The client settings of every replica, with the token read now (`security.token_file` or
        $SPECRL_TOKEN); SpecrlConfigError names a file that is not on this machine."""
        try:
            self.security.check_files(f"{CONFIG_KEY}.security")
            token = self.security.read_token()
        except ValueError as e:
            raise SpecrlConfigError(str(e)) from None
        return ClientConfig(timeout_s=self.connect_timeout_s, security=self.security, token=token)

    def align_config(self, temperature: float) -> DraftAlignConfig:
        return DraftAlignConfig(steps=self.draft_align_steps, temperature=temperature if temperature > 0 else 1.0)

    def sidecar_for(self, replica_rank: int, replicas: int | None = None) -> str:
        """The address replica `replica_rank` drives; with `replicas` (verl's count) also checks
        that there is exactly one sidecar per replica."""
        if replicas is not None and replicas != len(self.sidecars):
            raise SpecrlConfigError(
                f"verl makes {replicas} rollout replica(s) but {CONFIG_KEY}.sidecars lists {len(self.sidecars)}: "
                "list one sidecar per replica (replicas = rollout GPUs / (tensor x data x pipeline parallel size))"
            )
        if not 0 <= replica_rank < len(self.sidecars):
            raise SpecrlConfigError(
                f"rollout replica {replica_rank} has no sidecar: {CONFIG_KEY}.sidecars lists {len(self.sidecars)}; "
                "list one sidecar per replica"
            )
        return self.sidecars[replica_rank]


def model_facts(model_path: str | Path) -> dict[str, Any]:
    """The facts of verl's model a sidecar must share (from its config.json)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return {
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": int(config["hidden_size"]),
        "num_layers": int(config["num_hidden_layers"]),
    }


def attach(address: str, options: SpecrlRolloutOptions, model_path: str | Path | None) -> SidecarInfo:
    """Connect to a running sidecar and check it serves verl's model; returns its info. Raises
    SpecrlConfigError (what was wrong, what to do) when it is unreachable or serves another model."""
    client = SidecarClient(address, options.client_config())
    try:
        try:
            info = client.info()
        except SidecarCallError as e:
            raise SpecrlConfigError(
                f"cannot reach the specrl sidecar at {address} ({e.code.name}: {e.details}); start it there "
                f"(`specrl serve --model DIR --host 0.0.0.0 --port PORT`) or fix {CONFIG_KEY}.sidecars "
                "(and security.token_file / security.peer_ca if it requires them)"
            ) from None
    finally:
        client.close()
    if model_path is not None:
        served = info.engine.model
        want = model_facts(model_path)
        got = {"vocab_size": served.vocab_size, "hidden_size": served.hidden_size, "num_layers": served.num_layers}
        if got != want:
            raise SpecrlConfigError(
                f"the sidecar at {address} serves {served.name or 'a model'} with {got}, but verl trains "
                f"{model_path} with {want}; start the sidecar with the model verl trains "
                "(actor_rollout_ref.model.path, plus its mtp.* draft layers)"
            )
    if options.draft_checkpoint is not None:
        check_draft(address, options, Path(options.draft_checkpoint))
    return info


def check_draft(address: str, options: SpecrlRolloutOptions, checkpoint: Path) -> None:
    """SpecrlConfigError unless the draft layers in `checkpoint` (what DraftAligner refits and
    pushes) are the ones the sidecar serves: same names and shapes (DescribeWeights, selector
    draft). A mismatch would otherwise fail the first push of training, not verl's start."""
    try:
        config = ModelConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
        ours = (
            {n: tuple(t.shape) for n, t in read_draft_tensors(checkpoint).items()}
            if config.num_nextn_predict_layers
            else {}
        )
    except (OSError, ValueError, KeyError) as e:
        raise SpecrlConfigError(
            f"{CONFIG_KEY}.draft_checkpoint {checkpoint} cannot be read ({e}); point it at a checkpoint directory"
        ) from None
    client = SidecarClient(address, options.client_config())
    try:
        specs, _ = client.describe_weights(WeightSelector.DRAFT)
    finally:
        client.close()
    served = {s.name: tuple(s.shape) for s in specs}
    if ours != served:
        differ = sorted(n for n in ours.keys() | served.keys() if ours.get(n) != served.get(n))
        raise SpecrlConfigError(
            f"{CONFIG_KEY}.draft_checkpoint {checkpoint} holds draft layers that do not match what the sidecar at "
            f"{address} serves ({len(ours)} tensors against {len(served)}; they differ in {differ[:3]}); point "
            "draft_checkpoint at the checkpoint the sidecar was started with"
        )
