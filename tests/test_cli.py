"""The `specrl` command line: help works and unfinished commands say so instead of faking it."""

from __future__ import annotations

from click.testing import CliRunner

from trainer.cli import main


def test_help_lists_the_commands() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "demo" in result.output


def test_demo_before_the_rl_loop_lands_fails_clearly() -> None:
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code != 0
    assert "not yet available" in result.output
