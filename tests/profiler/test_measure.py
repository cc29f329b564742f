"""hpipe profile against live daemons: structure, cache, links, failures named."""

import json
import time

import pytest

from hpipe.cli import main
from hpipe.errors import HpipeError
from profiler.links import fit_link
from profiler.measure import _grids, profile_cluster
from profiler.schema import Profile
from runtime.cluster import ClusterSpec
from tests.cluster_helpers import free_ports


def test_profile_live_cluster_and_cache(cluster3, smollm2, tmp_path, capsys):
    out = tmp_path / "profile.json"
    args = ["profile", "--cluster", str(cluster3.path), "--model", "smollm2-135m", "--max-len", "128",
            "--repeats", "1", "-o", str(out)]
    assert main(args + ["--force"]) == 0
    err = capsys.readouterr().err
    assert "links (latency ms / bandwidth MB/s)" in err and "s2" in err
    profile = Profile.from_json(out.read_text())
    assert profile.source == "measured" and [d.name for d in profile.devices] == ["s0", "s1", "s2"]
    assert len(profile.links) == 6 and all(l.bandwidth_Bps > 1e6 for l in profile.links)
    attn = profile.devices[0].compute["attn"]
    assert attn.tokens[-1] == 128 and len(attn.contexts) > 1
    # attention grows with the slice, and the profile is a usable cost model
    assert attn.time(128, 0, 1) > attn.time(16, 0, 1) > 0
    assert all(d.memory_bytes > 0 for d in profile.devices)
    t0 = time.perf_counter()
    assert main(args) == 0  # unchanged devices: compute comes from the cache
    assert time.perf_counter() - t0 < 20
    again = Profile.from_json(out.read_text())
    # the three daemons share one fingerprint: all now come from the one cached grid
    assert again.meta["cached"] == ["s0", "s1", "s2"] and profile.meta["cached"] == []
    # they share this machine, so each was also timed while the others computed
    assert set(again.meta["colocation_factors"]) == {"s0", "s1", "s2"}
    assert all(f >= 1.0 for f in again.meta["colocation_factors"].values())


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
        _grids(NS(name="x", address="a:1"), bad)


def test_link_fit_recovers_latency_and_bandwidth():
    sizes = [1_000, 10_000, 100_000, 1_000_000]
    lat, bw = fit_link(sizes, [0.001 + n / 50e6 for n in sizes])
    assert lat == pytest.approx(0.001, rel=1e-6) and bw == pytest.approx(50e6, rel=1e-6)


def test_config_dict_round_trips_every_family_and_shape(tiny_dirs):
    """Daemons rebuild the model's shape from config_dict: it must lose nothing that changes the work."""
    from hpipe.config import ModelConfig
    from hpipe.shapes import SHAPES, model_shape
    from profiler.measure import config_dict

    configs = [ModelConfig.from_file(d / "config.json") for d in tiny_dirs.values()]
    configs += [model_shape(f"random:{name}")[1] for name in SHAPES]
    for cfg in configs:
        assert ModelConfig.from_dict(config_dict(cfg)) == cfg, cfg.architecture
