"""The `specrl` command line: help lists the commands and bad configs fail with a clear message."""

from __future__ import annotations

from click.testing import CliRunner

from trainer.cli.main import main


def test_help_lists_the_commands() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    assert "demo" in result.output


def test_rl_commands_are_registered() -> None:
    result = CliRunner().invoke(main, ["--help"])
    for command in ("train", "draft-init", "warmup", "export", "demo", "serve"):
        assert command in result.output


def test_train_names_a_bad_override() -> None:
    result = CliRunner().invoke(main, ["train", "--set", "model=/tmp", "--set", "rollout.no_such_field=1"])
    assert result.exit_code != 0
    assert "no_such_field" in result.output and "rollout" in result.output


def test_train_requires_a_model() -> None:
    result = CliRunner().invoke(main, ["train", "--local-sidecars", "2"])
    assert result.exit_code != 0
    assert "model" in result.output
