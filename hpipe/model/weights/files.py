"""Files in hpipe's cache: a model file's identity, and directories written whole or not at all."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path


def file_key(path: Path) -> str:
    """Identity of a model file: its size and a hash of its first and last MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]

def write_once(target: Path, write, file: str | None = None) -> None:
    """Run ``write(tmp_dir)`` and move its result to ``target`` (a directory, or ``file`` inside
    the temporary directory): readers never see a half-written import, and of two processes
    importing at once one wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=target.parent))
    try:
        write(tmp)
        try:
            (tmp / file if file else tmp).rename(target)
        except OSError:
            if not target.exists():  # not a concurrent import that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
