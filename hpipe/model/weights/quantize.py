"""Quantize on load: a Hugging Face checkpoint's matrices turned into GGUF blocks once, and cached.

For models that do not come as GGUF files, ``--quantize q8_0|q4_0|q4_k`` writes every matrix of
a float32/bfloat16 safetensors checkpoint (projections, MLP, embedding, LM head) in the chosen
block type, and every vector (norms, biases) as float32, into one file in hpipe's cache beside a
copy of the model's config and tokenizer and a tensor index (``tensors.json``) in the format a
GGUF import has (:mod:`hpipe.model.weights.gguf`). From then on the model is that directory: stages
read its blocks as they read a GGUF file's, the profiler times them, daemons without it are sent
them (:mod:`runtime.coordinator.ship`). The tensors keep Hugging Face's names and layout (the
index says ``"architecture": "hf"``), so nothing is permuted or offset on the way back.

Q8_0 and Q4_0 are the gguf package's quantizers (llama.cpp's reference arithmetic). Q4_K is
written here (:func:`quantize_q4_k`): per 32 values, a scale and a minimum from the block's range,
both kept at 6 bits under the 256-value super-block's two float16 factors. It is a plain
min/max fit, not llama.cpp's iterative search, so its error is somewhat larger than
``llama-quantize``'s for the same type. A matrix whose width is not a multiple of 256 is written as
Q5_0 instead (what ``llama-quantize`` does for Q4_K_M), one not a multiple of 32 as float32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from hpipe.core.errors import InputError, ModelSourceError
from hpipe.core.paths import cache_root

log = logging.getLogger(__name__)

#: --quantize choices -> ggml type ids (gguf.GGMLQuantizationType)
KINDS = {"q8_0": 8, "q4_0": 2, "q4_k": 12}
Q5_0, F32 = 6, 0
BLOCKS = "weights.bin"
QK_K = 256


def quantize_matrix(x: np.ndarray, ggml_type: int) -> tuple[int, bytes]:
    """``x`` [rows, width] float32 as ``ggml_type`` blocks (or the fallback its width needs): the
    type used and the bytes, row after row."""
    from gguf import GGMLQuantizationType, quants

    width = x.shape[-1]
    if ggml_type == KINDS["q4_k"] and width % QK_K:
        ggml_type = Q5_0
    if width % 32:
        return F32, np.ascontiguousarray(x, dtype=np.float32).tobytes()
    if ggml_type == KINDS["q4_k"]:
        return ggml_type, quantize_q4_k(x).tobytes()
    return ggml_type, quants.quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType(ggml_type)).tobytes()


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of ``x`` [rows, width], width a multiple of 256: uint8 [rows, width / 256 * 144]."""
    rows, width = x.shape
    sub = x.astype(np.float32).reshape(rows, width // QK_K, 8, 32)  # super-blocks of 8 sub-blocks
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = np.maximum(sub.max(axis=-1), 0.0)
    scale = (hi - lo) / 15.0
    mins = -lo
    d = scale.max(axis=-1) / 63.0                       # [rows, blocks]
    dmin = mins.max(axis=-1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[..., None] > 0, np.rint(scale / d[..., None]), 0).clip(0, 63).astype(np.uint8)
        lm = np.where(dmin[..., None] > 0, np.rint(mins / dmin[..., None]), 0).clip(0, 63).astype(np.uint8)
        step = d[..., None] * ls                          # the scale each sub-block decodes with
        low = dmin[..., None] * lm
        q = np.where(step[..., None] > 0, np.rint((sub + low[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8)                   # [rows, blocks, 8, 32]
    scales = np.zeros((rows, width // QK_K, 12), dtype=np.uint8)
    scales[..., 0:4] = ls[..., 0:4] | ((ls[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = lm[..., 0:4] | ((lm[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (ls[..., 4:8] & 0xF) | ((lm[..., 4:8] & 0xF) << 4)
    pairs = q.reshape(rows, width // QK_K, 4, 2, 32)      # sub-blocks 2j (low nibbles) and 2j+1 (high)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, width // QK_K, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(rows, -1, 2), dmin16.view(np.uint8).reshape(rows, -1, 2),
                          scales, qs], axis=-1)
    return out.reshape(rows, -1)


def _model_key(model_dir: Path) -> str:
    """Identity of a checkpoint: its config and each weight file's name and identity."""
    from hpipe.model.weights.files import file_key

    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{file_key(f)}".encode())
    return h.hexdigest()[:16]


def quantized_dir(source, kind: str) -> Path:
    """The cache directory of ``source`` (a safetensors :class:`ModelSource`) quantized to ``kind``,
    written on first use."""
    from hpipe.model.weights.files import write_once

    if kind not in KINDS:
        raise InputError(f"--quantize {kind}: choose one of {', '.join(KINDS)}")
    if source.gguf is not None:
        raise InputError(f"{source.name} is a GGUF file: it is quantized already (its blocks are used as stored)")
    target = cache_root() / "models" / f"{source.path.name}-{kind}-{_model_key(source.path)}"
    if not (target / "tensors.json").exists():
        log.warning("quantizing %s to %s into %s (once; later runs reuse it)", source.name, kind.upper(), target)
        write_once(target, lambda tmp: _write(source, KINDS[kind], tmp))
    return target


def _write(source, ggml_type: int, out: Path) -> None:
    from hpipe.model.weights.manifest import MANIFEST
    from hpipe.model.weights.store import WeightStore

    made_here = {"model.safetensors.index.json", "tensors.json", MANIFEST}  # of the weights, or hpipe's
    for f in source.path.iterdir():  # config, tokenizer, generation config: everything but the weights
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth")) and f.name not in made_here:
            shutil.copy(f, out / f.name)
    store = WeightStore(source.path)
    tensors, offset = {}, 0
    with open(out / BLOCKS, "wb") as blocks:
        for name in store.names():
            t = store.load([name])[name].float()
            if t.dim() == 2:
                kind, data = quantize_matrix(t.numpy(), ggml_type)
            elif t.dim() == 1:
                kind, data = F32, t.numpy().astype(np.float32).tobytes()
            else:
                raise ModelSourceError(f"{source.name}: tensor {name} has {t.dim()} dimensions")
            blocks.write(data)
            tensors[name] = {"gguf": name, "type": kind, "shape": list(t.shape), "offset": offset, "bytes": len(data)}
            offset += len(data)
    (out / "tensors.json").write_text(json.dumps({"architecture": "hf", "tensors": tensors}))


def is_quantized_dir(path: Path) -> bool:
    return (path / BLOCKS).exists() and (path / "tensors.json").exists()
