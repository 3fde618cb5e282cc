"""Generate, or check for drift, the protobuf/gRPC Python code of every proto.

`protoc -I protos` emits `waygate/<svc>/v1/*_pb2*.py(i)`; the import package
`waygate` lives in `services/`, so the output is written (or compared) under
`services/<svc>/v1/`. The generated imports read `from waygate.<svc>.v1 import
...`, which resolve through the editable install.

Usage: python protos/generate.py generate|check
"""

from __future__ import annotations

import filecmp
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_ROOT = ROOT / "services"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _run_protoc(out_dir: Path) -> None:
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def _generated(tree: Path) -> dict[Path, Path]:
    """Relative path (under the `waygate` package) -> file, for generated files."""
    return {
        p.relative_to(tree): p
        for p in tree.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def generate() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _run_protoc(out)
        fresh = _generated(out / "waygate")
        for stale in set(_generated(PACKAGE_ROOT)) - set(fresh):
            (PACKAGE_ROOT / stale).unlink()
        for rel, src in fresh.items():
            dest = PACKAGE_ROOT / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            init = dest.parent / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated protobuf and gRPC code; do not edit (make protos)."""\n')
            shutil.copyfile(src, dest)


def check(package_root: Path = PACKAGE_ROOT) -> int:
    """0 when the generated files under package_root match protos/, else 1 (and says why)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _run_protoc(out)
        fresh = _generated(out / "waygate")
        checked_in = _generated(package_root)
        problems = [f"missing: services/{rel}" for rel in sorted(set(fresh) - set(checked_in))]
        problems += [f"not generated from protos/: services/{rel}" for rel in sorted(set(checked_in) - set(fresh))]
        problems += [
            f"differs from protos/: services/{rel}"
            for rel in sorted(set(fresh) & set(checked_in))
            if not filecmp.cmp(fresh[rel], checked_in[rel], shallow=False)
        ]
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("generated code has drifted from protos/: run `make protos`", file=sys.stderr)
        return 1
    print(f"protos-check: {len(fresh)} generated files match protos/")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("generate", "check"):
        raise SystemExit("usage: python protos/generate.py generate|check")
    if sys.argv[1] == "generate":
        generate()
    else:
        sys.exit(check())
