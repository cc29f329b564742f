"""A micro-batch of many sequences gives each one the logits it gets alone.

SmolLM2, one stage: nine sequences of different lengths in one KV pool; one micro-batch mixes
prefill chunks (of different sizes, some the first of their sequence) with decode tokens.
"""

import pytest
import torch

from hpipe.core.errors import ModelSourceError
from hpipe.core.units import UnitRange
from hpipe.model import StageModel
from hpipe.model.kvpool import Entry, KVPool
from hpipe.model.quant import set_prefill_gemm

PROMPTS = [37, 5, 120, 64, 9, 200, 17, 90, 3]   # tokens already in each sequence's cache
NEXT = [1, 16, 1, 33, 1, 1, 40, 1, 8]           # what the mixed micro-batch adds (1: a decode token)


@pytest.fixture(params=["float32", "bfloat16"])
def prefill_gemm(request):
    """Both precisions of the quantized prefill (bfloat16 skipped where the CPU lacks it)."""
    try:
        before = set_prefill_gemm(request.param)
    except ModelSourceError as e:
        pytest.skip(str(e))
    yield request.param
    set_prefill_gemm(before)


def test_mixed_micro_batch_equals_each_sequence_alone(smollm2, prefill_gemm):
    """With the prefill in bfloat16 too: a row's precision is its entry's (decode tokens float32,
    prefill slices bfloat16), never the micro-batch's, so what shares a micro-batch changes nothing."""
    cfg = smollm2.config
    stage = StageModel.from_checkpoint(smollm2.weights(), cfg, UnitRange.full(cfg.num_layers))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.vocab_size, (p + n,), generator=gen) for p, n in zip(PROMPTS, NEXT)]
    # alone: each sequence in its own cache, prompt then its next tokens
    alone = []
    for x, p in zip(ids, PROMPTS):
        cache = stage.new_cache(1, len(x))
        if p:
            stage(x[None, :p], 0, cache, logits=False)
        alone.append(stage(x[None, p:], p, cache)[0, -1])
    # together: one shared pool; the prompts in two micro-batches, then one mixing every kind of entry
    pool = KVPool(UnitRange.full(cfg.num_layers).attention_layers(), 400, cfg.num_kv_heads, cfg.head_dim,
                  stage.dtype, stage.device)
    seqs = [pool.sequence(len(x)) for x in ids]
    for group in (range(0, 5), range(5, 9)):
        entries = []
        for i in group:
            seqs[i].grow(PROMPTS[i])
            entries.append(Entry(0, PROMPTS[i], seqs[i], "none"))
        stage.forward_batch(torch.cat([ids[i][:PROMPTS[i]] for i in group]), entries, pool)
    entries = []
    for i, s in enumerate(seqs):
        s.grow(PROMPTS[i] + NEXT[i])
        entries.append(Entry(PROMPTS[i], NEXT[i], s, "last"))
    together = stage.forward_batch(torch.cat([x[p:] for x, p in zip(ids, PROMPTS)]), entries, pool)
    assert together.shape == (len(PROMPTS), cfg.vocab_size)
    for i, ref in enumerate(alone):
        scale = ref.abs().max()
        assert (together[i] - ref).abs().max() <= 1e-4 * scale, i


def test_scattered_blocks_give_the_same_logits(smollm2):
    """Under a full pool a sequence's blocks scatter; its keys are then gathered, with equal results."""
    cfg = smollm2.config
    stage = StageModel.from_checkpoint(smollm2.weights(), cfg, UnitRange(0, 5, cfg.num_layers))
    layers = stage.units.attention_layers()
    x = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    outs = []
    for scatter in (False, True):
        pool = KVPool(layers, 12, cfg.num_kv_heads, cfg.head_dim, stage.dtype, stage.device)
        fillers = []
        if scatter:  # every other block taken, so the sequence gets blocks 1, 3, 5, ...
            for _ in range(6):
                f = pool.sequence(16)
                f.grow(16)
                fillers.append(f)
            for f in fillers[1::2]:
                f.release()
        seq = pool.sequence(16)  # declares 16 (placed in a run of one block), then grows past it
        seq.grow(16)
        seq.max_len = 70
        out = []
        for start, n in ((0, 30), (30, 1), (31, 39)):
            seq.grow(start + n)
            out.append(stage.forward_batch(x[start:start + n], [Entry(start, n, seq, "none")], pool))
        assert (seq.run(70) is None) == scatter
        outs.append(torch.cat(out))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[0].abs().max()
