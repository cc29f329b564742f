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
