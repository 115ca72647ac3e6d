"""The toolbox: tools/ holds the shell entry points, the two generators and one bench package, and
every benchmark runs as `specrl bench SECTION [options]` (or `python -m tools.bench SECTION`).

The registry (`SECTIONS` in tools/bench/common.py) is checked against BENCHMARKS.md: its sections
are exactly the BENCHMARKS sections that have a command, and every command there (fenced blocks and
`inline` ones starting with `specrl bench`, `python -m tools.bench` or `tools/`) runs as written as
far as `--help` can tell: its section (and subcommand) answers `--help` in this process, and each
`--option` it passes is one the section's help names. A section whose module is missing fails with
the file to move in.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import shlex
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tools.bench import main as bench_main
from tools.bench.common import BY_NAME, SECTIONS, Section, call_main

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
BENCH = TOOLS / "bench"
BENCHMARKS = ROOT / "BENCHMARKS.md"
MAX_TOOLS_ENTRIES = 16
NOT_SECTIONS = {"__init__", "__main__", "common", "cost_ceiling"}  # the package's own and its libraries
TOP_SCRIPTS = sorted(TOOLS.glob("*.py"))  # gen_proto.py, gen_config_docs.py
ENV = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+|time\s+)*")
BENCH_ENTRY = re.compile(r"^(?:specrl bench|(?:\.venv[\w-]*/bin/)?python3? -m tools\.bench)(?=\s|$)")


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
            pytest.fail(f"{prog}: `main` is not callable")
    assert exit_.value.code in (0, None), f"{prog} --help exited with {exit_.value.code}"
    return out.getvalue()


def bench_help(words: list[str]) -> str:
    """What `specrl bench WORDS --help` prints, through the package's dispatch."""
    out = io.StringIO()
    code: object = None
    with contextlib.redirect_stdout(out):
        try:
            code = bench_main([*words, "--help"])
        except SystemExit as e:
            code = e.code
    assert code in (0, None), f"specrl bench {' '.join(words)} --help exited with {code}"
    text = out.getvalue()
    assert "usage:" in text.lower() and "--help" in text, text
    return text


def subcommands(section: Section) -> dict[str, object]:
    return dict(getattr(importlib.import_module(f"tools.bench.{section.module}"), "SUBCOMMANDS", {}))


def benchmarks_commands(text: str) -> list[tuple[str, str]]:
    """(heading, command) for every command in BENCHMARKS.md: the lines of fenced blocks (a trailing
    backslash continues a line) and `inline` spans (which may wrap), led by env assignments or
    `time` at most, that start with `specrl bench`, `python -m tools.bench` or `tools/`."""
    found: list[tuple[str, str]] = []
    heading = ""
    prose: list[str] = []
    fenced: list[str] | None = None

    def flush_prose() -> None:
        for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
            found.append((heading, " ".join(span.split())))
        prose.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            if fenced is None:
                flush_prose()
                fenced = []
            else:
                found += [(heading, " ".join(c.split())) for c in "\n".join(fenced).replace("\\\n", " ").splitlines()]
                fenced = None
        elif fenced is not None:
            fenced.append(line)
        elif line.startswith("#"):
            flush_prose()
            heading = line.lstrip("#").strip()
        else:
            prose.append(line)
    flush_prose()
    out = []
    for where, command in found:
        command = ENV.sub("", command)
        if BENCH_ENTRY.match(command) or command.startswith("tools/"):
            out.append((where, command))
    return out


COMMANDS = benchmarks_commands(BENCHMARKS.read_text())
BENCH_COMMANDS = [(h, c) for h, c in COMMANDS if BENCH_ENTRY.match(c)]
TOOL_COMMANDS = [(h, c) for h, c in COMMANDS if c.startswith("tools/")]


def section_words(command: str) -> list[str]:
    """`specrl bench adaptive controller --calls 20` -> ["adaptive", "controller"]."""
    words = shlex.split(BENCH_ENTRY.sub("", command).replace("<", "'<").replace(">", ">'"))
    name = words[0] if words else ""
    if name not in BY_NAME:
        pytest.fail(f"BENCHMARKS.md runs `{command}`, but there is no section {name!r} in tools/bench/common.py")
    if len(words) > 1 and words[1] in subcommands(BY_NAME[name]):
        return words[:2]
    return words[:1]


