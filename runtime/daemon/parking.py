"""Stages a Seesaw layout switch took from this daemon, their weights kept for the switch back.

The two layouts alternate, so a stage a daemon gives up going to decode it takes again going back
to prefill. Its KV goes with the switch (the pool is freed; the coordinator rebuilds what it
needs), but its weights stay here where memory allows, and the switch back reads nothing
(docs/decisions/seesaw.md: the planner prices a unit that changes owner as free when its daemon
can hold both layouts' units). A full load of another deployment lets them all go.
"""

from __future__ import annotations

from typing import Callable

import torch

from hpipe.core.errors import StatusError
from hpipe.model.compute.stage import StageModel
from runtime.daemon import memory


class ParkedStages:
    def __init__(self):
        self.models: dict[int, StageModel] = {}  # stage index -> the model it held
        self.reused = 0  # stages a switch took from here instead of loading them

    @property
    def nbytes(self) -> int:
        return sum(m.weight_bytes() for m in self.models.values())

    def park(self, models: dict[int, StageModel], budget: int | None, held: int, device: torch.device) -> None:
        """Keep ``models`` (stage index -> model) while their weights fit beside those kept already:
        in the memory ``budget`` less the ``held`` bytes (weights and pools), or without a budget
        in half the memory the device has free; let the others go."""
        room = memory.available(device) // 2 if budget is None else budget - held
        for i, model in models.items():
            if model.weight_bytes() <= room - self.nbytes:
                self.models[i] = model

    def load_beside(self, new: tuple[int, ...], load: Callable[[dict[int, StageModel], int], dict]) -> dict:
        """``load(kept, bytes)`` the stages ``new``: ``kept`` the models kept here (the load pops
        those it takes), ``bytes`` what the others take, in use beside the load. Where they leave
        it no room (``RESOURCE_EXHAUSTED``), they go and the load runs again without them."""
        reused = sum(1 for i in new if i in self.models)
        try:
            loaded = load(self.models, sum(m.weight_bytes() for i, m in self.models.items() if i not in new))
        except StatusError as e:
            if e.code != "RESOURCE_EXHAUSTED" or not self.models:
                raise
            self.clear()
            return load(self.models, 0)
        self.reused += reused
        return loaded

    def clear(self) -> None:
        self.models.clear()
