"""hpipe profile against live daemons: structure, cache, links, failures named."""

import time

import pytest
import torch

from hpipe.app.cli import main
from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from hpipe.core.profile import ComputeGrid, Profile
from profiler.grid import grid_axes, grids_from_reply
from profiler.links import fit_host_cpu, fit_link, fit_probes
from profiler.measure import profile_cluster
from tests.cluster_helpers import free_ports
from tests.helpers import need_cpu_kernels


def test_profile_live_cluster_and_cache(cluster3, smollm2, tmp_path, capsys):
    out = tmp_path / "profile.json"
    args = ["profile", "--cluster", str(cluster3.path), "--model", "smollm2-135m", "--max-len", "128",
            "--repeats", "1", "--colocation-rounds", "2", "-o", str(out)]
    assert main(args + ["--force"]) == 0
    err = capsys.readouterr().err
    assert "links (latency ms / bandwidth MB/s)" in err and "s2" in err
    profile = Profile.from_json(out.read_text())
    assert profile.source == "measured" and [d.name for d in profile.daemons] == ["s0", "s1", "s2"]
    # the built-in GGUF's daemons hold Q4_1 blocks (and a Q8_0 embedding): its bits, and units timed so
    assert 5.0 < profile.weight_bits < 6.0 and "weights held at 5.74 bits" in err
    assert len(profile.links) == 6 and all(l.bandwidth_Bps > 1e6 for l in profile.links)
    # moving activations costs each end's host CPU, measured per byte on every link: a noisy
    # difference of CPU clocks, clamped at 0 (profiler.links.fit_host_cpu), so one link's may come
    # out 0 on a loaded machine (a fresh-clone CI run had one); not all six
    assert all(l.send_cpu_s_per_byte >= 0 and l.recv_cpu_s_per_byte >= 0 for l in profile.links)
    assert sum(l.send_cpu_s_per_byte for l in profile.links) > 0 and sum(l.recv_cpu_s_per_byte
                                                                         for l in profile.links) > 0
    assert all(1e-6 < l.send_cpu(128 * 576 * 4) < 0.1 for l in profile.links)
    assert "host CPU ms per 128-token slice" in err
    attn = profile.daemons[0].compute["attn"]
    assert attn.tokens[-1] == 128 and len(attn.contexts) > 1
    # attention grows with the slice, and the profile is a usable cost model
    assert attn.time(128, 0, 1) > attn.time(16, 0, 1) > 0
    assert all(d.memory_bytes > 0 for d in profile.daemons)
    # how much CPU the hypervisor took from each daemon while it was profiled (Linux knows)
    assert set(profile.meta["steal_s"]) == {"s0", "s1", "s2"} and min(profile.meta["steal_s"].values()) >= 0
    assert "CPU steal while profiling" in err
    assert main(args) == 0  # unchanged devices: compute comes from the cache
    again = Profile.from_json(out.read_text())
    # the three share this machine: their grids were measured together, as a pipeline runs them,
    # and are cached as a group (unchanged devices: all three now come from the cache)
    assert profile.meta["measured_together"] == ["s0", "s1", "s2"]
    assert again.meta["cached"] == ["s0", "s1", "s2"] and profile.meta["cached"] == []
    # they share this machine, so each was also timed while the others computed
    assert set(again.meta["colocation_factors"]) == {"s0", "s1", "s2"}
    assert all(f >= 1.0 for f in again.meta["colocation_factors"].values())
    # every daemon's reference stage time, measured fresh even with cached grids, for bench --profile
    ref = again.meta["reference"]
    assert set(ref["seconds"]) == {"s0", "s1", "s2"} and all(t > 0 for t in ref["seconds"].values())
    assert ref["tokens"] == 32 and ref["context"] == 64 and ref["units"] == [1, 1 + 2 * (30 // 3)]


def test_calibration_needs_a_profile_with_reference_timings(cluster3):
    import random

    from profiler.reference import calibrate
    from tests.planner.synthetic import make_profile

    with pytest.raises(HpipeError, match="no reference timings"):  # synthetic and simulated profiles have none
        calibrate(cluster3.spec, make_profile(random.Random(0), n=3))


def test_a_down_daemon_is_named(tmp_path, smollm2):
    port = free_ports(1)[0]
    path = tmp_path / "c.yaml"
    path.write_text(f"name: broken\ndaemons:\n  - name: ghost\n    address: 127.0.0.1:{port}\n")
    with pytest.raises(HpipeError, match=r"daemon ghost \(127.0.0.1:\d+\) is down or unreachable"):
        profile_cluster(ClusterSpec.load(path), "smollm2-135m", smollm2.config, max_len=64)


def test_malformed_reply_is_refused():
    from types import SimpleNamespace as NS

    bad = NS(units=[NS(kind="attn", batches=[1], tokens=[1, 2], contexts=[0], seconds=[0.1])])
    with pytest.raises(HpipeError, match="malformed attn profile"):
        grids_from_reply(NS(name="x", address="a:1"), bad)


def test_the_token_axis_has_the_step_after_each_block_boundary():
    _, tokens, _ = grid_axes(2048, 1)
    assert {128, 129, 256, 257, 512, 513, 2048} <= set(tokens) and 769 not in tokens
    assert grid_axes(128, 1)[1][-1] == 128  # never past max_len
    # a cost that steps up past 128 tokens (as SmolLM2's MLP does on MKL) is then read right at 144
    step = ComputeGrid((1,), tuple(tokens), (0,), (tuple((t + (50.0 if t > 128 else 0.0),) for t in tokens),))
    assert step.time(144, 0, 1) == pytest.approx(194.0)


def test_link_fit_recovers_latency_and_bandwidth():
    sizes = [1_000, 10_000, 100_000, 1_000_000]
    lat, bw = fit_link(sizes, [0.001 + n / 50e6 for n in sizes])
    assert lat == pytest.approx(0.001, rel=1e-6) and bw == pytest.approx(50e6, rel=1e-6)


def test_link_probes_fit_a_budget_by_the_links_rough_rate():
    """Every size and round on a fast link; on a Wi-Fi-class one fewer rounds, then fewer of the
    largest sizes, so each link takes seconds rather than minutes; never under the minimums."""
    sizes = [2304 * t for t in (1, 16, 64, 256, 512, 1024, 2048, 4096)]  # SmolLM2's activations, float32
    assert fit_probes(sizes, 21, 125e6, budget_s=10.0) == (sizes, 21)  # 1 Gbit/s: 3.3 s as asked
    these, repeats = fit_probes(sizes, 21, 2.5e6, budget_s=10.0)  # 20 Mbit/s: 163 s as asked
    assert (these, repeats) == (sizes[:5], 7)  # up to 512 tokens (0.47 s each), 8 sends of each
    assert (repeats + 1) * sum(these) / 2.5e6 <= 10.0
    assert fit_probes(sizes, 21, 1e4, budget_s=10.0) == (sizes[:3], 7)  # hopeless: the least it measures with


def test_host_cpu_fit_separates_per_message_from_per_byte():
    sizes, messages = [18_432, 1_179_648], [22, 22]
    per_message, per_byte = fit_host_cpu(sizes, messages, [22 * (2e-4 + n * 3e-9) for n in sizes])
    assert per_message == pytest.approx(2e-4, rel=1e-6) and per_byte == pytest.approx(3e-9, rel=1e-6)
    # noise that would make the per-message part negative: a line through the origin instead
    per_message, per_byte = fit_host_cpu(sizes, messages, [22 * n * 3e-9 - 0.001 for n in sizes])
    assert per_message == 0.0 and per_byte > 0
    # an unmeasured host (a daemon whose replies carry no CPU time) costs nothing
    assert fit_host_cpu(sizes, messages, [0.0, 0.0]) == (0.0, 0.0)


def _bursty_points(n_points: int, burst: range):
    """Points that each take 2 ms, except every call whose global index is in ``burst`` (40 ms):
    the machine slowing down for a few consecutive calls, whatever point is running then."""
    calls = [0]

    def run():
        i = calls[0]
        calls[0] += 1
        time.sleep(0.04 if i in burst else 0.002)

    def points(sweep):
        for k in range(n_points):
            yield k, run
    return points


def test_sweeps_keep_a_slowdown_out_of_the_medians():
    """A burst of slowness spoils one sample of several points, which the median across sweeps drops.

    Timed back to back, as profiles were before, the same burst spoils every sample of one point.
    """
    import torch

    from profiler.device import WARMUP_CALLS, _median_time, swept_medians

    first_sweep = 5 * (WARMUP_CALLS + 1)
    burst = range(first_sweep + 1, first_sweep + 4)  # three consecutive calls of the second sweep
    medians = swept_medians(_bursty_points(5, burst), 3, torch.device("cpu"), min_total_s=0.0, max_runs=3)
    assert sorted(medians) == list(range(5))
    assert max(medians.values()) < 0.02, medians

    calls = _bursty_points(1, range(1, 4))  # warm-up, then the three timed runs all in the burst
    run = next(iter(calls(0)))[1]
    assert _median_time(run, torch.device("cpu"), 3) > 0.03


def test_a_short_point_is_timed_at_the_rate_it_sustains_back_to_back():
    """A device under a CPU quota runs a short call at full speed while its period's budget lasts,
    then waits out the period: here one call in three. A busy stage runs calls back to back, so the
    grid must read their mean (4 ms), not the fast calls' median (1 ms)."""
    import torch

    from profiler.device import swept_medians

    calls = [0]

    def run():
        calls[0] += 1
        time.sleep(0.010 if calls[0] % 3 == 0 else 0.001)

    medians = swept_medians(lambda sweep: iter([("p", run)]), 3, torch.device("cpu"), min_total_s=0.09, max_runs=60)
    assert 0.003 < medians["p"] < 0.0055, medians


def test_the_calls_that_grow_the_heap_are_not_timed():
    """A point's first calls on a CPU run slower than the rest (heap growth, page faults): none is timed."""
    import torch

    from profiler.device import swept_medians

    calls = [0]

    def run():  # the first two calls are slow, as an MLP's are (see WARMUP_CALLS)
        calls[0] += 1
        time.sleep(0.03 if calls[0] <= 2 else 0.002)

    # two sweeps: the median is the mean of two samples, so one slow timed call would show
    medians = swept_medians(lambda sweep: iter([("p", run)]), 2, torch.device("cpu"), min_total_s=0.0, max_runs=2)
    assert medians["p"] < 0.01, medians


def test_a_long_point_is_warmed_once_and_timed_in_fewer_sweeps(monkeypatch):
    """A point whose first call takes LONG_CALL_S or more (a billion-parameter block's long slice)
    is not called nine times: one warm-up, then one call in each of the first LONG_SWEEPS sweeps;
    short points keep every sweep."""
    from types import SimpleNamespace

    import torch

    import profiler.device as device

    monkeypatch.setattr(device, "LONG_CALL_S", 0.02)
    clock = [0.0]  # the profiler's clock, advanced only by the calls: no machine's speed decides
    monkeypatch.setattr(device, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = {"long": 0, "short": 0}

    def call(key, seconds):
        def run():
            calls[key] += 1
            clock[0] += seconds
        return run

    points = lambda sweep: iter([("long", call("long", 0.025)), ("short", call("short", 0.001))])  # noqa: E731
    medians = device.swept_medians(points, 7, torch.device("cpu"), min_total_s=0.0, max_runs=7)
    assert calls == {"long": 1 + device.LONG_SWEEPS, "short": device.WARMUP_CALLS + 7}
    assert medians["long"] >= 0.025 and medians["short"] < 0.02


def test_a_timed_stage_is_kept_for_the_next_timing_of_its_shape():
    """Co-located daemons time together; none should spend that window building weights again."""
    import torch

    import profiler.device as device
    from hpipe.core.config import ModelConfig
    from hpipe.core.units import UnitRange

    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100,
                                     hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
    cpu, units = torch.device("cpu"), UnitRange(1, 4, 2)
    assert device.time_stage(cfg, torch.float32, cpu, units, 1, 8, 4, repeats=1) > 0
    built = device._built[1]
    device.time_stage(cfg, torch.float32, cpu, units, 1, 8, 4, repeats=1)
    assert device._built[1] is built  # same shape: reused
    device.time_stage(cfg, torch.float32, cpu, UnitRange(1, 3, 2), 1, 8, 4, repeats=1)
    assert device._built[1] is not built and device._built[0][3] == UnitRange(1, 3, 2)  # replaced, not added
    device.release_timed_stages()
    assert device._built is None


def test_units_are_timed_in_the_blocks_the_daemons_hold():
    """A config sent with a ``quantization_config`` naming a ggml type is timed on units whose
    matrices are random blocks of that type; an unreadable type is refused."""
    import json

    from hpipe.core.errors import InputError
    from hpipe.core.shapes import random_config
    from hpipe.model.compute.linear import QuantLinear
    from hpipe.model.compute.stage import StageModel
    from profiler.device import measure_units
    from profiler.service import config_from_json

    cfg = random_config("random:tiny")
    shape = {**cfg.to_dict(), "quantization_config": {"quant_method": "gguf", "ggml_type": 8}}
    assert config_from_json(json.dumps(shape)) == (cfg, 8)
    assert config_from_json(json.dumps(cfg.to_dict())) == (cfg, 0)
    with pytest.raises(InputError, match="ggml type 10"):
        config_from_json(json.dumps({**shape, "quantization_config": {"ggml_type": 10}}))
    stage = StageModel.random(cfg, cfg_units(cfg), weight_type=8)
    assert any(isinstance(m, QuantLinear) for m in stage.modules())
    times = measure_units(cfg, torch.float32, torch.device("cpu"), [1], [1, 16], [0, 16], 64, repeats=1,
                          weight_type=8)
    assert all(t > 0 for kind in times.values() for plane in kind for row in plane for t in row)


def test_the_grid_times_quantized_prefill_rows_as_a_stage_computes_them(monkeypatch):
    """A daemon's stage marks the rows of slices of two tokens or more as prefill's, which its
    quantized projections multiply in bfloat16 where the prefill is (decode tokens stay float32):
    the profile's grid marks the same rows, or it would time quantized prefill at float32's cost."""
    from hpipe.core.shapes import random_config
    from hpipe.model.compute import linear
    from profiler.device import measure_units

    seen = []
    forward = linear.QuantLinear.forward

    def spy(self, x):
        if self.low_precision:
            rows = linear._PREFILL_ROWS.get()
            seen.append((x.reshape(-1, x.shape[-1]).shape[0], None if rows is None else int(rows.sum())))
        return forward(self, x)

    monkeypatch.setattr(linear.QuantLinear, "forward", spy)
    monkeypatch.setenv("HPIPE_CPU_KERNEL", "off")  # one-token points through the units (else: the next test)
    cfg = random_config("random:tiny")
    measure_units(cfg, torch.float32, torch.device("cpu"), [1, 2], [1, 16], [0, 16], 64, repeats=1, weight_type=8)
    assert {n for n, _ in seen} == {1, 2, 16, 32}  # one token of one or two sequences, 16 of one or two
    assert all(marked == (n if n >= 16 else None) for n, marked in seen), seen


@pytest.mark.usefixtures("cpu_kernels")
def test_one_token_points_are_timed_through_the_decode_kernel_as_a_daemon_decodes_them(monkeypatch):
    """A CPU daemon computes a micro-batch of one-token decode entries through the C++ decode
    kernel, each attention and MLP unit there: the grid's one-token points (one token of each of
    ``b`` sequences, at every context) are timed through it, the longer slices through the units."""
    from hpipe.core.shapes import random_config
    from hpipe.model.compute import stage_kernel
    from profiler.device import measure_units

    seen = []
    call = stage_kernel.StageKernel.__call__

    def spy(self, x, tables, entries, pool):
        seen.append((tuple(self.kinds), x.shape[0], {e.start for e in entries}, {e.length for e in entries}))
        return call(self, x, tables, entries, pool)

    monkeypatch.setattr(stage_kernel.StageKernel, "__call__", spy)
    cfg = random_config("random:tiny")
    times = measure_units(cfg, torch.float32, torch.device("cpu"), [1, 2], [1, 16], [0, 16], 64, repeats=1,
                          weight_type=8)
    assert {(kinds, rows) for kinds, rows, _, _ in seen} == {((0,), 1), ((0,), 2), ((1,), 1), ((1,), 2)}
    assert {start for kinds, _, starts, _ in seen if kinds == (0,) for start in starts} == {0, 16}  # each context
    assert all(lengths == {1} for *_, lengths in seen)
    assert all(t > 0 for kind in times.values() for plane in kind for row in plane for t in row)
    seen.clear()
    monkeypatch.setenv("HPIPE_CPU_KERNEL", "off")  # a daemon without the kernel decodes through the units
    measure_units(cfg, torch.float32, torch.device("cpu"), [1], [1, 16], [0], 64, repeats=1, weight_type=8)
    assert not seen


def cfg_units(cfg):
    from hpipe.core.units import UnitRange

    return UnitRange(0, cfg.num_units, cfg.num_layers)


def test_links_are_timed_over_the_data_plane():
    """MeasureLink sends its probes to the other daemon's data port (where activations arrive), with
    the cluster's token, and a daemon's data plane answers each one."""
    import grpc

    from runtime.wire.channels import Security
    from runtime.wire.messages import pb
    from tests.cluster_helpers import Served

    a, b = Served("a", token="t0k"), Served("b", token="t0k")
    try:
        client = a.client(Security(token="t0k"))
        sizes = [0, 1 << 10, 1 << 20, 8 << 20]
        reply = client.call("MeasureLink", pb.LinkRequest(target_address=b.address, target_data_port=b.stage.data.port,
                                                          sizes=sizes, repeats=3))
        assert list(reply.sizes) == sizes and all(s > 0 for s in reply.seconds)
        assert reply.seconds[-1] > reply.seconds[0]  # 8 MiB takes longer than nothing
        grpc_port = int(b.address.rsplit(":", 1)[1])  # the gRPC port speaks no data plane: refused, named
        with pytest.raises(grpc.RpcError) as e:
            client.call("MeasureLink", pb.LinkRequest(target_address=b.address, target_data_port=grpc_port,
                                                      sizes=[1], repeats=1))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and f":{grpc_port}" in e.value.details()
        client.close()
    finally:
        a.stop(), b.stop()


def test_quantized_prefill_is_timed_in_the_precision_runs_ask_for(monkeypatch):
    """A daemon times quantized prefill rows in the precision the coordinator's runs will ask of it
    (``HPIPE_PREFILL_GEMM``, as a Load sends it), not whatever its last deployment set, and keeps
    its own afterwards; the grid cache keys on it, so a grid timed in one is never reused for the other."""
    import json

    import grpc

    from hpipe.core.shapes import random_config
    from hpipe.model.compute import linear
    from profiler.measure import grid_request
    from tests.cluster_helpers import Served

    need_cpu_kernels()
    cfg = random_config("random:tiny")
    shape = {**cfg.to_dict(), "quantization_config": {"quant_method": "gguf", "ggml_type": 8}}
    keys = {}
    for mode in ("float32", "bfloat16", ""):
        monkeypatch.setenv("HPIPE_PREFILL_GEMM", mode)
        request, keys[mode] = grid_request(shape, "float32", ([1], [1, 16], [0, 16]), 64, 1)
        assert request.prefill_gemm == mode
    assert len({json.dumps(k) for k in keys.values()}) == 3
    seen = []
    forward = linear.QuantLinear.forward

    def spy(self, x):
        if self.low_precision and x.reshape(-1, x.shape[-1]).shape[0] > 1:
            seen.append(torch.ops.hpipe.prefill_gemm(""))
        return forward(self, x)

    monkeypatch.setattr(linear.QuantLinear, "forward", spy)
    bf16 = torch.ops.hpipe.bf16_gemm_kernel() != "none"
    before = torch.ops.hpipe.prefill_gemm("")
    served = Served("p")
    try:
        client = served.client()
        for mode in ("float32", "bfloat16"):
            request.prefill_gemm = mode
            seen.clear()
            if mode == "bfloat16" and not bf16:
                with pytest.raises(grpc.RpcError, match="bfloat16"):
                    client.call("ProfileCompute", request)
                continue
            client.call("ProfileCompute", request)
            assert seen and set(seen) == {mode}
            assert torch.ops.hpipe.prefill_gemm("") == before  # the daemon's own precision again
        client.close()
    finally:
        served.stop()


def test_a_profile_whose_caller_went_away_stops_at_its_next_point(monkeypatch):
    """An 8B grid runs for many minutes: a profile stopped by its caller must not keep the daemon busy."""
    import grpc

    import profiler.device as device
    from hpipe.core.shapes import random_config
    from profiler.measure import grid_request
    from tests.cluster_helpers import Served

    calls = [0]

    def slow_runs(fn, dev, at_least, min_total_s, at_most):
        calls[0] += 1
        time.sleep(0.02)
        return [0.001]

    monkeypatch.setattr(device, "_runs", slow_runs)
    cfg = random_config("random:tiny")
    request, _ = grid_request(cfg.to_dict(), "float32", ([1], [1, 2, 3, 4, 5, 6, 7, 8], [0, 8]), 64, 7)
    served = Served("p")
    try:
        client = served.client()
        with pytest.raises(grpc.RpcError) as e:  # the whole grid: 8 x 5 points x 7 sweeps x 20 ms, ~6 s
            client.call("ProfileCompute", request, timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5.0
        while True:  # within one slice length's points (5 x 20 ms) of the caller leaving
            seen = calls[0]
            time.sleep(0.5)
            if calls[0] == seen or time.monotonic() > deadline:
                break
        assert calls[0] == seen and seen < 8 * 5 * 7 / 2, calls  # stopped, and well before the end
        client.close()
    finally:
        served.stop()


def test_the_reference_stage_of_a_big_model_stays_small():
    """A 1/n share of an 8B's blocks took 10-15 s a call, and the co-location rounds call it about
    70 times: its blocks are capped at REFERENCE_BYTES of weights; a small model's share is kept."""
    from hpipe.core.shapes import random_config
    from profiler.reference import REFERENCE_BYTES, reference_stage

    big = random_config("random:llama3-8b")
    block = big.block_weights * 4.89 / 8  # Q4_K_M's bits per weight
    ref = reference_stage(big, 3, 4096, 1, block)
    blocks = (ref["units"][1] - ref["units"][0]) // 2
    assert blocks == int(REFERENCE_BYTES // block) == 2 and ref["tokens"] == 128
    assert reference_stage(big, 3, 4096, 1) == {**ref, "units": [1, 21]}  # no size given: 10 blocks
    small = random_config("random:tiny")
    assert reference_stage(small, 2, 512, 1, small.block_weights * 4)["units"] == [1, 5]
