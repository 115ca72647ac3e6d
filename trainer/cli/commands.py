"""`specrl train`, `specrl warmup`, `specrl draft-init`, `specrl export` and `specrl demo` (click).

The commands only select and override: a run is an `RLConfig` (`trainer.rl.config`) read from
YAML/TOML with `--set section.field=value` overrides on top; `--sidecar`, `--local-sidecars`,
`--model` and `--run-dir` are shorthands for the corresponding fields.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import yaml
from tqdm import tqdm

from sidecar.config_io import ConfigError, from_mapping, load_file, merge_overrides, retired_option, to_mapping
from trainer.rl.config import RLConfig, TaskConfig
from trainer.rl.environments import Environment
from trainer.rl.tasks import DatasetFields, Task
from trainer.rl.warmup import DraftInitConfig, Progress, WarmupConfig
from trainer.tokenizer import Tokenizer


@contextmanager
def _bar(total: int, desc: str) -> Iterator[Progress]:
    with tqdm(total=total, desc=desc, unit="step") as bar:

        def update(step: int, metrics: dict[str, float]) -> None:
            bar.update(step - bar.n)
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items()})

        yield update


def resolve_config(config: Path | None, overrides: list[str]) -> RLConfig:
    """File (optional) + dotted overrides → RLConfig; ClickException naming the bad key."""
    try:
        data = load_file(config) if config is not None else {}
        return from_mapping(RLConfig, merge_overrides(data, overrides))
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    except TypeError as e:  # a required field (model) is missing
        raise click.ClickException(f"{e}; set it in the file or with --set / --model") from None


@contextmanager
def user_errors() -> Iterator[None]:
    """Expected failures leave as one clear CLI message (exit code 1), not a traceback.

    specrl's own errors (SpecrlError: preflight, rollout, sidecar start, checkpoint mismatch,
    reward function, weight push) say what was wrong and what to do; so do config errors and an
    occupied run directory. Anything else is a bug and keeps its traceback.
    """
    from sidecar.errors import SpecrlError

    try:
        yield
    except (SpecrlError, ConfigError, FileExistsError) as e:
        raise click.ClickException(f"{type(e).__name__}: {e}") from None


@click.command()
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="YAML/TOML.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a field, e.g. steps=20.")
@click.option("--model", type=click.Path(exists=True, file_okay=False), help="Checkpoint to start from (= model).")
@click.option("--sidecar", "sidecars", multiple=True, metavar="HOST:PORT", help="A running sidecar (repeatable).")
@click.option("--local-sidecars", type=click.IntRange(1), help="Start N local `specrl serve` processes instead.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory (= run_dir).")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir from its latest checkpoint.")
@click.option("--print-config", is_flag=True, help="Print the resolved config (YAML) and exit.")
@click.option("--log-level", default="WARNING", show_default=True)
def train(
    config: Path | None,
    overrides: tuple[str, ...],
    model: str | None,
    sidecars: tuple[str, ...],
    local_sidecars: int | None,
    run_dir: str | None,
    resume: bool,
    print_config: bool,
    log_level: str,
) -> None:
    """Run RL: generate on the sidecars, train policy and draft, push weights, every step."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    extra = list(overrides)
    if model:
        extra.append(f"model={model}")
    if run_dir:
        extra.append(f"run_dir={run_dir}")
    if sidecars:
        extra += ["sidecars.local=0", "sidecars.addresses=[" + ",".join(f"'{s}'" for s in sidecars) + "]"]
    if local_sidecars:
        extra += [f"sidecars.local={local_sidecars}", "sidecars.addresses=[]"]
    cfg = resolve_config(config, extra)
    if print_config:
        click.echo(yaml.safe_dump(to_mapping(cfg), sort_keys=False), nl=False)
        return
    from trainer.rl.export import EXPORT_DIR
    from trainer.rl.loop import train as run_training
    from trainer.rl.ranks import is_leader

    with user_errors():
        history = run_training(cfg, resume=resume)
    if history and is_leader():  # under torchrun, rank 0 reports
        last = history[-1]
        click.echo(
            f"done: {len(history)} steps, reward {last['reward/train_mean']:.3f}, "
            f"tau {last['spec/acceptance_length']:.2f}; run directory {cfg.run_dir}"
            + (f"; exported to {cfg.run_dir / EXPORT_DIR}" if cfg.export else "")
        )


