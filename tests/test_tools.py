"""Every script in tools/ still runs: it imports against today's code and answers `--help`, and
each one is referenced from README.md, BENCHMARKS.md, another tool, a test or CI.

`--help` runs in this process (the tools share one import of torch, the sidecar and the trainer),
through the tool's own `main`: a click command, or an argparse `main(argv)`, or an argparse
`main()` that reads `sys.argv`. A tool that does its work at import time, or that has no `main`,
fails here. The scripts listed in `LIBRARIES` have no command line: other tools import them.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
SCRIPTS = sorted(TOOLS.glob("*.py"))
LIBRARIES = {
    "bench_stats": "the benchmarks' paired statistics",
    "cost_ceiling": "the controller priced by a measured cost table (bench_rl, measure_cost_table, sim_adaptive)",
}
REFERENCED_FROM = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *TOOLS.iterdir(), *ROOT.glob("tests/**/*.py")]
REFERENCED_FROM += list((ROOT / ".ci").rglob("*")) if (ROOT / ".ci").is_dir() else []


def _import(name: str) -> ModuleType:
    for path in (str(TOOLS), str(ROOT)):  # as when run as a script: tools/ first, then the repository
        if path not in sys.path:
            sys.path.insert(0, path)
    return importlib.import_module(name)


def help_text(main: object, prog: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """What `prog --help` prints through `main`; fails unless it exits with status 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        if isinstance(main, click.Command):
            main.main(args=["--help"], prog_name=prog)
        elif callable(main) and inspect.signature(main).parameters:
            main(["--help"])
        elif callable(main):
            monkeypatch.setattr(sys, "argv", [prog, "--help"])
            main()
        else:
            pytest.fail(f"tools/{prog}: `main` is not callable")
    assert exit_.value.code in (0, None), f"tools/{prog} --help exited with {exit_.value.code}"
    return out.getvalue()


def test_the_tool_list_is_complete() -> None:
    assert len(SCRIPTS) > 30
    assert set(LIBRARIES) <= {p.stem for p in SCRIPTS}, "a library in LIBRARIES is gone: drop it there"


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_tool_imports_and_answers_help(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = script.read_text()
    runs_as_script = 'if __name__ == "__main__":' in source
    if script.stem in LIBRARIES:
        assert not runs_as_script, f"tools/{script.name} has a command line: drop it from LIBRARIES"
        _import(script.stem)
        return
    assert runs_as_script, f"tools/{script.name} has no `if __name__ == '__main__':` entry (or list it in LIBRARIES)"
    main = getattr(_import(script.stem), "main", None)
    assert main is not None, f"tools/{script.name} has no `main`: give it one that parses its options"
    text = help_text(main, script.name, monkeypatch)
    assert "usage:" in text.lower() and "--help" in text, text


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_tool_is_referenced(script: Path) -> None:
    """A script nothing names is one nobody runs: name it where its figures are (BENCHMARKS.md) or
    remove it."""
    others = [p for p in REFERENCED_FROM if p.is_file() and p not in (script, Path(__file__))]
    assert any(script.name in p.read_text(errors="replace") for p in others), (
        f"tools/{script.name} is referenced nowhere (README.md, BENCHMARKS.md, tools/, tests/, .ci/)"
    )


def test_help_catches_a_tool_without_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a `main` that does its work instead of parsing `--help`."""

    def main() -> None:
        print("working")

    with pytest.raises(pytest.fail.Exception):
        help_text(main, "probe.py", monkeypatch)
