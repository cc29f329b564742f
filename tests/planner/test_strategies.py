"""hpipe vs baselines on random clusters; plan files; infeasible requests."""

import json
import random
from dataclasses import replace

import pytest

from hpipe.app.cli import main
from hpipe.core.plan import Plan, PlanError
from hpipe.core.profile import Profile, ProfileError
from planner.costs import CostModel, Workload
from planner.cuts import InfeasibleError
from planner.strategies import plan
from tests.planner.synthetic import make_profile


@pytest.mark.parametrize("seed", range(12))
def test_hpipe_never_worse_than_any_baseline(seed):
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 4, 6])
    profile = make_profile(rng, n=rng.randint(1, 5), layers=rng.randint(1, 4), batches=tuple(
        b for b in range(1, batch + 1) if batch % b == 0))
    work = Workload(seq_len=rng.choice([100, 512, 1500]), batch=batch)
    p = plan(profile, work)
    hp = p.strategies["hpipe"].predicted_s
    for name, sp in p.strategies.items():
        assert hp <= sp.predicted_s * (1 + 1e-12), (name, hp, sp.predicted_s)
        assert sum(sp.slices) == work.seq_len
    assert p.ideal_s <= hp * (1 + 1e-9)  # nothing beats all devices sharing the work perfectly


def test_interleave_splits_each_stage_into_rounds():
    from planner.strategies import interleave

    assert interleave((0, 4, 10, 13), (2, 0, 1), 2) == ((0, 2, 5, 7, 9, 12, 13), (2, 0, 1, 2, 0, 1))
    assert interleave((0, 4, 10, 13), (2, 0, 1), 4) is None  # the last stage has 3 units
    assert interleave((0, 13), (0,), 2) is None


def test_interleaving_shortens_fill_and_drain():
    """Three devices of speeds 1 : 0.5 : 0.27 (the emulated cluster's) and a 30-block model: filling
    and draining a 3-stage pipeline costs ~2 slice times of each device; with each device holding
    two or three ranges it costs a half or a third of that, so hpipe picks an interleaved chain."""
    from tests.planner.synthetic import grid

    rng = random.Random(1)
    base = make_profile(rng, n=3, layers=30)
    devices = tuple(replace(d, compute={"embed": grid(1e-6 / v, 1e-5), "attn": grid(2e-5 / v, 1e-4, 1e-9 / v),
                                        "mlp": grid(3e-5 / v, 1e-4), "head": grid(1e-5 / v, 5e-5)})
                    for d, v in zip(base.daemons, (1.0, 0.5, 0.27)))
    links = tuple(replace(link, latency_s=1e-4, bandwidth_Bps=1.25e8) for link in base.links)
    profile = replace(base, daemons=devices, links=links)
    work = Workload(seq_len=2048)
    hp = plan(profile, work).strategies["hpipe"]  # interleaving is a default candidate
    names = [s.daemon for s in hp.stages]
    assert len(names) > len(set(names)) == 3  # a device holds several ranges
    assert all(a != b for a, b in zip(names, names[1:]))
    chain = plan(profile, work, max_ranges=1).strategies["hpipe"]  # one range per device
    assert len(chain.stages) == 3
    assert hp.predicted_s < 0.97 * chain.predicted_s
    # what each hop costs a CPU host's compute is in the price: dear enough, one range each wins
    costly = replace(profile, links=tuple(replace(link, send_cpu_s=0.1, recv_cpu_s=0.1) for link in links))
    assert len(plan(costly, work).strategies["hpipe"].stages) == 3


def test_a_plan_for_an_answer_prices_every_decoded_token_through_its_chain():
    """An interleaved chain fills and drains faster but makes V times the hops per token: for the
    prompt alone hpipe interleaves, for a prompt and a long answer (a job's --max-new-tokens) it
    keeps one range a device, and the plan says what each strategy's answer costs."""
    from planner.strategies import answer_token_s
    from tests.planner.synthetic import grid

    rng = random.Random(1)
    base = make_profile(rng, n=3, layers=30)
    devices = tuple(replace(d, compute={"embed": grid(1e-6 / v, 1e-5), "attn": grid(2e-5 / v, 1e-4, 1e-9 / v),
                                        "mlp": grid(3e-5 / v, 1e-4), "head": grid(1e-5 / v, 5e-5)})
                    for d, v in zip(base.daemons, (1.0, 0.5, 0.27)))
    profile = replace(base, daemons=devices,
                      links=tuple(replace(link, latency_s=2e-3, bandwidth_Bps=1.25e8) for link in base.links))
    prompt = plan(profile, Workload(seq_len=2048))
    assert len(prompt.chosen.stages) > 3 and "answer" not in prompt.meta  # interleaved; prefill alone
    answered = plan(profile, Workload(seq_len=2048, output_len=512))
    hp = answered.chosen
    assert len(hp.stages) == 3
    token_s = answered.meta["answer"]["token_s"]
    assert set(token_s) >= {"hpipe", "base", "terapipe"} and token_s["hpipe"] > 0
    interleaved = prompt.chosen
    cost = CostModel(profile)
    chain = tuple(profile.daemons.index(next(d for d in profile.daemons if d.name == st.daemon))
                  for st in interleaved.stages)
    bounds = (0, *interleaved.cuts, profile.model.num_units)
    longer = answer_token_s(cost, Workload(seq_len=2048, output_len=512), bounds, chain)
    assert longer > token_s["hpipe"] + 5e-3  # at least 3 more hops of 2 ms
    # the answer decides: the plan chosen is the fastest to prefill plus the answer
    assert hp.predicted_s + 512 * token_s["hpipe"] < interleaved.predicted_s + 512 * longer


