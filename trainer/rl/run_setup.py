"""What a run is built of: the policy from the run config, the sidecars (local processes or given
addresses) as one fleet, the run directory, and the checkpoint a resume starts from."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

from sidecar.client.fleet import Fleet, FleetConfig
from sidecar.config_io import to_mapping, write_yaml
from sidecar.model.model import ModelConfig
from sidecar.serve_config import ServeConfig
from trainer.policy.policy import Policy
from trainer.rl.config import RLConfig
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.preflight import check_sidecars
from trainer.rl.run_dir import RunDir
from trainer.rl.trackers import open_trackers


def policy_config(cfg: RLConfig) -> Policy.Config:
    """The policy's config from the run config: every `Policy.Config` field has a run-config key."""
    return Policy.Config(
        tensor_parallel=cfg.train.tensor_parallel,
        data_parallel=cfg.train.data_parallel,
        expert_parallel=cfg.train.expert_parallel,
        router=cfg.train.router,
        seed=cfg.seed,
        temperature=cfg.rollout.temperature,
        grpo=cfg.algorithm,
        optimizer=cfg.optimizer,
        clip_grad=cfg.train.clip_grad,
        draft=cfg.draft,
        micro_batch_rows=cfg.train.micro_batch_rows,
        lr_schedule=cfg.train.lr_schedule,
        total_updates=cfg.steps * cfg.train.updates_per_batch,
    )


def build_policy(cfg: RLConfig) -> Policy:
    if cfg.draft.eagle3 is None:
        return Policy.from_checkpoint(cfg.model, policy_config(cfg))
    from sidecar.model.checkpoint import load_checkpoint
    from sidecar.model.eagle3_checkpoint import load_eagle3_draft

    model_config, tensors = load_checkpoint(cfg.model)
    draft = load_eagle3_draft(cfg.draft.eagle3, target=model_config)
    return Policy(model_config, policy_config(cfg), tensors, eagle3=draft)


def local_serve_config(cfg: RLConfig) -> ServeConfig:
    """What the run's local sidecars serve with: `sidecars.serve`, with the k of the rollouts and
    the run's EAGLE-3 draft (the keys the trainer owns, `trainer.rl.config.TRAINER_OWNED`)."""
    serve = cfg.sidecars.serve
    engine = dataclasses.replace(
        serve.engine,
        speculation_k=cfg.rollout.speculation_k,
        speculation_auto=cfg.rollout.speculation_auto,
        draft=cfg.draft.eagle3,
    )
    return dataclasses.replace(serve, engine=engine)


@contextlib.contextmanager
def sidecar_fleet(cfg: RLConfig, run_dir: Path) -> Iterator[tuple[Fleet, LocalSidecars | None]]:
    """The run's sidecars: local subprocesses (torn down on exit) or the given addresses, all
    reached with the run's credentials (`sidecars.security`; local sidecars get its token)."""
    local = None
    client = cfg.sidecars.client_config()
    client = dataclasses.replace(
        client,
        transports=cfg.sidecars.weight_transport.transport_config(),
        sparse_deltas=cfg.sidecars.weight_transport.sparse_deltas,
    )
    if cfg.sidecars.local:
        local = LocalSidecars(
            cfg.model,
            int(cfg.sidecars.local),
            run_dir / "logs",
            serve=local_serve_config(cfg),
            threads=cfg.sidecars.threads,
            startup_timeout_s=cfg.sidecars.startup_timeout_s,
            devices=cfg.sidecars.devices,
            token=client.token,
        )
    with contextlib.ExitStack() as stack:
        if local is not None:
            stack.enter_context(local)
            addresses = local.start()
        else:
            addresses = list(cfg.sidecars.addresses)
        fleet = stack.enter_context(Fleet(addresses, FleetConfig(client=client, deadline_s=cfg.rollout.deadline_s)))
        yield fleet, local


def latest_checkpoint(checkpoints: Path) -> tuple[int, Path] | None:
    """The newest `step_N` directory under `checkpoints`, with N."""
    steps = [(int(m.group(1)), p) for p in checkpoints.glob("step_*") if (m := re.match(r"step_(\d+)$", p.name))]
    return max(steps) if steps else None


def open_run_dir(cfg: RLConfig, resume: bool, model: ModelConfig) -> RunDir:
    """Rank 0's run directory with the resolved config and the trackers; probes remote sidecars."""
    if cfg.sidecars.addresses:
        check_sidecars(cfg, model)
    run_dir = RunDir(cfg.run_dir, resume=resume)
    write_yaml(cfg, run_dir.config_path)
    run_dir.trackers = open_trackers(cfg.trackers, run_dir.root, to_mapping(cfg))
    return run_dir
