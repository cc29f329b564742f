"""The model's shape, read from its own Hugging Face ``config.json`` (never guessed from a name).

One frozen dataclass describes every model we run: Llama 2/3 (with Llama 3 rope scaling), Mistral
(sliding window), Qwen2 (qkv bias, optional sliding layers), SmolLM2 (tied embeddings), Qwen3
(q/k norms), Phi-3 (fused checkpoint projections, LongRoPE, partial rotary) and Gemma 3 (q/k norms,
norms after attention and MLP, ``(1 + weight)`` norms, GeGLU, scaled embeddings, its own query
scale, sliding layers with a RoPE of their own). Each family's traits are read from its config's
keys and its architecture, never from a model's name. Both the transformers 4 layout
(``rope_theta`` + ``rope_scaling``) and the 5 layout (``rope_parameters``, per layer type for
Gemma 3) are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: Gemma 3's layer kinds, the keys of its per-kind ``rope_parameters``
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    #: LongRoPE (Phi-3): per-frequency divisors below and from ``original_max_position_embeddings``
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    #: LongRoPE's factor on cos and sin (1.0 for the other types)
    attention_factor: float = 1.0
    #: the share of each head that is rotated (its leading dimensions); the rest passes through
    partial_rotary_factor: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        if self.type == "longrope":
            out.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor),
                       attention_factor=self.attention_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out


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
    #: the RoPE of the sliding layers where it differs from ``rope`` (Gemma 3), else None
    local_rope: RopeConfig | None = None
    #: the MLP's gate activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU)
    hidden_act: str = "silu"
    #: queries are scaled by this to the power -1/2 (Gemma 3's ``query_pre_attn_scalar``; None: head_dim)
    query_pre_attn_scalar: float | None = None

    @property
    def family(self) -> str:
        """``llama`` (Llama, Mistral, Qwen2), ``qwen3``, ``phi3`` or ``gemma3``: what decides the units'
        structure and the checkpoint's tensor names."""
        return {"Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
                "Gemma3ForCausalLM": "gemma3"}.get(self.architecture, "llama")

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normed per head before the rotary embedding."""
        return self.family in ("qwen3", "gemma3")

    @property
    def sandwich_norms(self) -> bool:
        """Whether attention and MLP outputs are normed again before the residual add (Gemma 3)."""
        return self.family == "gemma3"

    @property
    def norm_offset(self) -> float:
        """What a norm's effective weight adds to the checkpoint's (Gemma's ``1 + weight``)."""
        return 1.0 if self.family == "gemma3" else 0.0

    @property
    def embed_scale(self) -> float:
        """The factor on the embedding's output (Gemma: the square root of the hidden size)."""
        return self.hidden_size ** 0.5 if self.family == "gemma3" else 1.0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_of(self, layer: int) -> RopeConfig:
        """The RoPE of ``layer``: the sliding layers' own where the model has one."""
        return self.local_rope if self.local_rope is not None and self.sliding_windows[layer] else self.rope

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ModelSourceError(f"config.json: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise UnsupportedModelError("one sliding window entry per layer is required")
        for rope in (self.rope, self.local_rope):
            rotated = int(self.head_dim * rope.partial_rotary_factor) if rope else 0
            if rope and (rotated <= 0 or rotated % 2):
                raise UnsupportedModelError(f"a rotary embedding turns pairs of dimensions: {rotated} of a head's "
                                            f"{self.head_dim} cannot be turned")
            if rope and rope.type == "longrope" and not len(rope.short_factor) == len(rope.long_factor) == rotated // 2:
                raise ModelSourceError(f"config.json: longrope's short_factor and long_factor need {rotated // 2} "
                                       f"entries each (half the {rotated} rotated dimensions of a head)")

    @property
    def block_weights(self) -> int:
        """Matrix entries of one block (its attention's and its MLP's projections)."""
        return (self.hidden_size * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
                + self.num_heads * self.head_dim * self.hidden_size + 3 * self.hidden_size * self.intermediate_size)

    @property
    def num_units(self) -> int:
        """embed + (attn, mlp) per layer + head."""
        return num_units(self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        """This config as a Hugging Face ``config.json`` dict: ``from_dict(c.to_dict()) == c``.

        The one serialisation of a model's shape: plans and profiles store it, and daemons asked to
        profile or time a shape rebuild it from it."""
        windows = [w for w in self.sliding_windows if w is not None]
        rope = self.rope.to_dict()
        if self.local_rope is not None:
            rope = {FULL: rope, SLIDING: self.local_rope.to_dict()}
        out = {
            "architectures": [self.architecture], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias, "mlp_bias": self.mlp_bias, "hidden_act": self.hidden_act,
        }
        if self.query_pre_attn_scalar is not None:
            out["query_pre_attn_scalar"] = self.query_pre_attn_scalar
        if windows:
            out["sliding_window"] = windows[0]
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.sliding_windows]
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(raw, Mapping):
            raise ModelSourceError(f"config.json is not a mapping of keys (found {type(raw).__name__})")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs) \
                or not isinstance(raw.get("model_type", ""), (str, type(None))):
            raise ModelSourceError("config.json: architectures is a list of names, model_type a name")
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
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"{arch}: hidden_act {act!r} is not supported "
                                        f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        _refuse_unsupported_options(raw, arch)
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
                rope=_rope_from_dict(raw, arch, FULL),
                local_rope=_rope_from_dict(raw, arch, SLIDING) if arch == "Gemma3ForCausalLM" else None,
                hidden_act=act,
                query_pre_attn_scalar=(float(raw.get("query_pre_attn_scalar") or 256)
                                       if arch == "Gemma3ForCausalLM" else None),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                o_bias=(arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
                        and bool(raw.get("attention_bias", False))),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_windows=_sliding_windows(raw, arch, layers),
            )
        except KeyError as e:
            raise ModelSourceError(f"config.json lacks the required key {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as e:
            raise ModelSourceError(f"config.json has a value of the wrong kind ({e})") from None
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


def _refuse_unsupported_options(raw: Mapping[str, Any], arch: str) -> None:
    """A config option that would change the arithmetic and that hpipe does not implement: an error
    naming it, at load (never a model that runs and answers wrongly)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise UnsupportedModelError(f"{arch}: {key} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{arch}: use_bidirectional_attention is not supported")


def _rope_from_dict(raw: Mapping[str, Any], arch: str, kind: str) -> RopeConfig:
    """The RoPE of the ``kind`` layers (Gemma 3 keeps one per kind; the others one for all)."""
    params = dict(raw.get("rope_parameters") or {})
    if FULL in params or SLIDING in params:  # transformers 5, one entry per layer kind
        params = dict(params.get(kind) or {})
    elif arch == "Gemma3ForCausalLM" and kind == SLIDING:  # transformers 4: a base and no scaling
        params = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    else:
        params = {**dict(raw.get("rope_scaling") or {}), **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and arch != "Phi3ForCausalLM":
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 is not supported")
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    rope = RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=(int(original) if original is not None and rope_type in ("llama3", "longrope")
                                          else None),
        partial_rotary_factor=partial,
    )
    return _longrope(rope, params, raw, arch) if rope_type == "longrope" else rope


def _longrope(rope: RopeConfig, params: Mapping[str, Any], raw: Mapping[str, Any], arch: str) -> RopeConfig:
    """LongRoPE's factor lists and its attention factor, as transformers computes them."""
    original = rope.original_max_position_embeddings
    try:
        short, long = tuple(float(f) for f in params["short_factor"]), tuple(float(f) for f in params["long_factor"])
    except (KeyError, TypeError, ValueError):
        raise UnsupportedModelError(f"{arch}: longrope needs short_factor and long_factor lists") from None
    if not original:
        raise UnsupportedModelError(f"{arch}: longrope needs original_max_position_embeddings")
    attention = params.get("attention_factor")
    if attention is None:
        factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dataclasses.replace(rope, short_factor=short, long_factor=long, attention_factor=float(attention))


def _sliding_windows(raw: Mapping[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return (None,) * layers
    if arch == "Gemma3ForCausalLM" and not raw.get("layer_types"):  # transformers 4: every sixth is global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % pattern == 0 else int(window) for i in range(layers))
    window = int(window)
    layer_types = raw.get("layer_types")
    if layer_types:
        if len(layer_types) != layers:
            raise ModelSourceError("config.json: layer_types must have one entry per layer")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False):
            return (None,) * layers
        first = int(raw.get("max_window_layers", layers))
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers  # Mistral: every layer
