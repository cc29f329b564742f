"""What connections that never authenticate cost a daemon: its resident memory and threads, idle
and with N data connections open that each announce a 4 MiB Hello and never send it.

    python benchmarks/preauth_flood.py [--connections 1000]

Starts one ``hpipe daemon`` (with a token) on free loopback ports and stops it afterwards.
"""

from __future__ import annotations

import argparse
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from runtime.wire.channels import DaemonClient, Security


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000)
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
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
