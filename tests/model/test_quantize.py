"""--quantize: a safetensors checkpoint's matrices in GGUF blocks, made once, computed on as a GGUF's."""

import json

import numpy as np
import pytest
import torch

from hpipe.core.errors import InputError, ModelSourceError
from hpipe.model.generate.local import LocalModel
from hpipe.model.weights.blocks import QuantizedWeight
from hpipe.model.weights.quantize import KINDS, Q5_0, quantize_matrix, quantized_dir
from hpipe.model.weights.sources import ModelSource, quantized_model, resolve_model

RNG = np.random.default_rng(7)
pytestmark = pytest.mark.usefixtures("cpu_kernels")  # a failure under CI without them


@pytest.mark.parametrize("kind", list(KINDS))
def test_blocks_read_back_as_the_gguf_package_reads_them(kind):
    x = (RNG.standard_normal((12, 512)) * 0.05).astype(np.float32)
    x[3, :40] = 0.0  # an all-zero sub-block, and one all positive below
    x[5, 256:288] = np.abs(x[5, 256:288]) + 0.01
    t, data = quantize_matrix(x, KINDS[kind])
    assert t == KINDS[kind]
    from gguf import GGMLQuantizationType, quants

    reference = quants.dequantize(np.frombuffer(data, np.uint8).reshape(12, -1), GGMLQuantizationType(t))
    ours = QuantizedWeight.of(t, 12, 512, torch.frombuffer(bytearray(data), dtype=torch.uint8)).dequantize()
    assert torch.equal(ours, torch.from_numpy(reference.copy()))  # the kernels read what ggml would
    err = np.linalg.norm(reference - x) / np.linalg.norm(x)
    assert err < {"q8_0": 0.01, "q4_0": 0.12, "q4_k": 0.1}[kind], err
    assert np.all(reference[3, :32] == 0.0)


def test_widths_the_type_cannot_hold_fall_back():
    x = (RNG.standard_normal((4, 96)) * 0.05).astype(np.float32)
    assert quantize_matrix(x, KINDS["q4_k"])[0] == Q5_0  # 96 is not a multiple of 256 (llama-quantize's choice)
    t, data = quantize_matrix(np.ones((2, 40), np.float32), KINDS["q8_0"])  # nor of 32: kept as float32
    assert t == 0 and len(data) == 2 * 40 * 4


def test_a_quantized_model_computes_near_the_float_one_and_is_made_once(tiny_chat_model):
    source = resolve_model(str(tiny_chat_model))
    ids = torch.tensor([[1, 5, 9, 33, 200, 7, 81, 12]])
    ref = LocalModel(source).open(16).prefill(ids, [8])
    path = quantized_model(str(tiny_chat_model), "q8_0")
    q = resolve_model(path)
    assert q.gguf is not None and q.tokenizer() is not None and q.held_weights()["weight_bits"] < 16
    index = json.loads((q.path / "tensors.json").read_text())
    assert index["architecture"] == "hf"
    for name, e in index["tensors"].items():  # matrices in Q8_0 (float32 where the width is not a multiple of 32)
        want = 0 if len(e["shape"]) == 1 or e["shape"][1] % 32 else KINDS["q8_0"]
        assert e["type"] == want, (name, e)
    stage = LocalModel(q)
    out = stage.open(16).prefill(ids, [8])  # the last position's logits
    assert torch.nn.functional.cosine_similarity(out, ref, dim=0) > 0.999
    assert out.argmax() == ref.argmax()
    # the blocks are held, not float copies: the stage's weights are about a quarter of float32's
    assert stage.stages[0].weight_bytes() < 0.4 * LocalModel(source).stages[0].weight_bytes()
    mtime = (q.path / "weights.bin").stat().st_mtime_ns
    assert quantized_model(str(tiny_chat_model), "q8_0") == path and \
        (q.path / "weights.bin").stat().st_mtime_ns == mtime  # made once
    with pytest.raises(ModelSourceError, match="quantized by --quantize"):
        q.weights(dequantize=True)


def test_what_cannot_be_quantized_is_refused(smollm2, tiny_chat_model):
    with pytest.raises(InputError, match="quantized already"):
        quantized_dir(smollm2, "q8_0")
    with pytest.raises(InputError, match="choose one of"):
        quantized_dir(ModelSource("x", tiny_chat_model), "q2_k")


def test_the_commands_take_quantize(tiny_chat_model, capsys, tmp_path):
    from hpipe.app.cli import main

    assert main(["generate", "--model", str(tiny_chat_model), "--quantize", "q4_0", "--prompt", "Hello there",
                 "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "-q4_0-" in out["model"] and len(out["token_ids"]) == 4
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    assert main(["run", "--plan", str(plan), "--quantize", "q8_0", "--instruction", "x", str(plan)]) != 0
    assert "--quantize goes with --model" in capsys.readouterr().err
