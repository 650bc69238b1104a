"""Generate the Python code for splitserve/protos/v1/*.proto (messages, gRPC stubs, type stubs).

    python -m splitserve.protos.generate           # write splitserve/protos/v1/*_pb2*.py(i)
    python -m splitserve.protos.generate --check   # exit 1 if the committed code is stale (CI)
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

# NOTE: compiled from the folder above `splitserve/`, so that the generated modules import each
# other as `splitserve.protos.v1.*`, the installed name.
ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("splitserve") / "protos" / "v1"


def _generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into out_dir, mirroring the source tree; return the generated paths."""
    sources = sorted((ROOT / PROTO_DIR).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(src.relative_to(ROOT)) for src in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / PROTO_DIR).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = _generate(Path(tmp))
        committed = sorted((ROOT / PROTO_DIR).glob("*_pb2*.py*"))
        names = {p.name for p in generated}
        if args.check:
            stale = [p.name for p in generated if not (ROOT / PROTO_DIR / p.name).is_file()]
            stale += [
                p.name
                for p in generated
                if (ROOT / PROTO_DIR / p.name).is_file()
                and not filecmp.cmp(p, ROOT / PROTO_DIR / p.name, shallow=False)
            ]
            stale += [p.name for p in committed if p.name not in names]
            if stale:
                print(
                    f"stale generated code: {sorted(stale)}; "
                    "run python -m splitserve.protos.generate"
                )
                return 1
            print(f"generated code is up to date ({len(generated)} files)")
            return 0
        for old in committed:
            if old.name not in names:
                old.unlink()
        for path in generated:
            shutil.copyfile(path, ROOT / PROTO_DIR / path.name)
        print(f"wrote {len(generated)} files to {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
