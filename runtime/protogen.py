"""Generate the Python gRPC code from ``proto/stage.proto`` into ``runtime/proto_gen/``.

Run at set-up (``python -m runtime.protogen``); :func:`ensure` also regenerates on import when the
generated code is missing or older than the proto, so it can never drift from the single source.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "stage.proto"
OUT = Path(__file__).resolve().parent / "proto_gen"
STAMP = OUT / "SOURCE_SHA256"


def _digest() -> str:
    return hashlib.sha256(PROTO.read_bytes()).hexdigest()


def generate() -> None:
    from grpc_tools import protoc

    OUT.mkdir(exist_ok=True)
    args = ["protoc", f"-I{PROTO.parent}", f"--python_out={OUT}", f"--pyi_out={OUT}",
            f"--grpc_python_out={OUT}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    # protoc writes an absolute import of the message module; make it package-relative.
    grpc_file = OUT / "stage_pb2_grpc.py"
    grpc_file.write_text(re.sub(r"^import stage_pb2 as", "from . import stage_pb2 as", grpc_file.read_text(),
                                flags=re.M))
    (OUT / "__init__.py").write_text('"""Generated from proto/stage.proto by runtime/protogen.py. Do not edit."""\n')
    STAMP.write_text(_digest())


def ensure() -> None:
    if not STAMP.exists() or STAMP.read_text() != _digest():
        generate()


if __name__ == "__main__":
    generate()
    print(f"generated {OUT.relative_to(ROOT)} from {PROTO.relative_to(ROOT)}", file=sys.stderr)
