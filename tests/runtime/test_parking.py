"""The weights a layout switch takes from a daemon, kept for the switch back while memory allows."""

import pytest
import torch

from hpipe.core.errors import StatusError
from runtime.daemon.parking import ParkedStages


class Weights:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def weight_bytes(self) -> int:
        return self.nbytes


def test_kept_within_the_budget_beside_what_is_held():
    parked = ParkedStages()
    a, b, c = Weights(40), Weights(30), Weights(20)
    parked.park({0: a, 1: b, 2: c}, budget=100, held=40, device=torch.device("cpu"))
    assert parked.models == {0: a, 2: c}  # 40 fits in 60, then 30 does not in 20, 20 does
    assert parked.nbytes == 60


def test_a_load_takes_what_it_needs_and_counts_the_rest_in_use():
    parked = ParkedStages()
    parked.park({0: Weights(40), 2: Weights(20)}, budget=None, held=0, device=torch.device("cpu"))
    seen = []

    def load(kept, in_use):
        seen.append((sorted(kept), in_use))
        return {i: kept.pop(i) for i in (0, 1) if i in kept}

    assert list(parked.load_beside((0, 1), load)) == [0]
    assert seen == [([0, 2], 20)] and parked.reused == 1 and list(parked.models) == [2]


def test_where_the_kept_leave_no_room_they_go_and_the_load_runs_again():
    parked = ParkedStages()
    parked.park({3: Weights(50)}, budget=None, held=0, device=torch.device("cpu"))
    calls = []

    def load(kept, in_use):
        calls.append(in_use)
        if in_use:
            raise StatusError("RESOURCE_EXHAUSTED", "no room")
        return {}

    assert parked.load_beside((0,), load) == {} and calls == [50, 0] and not parked.models
    with pytest.raises(StatusError, match="bad"):
        parked.park({3: Weights(1)}, budget=None, held=0, device=torch.device("cpu"))
        parked.load_beside((0,), lambda kept, in_use: (_ for _ in ()).throw(StatusError("NOT_FOUND", "bad")))
    assert list(parked.models) == [3]  # another error leaves them
