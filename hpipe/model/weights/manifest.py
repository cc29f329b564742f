"""A GGUF model's manifest: every tensor hpipe reads, where the file stores it, and its content hash.

Weights travel from the coordinator to daemons that do not hold the model
(:mod:`runtime.coordinator.ship`), tensor by tensor as the file stores them (quantized blocks stay
quantized), and daemons cache them by content (:mod:`runtime.daemon.weights_cache`). The manifest
names each tensor's bytes by their BLAKE3 hash; it is computed once per imported file and kept
beside its import as ``manifest.json`` (BLAKE3 reads a few GB a second, so even a large model's
first manifest takes seconds, and later runs read the JSON).

A stage needs the tensors of its units (:func:`tensors_of`), so each daemon receives only those.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from hpipe.core.errors import ModelSourceError

MANIFEST = "manifest.json"


def content_hash(data) -> str:
    """The hex BLAKE3 hash of ``data`` (bytes, or a buffer)."""
    import blake3

    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def file_hash(path: Path, offset: int = 0, length: int | None = None) -> str:
    """The hash of ``length`` bytes of ``path`` from ``offset`` (to its end without ``length``),
    read through a memory map (no copy: half the time of chunked reads on a 200 MB file)."""
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    size = path.stat().st_size
    end = size if length is None else offset + length
    if end > size:
        raise ModelSourceError(f"{path}: truncated ({end - size} bytes short)")
    if end > offset:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, \
                memoryview(mm)[offset:end] as view:
            h.update(view)
    return h.hexdigest()


@dataclass(frozen=True)
class TensorEntry:
    name: str            # its Hugging Face name
    type: int            # ggml type
    shape: tuple[int, ...]
    offset: int          # in the file
    nbytes: int
    hash: str


@dataclass(frozen=True)
class Manifest:
    architecture: str
    tensors: dict[str, TensorEntry]  # by name

    def entries(self, names) -> list[TensorEntry]:
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ModelSourceError(f"the model's file has no tensor {missing[0]!r}")
        return [self.tensors[n] for n in names]


def manifest(gguf: Path, imported: Path) -> Manifest:
    """The manifest of ``gguf`` (imported into ``imported``, whose ``tensors.json`` indexes it),
    computed once and cached there."""
    from hpipe.model.weights.gguf import INDEX

    path = imported / MANIFEST
    if not path.exists():
        index = json.loads((imported / INDEX).read_text())
        tensors = [{"name": name, "type": e["type"], "shape": e["shape"], "offset": e["offset"], "bytes": e["bytes"],
                    "hash": file_hash(gguf, e["offset"], e["bytes"])} for name, e in index["tensors"].items()]
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}")
        tmp.write_text(json.dumps({"architecture": index["architecture"], "tensors": tensors}))
        tmp.replace(path)  # readers never see half of it
    raw = json.loads(path.read_text())
    return Manifest(raw["architecture"], {t["name"]: TensorEntry(t["name"], t["type"], tuple(t["shape"]), t["offset"],
                                                                 t["bytes"], t["hash"]) for t in raw["tensors"]})


