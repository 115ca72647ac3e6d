"""Generate the Python stubs of the specrl.v1 protocol from `proto/`.

The `.proto` files are the single source of truth; the generated modules are checked in
under `sidecar/protocol/specrl/v1/` so that installing specrl needs no code generator.
`--check` regenerates into a temporary directory and fails if anything differs, which is
how the tests prove the stubs match the protos.

protoc writes cross-file imports as `from specrl.v1 import x_pb2`; since `specrl` is not a
top-level package here, they are rewritten to `sidecar.protocol.specrl.v1`.

Usage: python tools/gen_proto.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_ROOT = ROOT / "sidecar" / "protocol"
PACKAGE_DIR = Path("specrl") / "v1"
PYTHON_PACKAGE = "sidecar.protocol.specrl.v1"
GRPCIO_TOOLS_VERSION = "1.85.1"  # keep equal to the pin in pyproject.toml

_IMPORT = re.compile(r"^from specrl\.v1 import", re.MULTILINE)


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto file into `out_root`; return the generated paths."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    installed = importlib.metadata.version("grpcio-tools")
    if installed != GRPCIO_TOOLS_VERSION:
        raise SystemExit(
            f"grpcio-tools {installed} is installed but the stubs are generated with "
            f"{GRPCIO_TOOLS_VERSION}; run tools/setup-env to install the pinned version"
        )
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    generated = sorted((out_root / PACKAGE_DIR).glob("*.py*"))
    for path in generated:
        path.write_text(_IMPORT.sub(f"from {PYTHON_PACKAGE} import", path.read_text()))
    for package in (out_root / "specrl", out_root / PACKAGE_DIR):
        init = package / "__init__.py"
        init.write_text('"""Generated from proto/ by tools/gen_proto.py; do not edit."""\n')
        generated.append(init)
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if checked-in stubs differ")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        relative = [p.relative_to(tmp) for p in fresh]
        if args.check:
            stale = [
                r
                for r in relative
                if not (OUT_ROOT / r).exists() or not filecmp.cmp(Path(tmp) / r, OUT_ROOT / r, shallow=False)
            ]
            existing = {p.relative_to(OUT_ROOT) for p in (OUT_ROOT / PACKAGE_DIR).glob("*.py*")}
            extra = sorted(existing - set(relative))
            if stale or extra:
                print("generated stubs do not match proto/:", *map(str, stale + extra), sep="\n  ")
                print("run: python tools/gen_proto.py")
                return 1
            print(f"stubs match proto/ ({len(relative)} files)")
            return 0
        shutil.rmtree(OUT_ROOT / "specrl", ignore_errors=True)
        for r in relative:
            (OUT_ROOT / r).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / r, OUT_ROOT / r)
        print(f"wrote {len(relative)} files under {OUT_ROOT.relative_to(ROOT)}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
