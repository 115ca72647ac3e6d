"""The `specrl` command line (click). Each subsystem adds its commands to `main`."""

from __future__ import annotations

import warnings

import click

# megatron-core announces optional accelerators it falls back from (Apex, Transformer Engine)
# and a config default it deprecates, on every import; on a CPU machine these are expected and
# say nothing the user can act on. Only these exact messages are silenced.
_EXPECTED_MEGATRON_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrl")
def main() -> None:
    """specrl: fast, lossless RL post-training with speculative rollouts."""
    for message in _EXPECTED_MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


from sidecar.losslessness.cli import verify  # noqa: E402
from sidecar.server.cli import serve  # noqa: E402  (subcommands register on main)
from trainer.cli.commands import demo, draft_init_cmd, export_cmd, train, warmup  # noqa: E402
from trainer.planning.cli import plan  # noqa: E402


@click.command(
    "bench",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run a benchmark section (BENCHMARKS.md) from tools/bench/ of this checkout; `specrl bench
    --help` lists the sections."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # tools/ is not installed: it sits beside trainer/
    if not (root / "tools" / "bench" / "__init__.py").is_file():
        raise click.ClickException(
            f"specrl bench runs the benchmarks in tools/bench/, which {root} does not have (an installed "
            "package, not a checkout): run it from a checkout of the repository (`pip install -e .` there), "
            "or run `python -m tools.bench SECTION` from the checkout's root"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from tools.bench import main as bench_main

    sys.exit(bench_main(list(args)))


main.add_command(serve)
main.add_command(verify)
main.add_command(train)
main.add_command(warmup)
main.add_command(draft_init_cmd)
main.add_command(export_cmd)
main.add_command(demo)
main.add_command(plan)
main.add_command(bench)

if __name__ == "__main__":  # `torchrun ... -m trainer.cli.main train ...` (README, "Training on several nodes")
    main()
