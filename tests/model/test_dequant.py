"""GGUF blocks dequantized by torch operations at each use (a GPU stage's way): ggml's values bit
for bit on every type, and a stage that keeps its blocks computes what the dequantized checkpoint
computes in the same dtype. Run on the CPU here; tests/test_gpu.py runs the same on a GPU."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from hpipe.core.shapes import random_config
from hpipe.core.units import UnitRange, ranges_from_cuts
from hpipe.model.compute import stage as stage_module
from hpipe.model.compute.layers import checkpoint_tensors
from hpipe.model.compute.linear import DequantEmbedding, DequantLinear
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import LocalModel, encode_prompt, generate
from hpipe.model.weights import dequant
from hpipe.model.weights.blocks import TYPES, QuantizedWeight
from hpipe.model.weights.dequant import dequantize, lookup


def _blocks(t: T, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``width`` values in type ``t``: quantized by the gguf package where it
    can, else (the K-quants) random bytes with small scales."""
    try:
        w = rng.standard_normal((rows, width)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(w, t)).view(np.uint8).reshape(rows, -1)
    except NotImplementedError:
        _, values, nbytes = TYPES[int(t)]
        raw = rng.integers(0, 256, size=(rows, width // values, nbytes), dtype=np.uint8)
        scale = np.array([0.01, 0.003], dtype=np.float16).view(np.uint8)
        if t == T.Q6_K:
            raw[:, :, 208:210] = scale[:2]
        else:
            raw[:, :, 0:4] = scale
        return raw.reshape(rows, -1)


@pytest.mark.parametrize("t", [T(i) for i in TYPES], ids=lambda t: t.name)
def test_every_type_dequantizes_as_the_gguf_package_does(t, monkeypatch):
    """Whole matrices (in chunks of rows too) and looked-up rows equal ``gguf.quants.dequantize``."""
    rng = np.random.default_rng(int(t))
    rows, width = 40, 512
    raw = _blocks(t, rows, width, rng)
    ref = torch.from_numpy(quants.dequantize(raw, t).reshape(rows, width).astype(np.float32))
    w = QuantizedWeight.of(int(t), rows, width, torch.from_numpy(raw).reshape(-1))
    assert torch.equal(dequantize(w.data, w.parts.tolist(), width, torch.float32), ref)
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 7 * width)  # chunks of 7 rows, the last of 5
    assert torch.equal(dequantize(w.data, w.parts.tolist(), width, torch.float32), ref)
    assert torch.equal(dequantize(w.data, w.parts.tolist(), width, torch.bfloat16), ref.bfloat16())
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(lookup(w.data, w.parts[0].tolist(), width, torch.float32, ids), ref[ids])


def test_parts_of_different_types_and_a_bias():
    rng = np.random.default_rng(1)
    pieces = [QuantizedWeight.of(int(t), rows, 256, torch.from_numpy(_blocks(t, rows, 256, rng)).reshape(-1))
              for t, rows in ((T.Q4_K, 8), (T.Q6_K, 4), (T.Q8_0, 4))]
    dense = torch.cat([torch.from_numpy(quants.dequantize(p.data.numpy().reshape(p.rows, -1), T(int(p.parts[0, 0]))))
                       .reshape(p.rows, 256) for p in pieces])
    bias = torch.arange(16, dtype=torch.float32)
    layer = DequantLinear(QuantizedWeight.stack(pieces), bias, torch.float32)
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense, bias))
    with pytest.raises(ValueError, match="one type"):
        DequantEmbedding(QuantizedWeight.stack(pieces), torch.float32)


@pytest.fixture
def at_use(monkeypatch):
    """Stages keep their blocks and dequantize at use on the CPU, as they do on a GPU."""
    monkeypatch.setattr(stage_module, "_at_use", lambda device: True)


def test_a_stage_dequantizing_at_use_computes_the_dequantized_checkpoint(smollm2, at_use):
    """SmolLM2's Q4_1 blocks kept as stored, in bfloat16: the logits of the ``--dequantize``
    checkpoint in bfloat16 bit for bit and its greedy tokens, whole and cut inside blocks (a tied
    embedding and head share one table); each stage holds the file's bytes of its units."""
    cfg, store, tok = smollm2.config, smollm2.weights(), smollm2.tokenizer()
    reference = LocalModel(smollm2, dtype=torch.bfloat16, dequantize=True)
    quantized = LocalModel(smollm2, dtype=torch.bfloat16, cuts=(5, 33, 61))
    modules = [m for s in quantized.stages for m in s.modules()]
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in modules)  # no dense copy
    assert sum(isinstance(m, DequantEmbedding) for m in modules) == 1
    assert sum(isinstance(m, DequantLinear) for m in modules) == 4 * smollm2.config.num_layers + 1  # qkv, o, gate_up, down; the head
    ids = torch.tensor([encode_prompt(tok, "The committee met on Tuesday to decide", False)])
    ours, ref = quantized.open(ids.shape[1]), reference.open(ids.shape[1])
    assert torch.equal(ours.prefill(ids, [4, ids.shape[1] - 4]), ref.prefill(ids, [4, ids.shape[1] - 4]))
    prompt = "def fibonacci(n):\n    "
    a = generate(quantized.open, tok, prompt, context=256, eos_ids=[], max_new_tokens=6)
    b = generate(reference.open, tok, prompt, context=256, eos_ids=[], max_new_tokens=6)
    assert a.token_ids == b.token_ids
    for units in ranges_from_cuts([7, 40], cfg.num_layers):
        stage = StageModel.from_checkpoint(store, cfg, units, dtype=torch.bfloat16)
        stored = sum(store.nbytes(n) for n in {n for u in units for n in checkpoint_tensors(cfg, u)})
        assert abs(stage.weight_bytes() - stored) <= 0.1 * stored, units


def test_random_blocks_dequantize_at_use(at_use):
    """The profiler's random units of a block type build on the at-use path too."""
    cfg = random_config("random:tiny")
    stage = StageModel.random(cfg, UnitRange.full(cfg.num_layers), dtype=torch.bfloat16, weight_type=int(T.Q4_1))
    assert any(isinstance(m, DequantLinear) for m in stage.modules())
    assert stage.weight_bytes() < 0.5 * stage.parameter_count() * 2


def test_the_load_check_counts_what_a_stage_will_hold(smollm2, at_use):
    """A daemon's memory check before it loads (runtime.daemon.deployment.weight_bytes) counts the
    file's bytes where the stage keeps its blocks (float32 on the CPU, any GPU stage) and the
    dtype's where a CPU stage dequantizes once; what the built stage holds agrees."""
    from runtime.daemon.deployment import weight_bytes

    cfg, store = smollm2.config, smollm2.weights()
    units = UnitRange(0, 20, cfg.num_layers)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # only the device's type is read
    stored = weight_bytes(cfg, units, torch.float32, cpu, store)
    assert weight_bytes(cfg, units, torch.bfloat16, gpu, store) == weight_bytes(cfg, units, torch.float16, gpu, store) \
        == stored
    dense = weight_bytes(cfg, units, torch.bfloat16, cpu, store)
    assert stored < 0.5 * dense
    held = StageModel.from_checkpoint(store, cfg, units, dtype=torch.bfloat16).weight_bytes()  # at use, as on a GPU
    assert abs(held - stored) <= 0.02 * stored
