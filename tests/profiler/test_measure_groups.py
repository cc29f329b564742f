"""Daemons of one machine measured together, and one failing beside the others (fake daemons)."""

import time

import pytest

from hpipe.core.errors import HpipeError


class _FakeDaemon:
    """A client whose ProfileCompute takes ``seconds`` (or fails), and whose TimeStage is counted."""

    def __init__(self, seconds: float, fail: bool = False):
        import threading

        self.seconds, self.fail, self.loads, self.lock = seconds, fail, [], threading.Lock()
        self.asked: list[list[int]] = []

    def call(self, method, request, timeout=None):
        from types import SimpleNamespace as NS

        import grpc

        if method == "ProfileCompute":
            time.sleep(self.seconds)
            if self.fail:
                class Failed(grpc.RpcError):
                    def code(self):
                        return grpc.StatusCode.INTERNAL

                    def details(self):
                        return "out of memory"
                raise Failed()
            tokens = list(request.tokens)
            self.asked.append(tokens)
            return NS(units=[NS(kind=k, batches=[1], tokens=tokens, contexts=[0], seconds=[t / 1600 for t in tokens])
                             for k in ("embed", "attn", "mlp", "head")])
        assert method == "TimeStage"
        time.sleep(0.01)
        with self.lock:
            self.loads.append(time.perf_counter())
        return NS(seconds=0.01)


def _group(*daemons, prints=None):
    from types import SimpleNamespace as NS

    group = [NS(name=f"d{i}", address=f"127.0.0.1:{i}") for i in range(len(daemons))]
    clients = {d.name: c for d, c in zip(group, daemons)}
    infos = {d.name: NS(fingerprint=p) for d, p in zip(group, prints or ["same"] * len(daemons))}
    ref = {"units": [1, 3], "tokens": 16, "context": 0, "batch": 1}
    return group, clients, infos, ({}, "float32", ref)


def _request(tokens=(1, 16)):
    from runtime.wire.messages import pb

    return pb.ProfileRequest(batches=[1], tokens=list(tokens), contexts=[0])


class _Bar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass


def test_daemons_sharing_a_machine_measure_together_and_keep_each_other_busy(tmp_path, monkeypatch):
    from profiler import measure

    monkeypatch.setenv("HPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measure, "LOAD_CHUNK_S", 0.05)
    quick, slow = _FakeDaemon(0.1), _FakeDaemon(0.6)
    group, clients, infos, ref_args = _group(quick, slow, prints=["fast", "slow"])
    t0 = time.perf_counter()
    grids, cached = measure._group_grids(group, clients, infos, _request(), ["k"], False, True, ref_args, _Bar())
    assert set(grids) == {"d0", "d1"} and cached == []
    # the quick daemon kept timing the reference stage while the slow one measured, then stopped
    assert len(quick.loads) >= 5 and not slow.loads
    assert max(quick.loads) < t0 + 0.6 + 0.2
    # cached as a group: the next profile reuses both
    again, cached = measure._group_grids(group, clients, infos, _request(), ["k"], False, True, ref_args, _Bar())
    assert cached == ["d0", "d1"] and again["d1"]["attn"].time(16, 0, 1) == pytest.approx(0.01)


def test_a_daemon_failing_beside_others_is_named_without_waiting_for_them(tmp_path, monkeypatch):
    from profiler import measure

    monkeypatch.setenv("HPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measure, "LOAD_CHUNK_S", 0.05)
    group, clients, infos, ref_args = _group(_FakeDaemon(0.05, fail=True), _FakeDaemon(3.0))
    t0 = time.perf_counter()
    with pytest.raises(HpipeError, match=r"daemon d0 \(127.0.0.1:0\) failed to profile itself: INTERNAL: out of memory"):
        measure._group_grids(group, clients, infos, _request(), ["k"], False, True, ref_args, _Bar())
    assert time.perf_counter() - t0 < 2.5  # the other daemon takes 3 s: its grid was not awaited


def test_twins_time_one_grid_between_them(tmp_path, monkeypatch):
    """Daemons of one fingerprint on one machine (local-3's) each time a share of the slice lengths,
    longest first to the least loaded; every daemon gets the whole grid, cached once."""
    from profiler import measure

    monkeypatch.setenv("HPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measure, "LOAD_CHUNK_S", 0.05)
    fakes = [_FakeDaemon(0.05), _FakeDaemon(0.05), _FakeDaemon(0.05), _FakeDaemon(0.05)]
    group, clients, infos, ref_args = _group(*fakes, prints=["twin", "twin", "twin", "other"])
    tokens = [1, 16, 64, 128, 129, 256, 512, 1024, 2048]
    grids, _ = measure._group_grids(group, clients, infos, _request(tokens), ["k"], False, True, ref_args, _Bar())
    shares = [f.asked[0] for f in fakes[:3]]
    assert sorted(t for share in shares for t in share) == tokens  # each length timed once among the twins
    assert shares == [[2048], [64, 1024], [1, 16, 128, 129, 256, 512]]  # 2,048, 1,088 and 1,042 tokens
    assert fakes[3].asked == [tokens]  # a device of its own times the whole axis
    for d in ("d0", "d1", "d2", "d3"):
        assert grids[d]["mlp"].tokens == tuple(tokens)
        assert grids[d]["mlp"].time(512, 0, 1) == pytest.approx(512 / 1600)
    again, cached = measure._group_grids(group, clients, infos, _request(tokens), ["k"], False, True, ref_args, _Bar())
    assert cached == ["d0", "d1", "d2", "d3"] and again["d1"] == grids["d0"]


def test_a_split_axis_merges_back_and_refuses_overlaps():
    from hpipe.core.errors import HpipeError
    from hpipe.core.profile import ComputeGrid
    from profiler.grid import merge_grids, split_tokens

    assert split_tokens([1, 16], 3) == [[16], [1], []]
    parts = [{"attn": ComputeGrid((1,), tuple(ts), (0, 8), tuple([tuple((t, t + 1.0) for t in ts)]))}
             for ts in ([16], [1, 64])]
    whole = merge_grids(parts)["attn"]
    assert whole.tokens == (1, 16, 64) and whole.seconds == (((1, 2.0), (16, 17.0), (64, 65.0)),)
    with pytest.raises(HpipeError, match="overlap"):
        merge_grids(parts + parts[:1])
