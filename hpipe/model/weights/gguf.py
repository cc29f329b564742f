"""Read a stage's own tensors straight out of a GGUF file, in the blocks the file stores.

The file's tensor index (name, ggml type, shape, offset, bytes) is read once with the ``gguf``
package when the file is imported (:func:`write_index`: parsing the whole header takes seconds
and a few hundred MB for a 49k-token vocabulary) and kept as ``tensors.json`` beside the
imported config; a stage then reads only its own tensors, with plain file reads into memory it
owns (for the reasons :mod:`hpipe.model.weights.store` gives). A daemon's weights cache is the exception
(:meth:`GGUFWeights.of_files`): each file is one tensor, written once and renamed into place, never
rewritten, so it is mapped (privately) instead. A tensor used as stored (the embedding, an
unfused projection) is then the page cache's bytes with no copy, and the mapping goes when the
tensor does; its Load after a restart is one pass over the bytes (the hash check) instead of two.

Tensors are named as Hugging Face names them (``model.layers.3.self_attn.q_proj.weight``), so a
stage loads a GGUF exactly as it loads a safetensors checkpoint. Two differences are undone here:
llama.cpp's converter reorders the rows of a Llama model's query and key projections (its rotary
embedding pairs neighbouring dimensions, Hugging Face's pairs the two halves of a head), and the
matrices come back as :class:`QuantizedWeight` unless the file stores them as float32.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
from pathlib import Path

import torch

from hpipe.core.config import ModelConfig
from hpipe.core.errors import ModelSourceError
from hpipe.model.weights.blocks import TYPES, QuantizedWeight

INDEX = "tensors.json"

#: the architectures whose GGUF tensors hpipe maps, and whether the converter permuted Q and K
#: ("hf": blocks hpipe's --quantize wrote, in Hugging Face's names and layout, hpipe.model.weights.quantize)
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "phi3": False, "gemma3": False, "hf": False}
#: what a norm's stored weight adds to the Hugging Face one (llama.cpp's converter stores Gemma's
#: ``1 + weight``; transformers subtracts the one again, and so does this store)
NORM_OFFSET = {"gemma3": 1.0}

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
#: where an architecture names a block's tensors otherwise
_BLOCK_OF = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # stored fused, as in transformers
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor (None: a tensor hpipe does not use, e.g. rope_freqs)."""
    base, _, param = gguf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{param}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    block = {**_BLOCK, **_BLOCK_OF.get(arch, {})}
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{param}"
    return None


def check_file(gguf: Path) -> None:
    """Refuse, with one line naming the file (and the tensor), a file that is not a whole GGUF:
    what the gguf package's reader raises on it, or a tensor whose bytes lie past the end."""
    try:
        _entries(gguf)
    except ModelSourceError:
        raise
    except Exception as e:  # noqa: BLE001 - a file from anywhere: whatever the parser raises, one clear line
        first = str(e).splitlines()[0][:200] if str(e) else "malformed"
        raise ModelSourceError(f"{gguf}: not a GGUF file hpipe can read ({type(e).__name__}: {first})") from None


def write_index(gguf: Path, out: Path) -> None:
    """Write ``out/tensors.json``: the architecture and, per tensor hpipe uses, its Hugging Face
    name, ggml type, shape ``[rows, in]`` (or ``[n]``), absolute offset and bytes."""
    arch, tensors = _entries(gguf)
    (out / INDEX).write_text(json.dumps({"architecture": arch, "tensors": tensors}))


