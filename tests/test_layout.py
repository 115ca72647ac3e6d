"""The code's layout holds: imports run one way, and no product file outgrows one concern.

Imports run tools -> trainer -> sidecar client side -> protocol/types <- sidecar server side ->
engines -> model, with muon and yarn at the bottom (docs/layout.md). The server side (what
`specrl serve` runs) never imports the client side (what a trainer or another framework runs),
nor the reverse; engines, the model and the speculation controller know neither side nor the
protocol (protobuf stays at the edge). Every import counts, including those inside functions.

docs/layout.md names every product module (generated stubs and `__init__.py` aside), and
only files that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sidecar", "trainer", "muon", "yarn")
GENERATED = ROOT / "sidecar" / "protocol" / "specrl"
MAX_LINES = 700

SERVER = ("sidecar.server",)
CLIENT = ("sidecar.client", "sidecar.integrations", "sidecar.losslessness")
CORE = ("sidecar.engine", "sidecar.model", "sidecar.speculation")
TRAINER_GROUPS = ("trainer.cli", "trainer.rl", "trainer.policy", "trainer.draft", "trainer.planning")
TRAINER_GROUPS_ABOVE_DRAFT = ("trainer.cli", "trainer.rl", "trainer.policy", "trainer.planning")
TRAINER_SHARED = ("trainer.schedules", "trainer.tokenizer")

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
    # inside the trainer: CLI -> RL algorithm -> policy and Megatron -> draft; planning apart; shared below
    (("trainer.rl",), ("trainer.cli", "trainer.planning"), "the RL algorithm knows no command"),
    (("trainer.policy",), ("trainer.cli", "trainer.rl", "trainer.planning"), "the policy knows no RL loop or command"),
    (("trainer.draft",), TRAINER_GROUPS_ABOVE_DRAFT, "the draft is below the policy"),
    (("trainer.planning",), ("trainer.cli", "trainer.rl", "trainer.policy", "trainer.draft"), "planning reads no run"),
    (TRAINER_SHARED, TRAINER_GROUPS, "the trainer's shared modules are below every group"),
]

ALLOWED = {
    ("trainer.cli.main", "sidecar.server.cli"): "the one `specrl` command registers `specrl serve`",
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


def test_every_trainer_module_has_its_group() -> None:
    """The trainer is grouped by role (the CLI, the RL algorithm, the policy and Megatron, the
    draft, planning) with a few shared modules below them; a new module joins a group."""
    trainer = [_module_name(p) for p in _product_files() if p.parts[len(ROOT.parts)] == "trainer"]
    loose = [m for m in trainer if m != "trainer" and not _within(m, (*TRAINER_GROUPS, *TRAINER_SHARED))]
    assert len(trainer) > 40
    assert loose == [], f"put these in the trainer group of their role (trainer/__init__.py): {loose}"


def test_the_rules_catch_the_policy_importing_the_rl_loop() -> None:
    probe = "from trainer.rl.loop import rl_step\nfrom ..draft import objective\n"
    found = violations({"trainer.policy._probe": _imports(probe, "trainer.policy._probe")})
    assert found == [
        "trainer.policy._probe imports trainer.rl.loop: the policy knows no RL loop or command",
        "trainer.policy._probe imports trainer.rl.loop.rl_step: the policy knows no RL loop or command",
    ]
    found = violations({"trainer.draft._probe": _imports(probe, "trainer.draft._probe")})
    assert "trainer.draft._probe imports trainer.rl.loop: the draft is below the policy" in found


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


def _module_graph() -> dict[str, set[str]]:
    """Every product module and tool (`tools/bench/x.py` as `tools.bench.x`) -> the modules of that set it
    imports, anywhere in it (at the top, in a function, under TYPE_CHECKING): `from a import b`
    counts as importing `a.b` where that is a module, else `a`."""
    files = {_module_name(p): p for p in _product_files()}
    for p in sorted((ROOT / "tools").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if p.name == "__init__.py" else parts)] = p
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        named = _imports(path.read_text(), name, path.name == "__init__.py")
        modules = {n for n in named if n in files and n != name}
        # `from a import b` names `a` and `a.b`: where `a.b` is a module, that is the import
        graph[name] = {n for n in modules if not any(m.startswith(n + ".") and m in modules for m in modules)}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle_anywhere() -> None:
    """A module that needs another which needs it back (even for a type, or inside a function) is
    one concern split in two, or two tangled: neither reads alone. None in the product or tools."""
    graph = _module_graph()
    assert {"sidecar.engine.torch_engine", "trainer.policy.policy", "tools.bench.gpu"} <= set(graph)
    assert import_cycles(graph) == []


def test_the_circle_check_catches_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_product_file_outgrows_one_concern() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _product_files()}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert set(over) == set(OVERSIZED), f"split these by concern (> {MAX_LINES} lines)"


RL_LOOP_LINES = 250


def test_the_rl_loop_reads_like_the_algorithm() -> None:
    """`trainer/rl/loop.py` holds the step (generate → score → log-probs → update → push) and the
    run around it; every mechanism it drives lives in a module named after it (slime's train.py
    is 85 lines)."""
    n = len((ROOT / "trainer" / "rl" / "loop.py").read_text().splitlines())
    assert n <= RL_LOOP_LINES, f"trainer/rl/loop.py has {n} lines: move the mechanism that grew into its own module"


LAYOUT_HEADING = "## The table"
TABLE_ROOTS = ("proto/", "sidecar/", "trainer/", "muon/", "yarn/", "tests/", "tools/")


def layout_table_paths(readme: str) -> set[str]:
    """The files the README's layout table names, as paths from the repository root.

    A row's first cell names a folder or a file (its folder is the row's base); a backticked path
    that starts at the root (`tools/bench/gpu.py`) or a subfolder (`sglang/`) moves the base there,
    and a bare name (`convert.py`) is a file in the current base. Backticked words that are not
    paths (`SidecarClient`) are skipped."""
    section = readme.split(LAYOUT_HEADING, 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for line in section.splitlines():
        cells = line.split("|")
        if not line.startswith("| `") or len(cells) < 4:
            continue
        base = ""
        for cell in cells[1:3]:
            for token in re.findall(r"`([^`]+)`", cell):
                if not re.fullmatch(r"[\w./]+", token) or not (token.endswith(("/", ".py")) or "." in token):
                    continue
                absolute = token.startswith(TABLE_ROOTS)
                path = token if absolute else base + token
                if token.endswith("/"):
                    base = path
                    continue
                if "/" in token:
                    base = path.rsplit("/", 1)[0] + "/"
                named.add(path)
    return named


def _modules_and_table() -> tuple[set[str], set[str]]:
    modules = {str(p.relative_to(ROOT)) for p in _product_files() if p.name != "__init__.py"}
    return modules, layout_table_paths((ROOT / "docs" / "layout.md").read_text())


def test_the_layout_table_names_every_module() -> None:
    modules, named = _modules_and_table()
    missing = sorted(modules - named)
    assert not missing, f"name these modules in docs/layout.md: {missing}"


def test_the_layout_table_names_only_files_that_exist() -> None:
    _, named = _modules_and_table()
    assert len(named) > 100
    gone = sorted(p for p in named if not (ROOT / p).is_file())
    assert not gone, f"docs/layout.md names files that do not exist: {gone}"


def test_the_table_parser_reads_bases_and_subfolders() -> None:
    """The parser itself: bare names take the row's folder, a path moves it, prose is skipped."""
    readme = (
        f"{LAYOUT_HEADING}\n\n| folder / file | what it holds |\n|---|---|\n"
        "| `sidecar/engine/` | `base.py` (`Engine`), `sglang/` (`engine.py`), `tools/x.py`, `y.py` |\n"
        "| `trainer/cli/main.py`, `demo.py` | the `specrl` command |\n\n## Next\n| `muon/z.py` | not in the section |\n"
    )
    assert layout_table_paths(readme) == {
        "sidecar/engine/base.py",
        "sidecar/engine/sglang/engine.py",
        "tools/x.py",
        "tools/y.py",
        "trainer/cli/main.py",
        "trainer/cli/demo.py",
    }