def test_tools_has_few_top_level_entries() -> None:
    entries = sorted(p.name for p in TOOLS.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOOLS_ENTRIES, (
        f"tools/ has {len(entries)} entries (at most {MAX_TOOLS_ENTRIES}): a benchmark or measuring tool "
        f"goes in tools/bench/ as a section of the registry in tools/bench/common.py: {entries}"
    )


@pytest.mark.parametrize("section", SECTIONS, ids=[s.name for s in SECTIONS])
def test_a_section_module_is_there_and_answers_help(section: Section) -> None:
    assert section.path.is_file(), (
        f"section {section.name!r}: tools/bench/{section.module}.py is missing (tools/bench/common.py's "
        f"registry names it): move the script in with `git mv tools/<old name>.py tools/bench/{section.module}.py` "
        "and make its imports `from tools.bench.X import ...`, or drop the entry"
    )
    bench_help([section.name])
    for sub in subcommands(section):
        bench_help([section.name, sub])


def test_every_bench_module_is_a_section_or_a_subcommand() -> None:
    reached = {s.module for s in SECTIONS} | {
        m for s in SECTIONS for m in subcommands(s).values() if isinstance(m, str)
    }
    strays = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in reached | NOT_SECTIONS)
    assert not strays, f"tools/bench/ modules no section runs: {strays} (add them to SECTIONS or a SUBCOMMANDS table)"


def test_the_registry_is_the_benchmarks_sections_with_a_command() -> None:
    headings = {line[3:].strip() for line in BENCHMARKS.read_text().splitlines() if line.startswith("## ")}
    with_command = {h for h, c in COMMANDS if not c.startswith("tools/bench/")}
    in_registry = {w for s in SECTIONS for w in s.where if not w.endswith(".md")}
    assert in_registry <= headings, f"registry sections that are no BENCHMARKS.md heading: {in_registry - headings}"
    assert with_command == in_registry, (
        f"BENCHMARKS.md sections with a command but no registry entry: {sorted(with_command - in_registry)}; "
        f"registry sections whose BENCHMARKS.md section has no command: {sorted(in_registry - with_command)}"
    )


@pytest.mark.parametrize(
    "section", [s for s in SECTIONS if any(w.endswith(".md") for w in s.where)], ids=lambda s: s.name
)
def test_a_section_outside_benchmarks_is_on_its_page(section: Section) -> None:
    for page in (w for w in section.where if w.endswith(".md")):
        assert f"specrl bench {section.name}" in (ROOT / page).read_text(), (
            f"{page} never runs `specrl bench {section.name}`"
        )


def test_benchmarks_has_its_commands() -> None:
    """The parser finds what is there (a negative control for the tests that read its output)."""
    assert len(BENCH_COMMANDS) > 40 and len(TOOL_COMMANDS) >= 3
    assert ("Paged KV cache, CPU", "specrl bench kv") in COMMANDS
    assert any(c.startswith("specrl bench engine step --against") for _, c in COMMANDS)  # a fenced block
    assert benchmarks_commands("## A\n`OMP_NUM_THREADS=1 specrl bench\nkv --quick` and `--other`\n") == [
        ("A", "specrl bench kv --quick")
    ]


def retired_paths(text: str) -> list[str]:
    """The `tools/....py` paths `text` names that are not files of the checkout (`tests/tools/...` is
    the tools' tests, another folder)."""
    return sorted({p for p in re.findall(r"(?<![\w/])tools/[\w/]+\.py", text) if not (ROOT / p).is_file()})


def test_a_retired_path_is_caught() -> None:
    assert retired_paths("run `tools/bench_kv.py --quick` or `tools/bench/kv.py`") == ["tools/bench_kv.py"]
    assert retired_paths("`tests/tools/test_soak.py` and `tools/soak.py`") == ["tools/soak.py"]


