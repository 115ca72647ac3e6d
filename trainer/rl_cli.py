"""`specrl train`, `specrl warmup`, `specrl draft-init` and `specrl demo` (click).

The commands only select and override: a run is an `RLConfig` (`trainer.rl_config`) read from
YAML/TOML with `--set section.field=value` overrides on top; `--sidecar`, `--local-sidecars`,
`--model` and `--run-dir` are shorthands for the corresponding fields.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import yaml
from tqdm import tqdm

from sidecar.config_io import ConfigError, from_mapping, load_file, merge_overrides, retired_option, to_mapping
from trainer.rl_config import RLConfig, TaskConfig
from trainer.tasks import Task
from trainer.warmup import DraftInitConfig, Progress, WarmupConfig


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
    from trainer.rl_loop import is_leader
    from trainer.rl_loop import train as run_training

    with user_errors():
        history = run_training(cfg, resume=resume)
    if history and is_leader():  # under torchrun, rank 0 reports
        last = history[-1]
        click.echo(
            f"done: {len(history)} steps, reward {last['reward/train_mean']:.3f}, "
            f"tau {last['spec/acceptance_length']:.2f}; run directory {cfg.run_dir}"
        )


def _task_options(f: Callable[..., None]) -> Callable[..., None]:
    f = click.option("--tokenizer", default="builtin", show_default=True, help="builtin or a tokenizer.json")(f)
    f = click.option("--regime", type=click.Choice(["zero", "think"]), default="zero", show_default=True)(f)
    f = click.option("--digits", type=click.IntRange(1, 6), default=2, show_default=True)(f)
    f = click.option("--dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="JSONL task")(f)
    return f


def _task(regime: str, digits: int, dataset: Path | None) -> Task:
    if dataset is not None:
        return TaskConfig(kind="jsonl", path=dataset).build()
    return TaskConfig(kind="arithmetic", regime="think" if regime == "think" else "zero", digits=digits).build()


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
    tokenizer: str,
    regime: str,
    digits: int,
    dataset: Path | None,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> None:
    """Supervised warm-up on the task's reference solutions (so the policy earns reward)."""
    from trainer.tokenizer import load_tokenizer
    from trainer.warmup import supervised_warmup

    cfg = WarmupConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    with user_errors(), _bar(steps, "warm-up") as progress:
        nll = supervised_warmup(model, out, _task(regime, digits, dataset), load_tokenizer(tokenizer), cfg, progress)
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
    tokenizer: str,
    regime: str,
    digits: int,
    dataset: Path | None,
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
    """Initialise the draft in-domain: fit it on the policy's own completions (trunk frozen)."""
    from trainer.tokenizer import load_tokenizer
    from trainer.warmup import draft_init

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
    with user_errors(), _bar(steps, "draft-init") as progress:
        losses = draft_init(model, out, _task(regime, digits, dataset), load_tokenizer(tokenizer), cfg, progress)
    click.echo(f"draft-init: draft loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {out}")


@click.command()
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), help="Where to keep everything (default: temp)."
)
@click.option("--rl-steps", type=click.IntRange(1), default=20, show_default=True, help="= DemoConfig.rl_steps")
def demo(out: Path | None, rl_steps: int) -> None:
    """End to end in minutes on a CPU: small model, warm-up, draft-init, two sidecars, RL with
    speculation, and the report (reward before/after, acceptance, speedup vs plain decoding)."""
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    from trainer.demo import DemoConfig, run_demo

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
