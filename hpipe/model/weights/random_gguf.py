"""Random-weight GGUF files of named shapes: one file that hpipe and llama.cpp both run.

    hpipe model make random:llama3-8b@q4_k_m [-o FILE]

No model of the sizes users run can be downloaded here, yet speed, memory, loading and shipping
must be measured at those sizes, against llama.cpp on the same bytes. This writes a GGUF file of a
built-in shape (:data:`hpipe.core.shapes.SHAPES`) whose matrices are random blocks of the named
type, with the tokenizer and vocabulary of a built-in model (SmolLM2's, so the file tokenizes real
text: the embedding has its 49,152 rows, whatever the shape's own vocabulary).

The blocks are drawn in the quantized domain, not rounded from float weights: random quants under
random per-block scales chosen so every weight is about N(0, 0.02)-sized and centred (a K-quant's
minimum cancels its mean), at the speed of writing bytes (an 8B file in under a minute) where
rounding 8 billion floats would take many. The file is a model of its own; its F16 and Q4_K_M
files are two different random models. Types: ``f16``, ``q8_0``, ``q4_k_m`` (llama.cpp's mix:
Q6_K for the output matrix (the embedding where they are tied) and, in the layers its
``use_more_bits`` picks, for ``attn_v`` and ``ffn_down``; Q4_K elsewhere) and ``q4_k`` / ``q6_k`` (every matrix of that type); a row that is
not whole blocks of 256 falls back as in ``llama-quantize`` (Q4_K to Q5_0, Q6_K to Q8_0). Norms are ones
(float32). Rope scaling is not written: llama3.x shapes get plain RoPE at their base frequency.

Files go to hpipe's cache (``models/random/``) unless ``-o`` names one, and are made once: a
second ``make`` of the same shape, type and seed returns the cached file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpipe.core.config import ModelConfig
from hpipe.core.errors import InputError
from hpipe.core.paths import cache_root
from hpipe.core.shapes import RANDOM_PREFIX, SHAPES, random_config

#: ggml type ids (gguf.GGMLQuantizationType)
F32, F16, Q5_0, Q8_0, Q4_K, Q6_K = 0, 1, 6, 8, 12, 14
#: block values and bytes of each type written here
BLOCKS = {F16: (1, 2), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}
#: llama-quantize's stand-in for a K-quant where a row is not whole blocks of 256
FALLBACK = {Q4_K: Q5_0, Q6_K: Q8_0}
QUANTS = ("f16", "q8_0", "q4_k_m", "q4_k", "q6_k")
TOKENIZER_FROM = "smollm2-135m"
STD = 0.02  # about the size of a weight, as random:NAME daemons draw them


@dataclass(frozen=True)
class Spec:
    shape: str
    quant: str
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> "Spec":
        """``random:SHAPE@QUANT``, a built-in shape and one of :data:`QUANTS`."""
        body = text[len(RANDOM_PREFIX):] if text.startswith(RANDOM_PREFIX) else text
        shape, _, quant = body.partition("@")
        if shape not in SHAPES:
            raise InputError(f"unknown shape {shape!r} in {text!r} (built-in shapes: {', '.join(SHAPES)})")
        if quant.lower() not in QUANTS:
            raise InputError(f"{text!r}: name a weight type after '@' ({', '.join(QUANTS)}), e.g. "
                             f"random:{shape}@q4_k_m")
        return cls(shape, quant.lower(), seed)

    @property
    def file_name(self) -> str:
        return f"{self.shape}-{self.quant}-seed{self.seed}.gguf"


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose ``attn_v`` and ``ffn_down`` a _M mix keeps at more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(quant: str, name: str, layer: int | None, layers: int, width: int) -> int:
    """The ggml type ``name``, ``width`` values a row, is written in for ``quant``."""
    t = _mix(quant, name, layer, layers)
    return FALLBACK.get(t, t) if width % BLOCKS[t][0] else t


def _mix(quant: str, name: str, layer: int | None, layers: int) -> int:
    if quant == "f16":
        return F16
    if quant == "q8_0":
        return Q8_0
    if quant in ("q4_k", "q6_k"):
        return Q4_K if quant == "q4_k" else Q6_K
    if name == "output.weight":
        return Q6_K
    if layer is not None and name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(layer, layers):
        return Q6_K
    return Q4_K


def tensors(cfg: ModelConfig, quant: str, vocab: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape as rows x width, ggml type) of every tensor of the file, in file order."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    layers = cfg.num_layers
    # a tied embedding is also the output matrix, and is written as llama-quantize writes that
    embed = "output.weight" if cfg.tie_word_embeddings else "token_embd.weight"
    out = [("token_embd.weight", (vocab, h), tensor_type(quant, embed, None, layers, h))]
    for i in range(layers):
        for name, shape in ((f"blk.{i}.attn_norm.weight", (h,)),
                            (f"blk.{i}.attn_q.weight", (cfg.num_heads * cfg.head_dim, h)),
                            (f"blk.{i}.attn_k.weight", (kv, h)),
                            (f"blk.{i}.attn_v.weight", (kv, h)),
                            (f"blk.{i}.attn_output.weight", (h, cfg.num_heads * cfg.head_dim)),
                            (f"blk.{i}.ffn_norm.weight", (h,)),
                            (f"blk.{i}.ffn_gate.weight", (cfg.intermediate_size, h)),
                            (f"blk.{i}.ffn_up.weight", (cfg.intermediate_size, h)),
                            (f"blk.{i}.ffn_down.weight", (h, cfg.intermediate_size))):
            out.append((name, shape, F32 if len(shape) == 1 else tensor_type(quant, name, i, layers, shape[1])))
    out.append(("output_norm.weight", (h,), F32))
    if not cfg.tie_word_embeddings:
        out.append(("output.weight", (vocab, h), tensor_type(quant, "output.weight", None, layers, h)))
    return out


def random_blocks(ggml_type: int, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` x ``width`` random weights of ``ggml_type``, as the file stores them (uint8 rows of
    blocks; float16 values for F16)."""
    if ggml_type == F16:
        return (rng.standard_normal((rows, width), dtype=np.float32) * STD).astype(np.float16)
    per, nbytes = BLOCKS[ggml_type]
    if width % per:
        raise InputError(f"a row of {width} values is not whole blocks of {per}")
    n = rows * (width // per)
    blocks = np.frombuffer(rng.bytes(n * nbytes), dtype=np.uint8).reshape(n, nbytes).copy()

    def half(values) -> np.ndarray:
        return np.asarray(values, dtype=np.float16).reshape(n, 1).view(np.uint8)

    if ggml_type == Q8_0:  # d, then 32 int8 quants (uniform: std 74 of 255 levels)
        blocks[:, 2:] = np.clip(blocks[:, 2:].view(np.int8), -127, 127).view(np.uint8)
        blocks[:, 0:2] = half(np.full(n, STD / 74.0))
    elif ggml_type == Q5_0:  # d, 4 bytes of fifth bits, 16 of nibbles: d (q - 16), q uniform in 0..31
        blocks[:, 0:2] = half(np.full(n, STD / 9.2))
    elif ggml_type == Q4_K:  # d, dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles
        sc = rng.integers(8, 64, (n, 8), dtype=np.uint8)
        m = np.rint(sc.astype(np.float32) * 15 / 16).astype(np.uint8)  # dmin = 8 d: the block's mean is about 0
        d = STD / (4.6 * sc.mean(axis=1))
        blocks[:, 0:2], blocks[:, 2:4] = half(d), half(8 * d)
        blocks[:, 4:16] = pack_k4_scales(sc, m)
    elif ggml_type == Q6_K:  # 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
        scales = rng.integers(8, 64, (n, 16), dtype=np.int8)
        blocks[:, 192:208] = scales.view(np.uint8)
        blocks[:, 208:210] = half(STD / (18.5 * scales.mean(axis=1)))
    return blocks.reshape(rows, -1)


def pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's 12 bytes holding 8 six-bit scales and 8 six-bit minimums (ggml's ``get_scale_min_k4``
    read backwards): [n, 8] each -> [n, 12]."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def make(spec: Spec, out: Path | None = None) -> Path:
    """Write ``spec``'s file (once: an existing one is returned) and return its path."""
    path = out or cache_root() / "models" / "random" / spec.file_name
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        _write(spec, tmp)
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write(spec: Spec, path: Path) -> None:
    import gguf
    from tqdm import tqdm

    from hpipe.model.weights.sources import _builtin_gguf

    cfg = random_config(RANDOM_PREFIX + spec.shape)
    template = gguf.GGUFReader(_builtin_gguf(TOKENIZER_FROM))
    vocab = len(template.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {spec.shape} {spec.quant} (seed {spec.seed})")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"f16": 1, "q8_0": 7, "q4_k_m": 15, "q4_k": 14, "q6_k": 18}[spec.quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, field in template.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    plan = tensors(cfg, spec.quant, vocab)
    for name, shape, t in plan:
        if t == F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        elif t == F16:
            writer.add_tensor_info(name, shape, np.dtype(np.float16), 2 * shape[0] * shape[1])
        else:
            per, nbytes = BLOCKS[t]
            row = shape[1] // per * nbytes
            writer.add_tensor_info(name, (shape[0], row), np.dtype(np.uint8), shape[0] * row,
                                   raw_dtype=gguf.GGMLQuantizationType(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, shape, t) in enumerate(tqdm(plan, desc=f"writing {path.name}", unit="tensor",
                                               disable=None)):
        rng = np.random.default_rng([spec.seed, i])
        writer.write_tensor_data(np.ones(shape, np.float32) if t == F32 else random_blocks(t, *shape, rng))
    writer.close()