def test_plan_round_trip_and_slices_for_every_length():
    profile = make_profile(random.Random(5), n=3, layers=3)
    p = plan(profile, Workload(seq_len=400, max_len=1024))
    again = Plan.from_json(p.to_json())
    assert again.to_dict() == p.to_dict()
    assert again.slices_for(400) == list(p.strategies["hpipe"].slices)
    for length in (1, 15, 16, 17, 333, 1024):
        sl = again.slices_for(length)
        assert sum(sl) == length and min(sl) >= 1
    with pytest.raises(PlanError, match="exceeds the plan's max length 1024"):
        again.slices_for(1025)


def test_infeasible_requests_are_clear():
    profile = make_profile(random.Random(2), n=2, layers=2)
    with pytest.raises(InfeasibleError, match="context of 4096"):
        plan(profile, Workload(seq_len=5000))
    with pytest.raises(InfeasibleError, match="does not fit"):
        plan(make_profile(random.Random(2), n=2, layers=2, memory=10_000), Workload(seq_len=64))
    with pytest.raises(ProfileError, match="lacks links"):
        Profile.from_dict({**profile.to_dict(), "links": []})


def test_a_scaled_profile_re_predicts_a_plan():
    """bench --profile re-simulates each schedule on the profile scaled by each device's drift."""
    from planner.strategies import timeline

    profile = make_profile(random.Random(7), n=3, layers=3)
    work = Workload(seq_len=600, max_len=1024)
    p = plan(profile, work)
    for sp in p.strategies.values():  # unscaled: exactly the plan's prediction
        assert timeline(profile.scaled({}), work, sp).makespan == pytest.approx(sp.predicted_s, rel=1e-12)
    hp = p.strategies["hpipe"]
    slower = profile.scaled({d.name: 2.0 for d in profile.daemons})
    t = timeline(slower, work, hp).makespan
    assert hp.predicted_s < t < 2 * hp.predicted_s + 1e-12  # compute doubles, links do not
    # only one device slower: only schedules using it change
    one = hp.stages[0].daemon
    assert timeline(profile.scaled({one: 1.5}), work, hp).makespan > hp.predicted_s
    with pytest.raises(ProfileError, match="no daemon nope"):
        profile.scaled({"nope": 1.0})
    with pytest.raises(ProfileError, match="finite and > 0"):
        profile.scaled({one: 0.0})


def test_one_item_schedules_run_at_the_devices_speed_alone():
    """A measured profile is slowed by co-location; Base (one item) never has two stages busy at once."""
    from dataclasses import replace

    profile = make_profile(random.Random(7), n=3, layers=3)
    work = Workload(seq_len=600, max_len=1024)
    factors = {d.name: 1.5 for d in profile.daemons}
    colocated = replace(profile.scaled(factors), meta={**profile.meta, "colocation_factors": factors})
    alone, together = plan(profile, work), plan(colocated, work)
    base0, base1 = alone.strategies["base"], together.strategies["base"]
    assert base1.predicted_s == pytest.approx(base0.predicted_s, rel=1e-9)
    assert [s.compute_s for s in base1.stages] == pytest.approx([s.compute_s for s in base0.stages], rel=1e-9)
    # sliced, the stages overlap: they compute at co-located speed
    tera0, tera1 = alone.strategies["terapipe"], together.strategies["terapipe"]
    assert len(tera1.slices) > 1 and tera1.predicted_s > 1.2 * tera0.predicted_s
    assert together.ideal_s == pytest.approx(1.5 * alone.ideal_s, rel=1e-9)