def _entries(gguf: Path) -> tuple[str, dict]:
    """The architecture and the tensors hpipe uses (parsed once per version of the file: an import
    checks the file, then indexes it, and a big vocabulary takes seconds to parse)."""
    st = gguf.stat()
    return _parsed(str(gguf), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> tuple[str, dict]:
    from gguf import GGUFReader

    gguf = Path(path)

    reader = GGUFReader(str(gguf))
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else ""
    if any(t.name.startswith("rope_factors") for t in reader.tensors):
        raise ModelSourceError(f"{gguf.name}: a GGUF with LongRoPE factors (rope_factors_*) is not supported; "
                               "use the model's Hugging Face directory")
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        offset, nbytes = int(t.data_offset), int(t.n_bytes)
        if nbytes <= 0 or offset + nbytes > size or t.data.nbytes != nbytes:  # a shorter slice of the map
            raise ModelSourceError(f"{gguf}: tensor {t.name} ({nbytes} bytes at offset {offset}) does not lie "
                                   f"inside the file's {size} bytes: the file is truncated or corrupt")
        if not readable(int(t.tensor_type)):
            raise ModelSourceError(f"{gguf}: tensor {t.name} is stored as ggml type {_type_name(int(t.tensor_type))}, "
                                   "which neither hpipe nor transformers (--dequantize) can read")
        tensors[name] = {"gguf": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in reversed(t.shape)],
                         "offset": offset, "bytes": nbytes}
    return arch, tensors


@functools.lru_cache(maxsize=None)
def readable(ggml_type: int) -> bool:
    """Whether hpipe reads ``ggml_type``, or transformers can dequantize it for ``--dequantize``
    (gguf's dequantizer, asked of one zero block)."""
    if ggml_type in TYPES:
        return True
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(ggml_type)
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


