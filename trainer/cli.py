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
from trainer.planning.cli import plan  # noqa: E402
from trainer.rl_cli import demo, draft_init_cmd, export_cmd, train, warmup  # noqa: E402

main.add_command(serve)
main.add_command(verify)
main.add_command(train)
main.add_command(warmup)
main.add_command(draft_init_cmd)
main.add_command(export_cmd)
main.add_command(demo)
main.add_command(plan)

if __name__ == "__main__":  # `torchrun ... -m trainer.cli train ...` (README, "Training on several nodes")
    main()
