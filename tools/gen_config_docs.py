"""Write docs/configuration.md from the configuration dataclasses themselves: every key of a run
config (`specrl train --config`, `RLConfig`) and of a sidecar (`specrl serve --config`,
`ServeConfig`), its default and the docstring under its field; and docs/models.md from the table
of config.json keys the engine reads and refuses (`sidecar/model/architectures.py`). `--check`
(run by the tests) fails when a page differs from what the code says, so a key added without its
line fails there.

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
MODELS_PAGE = ROOT / "docs" / "models.md"


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
    from trainer.rl.config import RLConfig

    sections = [
        (
            "Run configuration: `specrl train --config run.yaml`",
            "`trainer.rl.config.RLConfig`. A YAML file of these keys (nested sections as mappings), "
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


def models_page() -> str:
    """docs/models.md: the architectures the engine serves and what it does with each config.json key."""
    from sidecar.model.architectures import SUPPORTED_ARCHITECTURES, models_markdown

    archs = ", ".join(f"`{a}` (model_type `{t}`)" for a, t in SUPPORTED_ARCHITECTURES.items())
    return "\n".join(
        [
            "# Checkpoints the engine serves",
            "",
            "Generated from `sidecar/model/architectures.py` by `python tools/gen_config_docs.py` (checked by",
            "`tests/test_config_docs.py`).",
            "",
            f"Architectures (config.json's `architectures`): {archs}. Any other architecture or model type is",
            "refused at start, naming it and what is supported. The mixture-of-experts families (routers, expert",
            "names, kernels, what speculation costs there): [moe.md](moe.md).",
            "",
            "Every key of the architecture's config.json that changes transformers' forward is listed: *read*",
            "(implemented, tested against transformers' own forward on checkpoints its `save_pretrained`",
            "writes), or *refused unless* it holds the one value the engine implements. `specrl serve` (both",
            "engines), `specrl train`'s preflight, `specrl warmup` / `draft-init` and `specrl verify --model`",
            "all refuse such a checkpoint before anything is built, naming the key; a model is never served",
            "or trained as something it is not. Keys not listed do not change transformers' forward either",
            "and are ignored, as transformers ignores them.",
            "",
            models_markdown(),
            "",
        ]
    )


def undocumented() -> list[str]:
    """Keys whose field has no docstring."""
    from sidecar.serve_config import ServeConfig
    from trainer.rl.config import RLConfig

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
    pages = {PAGE: page(), MODELS_PAGE: models_page()}
    if args.check:
        stale = [p for p, text in pages.items() if not p.is_file() or p.read_text() != text]
        for p in stale:
            print(f"{p} is stale: run python tools/gen_config_docs.py", file=sys.stderr)
        if stale:
            return 1
        print(f"{', '.join(str(p.relative_to(ROOT)) for p in pages)} match the code")
        return 0
    for p, text in pages.items():
        p.parent.mkdir(exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
