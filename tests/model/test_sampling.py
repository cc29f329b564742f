import pytest
import torch

from hpipe.core.errors import InputError
from hpipe.model.generate.sampling import Sampler, SamplingParams


def test_greedy_and_topk1():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler()(logits) == 1
    assert Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0))(logits) == 1


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    a = [Sampler(SamplingParams(temperature=1.0, seed=7))(logits) for _ in range(3)]
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert a[0] == a[1] == a[2]
    draws = {s(logits) for _ in range(50)}
    assert len(draws) > 1  # it does sample


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert {s(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid(kw):
    with pytest.raises(InputError):
        SamplingParams(**kw)


def test_frequency_and_presence_penalties_follow_openai():
    """logit[t] -= count[t] * frequency + (count[t] > 0) * presence, for tokens generated so far."""
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    s.output.update({1: 3, 2: 1})  # token 1 generated three times, token 2 once
    logits = torch.tensor([1.0, 2.5, 1.6, 0.0])
    # 1: 2.5 - 1.5 - 0.25 = 0.75; 2: 1.6 - 0.5 - 0.25 = 0.85; 0 untouched at 1.0 wins
    assert s(logits) == 0
    s2 = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    s2.output.update({1: 3, 2: 1})
    assert s2(torch.tensor([0.8, 2.5, 1.6, 0.0])) == 2  # 0.85 beats 0.8 and 0.75
    assert Sampler()(logits) == 1  # without penalties the same logits pick token 1


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 4
    prompt, generated = [4, 9, 17], [9, 30]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + generated]), logits.clone())
    from hpipe.model.generate.sampling import _penalise

    s = Sampler(SamplingParams(repetition_penalty=1.7), prompt)
    s.output.update(generated)
    row = logits[0].clone()
    _penalise(row, s)
    torch.testing.assert_close(row, expected[0])
    assert s(logits[0]) == int(expected.argmax())


def test_mixed_parameters_in_one_batch_sample_each_row_as_alone():
    """One micro-batch's rows under different parameters (greedy, temperature with top-k, top-p,
    penalties, seeds) draw exactly the tokens each would draw sampled on its own."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 64, generator=gen) * 3
    params = [SamplingParams(),
              SamplingParams(temperature=0.7, top_k=5, seed=11),
              SamplingParams(temperature=1.3, top_p=0.6, seed=12),
              SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, temperature=0.9, seed=13),
              SamplingParams(repetition_penalty=1.5),  # greedy with a penalty
              SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=14)]
    prompts = [[1, 2], [3], [4, 5, 6], [int(logits[3].argmax())], [int(logits[4].argmax())], [7]]
    from hpipe.model.generate.sampling import sample

    batched = [Sampler(p, pr) for p, pr in zip(params, prompts)]
    alone = [Sampler(p, pr) for p, pr in zip(params, prompts)]
    penalty_acted = False
    for step in range(20):  # the samplers' state (generators, counts) advances alike in both
        together = sample(batched, logits)
        separately = [a(logits[i]) for i, a in enumerate(alone)]
        assert together == separately, step
        penalty_acted |= together[4] != int(logits[4].argmax())  # greedy row 4 left its favourite
        logits = torch.roll(logits, 1, dims=1)
    assert penalty_acted
    assert len({tuple(b.output) for b in batched}) == len(batched)  # every row drew its own tokens
