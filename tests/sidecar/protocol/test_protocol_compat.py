"""The protocol cannot break its clients unnoticed: `buf breaking` (WIRE_JSON: the wire format and
proto3 JSON, so field names and numbers) against the committed baseline of the last release.

Oracle: buf's own breaking-change rules, with their power shown on planted changes (a rename and a
renumbering fail, an added field passes) and the baseline tied to the release the package says it is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BASELINES = ROOT / "tests" / "protocol_baseline"


def _version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def _baseline() -> Path:
    """The baseline of the newest release at or below the package version (v<major>.<minor>.<patch>)."""

    def key(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in p.name[1:].split("."))

    current = key(Path("v" + _version()))
    candidates = [p for p in BASELINES.iterdir() if p.is_dir() and re.fullmatch(r"v\d+\.\d+\.\d+", p.name)]
    return max((p for p in candidates if key(p) <= current), key=key)


def buf_breaking(module: Path, against: Path) -> subprocess.CompletedProcess[str]:
    buf = shutil.which("buf")
    if buf is None:
        pytest.fail("buf is not installed: it comes with the dev extra (buf-bin); run tools/setup-env")
    return subprocess.run(
        [buf, "breaking", str(module), "--against", str(against)], capture_output=True, text=True, timeout=120
    )


def test_the_protocol_is_compatible_with_the_last_release() -> None:
    result = buf_breaking(ROOT / "proto", _baseline())
    assert result.returncode == 0, (
        f"proto/ breaks {_baseline().name}'s specrl.v1 (fields are added, never renamed or renumbered; a removed "
        f"one is reserved by number and name: docs/protocol.md):\n{result.stdout}{result.stderr}"
    )


def _planted(tmp_path: Path, old: str, new: str) -> Path:
    copy = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", copy)
    control = copy / "specrl" / "v1" / "control.proto"
    text = control.read_text()
    assert old in text
    control.write_text(text.replace(old, new, 1))
    return copy


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("uint32 speculation_k = 1;", "uint32 k = 1;", "changed name"),
        ("uint32 speculation_k = 1;", "uint32 speculation_k = 9;", 'Previously present field "1"'),
    ],
    ids=["rename", "renumber"],
)
def test_a_planted_rename_or_renumbering_is_caught(tmp_path: Path, old: str, new: str, needle: str) -> None:
    result = buf_breaking(_planted(tmp_path, old, new), _baseline())
    assert result.returncode != 0 and needle in result.stdout, result.stdout + result.stderr


def test_an_added_field_is_compatible(tmp_path: Path) -> None:
    copy = _planted(
        tmp_path,
        "message SetSpeculationRequest {",
        "message SetSpeculationRequest {\n  // planted\n  uint32 planted_field = 99;",
    )
    result = buf_breaking(copy, _baseline())
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_changelog_names_this_version_and_its_baseline_exists() -> None:
    changelog = (ROOT / "docs" / "changelog.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.MULTILINE)
    assert releases and releases[0] == _version(), "the newest changelog release must be pyproject's version"
    assert (BASELINES / f"v{releases[0]}").is_dir(), "a release commits its protocol as tests/protocol_baseline/vX.Y.Z"