def _task_options(f: Callable[..., None]) -> Callable[..., None]:
    f = click.option(
        "--tokenizer",
        default=None,
        help="A tokenizer.json, or builtin (default: the model's own; see RLConfig.tokenizer)",
    )(f)
    f = click.option("--regime", type=click.Choice(["zero", "think"]), default="zero", show_default=True)(f)
    f = click.option("--digits", type=click.IntRange(1, 6), default=2, show_default=True)(f)
    f = click.option(
        "--dataset",
        type=click.Path(exists=True, path_type=Path),
        help="A dataset (JSONL, parquet, JSON, CSV, arrow, a save_to_disk directory) instead of arithmetic",
    )(f)
    f = click.option(
        "--fields",
        default="",
        metavar="KEY=COLUMN,...",
        help="Its columns (task.fields), e.g. prompt=question or messages=conversation",
    )(f)
    f = click.option(
        "--system-prompt", default="", help="A system turn before every plain prompt (task.system_prompt)"
    )(f)
    return f


def _task(
    regime: str,
    digits: int,
    dataset: Path | None,
    fields: str = "",
    system_prompt: str = "",
    *,
    needs_answers: bool = True,
) -> Task:
    if dataset is not None:
        mapping = dict(part.split("=", 1) for part in fields.split(",") if part.strip())
        try:
            columns = DatasetFields(**{k.strip(): v.strip() for k, v in mapping.items()})
        except TypeError:
            raise ValueError(
                f"--fields {fields!r}: keys are {[f.name for f in dataclasses.fields(DatasetFields)]}"
            ) from None
        config = TaskConfig(kind="dataset", path=str(dataset), fields=columns, system_prompt=system_prompt)
    else:
        config = TaskConfig(kind="arithmetic", regime="think" if regime == "think" else "zero", digits=digits)
    task = config.build(needs_answers=needs_answers)
    assert not isinstance(task, Environment)  # single-turn kinds
    return task


def _checked_inputs(
    model: Path,
    tokenizer: str | None,
    regime: str,
    digits: int,
    dataset: Path | None,
    max_new_tokens: int,
    fields: str = "",
    system_prompt: str = "",
) -> tuple[Task, Tokenizer]:
    """The task and the model's tokenizer, checked as `specrl train`'s preflight checks them (config.json,
    tokenizer against the model, every dataset row; answers and rewards are not needed to warm up or to
    fit a draft); PreflightError naming the option to change."""
    from trainer.rl.preflight import PreflightError, check_problems, checked_tokenizer, read_model_config

    model_config = read_model_config(model)
    tok = checked_tokenizer(tokenizer, model, model_config, key="--tokenizer")
    try:
        task = _task(regime, digits, dataset, fields, system_prompt, needs_answers=False)
    except (OSError, ValueError) as e:
        raise PreflightError(f"--dataset: {e}") from None
    check_problems(task, tok, model_config, max_new_tokens, seed=0, reward_key="")
    return task, tok


_WARMUP = WarmupConfig()
_DRAFT_INIT = DraftInitConfig()
"""The commands' option defaults are the configs' defaults (one source of truth)."""


