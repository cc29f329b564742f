import pytest

from hpipe.core.config import ModelConfig
from hpipe.core.errors import UnsupportedModelError

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_transformers4_rope_layout():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert cfg.rope.type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.head_dim == 16 and cfg.num_units == 6


def test_transformers5_rope_layout():
    cfg = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
    assert cfg.rope.type == "default" and cfg.rope.theta == 1e5


def test_unsupported_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_is_named():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_family_specifics():
    qwen = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                  "sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_windows == (None, 4)
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                     "sliding_window": 16})
    assert mistral.sliding_windows == (16, 16)
    llama = ModelConfig.from_dict({**BASE, "attention_bias": True, "sliding_window": 16})
    assert llama.qkv_bias and llama.o_bias and llama.sliding_windows == (None, None)


def test_config_to_dict_round_trips_every_family_and_shape(tiny_dirs):
    """Daemons rebuild the model's shape from ModelConfig.to_dict: it must lose nothing that changes the work."""
    from hpipe.core.config import ModelConfig
    from hpipe.core.shapes import SHAPES
    from hpipe.model.weights.sources import model_shape

    configs = [ModelConfig.from_file(d / "config.json") for d in tiny_dirs.values()]
    configs += [model_shape(f"random:{name}")[1] for name in SHAPES]
    for cfg in configs:
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg, cfg.architecture
