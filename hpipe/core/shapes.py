"""Model shapes without weights: ``random:NAME`` for planning, what-if profiles and benchmarks.

Built-in shapes (Llama-family configs; the planner needs only the dimensions):

| name       | layers | hidden | intermediate | heads | kv heads | vocab  | context |
|------------|-------:|-------:|-------------:|------:|---------:|-------:|--------:|
| llama-7b   | 32     | 4096   | 11008        | 32    | 32       | 32000  | 4096    |
| llama-13b  | 40     | 5120   | 13824        | 40    | 40       | 32000  | 4096    |
| llama3-8b  | 32     | 4096   | 14336        | 32    | 8        | 128256 | 8192    |
| gpt3-2b    | 32     | 2560   | 6827         | 32    | 32       | 50257  | 2048    |
| llama3.1-8b| 32     | 4096   | 14336        | 32    | 8        | 128256 | 131072  |
| tiny       | 4      | 64     | 128          | 4     | 2        | 512    | 4096    |

``llama3.1-8b`` carries Llama 3.1's rope scaling (factor 8 over an original 8192 positions), for
long-input runs. ``tiny`` exists for tests. A shape may also be given as ``random:PATH`` to a
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


def is_random(spec: str) -> bool:
    return spec.startswith(RANDOM_PREFIX)


def random_config(spec: str) -> ModelConfig:
    """The config of ``random:NAME`` (a built-in shape) or ``random:PATH`` (a config.json)."""
    if not is_random(spec):
        raise ModelSourceError(f"{spec!r} is not a random-weight shape (random:NAME or random:PATH)")
    name = spec[len(RANDOM_PREFIX):]
    if name in SHAPES:
        return ModelConfig.from_dict({**_BASE, **SHAPES[name]})
    if name.endswith(".json") and Path(name).is_file():
        return ModelConfig.from_file(name)
    raise ModelSourceError(f"unknown built-in shape {name!r} (known: {', '.join(SHAPES)}; or random:PATH to a "
                           "config.json)")
