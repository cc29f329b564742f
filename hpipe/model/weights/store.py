"""Read single tensors out of a Hugging Face safetensors checkpoint (sharded or not).

Only the header of each file is read to build the name -> file map; a stage then reads exactly
the tensors of its own units, so its resident memory is that of its units.

Tensors are read with plain file reads into memory the stage owns, not memory-mapped. A mapped
tensor keeps its whole file mapped while any tensor from it lives, and every page a stage once
read stays in its resident set: a float32 CPU stage packs its projections at load (reading each
weight once, then dropping it), and with ``safe_open``'s mapped tensors a 17-block stage of
SmolLM2 then held 487 MB after loading 350 MB of weights, and the demo's last stage peaked 0.21
GiB above its plan. Owned reads also keep a daemon safe from the file being rewritten under it.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from hpipe.core.errors import ModelSourceError

#: safetensors dtype names -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: a header larger than this is not a safetensors header (the format caps it at 100 MB)
MAX_HEADER_BYTES = 100_000_000


def read_header(path: Path) -> tuple[dict, int]:
    """``({name: {dtype, shape, data_offsets}}, offset of the data)`` of a safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelSourceError(f"{path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise ModelSourceError(f"{path}: not a safetensors file (header length {n})")
            raw = f.read(n)
    except OSError as e:
        raise ModelSourceError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelSourceError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelSourceError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + n


class WeightStore:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._headers: dict[Path, tuple[dict, int]] = {}
        self._files = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (OSError, ValueError, KeyError, TypeError):
                raise ModelSourceError(f"{index}: not a safetensors index (no weight_map)") from None
            files = {}
            for name, fname in weight_map.items():
                # shards are files of this directory: an absolute path or a '..' would read any file
                if not isinstance(fname, str) or Path(fname).is_absolute() or ".." in Path(fname).parts:
                    raise ModelSourceError(f"{index}: shard {fname!r} of {name!r} is not a file of this directory")
                files[name] = self.directory / fname
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ModelSourceError(f"{self.directory}: no *.safetensors weights found")
        names: dict[str, Path] = {}
        for path in files:
            names.update({k: path for k in self._header(path)[0]})
        return names

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def _header(self, path: Path) -> tuple[dict, int]:
        if path not in self._headers:
            self._headers[path] = read_header(path)
        return self._headers[path]

    def load_stacked(self, names: list[str]) -> torch.Tensor:
        """Tensors of one dtype and trailing shape stacked along dim 0, read straight into one
        buffer (a fused projection: no piece allocated and freed on the way)."""
        if len(names) == 1:
            return self.load(names)[names[0]]
        entries = []
        for n in names:
            if n not in self._files:
                raise ModelSourceError(f"{self.directory}: checkpoint lacks tensor {n!r}")
            header, start = self._header(self._files[n])
            entries.append((n, header.get(n), start))
        try:
            dtypes = {DTYPES[e["dtype"]] for _, e, _ in entries}
            tails = {tuple(int(d) for d in e["shape"][1:]) for _, e, _ in entries}
        except (KeyError, TypeError, ValueError):
            dtypes, tails = set(), set()
        if len(dtypes) != 1 or len(tails) != 1:
            return torch.cat([self.load([n])[n] for n in names])
        rows = [int(e["shape"][0]) for _, e, _ in entries]
        out = torch.empty(sum(rows), *tails.pop(), dtype=dtypes.pop())
        at = 0
        for (n, entry, start), r in zip(entries, rows):
            with open(self._files[n], "rb") as f:
                _read_tensor(f, self._files[n], n, entry, start, out=out[at:at + r])
            at += r
        return out

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self._files]
        if missing:
            raise ModelSourceError(f"{self.directory}: checkpoint lacks tensors {missing[:4]}")
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._files[n], []).append(n)
        out = {}
        for path, file_names in by_file.items():
            header, data_start = self._header(path)
            with open(path, "rb") as f:
                for n in file_names:
                    out[n] = _read_tensor(f, path, n, header.get(n), data_start)
        return out


def _read_tensor(f, path: Path, name: str, entry: dict | None, data_start: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    if entry is None:
        raise ModelSourceError(f"{path}: has no tensor {name!r} (the index says it does)")
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ModelSourceError(f"{path}: tensor {name!r} has a malformed or unsupported header entry {entry}") from None
    itemsize, numel = dtype.itemsize, math.prod(shape)
    if end - begin != numel * itemsize or begin < 0 or min(shape, default=0) < 0:
        raise ModelSourceError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape {shape} "
                               f"needs {numel * itemsize}")
    if out is not None and (out.dtype != dtype or list(out.shape) != shape):
        raise ModelSourceError(f"{path}: tensor {name!r} is {shape} {entry['dtype']}, not what it is stacked with")
    buf = torch.empty(end - begin, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)
    f.seek(data_start + begin)
    if f.readinto(memoryview(buf.numpy())) != end - begin:
        raise ModelSourceError(f"{path}: truncated (tensor {name!r} runs past the end of the file)")
    return buf.view(dtype).reshape(shape) if out is None else out
