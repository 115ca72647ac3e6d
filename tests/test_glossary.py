"""docs/glossary.md names one spelling per concept; the spellings it retires stay retired.

Oracle: the glossary's own table (its last column), searched as whole words in every tracked text
file but the glossary, the changelog (which records each rename, old name included), the
generated protocol stubs and the frozen protocol baseline `buf breaking` compares against (a
released `.proto`, comments included, as it was). A planted old spelling is found."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
CHANGELOG = ROOT / "docs" / "changelog.md"
REFUSED_HERE = "# glossary: refused here"
"""Ends the line that refuses a retired CLI flag with an error naming the new one (`retired_option`)."""


def retired() -> list[str]:
    names: list[str] = []
    for line in GLOSSARY.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("concept", "---"):
            names += re.findall(r"`([^`]+)`", cells[3])
    return names


def pattern(names: list[str]) -> re.Pattern[str]:
    # whole words: not part of a longer identifier or flag (`max_k` is not `max_kv`)
    return re.compile("|".join(rf"(?<![\w-]){re.escape(n)}(?![\w-])" for n in names))


def offenders(files: list[Path], names: list[str]) -> list[str]:
    found = []
    regex = pattern(names)
    for f in files:
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if line.rstrip().endswith(REFUSED_HERE):  # the one place that refuses the old spelling by name
                continue
            m = regex.search(line)
            if m:
                found.append(f"{f.relative_to(ROOT)}:{i}: {m.group(0)}")
    return found


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [
        ROOT / p
        for p in out
        if (ROOT / p).is_file()
        and "_pb2" not in p
        and not p.startswith("tests/protocol_baseline/")
        and ROOT / p not in (GLOSSARY, CHANGELOG, Path(__file__).resolve())
    ]


def test_the_glossary_retires_spellings() -> None:
    assert {"spec_k", "max_k", "kmax", "k_eff", "delta_pushes"} <= set(retired())


def test_no_retired_spelling_is_used_anywhere() -> None:
    found = offenders(tracked(), retired())
    assert not found, "retired spellings (docs/glossary.md says which name to use):\n" + "\n".join(found[:30])


def test_a_planted_retired_spelling_is_found(tmp_path: Path) -> None:
    planted = ROOT / "tests" / "_planted_glossary_probe.py"
    try:
        planted.write_text(
            "spec_k = 3  # the old name\nmax_kv_heads = 2  # another word: not flagged\n"
            'refuse("spec_k")  # glossary: refused here\nspec_k = 4  # glossary: refused here, not at the end\n'
        )
        assert offenders([planted], retired()) == [
            "tests/_planted_glossary_probe.py:1: spec_k",
            "tests/_planted_glossary_probe.py:4: spec_k",
        ]
    finally:
        planted.unlink()