def test_moving_slices_costs_a_cpu_hosts_compute_not_an_accelerators():
    """A CPU daemon's transport threads share its cores with the compute: each slice a stage
    receives and sends adds the link's host CPU cost to that stage; a GPU's host runs beside it."""
    from planner.costs import CostModel
    from planner.strategies import stage_computes

    base = make_profile(random.Random(3), n=3, layers=2)
    costly = replace(base, links=tuple(replace(l, send_cpu_s=1e-3, send_cpu_s_per_byte=2e-9, recv_cpu_s=5e-4,
                                               recv_cpu_s_per_byte=1e-9) for l in base.links))
    work, bounds, devices, slices = Workload(seq_len=256), (0, 2, 4, 6), (0, 1, 2), [128, 128]
    plain = stage_computes(CostModel(base), work, bounds, devices, 1, slices)
    more = stage_computes(CostModel(costly), work, bounds, devices, 1, slices)
    nbytes = 128 * costly.activation_bytes_per_token()
    send, recv = 1e-3 + 2e-9 * nbytes, 5e-4 + 1e-9 * nbytes
    for j, extra in enumerate((send, recv + send, recv)):
        assert list(more[j] - plain[j]) == pytest.approx([extra, extra], rel=1e-9)
    # the planner's predictions include it; an accelerator's stages do not pay it
    assert plan(costly, work).strategies["hpipe"].predicted_s > plan(base, work).strategies["hpipe"].predicted_s
    gpu = replace(costly, daemons=tuple(replace(d, device="cuda:0") for d in costly.daemons))
    on_gpu = stage_computes(CostModel(gpu), work, bounds, devices, 1, slices)
    assert all(list(a) == pytest.approx(list(b), rel=1e-12) for a, b in zip(on_gpu, stage_computes(
        CostModel(replace(base, daemons=gpu.daemons)), work, bounds, devices, 1, slices)))
    # profiles from before the measurement read as costing nothing, and round-trip with it
    assert Profile.from_json(costly.to_json()) == costly
    old = json.loads(base.to_json())
    for link in old["links"]:
        for k in ("send_cpu_s", "send_cpu_s_per_byte", "recv_cpu_s", "recv_cpu_s_per_byte"):
            del link[k]
    assert Profile.from_dict(old) == base


def test_profile_round_trip():
    profile = make_profile(random.Random(9), n=3, layers=2, batches=(1, 2))
    assert Profile.from_json(profile.to_json()) == profile
    with pytest.raises(ProfileError, match="version"):
        Profile.from_dict({**profile.to_dict(), "version": 99})


def test_cli_plan(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(make_profile(random.Random(4), n=3, layers=2).to_json())
    out, chart = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--profile", str(path), "--seq-len", "512", "-o", str(out), "--chart", str(chart),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["predicted"]) == {"hpipe", "base", "gpipe", "gp_b", "terapipe"}
    assert sum(summary["slices"]) == 512 and isinstance(summary["cuts"], list)
    assert chart.stat().st_size > 1000 and Plan.from_json(out.read_text()).seq_len == 512
    assert main(["plan", "--profile", str(path), "--seq-len", "9000"]) == 1
    assert "context" in capsys.readouterr().err
    assert main(["plan", "--profile", str(path), "--seq-len", "512", "--max-ranges-per-device", "3", "-o",
                 str(tmp_path / "plan3.json")]) == 0
    capsys.readouterr()
    assert main(["plan", "--profile", str(path), "--seq-len", "512", "--output-len", "48", "-o",
                 str(tmp_path / "answer.json")]) == 0
    assert "with a 48-token answer" in capsys.readouterr().err
    assert Plan.from_json((tmp_path / "answer.json").read_text()).meta["answer"]["output_len"] == 48


def test_cli_plan_for_serving_executes_the_throughput_split(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(make_profile(random.Random(4), n=3, layers=2).to_json())
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(path), "--seq-len", "512", "--max-len", "1024", "--objective", "throughput",
                 "--output-len", "64", "-o", str(out), "--json"]) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert "throughput" in summary["predicted"] and "hpipe" in summary["predicted"]
    assert "seconds per request on each daemon" in printed.err
    the_plan = Plan.from_json(out.read_text())
    assert the_plan.strategy == "throughput" and the_plan.meta["serving"]["mix"]["output"] == 64
    assert main(["plan", "--profile", str(path), "--seq-len", "512", "--strategy", "throughput", "-o",
                 str(tmp_path / "p2.json")]) == 1
    assert "--objective throughput" in capsys.readouterr().err


def test_cli_what_if_profile(tmp_path, capsys):
    out = tmp_path / "paper.json"
    assert main(["profile", "--simulate", "--cluster", "clusters/paper-hpipe.yaml", "--model", "random:llama-7b",
                 "--dtype", "float16", "--max-len", "2048", "--batch", "6", "-o", str(out)]) == 0
    profile = Profile.from_json(out.read_text())
    assert profile.source == "simulated" and len(profile.daemons) == 6
    assert profile.link("p100-0", "rtx3090-0").bandwidth_Bps == pytest.approx(125e6)
    assert main(["profile", "--simulate", "--cluster", "clusters/local-3.yaml", "--model", "random:llama-7b"]) == 1
    assert "needs a 'spec'" in capsys.readouterr().err


def test_the_demo_benches_each_distinct_baseline_once():
    from hpipe.app.demo import distinct_strategies

    p = plan(make_profile(random.Random(3), n=3, layers=2), Workload(seq_len=512))
    assert p.strategies["gpipe"].micro_batches == 1  # batch 1: GPipe's schedule is Base's
    assert distinct_strategies(p) == ["hpipe", "base", "gp_b", "terapipe"]