@click.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@_task_options
@click.option("--steps", type=click.IntRange(1), default=_WARMUP.steps, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=_WARMUP.batch_size, show_default=True)
@click.option("--lr", type=float, default=_WARMUP.lr, show_default=True)
@click.option("--seed", type=int, default=_WARMUP.seed, show_default=True)
def warmup(
    model: Path,
    out: Path,
    tokenizer: str | None,
    regime: str,
    digits: int,
    dataset: Path | None,
    fields: str,
    system_prompt: str,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> None:
    """Supervised warm-up on the task's reference solutions (so the policy earns reward)."""
    from trainer.rl.warmup import supervised_warmup

    cfg = WarmupConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    with user_errors():
        task, tok = _checked_inputs(model, tokenizer, regime, digits, dataset, 0, fields, system_prompt)
    with user_errors(), _bar(steps, "warm-up") as progress:
        nll = supervised_warmup(model, out, task, tok, cfg, progress)
    click.echo(f"warm-up: token NLL {nll[0]:.3f} -> {nll[-1]:.3f}; wrote {out}")


@click.command("draft-init")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@_task_options
@click.option(
    "--prompts", type=click.IntRange(1), default=_DRAFT_INIT.prompts, show_default=True, help="Completions to fit on."
)
@click.option("--temperature", type=click.FloatRange(0), default=_DRAFT_INIT.temperature, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(1), default=_DRAFT_INIT.max_new_tokens, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=_DRAFT_INIT.steps, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=_DRAFT_INIT.batch_size, show_default=True)
@click.option("--lr", type=float, default=_DRAFT_INIT.lr, show_default=True)
@click.option(
    "--chain-depth",
    type=click.IntRange(0),
    default=_DRAFT_INIT.chain_depth,
    show_default=True,
    help="Draft steps trained (use >= spec k).",
)
@click.option("--seed", type=int, default=_DRAFT_INIT.seed, show_default=True)
@click.option(
    "--draft-kind",
    "kind",
    type=click.Choice(["mtp", "eagle3"]),
    default=_DRAFT_INIT.kind,
    show_default=True,
    help="mtp: train the checkpoint's MTP layers, OUT is the whole checkpoint; eagle3: a separate "
    "EAGLE-3 draft, OUT is its directory (specrl serve --model MODEL --draft OUT; SGLang/vLLM layout).",
)
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(0),
    default=_DRAFT_INIT.draft_vocab_size,
    show_default=True,
    help="eagle3: keep the draft's output to the N ids most frequent in the completions (0: all).",
)
@retired_option("--draft", "--draft-kind")
@retired_option("--draft-vocab", "--draft-vocab-size")  # glossary: refused here
def draft_init_cmd(
    model: Path,
    out: Path,
    tokenizer: str | None,
    regime: str,
    digits: int,
    dataset: Path | None,
    fields: str,
    system_prompt: str,
    prompts: int,
    temperature: float,
    max_new_tokens: int,
    steps: int,
    batch_size: int,
    lr: float,
    chain_depth: int,
    seed: int,
    kind: str,
    draft_vocab_size: int,
) -> None:
    """Initialise the draft in-domain: fit it on the policy's own completions (trunk frozen); a
    checkpoint without MTP layers gets one grafted first."""
    from trainer.rl.warmup import draft_init

    try:
        cfg = DraftInitConfig(
            prompts=prompts,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            chain_depth=chain_depth,
            seed=seed,
            kind=kind,
            draft_vocab_size=draft_vocab_size,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    with user_errors():
        task, tok = _checked_inputs(model, tokenizer, regime, digits, dataset, max_new_tokens, fields, system_prompt)
    with user_errors(), _bar(steps, "draft-init") as progress:
        losses = draft_init(model, out, task, tok, cfg, progress)
    click.echo(f"draft-init: draft loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {out}")


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=click.IntRange(1), help="A kept checkpoint's step (default: the run's last).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="A new directory.")
def export_cmd(run_dir: Path, step: int | None, out: Path) -> None:
    """Write a run's policy and draft as a Hugging Face checkpoint (transformers, specrl serve, SGLang)."""
    from trainer.rl.export import EAGLE3_DIR
    from trainer.rl.ranks import is_leader, join_torchrun_group

    join_torchrun_group()  # a tensor-parallel run exports under torchrun with as many processes
    with user_errors():
        done = export_run(run_dir, out, step, progress=True)
    if is_leader():
        draft = f" --draft {out / EAGLE3_DIR}" if (out / EAGLE3_DIR).is_dir() else ""  # the EAGLE-3 draft
        click.echo(f"export: step {done} of {run_dir} -> {out} (serve it: specrl serve --model {out}{draft})")


@click.command()
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), help="Where to keep everything (default: temp)."
)
@click.option("--rl-steps", type=click.IntRange(1), default=20, show_default=True, help="= DemoConfig.rl_steps")
def demo(out: Path | None, rl_steps: int) -> None:
    """End to end in minutes on a CPU: small model, warm-up, draft-init, two sidecars, RL with
    speculation, and the report (reward before/after, acceptance, speedup vs plain decoding)."""
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    from trainer.cli.demo import DemoConfig, run_demo

    with tempfile.TemporaryDirectory(prefix="specrl-demo-") as tmp:
        root = out or Path(tmp)
        cfg = DemoConfig(rl_steps=rl_steps)
        with _bar(cfg.warmup.steps + cfg.draft_init.steps, "warm-up + draft-init") as bar:
            offset = {"n": 0, "last": 0}

            def progress(step: int, metrics: dict[str, float]) -> None:
                if step < offset["last"]:  # the second phase restarts at 1
                    offset["n"] += offset["last"]
                offset["last"] = step
                bar(offset["n"] + step, metrics)

            with user_errors():
                report = run_demo(root, cfg, progress)
        click.echo(report.render())
        if out is not None:
            click.echo(f"\nrun directory (metrics.jsonl, plots/, checkpoints/): {out / 'run'}")


