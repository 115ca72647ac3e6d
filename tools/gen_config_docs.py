"""Write docs/configuration.md from the configuration dataclasses themselves: every key of a run
config (`specrl train --config`, `RLConfig`) and of a sidecar (`specrl serve --config`,
`ServeConfig`), its default and the docstring under its field. `--check` (run by the tests) fails
when the page differs from what the code says, so a key added without its line fails there.

    python tools/gen_config_docs.py          # rewrite docs/configuration.md
    python tools/gen_config_docs.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of `cls` (`sidecar.config_io.field_docs`)."""
    from sidecar.config_io import field_docs as docs

    return docs(cls)


def shown(value: Any) -> str:
    from sidecar.config_io import to_mapping

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return str(value)
    if value == "":
        return '""'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return str(to_mapping(value))
    return str(value)


def rows(cls: type, instance: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) of every leaf key of `cls`; a nested dataclass is walked into unless its
    field is documented as one value (none are today)."""
    docs = field_docs(cls)
    out: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += rows(type(value), value, key + ".")
            continue
        default = (
            "(required)"
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            else shown(value)
        )  # type: ignore[misc]
        out.append((key, default, docs.get(f.name, "")))
    return out


def page() -> str:
    from sidecar.serve_config import ServeConfig
    from trainer.rl_config import RLConfig

    sections = [
        (
            "Run configuration: `specrl train --config run.yaml`",
            "`trainer.rl_config.RLConfig`. A YAML file of these keys (nested sections as mappings), "
            "then `--set key.sub=value` overrides; `specrl train --print-config` shows the result.",
            rows(RLConfig, RLConfig(model=Path("ckpt"))),
        ),
        (
            "Sidecar configuration: `specrl serve --config serve.yaml`",
            "`sidecar.serve_config.ServeConfig`, its `engine` section `sidecar.engine.config.EngineConfig` "
            "(the one place an engine setting has its default; `specrl train` nests the whole of it as "
            "`sidecars.serve`). The same keys are `specrl serve`'s options (`port` is `--port`, "
            "`engine.max_batch_size` is `--max-batch-size`, `engine.kind` is `--engine`); a file, then "
            "`--set`, then options given on the command line; `--print-config` shows the result.",
            rows(ServeConfig, ServeConfig()),
        ),
    ]
    lines = [
        "# Configuration reference",
        "",
        "Generated from the configuration dataclasses by `python tools/gen_config_docs.py` (checked by",
        "`tests/test_config_docs.py`): each key, its default and the docstring under its field. Names",
        "follow [the glossary](glossary.md).",
    ]
    for title, intro, table in sections:
        lines += ["", f"## {title}", "", intro, "", "| key | default | meaning |", "|---|---|---|"]
        for key, default, doc in table:
            cell = doc.replace("|", "\\|")
            lines.append(f"| `{key}` | `{default}` | {cell} |")
    return "\n".join(lines) + "\n"


def undocumented() -> list[str]:
    """Keys whose field has no docstring."""
    from sidecar.serve_config import ServeConfig
    from trainer.rl_config import RLConfig

    return [
        key
        for key, _, doc in rows(RLConfig, RLConfig(model=Path("ckpt"))) + rows(ServeConfig, ServeConfig())
        if not doc
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = page()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python tools/gen_config_docs.py", file=sys.stderr)
            return 1
        print(f"{PAGE.relative_to(ROOT)} matches the configuration dataclasses")
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
