"""``hpipe model make``: random-weight GGUF files of named shapes that hpipe (and llama.cpp) run.

The references are outside hpipe: the gguf package's reader and dequantizers (llama.cpp's own
Python) for the blocks, and transformers' GGUF import (the ``--dequantize`` model) for the logits."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from hpipe.core.errors import InputError
from hpipe.core.shapes import SHAPES, random_config
from hpipe.model.generate.local import LocalModel, encode_prompt, generate
from hpipe.model.weights.random_gguf import (
    F32,
    Q4_K,
    Q5_0,
    Q6_K,
    Q8_0,
    STD,
    Spec,
    make,
    pack_k4_scales,
    random_blocks,
    tensors,
    use_more_bits,
)
from hpipe.model.weights.sources import resolve_model
from tests.helpers import max_rel_diff

#: a shape whose rows are whole blocks of 256, so the K-quants are written (not their fallbacks)
TINY_K = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)


def test_a_spec_names_a_shape_and_a_type():
    assert Spec.parse("random:llama3-8b@Q4_K_M") == Spec("llama3-8b", "q4_k_m")
    with pytest.raises(InputError, match="unknown shape 'llama9'.*built-in shapes: "):
        Spec.parse("random:llama9@q4_k_m")
    with pytest.raises(InputError, match="name a weight type after '@'"):
        Spec.parse("random:llama3-8b")


def test_k4_scales_pack_as_ggml_unpacks_them():
    rng = np.random.default_rng(0)
    sc, m = rng.integers(0, 64, (50, 8), dtype=np.uint8), rng.integers(0, 64, (50, 8), dtype=np.uint8)
    got_sc, got_m = gguf.quants.Q4_K.get_scale_min(pack_k4_scales(sc, m))
    assert (got_sc == sc).all() and (got_m == m).all()


@pytest.mark.parametrize("ggml_type", [Q4_K, Q6_K, Q8_0, Q5_0])
def test_random_blocks_are_centred_weights_of_about_the_random_models_size(ggml_type):
    """Dequantized by the gguf package: mean about 0 (Q5_0 and Q6_K sit half a step below: an even
    number of levels), standard deviation about 0.02, and each
    block's scales vary (a kernel reading the wrong scale would not go unseen)."""
    blocks = random_blocks(ggml_type, 64, 1024, np.random.default_rng(1))
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type))
    assert values.shape == (64, 1024)
    assert abs(values.mean()) < 0.1 * STD and 0.8 * STD < values.std() < 1.3 * STD
    if ggml_type in (Q4_K, Q6_K):  # each sub-block (32 values, Q6_K's 16) its own scale
        spread = values.reshape(-1, 32 if ggml_type == Q4_K else 16).std(axis=1)
        assert spread.std() > 0.2 * spread.mean()


def test_q4_k_m_keeps_llama_quantizes_layers_at_six_bits():
    """llama.cpp's mix: the output matrix, and attn_v and ffn_down in the first and last eighth and
    every third layer between, at Q6_K; the rest Q4_K; norms float32. (Checked once against
    llama-quantize's Q4_K_M of an F16 file of random:llama3.2-1b: every one of the 146 tensors'
    types the same.)"""
    cfg = random_config("random:llama3-8b")
    types = {name: t for name, _, t in tensors(cfg, "q4_k_m", 49152)}
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert types["output.weight"] == Q6_K and types["token_embd.weight"] == Q4_K
    assert all(types[f"blk.{i}.attn_v.weight"] == (Q6_K if i in more else Q4_K) for i in range(32))
    assert all(types[f"blk.{i}.ffn_down.weight"] == (Q6_K if i in more else Q4_K) for i in range(32))
    assert all(types[f"blk.{i}.attn_q.weight"] == Q4_K and types[f"blk.{i}.ffn_norm.weight"] == F32
               for i in range(32))
    tied = {name: t for name, _, t in tensors(random_config("random:llama3.2-1b"), "q4_k_m", 49152)}
    assert "output.weight" not in tied and tied["token_embd.weight"] == Q6_K  # the head is the embedding


@pytest.fixture(scope="module")
def tiny_k_file(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SHAPES, "tiny-k", TINY_K)
        return make(Spec.parse("random:tiny-k@q4_k_m"), tmp_path_factory.mktemp("random") / "tiny-k.gguf")


def test_the_file_is_the_shape_with_a_real_tokenizer(tiny_k_file):
    reader = gguf.GGUFReader(tiny_k_file)
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType(t) for t in (F32, Q4_K, Q6_K)}
    source = resolve_model(str(tiny_k_file))
    cfg = source.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (256, 512, 3, 4, 2)
    assert cfg.vocab_size == 49152  # SmolLM2's vocabulary, not the shape's 512
    assert source.tokenizer()("The committee met on Tuesday")["input_ids"] == \
        resolve_model("smollm2-135m").tokenizer()("The committee met on Tuesday")["input_ids"]


def test_hpipe_computes_the_file_as_transformers_reads_it(tiny_k_file):
    """hpipe's K-quant kernels on the file's blocks give the logits and greedy tokens of
    transformers' float32 import of the same file (the --dequantize model), whole and cut."""
    source = resolve_model(str(tiny_k_file))
    tok = source.tokenizer()
    reference = LocalModel(source, dequantize=True)
    ids = torch.tensor([encode_prompt(tok, "The committee met on Tuesday to decide", False)])
    for cuts in ((), (2, 5)):
        ours = LocalModel(source, cuts=cuts)
        a = ours.open(ids.shape[1]).prefill(ids, [ids.shape[1]])
        b = reference.open(ids.shape[1]).prefill(ids, [ids.shape[1]])
        assert torch.isfinite(a).all() and max_rel_diff(a, b) <= 1e-4, cuts
        x = generate(ours.open, tok, "def fibonacci(n):", context=256, eos_ids=[], max_new_tokens=12)
        y = generate(reference.open, tok, "def fibonacci(n):", context=256, eos_ids=[], max_new_tokens=12)
        assert x.token_ids == y.token_ids, cuts


def test_a_made_file_is_made_once(tiny_k_file):
    before = tiny_k_file.stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SHAPES, "tiny-k", TINY_K)
        assert make(Spec.parse("random:tiny-k@q4_k_m"), tiny_k_file) == tiny_k_file
    assert tiny_k_file.stat().st_mtime_ns == before
    assert not list(tiny_k_file.parent.glob(".*.part"))


def test_the_command_names_what_is_wrong(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hpipe.app.cli", "model", "make", "random:llama9@q4_k_m",
                          "-o", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert out.returncode != 0 and "unknown shape 'llama9'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "x.gguf").exists()
