"""The benchmarks and measuring tools, one module per BENCHMARKS.md section, behind one entry:

    specrl bench SECTION [options]        # from a checkout, with the project venv
    python -m tools.bench SECTION [options]   # the same, from the checkout's root, without `specrl`

`specrl bench --help` lists the sections; `specrl bench SECTION --help` gives a section's options.
The registry (`SECTIONS` in tools/bench/common.py) maps each section to its module and to where
its figures are. tools/ is not an installed package: `specrl bench` finds it next to the trainer
package of a checkout.
"""

from __future__ import annotations

import sys


def usage() -> str:
    from tools.bench.common import SECTIONS

    width = max(len(s.name) for s in SECTIONS)
    lines = [
        "usage: specrl bench SECTION [options]   (or: python -m tools.bench SECTION [options])",
        "",
        "Runs one benchmark section (BENCHMARKS.md); `specrl bench SECTION --help` gives its options.",
        "",
        "sections:",
    ]
    lines += [f"  {s.name:<{width}}  {s.summary}" for s in SECTIONS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `SECTION [options]` to the section's module; `--help` (or nothing) lists them."""
    from tools.bench.common import BY_NAME, call_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    section = BY_NAME.get(name)
    if section is None:
        print(f"specrl bench: no section {name!r}; the sections: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    return call_main(section.module, rest, f"specrl bench {name}")
