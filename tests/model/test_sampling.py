import pytest
import torch

from hpipe.core.errors import InputError
from hpipe.model.sampling import Sampler, SamplingParams


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
