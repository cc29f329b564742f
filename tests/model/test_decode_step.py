"""The static one-token step behind CUDA-graph decoding equals the ordinary forward (run eagerly here)."""

import pytest
import torch

from hpipe.core.units import ranges_from_cuts
from hpipe.model import StageModel
from hpipe.model.graphs import DecodeStep
from hpipe.model.sources import resolve_model
from tests.helpers import FAMILIES, max_rel_diff


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_decode_step_equals_forward(family, tiny_dirs):
    source = resolve_model(str(tiny_dirs[family]))
    cfg, store = source.config, source.weights()
    stages = [StageModel.from_checkpoint(store, cfg, r) for r in ranges_from_cuts([2, 5], cfg.num_layers)]
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    max_len = 24  # longer than mistral-sliding's window of 8, so decoding slides past it
    eager = [s.new_cache(2, max_len) for s in stages]
    static = [s.new_cache(2, max_len) for s in stages]
    steps = [DecodeStep(s, c, graph=False) for s, c in zip(stages, static)]
    for caches in (eager, static):  # the same prefill into both sets of caches
        x = prompt
        for stage, cache in zip(stages, caches):
            x = stage(x, 0, cache)
    token = x[:, -1].argmax(-1, keepdim=True)
    for pos in range(9, max_len):
        a = b = token
        for stage, cache in zip(stages, eager):
            a = stage(a, pos, cache)
        for step in steps:
            b = step(b, pos)
        assert b.shape == a.shape and max_rel_diff(b, a) <= 1e-5, (family, pos)
        token = a[:, -1].argmax(-1, keepdim=True)
    assert all(c.length == max_len for c in static)