def test_the_docs_name_no_retired_tool_path() -> None:
    """A `tools/x.py` path in the docs is a file that is there (the scripts moved into tools/bench/),
    and no command runs `python specrl` (what rewriting `python tools/x.py` can leave)."""
    docs = [BENCHMARKS, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docs.remove(ROOT / "docs" / "changelog.md")  # the record of what moved names the old paths
    for doc in docs:
        text = doc.read_text()
        gone = retired_paths(text)
        assert not gone, f"{doc.name} names {gone}: the benchmarks run as `specrl bench SECTION` now"
        assert not re.search(r"python3?\s+specrl", text), f"{doc.name}: `python specrl ...`; write `specrl bench ...`"


@pytest.mark.parametrize("command", sorted({c for _, c in BENCH_COMMANDS}))
def test_a_benchmarks_command_runs_as_written(command: str) -> None:
    words = section_words(command)
    text = bench_help(words)
    options = {w.split("=", 1)[0] for w in command.split() if w.startswith("--") and len(w) > 2}
    unknown = sorted(o for o in options if not re.search(re.escape(o) + r"(?![\w-])", text))
    assert not unknown, f"`{command}`: `specrl bench {' '.join(words)}` has no option {unknown}"


@pytest.mark.parametrize("command", sorted({c for _, c in TOOL_COMMANDS}))
def test_a_benchmarks_tools_path_exists(command: str) -> None:
    path = ROOT / command.split()[0]
    assert path.exists(), f"BENCHMARKS.md names `{command}`, but {path.relative_to(ROOT)} does not exist"
    if path.suffix != ".py" and path.is_file():
        assert os.access(path, os.X_OK), f"{path.relative_to(ROOT)} is not executable"


def test_specrl_bench_help_lists_the_sections() -> None:
    from trainer.cli.main import main

    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for section in SECTIONS:
        assert re.search(rf"^\s+{re.escape(section.name)}\s", result.output, re.M), section.name
    kv = CliRunner().invoke(main, ["bench", "kv", "--help"])
    assert kv.exit_code == 0 and "usage: specrl bench kv" in kv.output, kv.output


def test_an_unknown_section_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["no-such-section"]) == 2
    err = capsys.readouterr().err
    assert "no section 'no-such-section'" in err and "kv" in err


def test_a_missing_section_module_is_a_clear_failure() -> None:
    """The registry may name a module a later merge moves in: until then it fails saying which."""
    with pytest.raises(SystemExit, match=r"tools/bench/no_such_tool\.py is missing"):
        call_main("no_such_tool", ["--help"], "specrl bench no-such-tool")


def test_a_wrong_option_in_a_command_is_caught() -> None:
    """The option check can fail: an option the section does not take."""
    with pytest.raises(AssertionError, match="has no option"):
        test_a_benchmarks_command_runs_as_written("specrl bench kv --no-such-option 3")


@pytest.mark.parametrize("script", TOP_SCRIPTS, ids=[p.stem for p in TOP_SCRIPTS])
def test_a_top_level_tool_answers_help(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    main = getattr(importlib.import_module(script.stem), "main", None)
    assert main is not None, f"tools/{script.name} has no `main`: give it one that parses its options"
    text = help_text(main, script.name, monkeypatch)
    assert "usage:" in text.lower() and "--help" in text, text


def test_help_catches_a_tool_without_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a `main` that does its work instead of parsing `--help`."""

    def main() -> None:
        print("working")

    with pytest.raises(pytest.fail.Exception):
        help_text(main, "probe.py", monkeypatch)


def test_specrl_bench_outside_a_checkout_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Installed without tools/ beside trainer/ (a wheel), `specrl bench` says to run it from a checkout."""
    import trainer.cli.main

    monkeypatch.setattr(trainer.cli.main, "__file__", str(tmp_path / "trainer" / "cli" / "main.py"))
    result = CliRunner().invoke(trainer.cli.main.main, ["bench", "--help"])
    assert result.exit_code != 0
    assert "run it from a checkout" in result.output and "python -m tools.bench" in result.output, result.output
