"""Generate the Python gRPC code from ``proto/stage.proto`` into ``runtime/wire/proto_gen/``.

The proto is the single source of the wire format; the generated code is never committed or
edited. In a source checkout it is generated at set-up (``python -m runtime.wire.protogen``), and
:func:`ensure` regenerates it on import when it is missing or older than the proto. A wheel is
built with it (``setup.py`` calls :func:`generate` into the build), so an installed hpipe needs
neither the proto nor ``grpc_tools`` at run time.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "stage.proto"
OUT = Path(__file__).resolve().parent / "proto_gen"


def _digest(proto: Path) -> str:
    return hashlib.sha256(proto.read_bytes()).hexdigest()


def generate(proto: Path = PROTO, out: Path = OUT) -> None:
    """Write ``stage_pb2.py``, ``stage_pb2_grpc.py`` (and ``.pyi`` stubs) for ``proto`` into ``out``."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{proto.parent}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(proto)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")
    # protoc writes an absolute import of the message module; make it package-relative.
    grpc_file = out / "stage_pb2_grpc.py"
    grpc_file.write_text(re.sub(r"^import stage_pb2 as", "from . import stage_pb2 as", grpc_file.read_text(),
                                flags=re.M))
    (out / "__init__.py").write_text('"""Generated from proto/stage.proto by runtime/wire/protogen.py. Do not edit."""\n')
    shutil.copyfile(proto, out / proto.name)  # the source it came from, beside it
    (out / "SOURCE_SHA256").write_text(_digest(proto))


def ensure() -> None:
    """Make sure the generated code matches the proto (in a checkout), or exists (installed)."""
    stamp = OUT / "SOURCE_SHA256"
    if not PROTO.exists():  # an installed wheel: built with the code, and no proto beside it
        if not (OUT / "stage_pb2.py").exists():
            raise RuntimeError(f"hpipe is installed without its generated wire code ({OUT}); reinstall it")
        return
    if not stamp.exists() or stamp.read_text() != _digest(PROTO):
        generate()


if __name__ == "__main__":
    generate()
    print(f"generated {OUT.relative_to(ROOT)} from {PROTO.relative_to(ROOT)}", file=sys.stderr)
