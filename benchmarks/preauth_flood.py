"""What callers that never authenticate cost a daemon: its resident memory and threads, idle and
with N data connections open that each announce a 4 MiB Hello and never send it; then its peak
memory and an authorized Status's slowest answer while M gRPC callers without the token, each on
its own connection, send 64 MiB messages (a unary call and a stream each, tests/runtime/grpc_flood.py).

    python benchmarks/preauth_flood.py [--connections 1000] [--grpc-clients 500] [--mib 64]

Starts one ``hpipe daemon`` (with a token) on free loopback ports and stops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import pb


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--grpc-clients", type=int, default=500)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    token = Path(tempfile.mkdtemp()) / "token"
    token.write_text("s3cret")
    port, data_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "daemon", "--port", str(port), "--data-port",
                             str(data_port), "--token-file", str(token)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socks = []
    try:
        client = DaemonClient(f"127.0.0.1:{port}", Security(token="s3cret"))
        while not client.health():
            time.sleep(0.2)
        time.sleep(1.0)
        p = psutil.Process(proc.pid)
        idle = p.memory_info().rss, p.num_threads()
        for _ in range(args.connections):
            s = socket.create_connection(("127.0.0.1", data_port), timeout=10)
            s.sendall(struct.pack("<I", 4 << 20) + b"\0" * 1024)
            socks.append(s)
        time.sleep(2.0)
        flooded = p.memory_info().rss, p.num_threads()
        print(f"idle: {idle[0] >> 20} MB, {idle[1]} threads; with {args.connections} connections announcing "
              f"4 MiB Hellos: {flooded[0] >> 20} MB, {flooded[1]} threads")
        for s in socks:
            s.close()
        socks.clear()
        time.sleep(2.0)
        grpc_flood(p, client, port, args.grpc_clients, args.mib)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def grpc_flood(p: psutil.Process, client: DaemonClient, port: int, clients: int, mib: int) -> None:
    idle = peak = p.memory_info().rss
    flood = subprocess.Popen([sys.executable, "-m", "tests.runtime.grpc_flood", f"127.0.0.1:{port}",
                              "--clients", str(clients), "--mib", str(mib)], stdout=subprocess.PIPE, text=True)
    slowest, calls = 0.0, 0
    while flood.poll() is None:
        peak = max(peak, p.memory_info().rss)
        t0 = time.perf_counter()
        client.call("Status", pb.StatusRequest(), timeout=10)
        slowest, calls = max(slowest, time.perf_counter() - t0), calls + 1
        time.sleep(0.05)
    answered = json.loads(flood.communicate()[0])
    print(f"{clients} gRPC callers without the token, {mib} MiB messages, all at once: {answered}; the daemon "
          f"{idle >> 20} MB idle, {peak >> 20} MB at most (+{(peak - idle) >> 20}); {calls} authorized Status "
          f"calls meanwhile, the slowest {slowest * 1000:.0f} ms")


if __name__ == "__main__":
    main()
