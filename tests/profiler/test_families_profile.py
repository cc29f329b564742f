"""The profiler times, and the planner plans, every model family (tiny random configs of each)."""

from types import SimpleNamespace

import pytest
import torch

from hpipe.core.config import ModelConfig
from planner.costs import Workload
from planner.strategies import plan as make_plan
from profiler.device import measure_units
from profiler.roofline import simulated_profile
from tests.model.test_families import NEW_FAMILIES


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_family_is_timed_and_planned(family, tiny_dirs):
    cfg = ModelConfig.from_file(tiny_dirs[family] / "config.json")
    for weight_type in (0, 8):  # float, and Q8_0 blocks as a GGUF's daemon holds them
        times = measure_units(cfg, torch.float32, torch.device("cpu"), [1], [1, 16], [0, 16], 64, repeats=1,
                              weight_type=weight_type)
        assert all(t > 0 for kind in times.values() for plane in kind for row in plane for t in row), family
    daemons = [SimpleNamespace(name=n, address=f"127.0.0.1:{p}", device="cpu",
                               spec={"peak_tflops": t, "mem_bw_gbs": 20, "memory": 2 ** 30})
               for n, p, t in (("a", 1, 0.2), ("b", 2, 0.1))]
    links = {(x, y): (1e-4, 1e8) for x in "ab" for y in "ab" if x != y}
    profile = simulated_profile("tiny", cfg, daemons, links, "float32", 64, 1)
    plan = make_plan(profile, Workload(48, 1, 64))
    assert plan.chosen.stages and sum(plan.chosen.slices) == 48
