"""Callers that never authenticate cost a daemon next to nothing: idle data connections, and gRPC
callers sending large messages without the token (issue 64)."""

import json
import socket
import struct
import subprocess
import sys
import time

import psutil
import pytest

from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import pb
from runtime.wire.transport import LinkError, connect
from tests.cluster_helpers import free_ports

TOKEN = "s3cret"


def _rss_and_threads(pid: int) -> tuple[int, int]:
    p = psutil.Process(pid)
    return p.memory_info().rss, p.num_threads()


def _start_daemon(tmp_path) -> tuple[subprocess.Popen, int, int]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port, data_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "daemon", "--port", str(port), "--data-port",
                             str(data_port), "--token-file", str(token_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = DaemonClient(f"127.0.0.1:{port}", Security(token=TOKEN))
    deadline = time.monotonic() + 60
    while not client.health():
        assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
        time.sleep(0.2)
    client.close()
    return proc, port, data_port


def test_a_thousand_unauthenticated_connections_cost_next_to_nothing(tmp_path):
    proc, _, data_port = _start_daemon(tmp_path)
    socks = []
    try:
        time.sleep(1.0)
        idle_rss, idle_threads = _rss_and_threads(proc.pid)
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", data_port), timeout=10)
            if i % 3 == 0:
                s.sendall(struct.pack("<I", 4 << 20) + b"\0" * 1024)  # announces a 4 MiB Hello
            elif i % 3 == 1:
                s.sendall(struct.pack("<I", 200) + b"\x0a\x06s3")  # a Hello begun, never finished
            socks.append(s)
        time.sleep(1.0)
        rss, threads = _rss_and_threads(proc.pid)
        assert rss - idle_rss < 50 << 20, f"{(rss - idle_rss) >> 20} MiB more with 1,000 connections waiting"
        assert threads <= idle_threads + 2, (idle_threads, threads)
        connect("127.0.0.1", data_port, TOKEN, 0).close()  # and it still lets its own in
        with pytest.raises(LinkError, match="missing or wrong token"):
            connect("127.0.0.1", data_port, "guess", 0)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_callers_without_the_token_sending_large_messages_cost_little(tmp_path):
    """Issue 64: gRPC read each message whole (up to 64 MiB), and admitted a 16 MiB window on
    every stream, before the token check refused it: 100 such callers made a daemon grow by 2.3 GB
    and an authorized Status wait 1.8 s. Now a refusal reads no message and a daemon's streams
    admit 2 MiB each."""
    proc, port, _ = _start_daemon(tmp_path)
    client = DaemonClient(f"127.0.0.1:{port}", Security(token=TOKEN))
    flood = None
    try:
        time.sleep(1.0)
        idle = psutil.Process(proc.pid).memory_info().rss
        flood = subprocess.Popen([sys.executable, "-m", "tests.runtime.grpc_flood", f"127.0.0.1:{port}",
                                  "--clients", "100", "--mib", "32", "--timeout", "10"], stdout=subprocess.PIPE,
                                 text=True)
        peak, slowest, deadline = idle, 0.0, time.monotonic() + 120
        while flood.poll() is None and time.monotonic() < deadline:
            peak = max(peak, psutil.Process(proc.pid).memory_info().rss)
            t0 = time.perf_counter()
            client.call("Status", pb.StatusRequest(), timeout=10)
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.05)
        answers = json.loads(flood.communicate(timeout=60)[0])["answers"]
        assert not [a for a in answers if a.endswith(" OK")], answers
        assert peak - idle < 150 << 20, f"{(peak - idle) >> 20} MiB more while refusing large messages"
        assert slowest < 1.0, f"an authorized Status took {slowest:.2f} s"
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
