"""The model's shape, read from its own Hugging Face ``config.json`` (never guessed from a name).

One frozen dataclass describes every Llama-family model we run: Llama 2/3 (with Llama 3 rope
scaling), Mistral (sliding window), Qwen2 (qkv bias, optional sliding layers) and SmolLM2 (tied
embeddings). Both the transformers 4 layout (``rope_theta`` + ``rope_scaling``) and the 5 layout
(``rope_parameters``) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hpipe.core.errors import ModelSourceError, UnsupportedModelError
from hpipe.core.units import num_units

#: architectures (config.json ``architectures[0]``) and the ``model_type`` each must carry.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    #: attention window per layer; None means full causal attention.
    sliding_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise UnsupportedModelError("one sliding window entry per layer is required")

    @property
    def num_units(self) -> int:
        """embed + (attn, mlp) per layer + head."""
        return num_units(self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        """This config as a Hugging Face ``config.json`` dict: ``from_dict(c.to_dict()) == c``.

        The one serialisation of a model's shape: plans and profiles store it, and daemons asked to
        profile or time a shape rebuild it from it."""
        windows = [w for w in self.sliding_windows if w is not None]
        rope: dict[str, Any] = {"rope_type": self.rope.type, "rope_theta": self.rope.theta}
        if self.rope.type in ("linear", "llama3"):
            rope["factor"] = self.rope.factor
        if self.rope.type == "llama3":
            rope.update(low_freq_factor=self.rope.low_freq_factor, high_freq_factor=self.rope.high_freq_factor,
                        original_max_position_embeddings=self.rope.original_max_position_embeddings)
        out = {
            "architectures": [self.architecture], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias,
        }
        if windows:
            out["sliding_window"] = windows[0]
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.sliding_windows]
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        model_type = raw.get("model_type")
        if arch is None:
            # Some exports omit "architectures"; the model_type still tells the family.
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(model_type)
            if arch is None:
                raise UnsupportedModelError(
                    f"unsupported architecture: model_type {model_type!r} "
                    f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
                )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            cfg = cls(
                architecture=arch,
                model_type=SUPPORTED_ARCHITECTURES[arch],
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_dict(raw, arch),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                o_bias=arch == "LlamaForCausalLM" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_windows=_sliding_windows(raw, arch, layers),
            )
        except KeyError as e:
            raise ModelSourceError(f"config.json lacks the required key {e.args[0]!r}") from None
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelSourceError(f"{path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ModelSourceError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)


def _rope_from_dict(raw: Mapping[str, Any], arch: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _sliding_windows(raw: Mapping[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return (None,) * layers
    window = int(window)
    layer_types = raw.get("layer_types")
    if layer_types:
        if len(layer_types) != layers:
            raise ModelSourceError("config.json: layer_types must have one entry per layer")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window", False):
            return (None,) * layers
        first = int(raw.get("max_window_layers", layers))
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers  # Mistral: every layer
