"""Model shapes without weights: ``random:NAME`` for planning, what-if profiles and benchmarks.

Built-in shapes (Llama-family configs; the planner needs only the dimensions):

| name       | layers | hidden | intermediate | heads | kv heads | vocab  | context |
|------------|-------:|-------:|-------------:|------:|---------:|-------:|--------:|
| llama-7b   | 32     | 4096   | 11008        | 32    | 32       | 32000  | 4096    |
| llama-13b  | 40     | 5120   | 13824        | 40    | 40       | 32000  | 4096    |
| llama3-8b  | 32     | 4096   | 14336        | 32    | 8        | 128256 | 8192    |
| llama3.2-1b| 16     | 2048   | 8192         | 32    | 8        | 128256 | 131072  |
| llama3.2-3b| 28     | 3072   | 8192         | 24    | 8        | 128256 | 131072  |
| gpt3-2b    | 32     | 2560   | 6827         | 32    | 32       | 50257  | 2048    |
| llama3.1-8b| 32     | 4096   | 14336        | 32    | 8        | 128256 | 131072  |
| tiny       | 4      | 64     | 128          | 4     | 2        | 512    | 4096    |

``llama3.1-8b`` carries Llama 3.1's rope scaling (factor 8 over an original 8192 positions), for
long-input runs. ``tiny`` exists for tests. The Llama 3.2 shapes tie the
embedding and the LM head and, unlike the real models, have no rope scaling (plain RoPE at
θ = 500,000): the same cost per position. A shape may also be given as ``random:PATH`` to a
Hugging Face ``config.json``.

Daemons *run* ``random:`` models: each creates the weights of its own units from a seed and the
tensor's name (:meth:`hpipe.model.StageModel.random`), so any split is the same model, and nothing
large is shipped or transferred. They have no tokenizer: benchmarks feed them token ids.

``gpt3-2b`` is GPT-3 2.7B's shape (32 layers, d_model 2560, 32 heads of 80) in Llama form: its
two-matrix 4d MLP is written as a gated MLP of equal weight count (3 x 2560 x 6827 ~ 2 x 2560 x 10240).
"""

from __future__ import annotations

from pathlib import Path

from hpipe.core.config import ModelConfig
from hpipe.core.errors import ModelSourceError

_BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5)
SHAPES = {
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "llama-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rope_theta=500000.0, tie_word_embeddings=True),
    "llama3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                        rope_theta=500000.0, tie_word_embeddings=True),
    "gpt3-2b": dict(vocab_size=50257, hidden_size=2560, intermediate_size=6827, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048),
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}

RANDOM_PREFIX = "random:"

#: bits per weight of the matrices, for what-if shapes that name a quantization
#: (``random:llama3-8b@q4_k_m``): GGUF's block sizes, and for the _M mixes llama.cpp's averages
#: (a Q4_K_M file keeps some matrices at Q6_K)
QUANT_BITS = {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q8_0": 8.5, "q4_k": 4.5, "q5_k": 5.5,
              "q6_k": 6.5625, "q4_k_m": 4.85, "q5_k_m": 5.7, "f16": 16.0, "bf16": 16.0, "f32": 32.0}


def quantization_bits(spec: str) -> float:
    """Bits per weight a what-if shape's ``@QUANT`` names (0.0: none, the dtype's)."""
    if not is_random(spec) or "@" not in spec:
        return 0.0
    quant = spec.rsplit("@", 1)[1].lower()
    if quant not in QUANT_BITS:
        raise ModelSourceError(f"unknown quantization {quant!r} in {spec!r} (known: {', '.join(QUANT_BITS)})")
    return QUANT_BITS[quant]


def is_random(spec: str) -> bool:
    return spec.startswith(RANDOM_PREFIX)


def random_config(spec: str) -> ModelConfig:
    """The config of ``random:NAME`` (a built-in shape) or ``random:PATH`` (a config.json)."""
    if not is_random(spec):
        raise ModelSourceError(f"{spec!r} is not a random-weight shape (random:NAME or random:PATH)")
    name = spec[len(RANDOM_PREFIX):]
    if "@" in name:
        quantization_bits(spec)  # a known quantization, or a clear error
        name = name.rsplit("@", 1)[0]
    if name in SHAPES:
        return ModelConfig.from_dict({**_BASE, **SHAPES[name]})
    if name.endswith(".json") and Path(name).is_file():
        return ModelConfig.from_file(name)
    raise ModelSourceError(f"unknown built-in shape {name!r} (known: {', '.join(SHAPES)}; or random:PATH to a "
                           "config.json)")
