"""The static decode step behind CUDA-graph decoding equals the ordinary micro-batch forward (run
eagerly here): sequences of different lengths, padded to a bucket, one sliding past its window."""

import pytest
import torch

from hpipe.core.units import ranges_from_cuts
from hpipe.model.compute.graphs import DecodeGraphs
from hpipe.model.compute.stage import StageModel
from hpipe.model.kv.pool import Entry
from hpipe.model.weights.sources import resolve_model
from tests.helpers import FAMILIES, max_rel_diff


@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_decode_step_equals_forward(family, tiny_dirs):
    source = resolve_model(str(tiny_dirs[family]))
    cfg, store = source.config, source.weights()
    stages = [StageModel.from_checkpoint(store, cfg, r) for r in ranges_from_cuts([2, 5], cfg.num_layers)]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (9, 4, 13)]
    max_len = 30  # longer than mistral-sliding's window of 8, so decoding slides past it
    pools = {k: [s.new_pool(24) for s in stages] for k in ("eager", "static")}
    seqs = {k: [[p.sequence(max_len) if p else None for p in pools[k]] for _ in prompts] for k in pools}
    steps = [DecodeGraphs(s, p, graph=False) for s, p in zip(stages, pools["static"])]

    for kind in pools:  # the same prefill (one micro-batch of three prompts) into both sets of pools
        x = torch.cat(prompts)
        for j, stage in enumerate(stages):
            es = []
            for row, p in zip(seqs[kind], prompts):
                if row[j] is not None:
                    row[j].grow(len(p))
                es.append(Entry(0, len(p), row[j], "last"))
            x = stage.forward_batch(x, es, pools[kind][j])
    tokens = x.argmax(-1)
    positions = [len(p) for p in prompts]
    for _ in range(max_len - max(positions)):
        a = b = tokens
        for j, stage in enumerate(stages):
            for kind in pools:
                for row, pos in zip(seqs[kind], positions):
                    if row[j] is not None:
                        row[j].grow(pos + 1)
            ea = [Entry(pos, 1, row[j], "last") for row, pos in zip(seqs["eager"], positions)]
            eb = [Entry(pos, 1, row[j], "last") for row, pos in zip(seqs["static"], positions)]
            assert DecodeGraphs.fits(eb) or pools["static"][j] is None
            a = stage.forward_batch(a, ea, pools["eager"][j])
            b = steps[j](b, eb) if pools["static"][j] is not None else stage.forward_batch(b, eb, None)
        assert b.shape == a.shape and max_rel_diff(b, a) <= 1e-5, (family, positions)
        tokens = a.argmax(-1)
        positions = [p + 1 for p in positions]


def test_a_static_step_of_a_full_bucket_reads_no_garbage(tiny_dirs, monkeypatch):
    """The keys and values a static step gathers for masked positions come from the pool's padding
    block; with no padded row to write it (two entries: a full bucket), it must still hold numbers.
    A pool's memory may be reused (a layout switch frees pools and loads others): here every new
    tensor starts as NaN, and the step still equals the ordinary forward."""
    source = resolve_model(str(tiny_dirs["llama"]))
    cfg, store = source.config, source.weights()
    stage = StageModel.from_checkpoint(store, cfg, ranges_from_cuts([], cfg.num_layers)[0])
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    pools = [stage.new_pool(8), stage.new_pool(8)]
    monkeypatch.setattr(torch, "empty", empty)
    prompts = [torch.tensor([5, 9, 2]), torch.tensor([7, 1, 4, 4, 8])]
    seqs = [[p.sequence(16) for p in pools] for _ in prompts]
    for k, pool in enumerate(pools):
        es = []
        for row, p in zip(seqs, prompts):
            row[k].grow(len(p))
            es.append(Entry(0, len(p), row[k], "last"))
        x = stage.forward_batch(torch.cat(prompts), es, pool)
    tokens = x.argmax(-1)
    for row, p in zip(seqs, prompts):
        for kv in row:
            kv.grow(len(p) + 1)
    ordinary = stage.forward_batch(tokens, [Entry(len(p), 1, row[0], "last") for row, p in zip(seqs, prompts)], pools[0])
    static = DecodeGraphs(stage, pools[1], graph=False)(tokens, [Entry(len(p), 1, row[1], "last")
                                                                  for row, p in zip(seqs, prompts)])
    assert torch.isfinite(static).all() and max_rel_diff(static, ordinary) <= 1e-5