TESTS = ROOT / "tests"
HEAVY_TARGETS = ("with_trl", "with_verl", "with_sglang", "sglang_cpu_support", "protocol_baseline")
REPOSITORY_CHECKS = {"test_layout.py", "test_doc_links.py", "test_glossary.py", "test_config_docs.py"}


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _taken_from(modules: dict[str, Path]) -> dict[str, str]:
    """`module.name` -> the product module a name comes from, where a module imports it at its top
    (`from sidecar.model.model import ModelConfig` is the class of `sidecar.model.config`)."""
    taken: dict[str, str] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
                for alias in node.names:
                    if base in modules:
                        taken[f"{name}.{alias.asname or alias.name}"] = base
    return taken


def modules_named(source: str, modules: dict[str, Path], taken: dict[str, str]) -> set[str]:
    """The product modules a test module's text names: those it imports (a module, a name from it,
    or a name another module takes from it), and those it names by path or dotted name (a test that
    drives a module through another says which in its docstring)."""
    named = _imports(source, "tests._probe")
    named |= {taken[n] for n in named if n in taken}
    for module, path in modules.items():
        if module not in named and (
            str(path.relative_to(ROOT)) in source or re.search(rf"(?<![\w.]){re.escape(module)}(?!\w)", source)
        ):
            named.add(module)
    return {m for m in named if m in modules}


