"""docs/configuration.md is generated from the configuration dataclasses and says what they say.

Oracle: the dataclasses themselves (fields, defaults, the docstring under each field). The page
must equal what `tools/gen_config_docs.py` writes, every key must have a docstring, and a key
added to a config without one is caught (a planted dataclass)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_config_docs  # noqa: E402


def test_the_page_matches_the_dataclasses() -> None:
    assert gen_config_docs.main(["--check"]) == 0, "run: python tools/gen_config_docs.py"


def test_every_key_is_documented_under_its_field() -> None:
    assert gen_config_docs.undocumented() == []


@dataclasses.dataclass(kw_only=True)
class _Planted:
    documented: int = 1
    """A key with its line."""
    bare: int = 2


def test_a_key_without_a_docstring_and_a_stale_page_are_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = gen_config_docs.rows(_Planted, _Planted())
    assert rows == [("documented", "1", "A key with its line."), ("bare", "2", "")]
    monkeypatch.setattr(gen_config_docs, "PAGE", tmp_path / "configuration.md")
    (tmp_path / "configuration.md").write_text(gen_config_docs.page().replace("RL steps.", "Steps."))
    assert gen_config_docs.main(["--check"]) == 1
