"""The `specrl` command line (click). Each subsystem adds its commands to `main`."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrl")
def main() -> None:
    """specrl: fast, lossless RL post-training with speculative rollouts."""


from sidecar.cli import serve  # noqa: E402  (subcommands register on main)
from trainer.rl_cli import demo, draft_init_cmd, train, warmup  # noqa: E402

main.add_command(serve)
main.add_command(train)
main.add_command(warmup)
main.add_command(draft_init_cmd)
main.add_command(demo)
