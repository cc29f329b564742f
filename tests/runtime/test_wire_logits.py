"""A sampled row sent as its top logits draws what the whole row draws (runtime/wire/logits.py)."""

import pytest
import torch

from hpipe.model.generate.sampling import Sampler, SamplingParams, sample
from runtime.wire.logits import TOP_LOGITS, pack, payload_floats, unpack


def rows(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("vocab", [1000, 40])  # 40: fewer logits than a top row carries
def test_pack_and_unpack_keep_whole_rows_and_each_top_row_s_largest(vocab):
    out = rows(5, vocab)
    top = [True, False, True, True, False]
    buf = pack(out, top)
    assert buf.dtype == torch.float32 and buf.numel() == payload_floats(top, vocab)
    back = unpack(buf, top, vocab)
    assert torch.equal(back[[1, 4]], out[[1, 4]])  # whole rows: the same bits
    k = min(TOP_LOGITS, vocab)
    for i in (0, 2, 3):
        kept = torch.isfinite(back[i])
        assert int(kept.sum()) == k
        assert torch.equal(back[i][kept], out[i][kept])  # the same values at the same token ids
        largest = torch.sort(out[i], descending=True).values[:k]
        assert torch.equal(largest, torch.sort(back[i][kept], descending=True).values)
    assert torch.equal(unpack(pack(out, [False] * 5), [False] * 5, vocab), out)
    with pytest.raises(ValueError, match="payload"):
        unpack(buf[:-1], top, vocab)


def test_a_top_row_draws_what_the_whole_row_draws():
    """Greedy and a top-k cut within the top logits: the same tokens from the unpacked rows as
    from the whole ones, draw for draw (each request's generator seeded alike)."""
    out = rows(64, 5000, seed=1)
    top = [True] * 64
    back = unpack(pack(out, top), top, 5000)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_k=TOP_LOGITS, seed=3),
                   SamplingParams(temperature=1.3, top_k=20, top_p=0.7, seed=4)):
        assert params.needs_only_top(TOP_LOGITS)
        whole = sample([Sampler(params) for _ in range(64)], out)
        assert sample([Sampler(params) for _ in range(64)], back) == whole
    for params in (SamplingParams(temperature=0.8), SamplingParams(top_k=TOP_LOGITS + 1, temperature=1.0),
                   SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5)):
        assert not params.needs_only_top(TOP_LOGITS)


def test_a_non_finite_row_stays_non_finite():
    out = rows(2, 300)
    out[0, 7] = float("nan")
    out[1, 9] = float("inf")
    back = unpack(pack(out, [True, True]), [True, True], 300)
    assert not torch.isfinite(back.amax(dim=-1)).any()


@pytest.fixture(scope="module")
def three(tiny_dirs):
    from hpipe.model.weights.sources import resolve_model
    from runtime.coordinator.pipeline import Pipeline, cut_stages
    from tests.cluster_helpers import Served, cluster_of

    path = str(tiny_dirs["llama"])
    source = resolve_model(path)
    daemons = [Served(f"d{i}") for i in range(3)]
    pipe = Pipeline(cluster_of(*daemons))
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], source.config.num_units), torch.float32)
    yield pipe, source
    pipe.close()
    for d in daemons:
        d.stop()


def test_greedy_requests_get_their_tokens_from_top_rows_and_the_others_whole_rows(three):
    """Greedy and top-k requests beside ones that sample the whole row or ask for log-probabilities,
    in the same micro-batches: the greedy ones get the tokens they get alone, with or without
    log-probabilities (those as with every row sent whole), every request its tokens, and the
    logits come back in fewer bytes. (Draws are compared in the test above: over daemons a row's
    last bits may follow what it was batched with, which a seeded draw at a boundary would show.)"""
    from runtime.coordinator.engine import Engine, Request
    from runtime.coordinator.policies import POLICIES
    from tests.runtime.test_engine import alone, chunks, workload

    pipe, source = three
    prompts, news = workload(12, source.config.vocab_size)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=8, seed=1),
              SamplingParams(temperature=0.9, seed=2), SamplingParams()] * 3
    logprobs = [None, None, None, 2] * 3  # the fourth of each: greedy, with log-probabilities (a whole row)

    def run(top_logits: bool):
        session = pipe.session()
        try:
            engine = Engine(session, POLICIES["gllm"](), depth=len(pipe.stages), top_logits=top_logits)
            requests = [engine.add(Request(p, m, params=s, logprobs=lp, slicer=chunks))
                        for p, m, s, lp in zip(prompts, news, params, logprobs)]
            engine.run()
            return requests, session.result_bytes
        finally:
            session.close()
    top, top_bytes = run(True)
    whole, whole_bytes = run(False)
    assert all(r.stop_reason == "length" and not r.error for r in top + whole)
    assert all(len(r.tokens) == m and all(0 <= t < source.config.vocab_size for t in r.tokens)
               for r, m in zip(top, news))
    greedy = [i for i, s in enumerate(params) if s.greedy]
    reference = alone(source, [prompts[i] for i in greedy], [news[i] for i in greedy])
    assert [top[i].tokens for i in greedy] == reference == [whole[i].tokens for i in greedy]
    for i in (i for i, lp in enumerate(logprobs) if lp):
        assert [t for t, _, _ in top[i].token_logprobs] == top[i].tokens
        assert [lp for _, lp, _ in top[i].token_logprobs] == pytest.approx(
            [lp for _, lp, _ in whole[i].token_logprobs], abs=1e-4)
    # half the sampled rows are top rows: 2 * 64 floats where the whole row is 384
    assert top_bytes < 0.8 * whole_bytes, (top_bytes, whole_bytes)