def untested_modules(modules: dict[str, Path], tests: list[str]) -> list[str]:
    taken = _taken_from(modules)
    named = set().union(*(modules_named(source, modules, taken) for source in tests))
    return sorted(m for m, p in modules.items() if p.name != "__init__.py" and m not in named)


def test_every_product_module_has_a_test_module_naming_it() -> None:
    """A newcomer finds a module's tests by its name: each product module is imported or named by
    a test module (the heavy targets' count: verl's and TRL's plugins are tested there)."""
    modules = {_module_name(p): p for p in _product_files()}
    missing = untested_modules(modules, [p.read_text() for p in _test_modules()])
    assert missing == [], f"no test module names these (test them, or name them where a test drives them): {missing}"


def test_the_naming_check_catches_an_unnamed_module() -> None:
    """The check itself: a module no test names is reported; importing it, importing a name another
    module takes from it, or naming its path each count."""
    modules = {_module_name(p): p for p in _product_files()}
    taken = _taken_from(modules)
    assert modules_named("from sidecar.model.model import ModelConfig\n", modules, taken) >= {
        "sidecar.model.model",
        "sidecar.model.config",
    }
    assert "sidecar.engine.runner" in modules_named('"""Drives `sidecar/engine/runner.py`."""\n', modules, taken)
    assert modules_named("import torch\n", modules, taken) == set()
    only_one = {m: p for m, p in modules.items() if m in ("sidecar.engine.runner", "sidecar.engine.commit")}
    assert untested_modules(only_one, ["from sidecar.engine.commit import commit_round\n"]) == ["sidecar.engine.runner"]


def test_the_tests_mirror_the_packages() -> None:
    """`tests/sidecar/engine/` holds the tests of `sidecar/engine/`, and so on: every folder of test
    modules is a product folder's mirror (the heavy targets and the repository's own checks aside)."""
    folders = {p.parent.relative_to(TESTS) for p in _test_modules()}
    strays = sorted(str(f) for f in folders if f.parts and f.parts[0] not in HEAVY_TARGETS and not (ROOT / f).is_dir())
    assert strays == [], f"test folders that mirror no product folder: {strays}"
    top = sorted(p.name for p in _test_modules() if p.parent == TESTS)
    assert set(top) == REPOSITORY_CHECKS, (
        f"move these into the folder of what they test: {set(top) - REPOSITORY_CHECKS}"
    )
    assert {"sidecar", "trainer", "muon", "yarn", "tools"} <= {f.parts[0] for f in folders if f.parts}
