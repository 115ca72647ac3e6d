"""The `specrl` command: `main.py` (the group every subcommand joins), `commands.py` (`train`,
`warmup`, `draft-init`, `export`, `demo`) and `demo.py` (the demo run)."""
