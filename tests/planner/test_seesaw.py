"""Seesaw's planner: two layouts chosen exactly, the switch priced, the choice the cheapest way."""

import itertools
import math
import random

import pytest

from hpipe.core.profile import DaemonProfile, LinkProfile, Profile
from planner.costs import CostModel, Workload
from planner.cuts import comm_matrix
from planner.seesaw import Layout, both_time, phase_time, seesaw, switch_cost
from planner.serving import Mix, serving_table
from tests.planner.synthetic import grid, make_profile


def layouts(cost):
    """Every layout: a subset of devices in any order, each a contiguous range."""
    u, n = cost.num_units, len(cost.daemons)
    for k in range(1, n + 1):
        for devs in itertools.permutations(range(n), k):
            for cut in itertools.combinations(range(1, u), k - 1):
                yield Layout((0, *cut, u), devs)


@pytest.mark.parametrize("seed", range(6))
def test_each_phase_gets_its_best_layout_and_the_ways_are_priced_as_brute_force_finds(seed):
    rng = random.Random(seed)
    cost = CostModel(make_profile(rng, n=rng.randint(2, 3), layers=rng.randint(1, 3)))
    work = Workload(512, 1, 1024)
    mix = Mix(prompt=rng.choice([64, 300, 512]), output=rng.choice([16, 200]), decode_batch=rng.choice([1, 8]))
    tables = (serving_table(cost, work, mix, "prefill"), serving_table(cost, work, mix, "decode"))
    comms = (comm_matrix(cost, mix.prompt, 1), comm_matrix(cost, mix.output, 1))
    every = list(layouts(cost))
    result = seesaw(cost, work, mix, batch=8, break_even=False)
    best_prefill = min(phase_time(tables[0], comms[0], lay) for lay in every)
    best_decode = min(phase_time(tables[1], comms[1], lay) for lay in every)
    assert math.isclose(result.phase_s["prefill"], best_prefill, rel_tol=1e-9)
    assert math.isclose(result.phase_s["decode"], best_decode, rel_tol=1e-9)
    # a single layout serves both phases at once: its busiest stage's prefill + decode work; the
    # serving layout is the best such
    assert math.isclose(result.request_s["serving layout"], min(both_time(tables, comms, lay) for lay in every),
                        rel_tol=1e-9)
    for way, lay in (("prefill layout", result.prefill), ("decode layout", result.decode),
                     ("serving layout", result.serving)):
        brute = max(tables[0][m, a, b] + tables[1][m, a, b]
                    + ((comms[0] + comms[1])[m, lay.devices[j + 1]] if j + 1 < len(lay.devices) else 0.0)
                    for j, (m, a, b) in enumerate(lay.stages()))
        assert math.isclose(result.request_s[way], brute, rel_tol=1e-9)
        assert math.isclose(both_time(tables, comms, lay), brute, rel_tol=1e-9)
    if result.prefill != result.decode:
        assert math.isclose(result.request_s["seesaw"],
                            best_prefill + best_decode + result.switch.seconds / 8, rel_tol=1e-9)
        assert result.choice == min(result.request_s, key=result.request_s.get)
    else:
        assert result.switch.moved_units == 0 and result.choice == "prefill layout"


def two_devices(link_bps: float, memory: int = 10**9) -> CostModel:
    """Device 0 computes long slices fast but pays 2 ms a call (an accelerator behind a slow
    launch path); device 1 is 20x slower a token but pays next to nothing a call (a CPU reading
    its own memory): prefill wants device 0, decode (one token a call) device 1."""
    base = make_profile(random.Random(0), n=2, layers=8)
    shapes = ((1e-6, 2e-3), (2e-5, 1e-5))  # (seconds a token, seconds a call) of each device
    weights = {"embed": 0.05, "attn": 1.0, "mlp": 1.5, "head": 0.5}
    daemons = tuple(DaemonProfile(d.name, d.address, d.device, memory,
                                  {k: grid(per_token * w, fixed) for k, w in weights.items()})
                    for d, (per_token, fixed) in zip(base.daemons, shapes))
    links = tuple(LinkProfile(a.name, b.name, 2e-4, link_bps) for a in daemons for b in daemons if a is not b)
    return CostModel(Profile(base.model, base.source, base.dtype, daemons, links))


def test_where_the_phases_disagree_seesaw_pays_and_says_how_much():
    cost, work = two_devices(1.25e9), Workload(1024)  # a 10 Gbit/s link
    result = seesaw(cost, work, Mix(prompt=1024, output=128, decode_batch=1), batch=64)
    assert result.prefill != result.decode
    assert result.decode.devices == (1,)  # every decode token costs a call on every unit
    assert result.choice == "seesaw" and result.gain > 1.5
    singles = [t for way, t in result.request_s.items() if way != "seesaw"]
    assert result.request_s["seesaw"] * result.gain == pytest.approx(min(singles))
    assert result.break_even_output is not None and result.break_even_output <= 128
    assert set(result.busy) == {"prefill layout", "decode layout", "serving layout", "seesaw"}


