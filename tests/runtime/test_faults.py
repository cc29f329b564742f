"""A daemon killed mid-prefill: the coordinator names it within a bounded time, and the
surviving daemons free the sequence's KV cache."""

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from hpipe.core.cluster import ClusterSpec
from hpipe.core.errors import HpipeError
from runtime.cluster import launcher
from runtime.coordinator.pipeline import Pipeline, StageFailure, cut_stages
from runtime.wire.messages import pb
from tests.cluster_helpers import RunningCluster, discard_state, write_cluster


def test_killed_daemon_mid_prefill(tmp_path, smollm2):
    with RunningCluster(write_cluster(tmp_path, 3, name="faulty")) as cluster:
        pipe = Pipeline(cluster.spec)
        pipe.load("smollm2-135m", cut_stages(pipe.cluster, [21, 41], smollm2.config.num_units), torch.float32)
        seq = pipe.open(1024)
        ids = torch.randint(0, smollm2.config.vocab_size, (1, 1024))
        for k in range(16):
            seq.submit(ids[:, 64 * k: 64 * (k + 1)], want_logits=False)
        seq.result()  # the first slice went through all three stages; fifteen are still in flight
        victim = int((launcher.state_dir(cluster.spec) / "s1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(StageFailure) as info:
            for _ in range(15):
                seq.result()
        elapsed = time.monotonic() - t0
        print(f"failure reported {elapsed:.2f}s after the kill: {info.value}")
        assert "stage 1 (s1 at" in str(info.value) and "not responding" in str(info.value), info.value
        assert elapsed < 15, elapsed
        deadline = time.monotonic() + 5
        for i in (0, 2):  # the survivors freed the sequence (on their workers, once they reach it)
            while True:
                status = pipe.clients[i].call("Status", pb.StatusRequest(sequence_ids=seq.ids))
                if not status.sequences[0].open and status.kv_bytes == 0:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.1)
        pipe.close()


def test_a_failed_cluster_up_leaves_no_daemon_behind(tmp_path):
    path = write_cluster(tmp_path, 2, name="half")
    spec = ClusterSpec.load(path)
    a, b = spec.daemons
    with socket.socket() as taken:  # b's port is in use: b cannot start
        taken.bind(("127.0.0.1", b.port))
        taken.listen(1)
        with pytest.raises(HpipeError, match=f"daemon {b.name}"):
            launcher.up(spec)

    def running(port):
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if b"daemon" in args and str(port).encode() in args:
                return True
        return False
    deadline = time.monotonic() + 10
    while running(a.port):
        assert time.monotonic() < deadline, "daemon a still runs after the failed start"
        time.sleep(0.1)
    assert not (launcher.state_dir(spec) / f"{a.name}.pid").exists()
    assert not (launcher.state_dir(spec) / launcher.SUPERVISOR_PID).exists()
    discard_state(spec)


def test_the_pools_of_a_pipeline_with_a_dead_daemon_are_a_stage_failure(tiny_dirs):
    # the engine reads the pools when it starts and after every recovery: a daemon that dies in
    # that instant is a broken pipeline (recovered again), not a gRPC error out of the job
    from hpipe.model.weights.sources import resolve_model
    from tests.cluster_helpers import Served, cluster_of

    path = str(tiny_dirs["llama"])
    daemons = [Served("a"), Served("b")]
    pipe = Pipeline(cluster_of(*daemons))
    try:
        pipe.load(path, cut_stages(pipe.cluster, [3], resolve_model(path).config.num_units), torch.float32)
        assert len(pipe.pools()) == 2
        daemons[1].stop()
        with pytest.raises(StageFailure, match="b at .* is not responding"):
            pipe.pools()
    finally:
        pipe.close()
        daemons[0].stop()


def test_a_session_whose_daemon_is_gone_is_a_stage_failure():
    """A daemon lost between a deployment and its session (a job starting): a StageFailure the
    recovery handles, not an AttributeError of a half-made session (as it was)."""
    from types import SimpleNamespace

    from hpipe.core.cluster import DaemonSpec
    from runtime.coordinator.session import Session, StageFailure
    from runtime.wire.channels import Security
    from tests.cluster_helpers import free_ports

    gone = SimpleNamespace(stages=[object()], vocab_size=8, security=Security(), clients=[], stage_daemon=[0],
                           daemons=[DaemonSpec.at("x", "127.0.0.1:1")], data_ports=free_ports(1))
    with pytest.raises(StageFailure):
        Session(gone)
