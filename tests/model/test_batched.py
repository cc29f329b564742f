"""A micro-batch of many sequences gives each one the logits it gets alone.

SmolLM2, one stage: nine sequences of different lengths in one KV pool; one micro-batch mixes
prefill chunks (of different sizes, some the first of their sequence) with decode tokens.
"""

import pytest
import torch

from hpipe.core.errors import ModelSourceError
from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels.precision import set_prefill_gemm
from hpipe.model.kv.pool import Entry, KVPool

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


def _kv(pool: KVPool, seq, n: int) -> torch.Tensor:
    """Every layer's keys and values of a sequence's first ``n`` positions, ``[2, layers, kv_heads, n, head_dim]``."""
    slots = seq.slots(0, n, torch.device("cpu"))
    return torch.stack([torch.stack([pool.k[la].index_select(1, slots) for la in pool.layers]),
                        torch.stack([pool.v[la].index_select(1, slots) for la in pool.layers])])


def test_a_replay_computes_decoded_tokens_as_their_decode_did(smollm2, prefill_gemm):
    """A replay or a restart computes a prompt and the tokens decoded after it in one entry. Its
    prompt rows are prefill rows and the decoded ones decode rows (``prefill_end``): with the
    prefill in bfloat16, the rebuilt KV of the decoded positions is the one their decode steps
    wrote (up to float32's summation order), not a bfloat16 rounding of it, and the prompt's is
    the same bits."""
    cfg = smollm2.config
    stage = StageModel.from_checkpoint(smollm2.weights(), cfg, UnitRange.full(cfg.num_layers))
    prompt, decoded = 150, 12
    ids = torch.randint(0, cfg.vocab_size, (prompt + decoded,), generator=torch.Generator().manual_seed(3))
    pool = KVPool(UnitRange.full(cfg.num_layers).attention_layers(), 64, cfg.num_kv_heads, cfg.head_dim,
                  stage.dtype, stage.device)
    first = pool.sequence(len(ids))
    first.grow(prompt)
    stage.forward_batch(ids[:prompt], [Entry(0, prompt, first, "none", prompt)], pool)
    for p in range(prompt, prompt + decoded):
        first.grow(p + 1)
        last = stage.forward_batch(ids[p:p + 1], [Entry(p, 1, first, "last")], pool)[0]
    original = _kv(pool, first, len(ids))

    def replay(prefill_end):
        seq = pool.sequence(len(ids))
        seq.grow(len(ids))
        logits = stage.forward_batch(ids, [Entry(0, len(ids), seq, "last", prefill_end)], pool)[0]
        kv = _kv(pool, seq, len(ids))
        seq.release()
        return kv, logits

    kv, logits = replay(prompt)
    assert torch.equal(kv[..., :prompt, :], original[..., :prompt, :])
    scale = original[..., prompt:, :].abs().max()
    exact = (kv[..., prompt:, :] - original[..., prompt:, :]).abs().max() / scale
    # up to float32's summation order (the replay's attention is not the decode kernel's), and the
    # step of 15 bits (1/16383 of 32 values' largest) that order may tip where decode rows of
    # 1,536-long Q4_1 rows round x (kernels/legacy_dot.cpp)
    assert exact <= 1e-4, exact
    assert (logits - last).abs().max() <= 1e-4 * last.abs().max()
    if prefill_gemm == "bfloat16":  # every row a prefill row, as before: the decoded KV rounded
        kv, _ = replay(0)
        rounded = (kv[..., prompt:, :] - original[..., prompt:, :]).abs().max() / scale
        assert rounded > 30 * max(exact, 1e-7), (rounded, exact)
