"""Every relative link of README.md, BENCHMARKS.md and docs/*.md reaches a file, and its #anchor a
heading of that file (GitHub's anchor rule: lower case, punctuation dropped, spaces to hyphens).
A planted broken link is found."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")


def anchors(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken(page: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(page.read_text()):
        target, anchor = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (page.parent / target) if target else page
        if not path.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target}{anchor or ''} (no such file)")
        elif anchor and path.suffix == ".md" and anchor[1:] not in anchors(path):
            bad.append(f"{page.relative_to(ROOT)}: {target}{anchor} (no such heading)")
    return bad


def test_every_link_of_the_documents_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert [b for p in pages for b in broken(p)] == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = ROOT / "docs" / "_planted_links_probe.md"
    try:
        page.write_text("# Probe\n\n[ok](#probe) [gone](nowhere.md) [bad](glossary.md#no-such-heading)\n")
        assert broken(page) == [
            "docs/_planted_links_probe.md: nowhere.md (no such file)",
            "docs/_planted_links_probe.md: glossary.md#no-such-heading (no such heading)",
        ]
    finally:
        page.unlink()
