import pytest
import torch

from hpipe.core.errors import InputError
from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel
from hpipe.model.weights.sources import resolve_model


@pytest.fixture(scope="module")
def stages(tiny_dirs):
    src = resolve_model(str(tiny_dirs["llama"]))
    cfg, store = src.config, src.weights()
    return (StageModel.from_checkpoint(store, cfg, UnitRange(0, 3, cfg.num_layers)),
            StageModel.from_checkpoint(store, cfg, UnitRange(3, 8, cfg.num_layers)))


def test_positions_beyond_declared_length(stages):
    first, _ = stages
    cache = first.new_cache(1, 8)
    with pytest.raises(InputError, match="declared max length 8"):
        first(torch.zeros(1, 9, dtype=torch.long), 0, cache)


def test_slice_must_continue_the_sequence(stages):
    first, _ = stages
    cache = first.new_cache(1, 16)
    first(torch.zeros(1, 4, dtype=torch.long), 0, cache)
    with pytest.raises(InputError, match="starts at position 5"):
        first(torch.zeros(1, 2, dtype=torch.long), 5, cache)


def test_wrong_input_kinds(stages):
    first, second = stages
    with pytest.raises(InputError, match="token ids"):
        first(torch.zeros(1, 2, 64), 0, first.new_cache(1, 4))
    with pytest.raises(InputError, match="residual stream"):
        second(torch.zeros(1, 2, 63), 0, second.new_cache(1, 4))
    with pytest.raises(InputError, match=r"token ids must lie"):
        first(torch.tensor([[10_000]]), 0, first.new_cache(1, 4))


def test_cache_beyond_context(stages):
    with pytest.raises(InputError, match="exceeds the model's context"):
        stages[0].new_cache(1, 97)


def test_cache_holds_only_stage_layers(stages):
    first, second = stages
    assert list(first.new_cache(1, 4).layers) == [0]
    assert list(second.new_cache(1, 4).layers) == [1, 2]
