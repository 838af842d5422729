"""Generates the Python stubs of every proto under protos/ into the `primerl`
package of libs/common, or checks that the committed stubs are current.

    python protos/gen_python.py            # regenerate
    python protos/gen_python.py --check    # exit 1 when the stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
STUBS_ROOT = PROTO_ROOT.parent / "libs" / "common" / "src"
PACKAGE = "primerl"
INIT_TEXT = '"""Generated from protos/ by protos/gen_python.py. Do not edit."""\n'


def generate(out_dir: pathlib.Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).rglob("*.proto"))
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package_dir in [out_dir / PACKAGE, *(p for p in (out_dir / PACKAGE).rglob("*") if p.is_dir())]:
        (package_dir / "__init__.py").write_text(INIT_TEXT)


def stale_files(generated: pathlib.Path, committed: pathlib.Path) -> list[str]:
    def listing(root: pathlib.Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}

    new, old = listing(generated), listing(committed)
    differing = {name for name in new & old if not filecmp.cmp(generated / name, committed / name, shallow=False)}
    return sorted((new ^ old) | differing)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = pathlib.Path(tmp)
        generate(out_dir)
        target = STUBS_ROOT / PACKAGE
        if args.check:
            stale = stale_files(out_dir / PACKAGE, target)
            if stale:
                print("stale generated stubs (run `make protos`):", *stale, sep="\n  ", file=sys.stderr)
                return 1
            print("generated stubs are current")
            return 0
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(out_dir / PACKAGE, target)
        print(f"wrote stubs to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