class GGUFWeights:
    """A :class:`~hpipe.model.weights.store.WeightStore` over a GGUF file: the same names, the stored blocks."""

    def __init__(self, gguf: Path, index: Path, cfg: ModelConfig):
        try:
            meta = json.loads(index.read_text())
            architecture, tensors = meta["architecture"], meta["tensors"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelSourceError(f"{index}: not a GGUF tensor index ({e})") from None
        self._setup(Path(gguf).name, architecture, {n: {**e, "file": str(gguf)} for n, e in tensors.items()}, cfg)

    @classmethod
    def of_files(cls, label: str, architecture: str, tensors: dict[str, dict], cfg: ModelConfig) -> "GGUFWeights":
        """A store whose tensors lie in files of their own (a daemon's weights cache): ``tensors``
        maps each name to its ``type``, ``shape``, ``bytes``, ``file`` and ``offset`` there."""
        store = cls.__new__(cls)
        store._setup(label, architecture, {n: {"gguf": n, **e} for n, e in tensors.items()}, cfg)
        # each file is one tensor, page-aligned: mapped rather than read, so a tensor used as
        # stored (the embedding, unfused projections) is the page cache's bytes, not a copy
        store._mapped = True
        return store

    def _setup(self, label: str, architecture: str, tensors: dict[str, dict], cfg: ModelConfig) -> None:
        self.label, self.cfg, self.architecture, self._tensors = label, cfg, architecture, tensors
        self._mapped = False
        if self.architecture not in ARCHITECTURES:
            raise ModelSourceError(f"{label}: GGUF architecture {self.architecture!r} is not supported for "
                                   f"quantized weights (supported: {', '.join(ARCHITECTURES)})")

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def matrix_bits(self) -> float:
        """Bits per weight of the file's matrices, as stored (their mean over every entry)."""
        matrices = [e for e in self._tensors.values() if len(e["shape"]) == 2]
        entries = sum(math.prod(e["shape"]) for e in matrices)
        return 8 * sum(e["bytes"] for e in matrices) / max(entries, 1)

    def main_type(self) -> int:
        """The ggml type most of the layers' matrix bytes are stored in (what the profiler times)."""
        by_type: dict[int, int] = {}
        for name, e in self._tensors.items():
            if len(e["shape"]) == 2 and name.startswith("model.layers."):
                by_type[e["type"]] = by_type.get(e["type"], 0) + e["bytes"]
        return max(by_type, key=by_type.get) if by_type else 0

    def nbytes(self, name: str) -> int:
        """Bytes the file stores ``name`` in."""
        return int(self._entry(name)["bytes"])

    def load(self, names: list[str]) -> dict[str, torch.Tensor | QuantizedWeight]:
        files: dict[str, object] = {}
        try:
            for n in names:
                file = self._entry(n)["file"]
                if file not in files:
                    files[file] = open(file, "rb")
                    if self._mapped and os.fstat(files[file].fileno()).st_size:
                        f = files.pop(file)
                        with f:  # a private mapping: writable for torch, never written back
                            files[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            return {n: self._read(files[self._entry(n)["file"]], n) for n in names}
        finally:
            for f in files.values():
                if not isinstance(f, mmap.mmap):  # a mapping lives as long as the tensors made of it
                    f.close()

    def load_stacked(self, names: list[str]) -> torch.Tensor | QuantizedWeight:
        """Tensors stacked along dim 0 (a fused projection); a quantized stack keeps its blocks."""
        pieces = list(self.load(names).values())
        if all(isinstance(p, QuantizedWeight) for p in pieces):
            return QuantizedWeight.stack(pieces)
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in pieces])

    def _entry(self, name: str) -> dict:
        entry = self._tensors.get(name)
        if entry is None:
            raise ModelSourceError(f"{self.label}: has no tensor for {name!r}")
        return entry

    def _read(self, f, name: str) -> torch.Tensor | QuantizedWeight:
        e = self._entry(name)
        t, shape, offset, nbytes = e["type"], e["shape"], e["offset"], e["bytes"]
        if t not in TYPES:
            raise ModelSourceError(f"{self.label}: tensor {e['gguf']} is stored as ggml type {_type_name(t)}, "
                                   f"which hpipe cannot read (it reads {', '.join(v[0] for v in TYPES.values())}); "
                                   "requantize the file, e.g. llama-quantize ... Q4_K_M")
        _, per_block, block_bytes = TYPES[t]
        values = math.prod(shape)
        if not shape or min(shape) < 1 or values % per_block or values // per_block * block_bytes != nbytes:
            raise ModelSourceError(f"{self.label}: tensor {e['gguf']} holds {nbytes} bytes, which are not "
                                   f"{'x'.join(map(str, shape))} {_type_name(t)} values")
        size = len(f) if isinstance(f, mmap.mmap) else os.fstat(f.fileno()).st_size
        if offset < 0 or offset + nbytes > size:
            raise ModelSourceError(f"{self.label}: truncated (tensor {e['gguf']} runs past the end of the file)")
        if isinstance(f, mmap.mmap):
            buf = torch.frombuffer(f, dtype=torch.uint8, count=nbytes, offset=offset)  # keeps the mapping
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            f.seek(offset)
            if f.readinto(memoryview(buf.numpy())) != nbytes:
                raise ModelSourceError(f"{self.label}: truncated (tensor {e['gguf']})")
        return self._tensor(name, buf)

    def _tensor(self, name: str, buf: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        """``name``'s tensor made of its stored bytes ``buf`` (checked against its entry by the caller)."""
        e = self._entry(name)
        t, shape = e["type"], e["shape"]
        if t == 0 and len(shape) > 1:  # float32, as it is
            return buf.view(torch.float32).reshape(shape)
        if len(shape) == 1:  # a norm's or a bias's vector
            vector = buf.view(torch.float32) if t == 0 else QuantizedWeight.of(t, 1, shape[0], buf).dequantize()
            if name.endswith("norm.weight") and self.architecture in NORM_OFFSET:
                vector = vector - NORM_OFFSET[self.architecture]
            return vector.reshape(shape)
        rows, width = shape[0], math.prod(shape[1:])
        weight = QuantizedWeight.of(t, rows, width, buf)
        return self._unpermute(name, weight)

    def _unpermute(self, name: str, weight: QuantizedWeight) -> QuantizedWeight:
        # llama.cpp's converter interleaves the two halves of each head's rows in Q and K
        if not ARCHITECTURES[self.architecture]:
            return weight
        if name.endswith("q_proj.weight"):
            return weight.take_rows(head_order(weight.rows, self.cfg.num_heads))
        if name.endswith("k_proj.weight"):
            return weight.take_rows(head_order(weight.rows, self.cfg.num_kv_heads))
        return weight


def head_order(rows: int, heads: int) -> torch.Tensor:
    """The stored row each Hugging Face row of a Q or K projection is (transformers'
    ``reverse_permute_weights`` applied to the row indices)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _type_name(t: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return str(t)
