"""hpipe's side of the llama.cpp comparison: the shapes ``llama-batched-bench`` measures, in-process.

``measure(model, npp, ntg, npl)`` loads the whole model as one stage (the GGUF's blocks, or float32
with ``dequantize``), prefills ``npl`` sequences of ``npp`` random tokens one after another, then
decodes ``ntg`` tokens for all of them, one micro-batch of ``npl`` rows a step (the C++ decode
kernel where it is built). It returns llama-batched-bench's figures: prefill and decode tokens/s.
"""

from __future__ import annotations

import time

import torch

from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel
from hpipe.model.kv.pool import BLOCK_SIZE, Entry
from hpipe.model.weights.sources import resolve_model


def load(model: str, dequantize: bool) -> StageModel:
    source = resolve_model(model)
    cfg = source.config
    return StageModel.from_checkpoint(source.weights(dequantize=dequantize), cfg, UnitRange.full(cfg.num_layers))


@torch.inference_mode()
def measure(stage: StageModel, npp: int, ntg: int, npl: int, seed: int = 0) -> dict:
    cfg = stage.cfg
    max_len = npp + ntg
    pool = stage.new_pool(npl * (-(-max_len // BLOCK_SIZE)) + 1)
    gen = torch.Generator().manual_seed(seed)
    seqs = [pool.sequence(max_len) for _ in range(npl)]
    t0 = time.perf_counter()
    last = []
    for kv in seqs:
        ids = torch.randint(0, cfg.vocab_size, (npp,), generator=gen)
        kv.grow(npp)
        last.append(stage.forward_batch(ids, [Entry(0, npp, kv, "last")], pool).argmax(-1))
    prefill_s = time.perf_counter() - t0
    tokens = torch.cat(last)
    t0 = time.perf_counter()
    for step in range(ntg):
        pos = npp + step
        for kv in seqs:
            kv.grow(pos + 1)
        tokens = stage.forward_batch(tokens, [Entry(pos, 1, kv, "last") for kv in seqs], pool).argmax(-1)
    decode_s = time.perf_counter() - t0
    for kv in seqs:
        kv.release()
    return {"prefill_tok_s": npl * npp / prefill_s, "decode_tok_s": npl * ntg / decode_s}
