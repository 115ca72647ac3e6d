"""The code's layout holds: imports run one way, and no product file outgrows one concern.

Imports run tools -> trainer -> sidecar client side -> protocol/types <- sidecar server side ->
engines -> model, with muon and yarn at the bottom (README, "Layout"). The server side (what
`specrl serve` runs) never imports the client side (what a trainer or another framework runs),
nor the reverse; engines, the model and the speculation controller know neither side nor the
protocol (protobuf stays at the edge). Every import counts, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sidecar", "trainer", "muon", "yarn")
GENERATED = ROOT / "sidecar" / "protocol" / "specrl"
MAX_LINES = 700

SERVER = ("sidecar.server",)
CLIENT = ("sidecar.client", "sidecar.integrations", "sidecar.losslessness")
CORE = ("sidecar.engine", "sidecar.model", "sidecar.speculation")

# (importer prefixes, forbidden import prefixes, why)
RULES: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (SERVER, (*CLIENT, "trainer"), "the server side never imports the client side or the trainer"),
    (CLIENT, SERVER, "the client side never imports the server side"),
    (CORE, (*SERVER, *CLIENT, "sidecar.protocol", "trainer"), "engines, model and controller know no side"),
    (("sidecar.model",), ("sidecar.engine", "sidecar.speculation"), "the model is below the engines"),
    (("sidecar.speculation",), ("sidecar.engine", "sidecar.model"), "the controller is pure logic"),
    (("sidecar",), ("trainer",), "the sidecar package never imports the trainer"),
    (("trainer",), ("sidecar.server", "sidecar.protocol"), "the trainer talks to sidecars through the client"),
    (("muon", "yarn"), ("sidecar", "trainer"), "muon and yarn are at the bottom"),
]

ALLOWED = {
    ("trainer.cli", "sidecar.server.cli"): "the one `specrl` command registers `specrl serve`",
}
OVERSIZED: dict[str, str] = {}
"""Product files allowed over MAX_LINES for now, each with why; the test fails once one shrinks."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _product_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        files += [p for p in (ROOT / package).rglob("*.py") if GENERATED not in p.parents]
    return sorted(files)


def _imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports: absolute names, relative ones resolved."""
    tree = ast.parse(source, module)
    here = module.split(".")
    package = here if is_package else here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return out


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(modules: dict[str, set[str]]) -> list[str]:
    """The rules each importer breaks; `modules` maps a module to what it imports."""
    found = []
    for importer, imports in sorted(modules.items()):
        for imported in sorted(imports):
            for importers, forbidden, why in RULES:
                allowed = any(importer == a and _within(imported, (b,)) for a, b in ALLOWED)
                if _within(importer, importers) and _within(imported, forbidden) and not allowed:
                    found.append(f"{importer} imports {imported}: {why}")
    return found


def test_imports_run_one_way() -> None:
    modules = {
        _module_name(p): _imports(p.read_text(), _module_name(p), p.name == "__init__.py") for p in _product_files()
    }
    assert len(modules) > 50
    assert violations(modules) == []


def test_the_rules_catch_a_server_module_importing_the_client() -> None:
    """The walk itself works: a server-side module that imports the fleet is caught, inside a
    function, absolute or relative."""
    probe = "def f():\n    from sidecar.client.fleet import Fleet\n    from ..client import client\n"
    found = violations({"sidecar.server._layout_probe": _imports(probe, "sidecar.server._layout_probe")})
    assert found == [
        "sidecar.server._layout_probe imports sidecar.client: the server side never imports the client side or the trainer",
        "sidecar.server._layout_probe imports sidecar.client.client: the server side never imports the client side or the trainer",
        "sidecar.server._layout_probe imports sidecar.client.fleet: the server side never imports the client side or the trainer",
        "sidecar.server._layout_probe imports sidecar.client.fleet.Fleet: the server side never imports the client side or the trainer",
    ]


def test_no_product_file_outgrows_one_concern() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _product_files()}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert set(over) == set(OVERSIZED), f"split these by concern (> {MAX_LINES} lines)"
