"""Regenerates the Python code of the specdec protos.

    python protos/generate.py            # rewrite protos/v1/*_pb2*.py(i)
    python protos/generate.py --out DIR  # write into DIR (used by the staleness test)

grpc_tools emits absolute imports (``from v1 import specdec_pb2``); they are
rewritten to relative ones so the code works inside the ``specdec.protos``
namespace.
"""
from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ["v1/specdec.proto"]


def generate(out_dir: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # test/dev dependency only

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc", f"-I{PROTO_ROOT}", f"-I{include}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
            *PROTO_FILES,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            rel = src.relative_to(tmp)
            text = src.read_text()
            text = re.sub(r"^from v1 import (\w+)", r"from . import \1", text, flags=re.M)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
            written.append(dst)
        return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
