"""Read single tensors out of a Hugging Face safetensors checkpoint (sharded or not).

Only the header of each file is read to build the name -> file map; a stage then reads exactly
the tensors of its own units, so its resident memory is that of its units.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from hpipe.errors import ModelSourceError


class WeightStore:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._files = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.directory / fname for name, fname in weight_map.items()}
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ModelSourceError(f"{self.directory}: no *.safetensors weights found")
        names: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names.update({k: path for k in f.keys()})
        return names

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self._files]
        if missing:
            raise ModelSourceError(f"{self.directory}: checkpoint lacks tensors {missing[:4]}")
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._files[n], []).append(n)
        out = {}
        for path, file_names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for n in file_names:
                    out[n] = f.get_tensor(n)
        return out
