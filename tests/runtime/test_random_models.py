"""random:NAME models run for real: each daemon creates its own units' weights, any split is one model."""

import pytest
import torch

from hpipe.app.cli import main
from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import LocalRunner, decode_loop
from hpipe.model.generate.sampling import Sampler
from hpipe.model.weights.sources import model_shape
from runtime.coordinator.pipeline import Pipeline, RemoteRunner, cut_stages
from tests.cluster_helpers import Served, cluster_of

PROMPT = [5, 17, 99, 3, 250, 7, 64, 11, 400, 2, 31, 8]
SLICES = [5, 7]
NEW = 10


def reference_tokens(cfg, dtype=torch.float32):
    whole = StageModel.random(cfg, UnitRange.full(cfg.num_layers), dtype=dtype)
    out, *_ = decode_loop(LocalRunner([whole], len(PROMPT) + NEW), PROMPT, max_new_tokens=NEW, sampler=Sampler(),
                          eos_ids=[], slices=SLICES)
    return out


def test_random_model_split_over_daemons_equals_one_process():
    _, cfg = model_shape("random:tiny")
    daemons = [Served(f"d{i}") for i in range(3)]
    pipe = Pipeline(cluster_of(*daemons))
    try:
        # 3: attn_1 | mlp_1
        stages = pipe.load("random:tiny", cut_stages(pipe.cluster, [3, 6], cfg.num_units), torch.float32)
        assert [(s.units.start, s.units.end) for s in stages] == [(0, 3), (3, 6), (6, 10)]
        with pipe.open(len(PROMPT) + NEW) as seq:
            out, *_ = decode_loop(RemoteRunner(seq), PROMPT, max_new_tokens=NEW, sampler=Sampler(), eos_ids=[],
                                  slices=SLICES)
    finally:
        pipe.close()
        for d in daemons:
            d.stop()
    assert out == reference_tokens(cfg)


def test_unknown_shape_is_refused_by_the_daemon():
    d = Served("d")
    pipe = Pipeline(cluster_of(d))
    try:
        with pytest.raises(Exception, match="unknown built-in shape 'nope'"):
            pipe.load("random:nope", cut_stages(pipe.cluster, [], 10), torch.float32)
    finally:
        pipe.close()
        d.stop()


def test_generate_refuses_a_random_model(capsys):
    assert main(["generate", "--model", "random:tiny", "--prompt", "hi"]) == 1
    assert "random-weight shape" in capsys.readouterr().err


#: a shape whose rows are whole blocks of 256 (the K-quants' own kernels, no fallback)
TINY_K = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture
def tiny_k(monkeypatch):
    from hpipe.core.shapes import SHAPES

    monkeypatch.setitem(SHAPES, "tiny-k", TINY_K)
    return "random:tiny-k@q4_k_m"


def test_a_quantized_random_shape_runs_on_daemons_as_one_process_runs_its_blocks(tiny_k):
    """``random:SHAPE@q4_k_m`` without a file: each daemon makes its units' Q4_K/Q6_K blocks only, and
    the pipeline gives the tokens of one process holding them all."""
    from hpipe.model.weights.random_blocks import RandomBlocks

    _, cfg = model_shape(tiny_k)
    store = RandomBlocks(tiny_k, cfg)
    whole = StageModel.from_checkpoint(store, cfg, UnitRange.full(cfg.num_layers), dtype=torch.float32)
    dense = StageModel.random(cfg, UnitRange.full(cfg.num_layers)).weight_bytes()
    assert whole.weight_bytes() < dense / 4  # the blocks, not float32 (Q4_K: 4.5 bits a weight)
    expected, *_ = decode_loop(LocalRunner([whole], len(PROMPT) + NEW), PROMPT, max_new_tokens=NEW,
                               sampler=Sampler(), eos_ids=[], slices=SLICES)
    daemons = [Served(f"d{i}") for i in range(2)]
    pipe = Pipeline(cluster_of(*daemons))
    try:
        stages = pipe.load(tiny_k, cut_stages(pipe.cluster, [4], cfg.num_units), torch.float32)
        with pipe.open(len(PROMPT) + NEW) as seq:
            out, *_ = decode_loop(RemoteRunner(seq), PROMPT, max_new_tokens=NEW, sampler=Sampler(), eos_ids=[],
                                  slices=SLICES)
        held = [d.stage.weight_bytes for d in daemons]
    finally:
        pipe.close()
        for d in daemons:
            d.stop()
    assert out == expected
    units = [s.units for s in stages]
    from runtime.daemon.deployment import weight_bytes

    assert held == [weight_bytes(cfg, u, torch.float32, torch.device("cpu"), store) for u in units]


def test_a_quantized_random_shapes_layers_are_the_made_files_bytes(tiny_k, tmp_path):
    from hpipe.model.weights.random_blocks import RandomBlocks
    from hpipe.model.weights.random_gguf import Spec, make
    from hpipe.model.weights.sources import resolve_model

    _, cfg = model_shape(tiny_k)
    file = resolve_model(str(make(Spec.parse(tiny_k), tmp_path / "tiny-k.gguf"))).weights()
    names = [n for n in file.names() if n.startswith("model.layers.")]
    ours, theirs = RandomBlocks(tiny_k, cfg).load(names), file.load(names)
    for n in names:
        a, b = ours[n], theirs[n]
        a, b = (x.dequantize() if hasattr(x, "dequantize") else x for x in (a, b))
        assert torch.equal(a, b), n


def test_a_what_if_quantization_is_still_refused_by_daemons():
    from hpipe.core.errors import StatusError
    from runtime.daemon.deployment import model_config

    with pytest.raises(StatusError, match="what-if profiles"):
        model_config("random:tiny@q4_0")
    assert model_config("random:tiny@q8_0") == model_config("random:tiny")
