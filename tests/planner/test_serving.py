"""The serving split: the busiest daemon's work per request of a mix, minimised exactly."""

import itertools
import math
import random

import pytest

from hpipe.core.plan import Plan
from hpipe.core.profile import DaemonProfile, Profile
from planner.costs import CostModel, Workload
from planner.cuts import InfeasibleError
from planner.serving import Mix, daemon_loads, serving_cuts, serving_table, unit_work
from planner.strategies import plan
from tests.planner.synthetic import grid, make_profile


def brute_force(cost, work, mix):
    """max over stages of (a request's seconds on the stage + its activations' transfer to the
    next), minimised over every device subset, order and contiguous cut."""
    table, u, n = serving_table(cost, work, mix), cost.num_units, len(cost.daemons)
    best = math.inf
    for k in range(1, n + 1):
        for devs in itertools.permutations(range(n), k):
            for cut in itertools.combinations(range(1, u), k - 1):
                bounds = (0, *cut, u)
                worst = max(table[devs[j], a, b] + (cost.comm_time(devs[j], devs[j + 1], mix.prompt + mix.output, 1)
                                                    if j + 1 < k else 0.0)
                            for j, (a, b) in enumerate(zip(bounds, bounds[1:])))
                best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_serving_split_equals_brute_force(seed):
    rng = random.Random(seed)
    cost = CostModel(make_profile(rng, n=rng.randint(1, 4), layers=rng.randint(1, 3)))
    work = Workload(512, 1, 1024)
    mix = Mix(prompt=rng.choice([64, 300, 512]), output=rng.choice([0, 16, 200]), decode_batch=rng.choice([1, 8]))
    split = serving_cuts(cost, serving_table(cost, work, mix), mix)
    assert split.bounds[0] == 0 and split.bounds[-1] == cost.num_units
    assert math.isclose(split.bottleneck, brute_force(cost, work, mix), rel_tol=1e-9)


def test_a_request_costs_its_chunked_prefill_and_its_share_of_decode_micro_batches():
    cost = CostModel(make_profile(random.Random(3), n=1, layers=2))
    g = cost.daemons[0].compute
    w = unit_work(cost, 0, Mix(prompt=300, output=40, decode_batch=8, chunk=256))
    # prefill: 256 tokens at context 0, then 44 at context 256; decode: 40 tokens = 5 micro-batches of 8
    attn = g["attn"].time(256, 0, 1) + g["attn"].time(44, 256, 1) + 5 * g["attn"].time(8, 320, 1)
    mlp = g["mlp"].time(256, 0, 1) + g["mlp"].time(44, 0, 1) + 5 * g["mlp"].time(8, 0, 1)
    head = g["head"].time(1, 0, 1) + 5 * g["head"].time(8, 0, 1)
    assert w[1] == pytest.approx(attn) and w[2] == pytest.approx(mlp) and w[3] == pytest.approx(head)


def test_decode_heavy_serving_moves_layers_off_the_device_that_is_fast_only_at_prefill():
    """Device 0 computes long slices 4x faster than device 1 but pays the same fixed cost per call,
    as a fast CPU core beside a slow one reading the same memory. For one document's prefill it
    should take most layers; for answers of 256 tokens the split evens out."""
    base = make_profile(random.Random(0), n=2, layers=8)
    per_token = {"embed": 1e-7, "attn": 2e-6, "mlp": 3e-6, "head": 1e-6}
    daemons = tuple(DaemonProfile(d.name, d.address, d.device, d.memory_bytes,
                                  {k: grid(slowness * p, 2e-4) for k, p in per_token.items()})
                    for d, slowness in zip(base.daemons, (1, 4)))
    profile = Profile(base.model, base.source, base.dtype, daemons, base.links)
    cost, work = CostModel(profile), Workload(1024)
    prefill_mix, decode_mix = Mix(prompt=1024, output=0), Mix(prompt=64, output=256, decode_batch=1)
    prefill = serving_cuts(cost, serving_table(cost, work, prefill_mix), prefill_mix)
    decode = serving_cuts(cost, serving_table(cost, work, decode_mix), decode_mix)

    def share0(split):
        return sum(b - a for j, (a, b) in enumerate(zip(split.bounds, split.bounds[1:])) if split.daemons[j] == 0)

    assert share0(prefill) > 0.6 * cost.num_units
    assert abs(share0(decode) - cost.num_units / 2) <= 2
    loads = daemon_loads(cost, serving_table(cost, work, decode_mix), decode.bounds, decode.daemons)
    assert max(loads.values()) == pytest.approx(decode.bottleneck, rel=0.05)


def test_a_throughput_plan_executes_its_split_and_slices_by_its_own_schedule():
    profile = make_profile(random.Random(5), n=3, layers=4)
    work = Workload(512, 1, 1024)
    p = plan(profile, work, strategy="throughput", mix=Mix(512, 64))
    assert p.strategy == "throughput" and p.slicing_for == "throughput" and "hpipe" in p.strategies
    assert set(p.meta["serving"]["daemon_request_s"]) == {"hpipe", "throughput"}
    again = Plan.from_json(p.to_json())
    assert again.slicing_for == "throughput" and again.slices_for(700) == p.slices_for(700)
    assert sum(again.slices_for(700)) == 700
    latency = plan(profile, work)
    assert latency.slicing_for == "hpipe" and "throughput" not in latency.strategies
    with pytest.raises(InfeasibleError, match="request mix"):
        plan(profile, work, strategy="throughput")