def test_where_one_layout_serves_both_phases_it_is_chosen():
    """Every device alike: the phases want the same layout, there is nothing to switch."""
    base = make_profile(random.Random(1), n=3, layers=4)
    same = base.daemons[0].compute
    daemons = tuple(DaemonProfile(d.name, d.address, d.device, d.memory_bytes, same) for d in base.daemons)
    cost = CostModel(Profile(base.model, base.source, base.dtype, daemons, base.links))
    result = seesaw(cost, Workload(1024), Mix(prompt=512, output=64, decode_batch=8), batch=32)
    assert result.choice != "seesaw"
    assert result.request_s["seesaw"] >= min(t for way, t in result.request_s.items() if way != "seesaw")


def test_the_switch_sends_kv_or_recomputes_it_whichever_is_cheaper():
    work, mix = Workload(1024), Mix(prompt=1024, output=128, decode_batch=1)
    fast = seesaw(two_devices(1.25e9), work, mix, batch=64, break_even=False)  # 10 Gbit/s: send it
    assert fast.prefill != fast.decode
    assert fast.switch.kv_bytes > 0 and fast.switch.recomputed_units == 0
    assert fast.switch.weight_bytes == 0  # both layouts' weights fit on each daemon: none move
    slow = seesaw(two_devices(2e4), work, mix, batch=64, break_even=False)  # 160 kbit/s
    if slow.prefill != slow.decode:
        assert slow.switch.recomputed_units > 0
    # each run of units changing owner, with the choice the runtime follows (runtime.coordinator.kv_moves)
    for result in (fast, slow):
        moved = [u for u in range(result.prefill.bounds[-1]) if result.prefill.owner(u) != result.decode.owner(u)]
        runs = result.switch.runs
        assert sorted(u for _, _, a, b, _ in runs for u in range(a, b)) == moved
        assert all(src == result.prefill.owner(a) and dst == result.decode.owner(a) for src, dst, a, _, _ in runs)
        assert any(kv == "recompute" for *_, kv in runs) == (result.switch.recomputed_units > 0)
        assert any(kv == "send" for *_, kv in runs) == (result.switch.kv_bytes > 0)
    assert any(kv == "send" for *_, kv in fast.switch.runs)


def test_a_run_moved_from_the_start_is_recomputed_from_token_ids():
    """A run of units at the start of the model is rebuilt from the token ids (the coordinator's),
    not from activations over the link: on a slow link, recomputing it costs its compute alone,
    where sending its KV (or activations) would cost minutes; a run further on is rebuilt from
    the rows the daemon before it logged, over their link."""
    cost, mix = two_devices(2e4), Mix(prompt=1024, output=128, decode_batch=1)  # 160 kbit/s
    u = cost.num_units
    prefill, batch = Layout((0, u), (0,)), 8
    head = switch_cost(cost, mix, prefill, Layout((0, 4, u), (1, 0)), batch, resident={0, 1})
    assert [kv for *_, kv in head.runs] == ["recompute"] and head.kv_bytes == 0
    act = cost.profile.activation_bytes_per_token() * mix.prompt * batch
    assert head.to_decode_s < act / 2e4  # no activations crossed the link
    tail = switch_cost(cost, mix, prefill, Layout((0, u - 4, u), (0, 1)), batch, resident={0, 1})
    assert tail.to_decode_s > act / 2e4  # its KV, or the rows entering it, cross the link


def test_less_memory_means_fewer_requests_a_phase():
    work, mix = Workload(1024), Mix(prompt=1024, output=128, decode_batch=1)
    roomy = seesaw(two_devices(1.25e9), work, mix, break_even=False)
    tight = seesaw(two_devices(1.25e9, memory=200 * 2**20), work, mix, break_even=False)
    assert 1 <= tight.batch < roomy.batch


def test_hpipe_plan_objective_seesaw_prints_the_ways_and_keeps_the_prediction(tmp_path, capsys):
    import json

    from hpipe.app.cli import main
    from hpipe.core.plan import Plan

    path = tmp_path / "profile.json"
    path.write_text(two_devices(1.25e9).profile.to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(path), "--seq-len", "1024", "--objective", "seesaw", "--output-len", "128",
                 "--decode-batch", "1", "--seesaw-batch", "64", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    for way in ("prefill layout", "decode layout", "serving layout", "seesaw"):
        assert way in err
    assert "run it with hpipe run --policy seesaw" in err  # seesaw is chosen here: how to run it
    the_plan = Plan.from_json(out.read_text())
    assert the_plan.strategy == "throughput"  # what it executes
    prediction = the_plan.meta["seesaw"]
    assert prediction["choice"] == "seesaw" and prediction["batch"] == 64 and prediction["gain"] > 1.5
    assert json.loads(json.dumps(prediction)) == prediction
    runs = prediction["switch"]["runs"]  # what a switch sends or recomputes, by daemon name
    assert runs and all(r["kv"] in ("send", "recompute", "none") and isinstance(r["from"], str) for r in runs)
