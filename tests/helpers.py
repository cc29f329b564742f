"""Tiny random-weight Hugging Face models of each supported family, and reference forwards."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

FAMILIES = {
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", extra={}),
    "llama3-rope": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", extra=dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-tied-bias": dict(cls="LlamaForCausalLM", cfg="LlamaConfig",
                            extra=dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "mistral-sliding": dict(cls="MistralForCausalLM", cfg="MistralConfig", extra=dict(sliding_window=8)),
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", extra=dict(tie_word_embeddings=False)),
    # q/k norms, a head wider than hidden / heads, sliding layers after the first
    "qwen3-sliding": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", extra=dict(
        head_dim=32, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # a sliding layer between global ones (window shorter than the prompts), each kind its own RoPE,
    # a query scale that is not the head's, the global RoPE scaled linearly (as Gemma 3 4B's is)
    "gemma3": dict(cls="Gemma3ForCausalLM", cfg="Gemma3TextConfig", extra=dict(
        head_dim=32, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
    # Gemma 3 as transformers builds it by default: every sixth layer global (the seven layers give
    # one), one KV head (as the 270M has), the query scaled by the head size, no RoPE scaling
    "gemma3-pattern": dict(cls="Gemma3ForCausalLM", cfg="Gemma3TextConfig", layers=7, extra=dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=16, pad_token_id=0, num_key_value_heads=1)),
    # plain Qwen3 with attention biases (q, k, v and o), untied
    "qwen3-bias": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", extra=dict(
        head_dim=16, attention_bias=True, tie_word_embeddings=False)),
    # LongRoPE past 32 positions (the prompts cross it in decode), fused checkpoint projections
    "phi3-longrope": dict(cls="Phi3ForCausalLM", cfg="Phi3Config", extra=dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + i / 10 for i in range(4)] * 2,
                         "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 32})),
    # Phi-4-mini's partial rotation (three quarters of each head turn), Phi-3-mini-4k's sliding window
    "phi3-partial": dict(cls="Phi3ForCausalLM", cfg="Phi3Config", extra=dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.75, sliding_window=8)),
}


def make_tiny_model(family: str, directory: Path, *, vocab_size: int = 384, layers: int = 3,
                    tokenizer_from: Path | None = None, context: int = 96) -> Path:
    """Save a random-weight model of ``family`` (HF format, safetensors) into ``directory``."""
    import transformers

    spec = FAMILIES[family]
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=spec.get("layers", layers),
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, rms_norm_eps=1e-5,
                 initializer_range=0.3)
    cfg = getattr(transformers, spec["cfg"])(**{**shape, **spec["extra"]})
    torch.manual_seed(1234)
    model = getattr(transformers, spec["cls"])(cfg).eval()
    # Biases start at zero in HF init; make them matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(str(directory))
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, directory / f.name)
    return directory


def hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def run_split(stages, ids: torch.Tensor, slices: list[int], max_len: int) -> torch.Tensor:
    """All-position logits of ``ids`` fed slice by slice through ``stages``."""
    caches = [s.new_cache(ids.shape[0], max_len) for s in stages]
    out, start = [], 0
    for n in slices:
        x = ids[:, start:start + n]
        for stage, cache in zip(stages, caches):
            x = stage(x, start, cache, all_logits=True)
        out.append(x)
        start += n
    return torch.cat(out, dim=1)


def max_rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def need_cpu_kernels() -> None:
    """Go on only where hpipe's CPU kernels are here (built now if they can be): elsewhere skip the
    test, but under CI (``CI=true``) fail it, so a kernel that no longer builds cannot turn the
    kernel and quantized-model tests into skips and CI green."""
    from hpipe.model.kernels import library

    if library.available():
        return
    why = library.build_error() or "unknown error"
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"CI runs the CPU kernels' tests, and the kernels could not be built or loaded: {why}",
                    pytrace=False)
    pytest.skip(f"hpipe's CPU kernels could not be built here: {why}")
