"""Daemons of one machine measured together, and one failing beside the others (fake daemons)."""

import time

import pytest

from hpipe.core.errors import HpipeError


class _FakeDaemon:
    """A client whose ProfileCompute takes ``seconds`` (or fails), and whose TimeStage is counted."""

    def __init__(self, seconds: float, fail: bool = False):
        import threading

        self.seconds, self.fail, self.loads, self.lock = seconds, fail, [], threading.Lock()

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
            return NS(units=[NS(kind=k, batches=[1], tokens=[1, 16], contexts=[0], seconds=[0.001, 0.01])
                             for k in ("embed", "attn", "mlp", "head")])
        assert method == "TimeStage"
        time.sleep(0.01)
        with self.lock:
            self.loads.append(time.perf_counter())
        return NS(seconds=0.01)


def _group(*daemons):
    from types import SimpleNamespace as NS

    group = [NS(name=f"d{i}", address=f"127.0.0.1:{i}") for i in range(len(daemons))]
    clients = {d.name: c for d, c in zip(group, daemons)}
    infos = {d.name: NS(fingerprint="same") for d in group}
    ref = {"units": [1, 3], "tokens": 16, "context": 0, "batch": 1}
    return group, clients, infos, ({}, "float32", ref)


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
    group, clients, infos, ref_args = _group(quick, slow)
    t0 = time.perf_counter()
    grids, cached = measure._group_grids(group, clients, infos, None, ["k"], False, True, ref_args, _Bar())
    assert set(grids) == {"d0", "d1"} and cached == []
    # the quick daemon kept timing the reference stage while the slow one measured, then stopped
    assert len(quick.loads) >= 5 and not slow.loads
    assert max(quick.loads) < t0 + 0.6 + 0.2
    # cached as a group: the next profile reuses both
    again, cached = measure._group_grids(group, clients, infos, None, ["k"], False, True, ref_args, _Bar())
    assert cached == ["d0", "d1"] and again["d1"]["attn"].time(16, 0, 1) == pytest.approx(0.01)


def test_a_daemon_failing_beside_others_is_named_without_waiting_for_them(tmp_path, monkeypatch):
    from profiler import measure

    monkeypatch.setenv("HPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measure, "LOAD_CHUNK_S", 0.05)
    group, clients, infos, ref_args = _group(_FakeDaemon(0.05, fail=True), _FakeDaemon(3.0))
    t0 = time.perf_counter()
    with pytest.raises(HpipeError, match=r"daemon d0 \(127.0.0.1:0\) failed to profile itself: INTERNAL: out of memory"):
        measure._group_grids(group, clients, infos, None, ["k"], False, True, ref_args, _Bar())
    assert time.perf_counter() - t0 < 2.5  # the other daemon takes 3 s: its grid was not awaited