def export_run(run_dir: Path, out: Path, step: int | None = None, *, progress: bool = False) -> int:
    """Export the run in `run_dir` at `step` (default: its last kept checkpoint) to `out`; returns
    the step exported. ExportError for a directory that holds no run, a step that was not kept,
    or an `out` that already holds something. `progress`: announce the phases on stderr."""
    import torch.distributed as dist

    from trainer.rl.export import ExportError, export_policy, kept_steps
    from trainer.rl.ranks import is_leader
    from trainer.rl.run import phase
    from trainer.rl.run_setup import build_policy

    run_dir, out = Path(run_dir), Path(out)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(
            f"{run_dir} is not a run directory (it has no config.yaml): pass the --run-dir of a `specrl train` run"
        )
    steps = kept_steps(run_dir)
    if not steps:
        raise ExportError(
            f"{run_dir} has no checkpoint to export (no checkpoints/step_N): a run writes one at its end "
            "and every checkpoint_every steps"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; kept steps: {', '.join(map(str, steps))}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty: choose another --out, or remove it first")
    try:
        cfg = from_mapping(RLConfig, load_file(config))
    except (ConfigError, TypeError) as e:
        raise ExportError(f"{config}: cannot be read as a run config ({e})") from None
    for path, key in ((cfg.model, "model"), (cfg.draft.eagle3, "draft.eagle3")):
        if path is not None and not Path(path).is_dir():
            raise ExportError(
                f"{config}: {key} {path} does not exist (relative paths are read from the current directory, "
                "as `specrl train` read them): run export from where the run was started"
            )
    # one process per tensor-parallel shard, as the run had (torchrun for > 1); replicas: any number
    world, tp = (dist.get_world_size() if dist.is_initialized() else 1), cfg.train.tensor_parallel
    if world % tp:
        raise ExportError(
            f"{run_dir} was trained with train.tensor_parallel={tp}: export it with one process per shard, "
            f"torchrun --nproc-per-node {tp} -m trainer.cli.main export {run_dir} --out {out}"
        )
    train = dataclasses.replace(cfg.train, data_parallel=world // tp)
    with phase(f"restoring the policy of step {step} (Megatron)", progress and is_leader()):
        policy = build_policy(dataclasses.replace(cfg, train=train))
        policy.load(run_dir / "checkpoints" / f"step_{step}")
    with phase(f"writing {out}", progress and is_leader()):
        export_policy(policy, cfg.model, out)
    return step
