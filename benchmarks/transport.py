"""The data plane against a raw socket, on loopback between two processes, and what sending costs
a computing worker.

    python benchmarks/transport.py [--mb 64] [--transfers 8] [--rounds 3] [--compute-s 3]

Rate: ``--transfers`` messages of ``--mb`` MB from this process to a receiver process, timed to the
receiver's acknowledgement of the last, for a raw socket (``sendall`` of a buffer, ``recv_into``
a preallocated one: the ceiling) and for hpipe's transport (a frame header, then the tensor's
bytes read into a fresh tensor, as a daemon receives an activation), alternating, ``--rounds``
times. Worker: a thread multiplying matrices for ``--compute-s`` seconds, alone, then while
another thread of the same process keeps sending ``--mb`` MB activations, ``--rounds`` times
alternating; its rate with sending over its rate alone in each round, and their median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time

import torch

from runtime.wire.data_server import DataServer
from runtime.wire.messages import pb
from runtime.wire.transport import Connection, connect, read_payload


def _raw_receiver(port_q, nbytes: int, transfers: int, rounds: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(rounds):
        conn, _ = srv.accept()
        for _ in range(transfers):
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:])
        conn.sendall(b"k")
        conn.close()


def _hpipe_receiver(port_q, transfers: int) -> None:
    def serve(conn: Connection, session: int, key: bytes) -> None:
        for _ in range(transfers):
            frame = conn.read_frame()
            read_payload(conn.sock, frame.activation.payload_bytes)
        conn.sock.sendall(b"k")
        try:
            conn.read_frame()  # until the sender closes
        except Exception:  # noqa: BLE001 - the end of the connection
            pass

    server = DataServer("127.0.0.1", None, serve)
    port_q.put(server.port)
    threading.Event().wait()


def _sink(port_q) -> None:
    """A receiver that reads frames for ever (the worker test's far end)."""
    def serve(conn: Connection, session: int, key: bytes) -> None:
        while True:
            frame = conn.read_frame()
            read_payload(conn.sock, frame.activation.payload_bytes)

    server = DataServer("127.0.0.1", None, serve)
    port_q.put(server.port)
    threading.Event().wait()


def _start(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *args), daemon=True)
    proc.start()
    return proc, q.get(timeout=60)


def raw_rate(port: int, payload: bytearray, transfers: int) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for _ in range(transfers):
        sock.sendall(payload)
    sock.recv(1)
    elapsed = time.perf_counter() - t0
    sock.close()
    return transfers * len(payload) / elapsed


def hpipe_rate(port: int, tensor: torch.Tensor, transfers: int) -> float:
    conn = connect("127.0.0.1", port, None, 0)
    nbytes = tensor.numel() * tensor.element_size()
    t0 = time.perf_counter()
    for i in range(transfers):
        conn.send(pb.Frame(activation=pb.Activation(micro_batch=i, stage=1, payload_bytes=nbytes)), tensor)
    conn.sock.recv(1)
    elapsed = time.perf_counter() - t0
    conn.close()
    return transfers * nbytes / elapsed


def worker_rate(seconds: float, sending: threading.Event | None) -> float:
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--transfers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compute-s", type=float, default=3.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the worker of a one-thread daemon
    nbytes = args.mb << 20
    payload = bytearray(nbytes)
    tensor = torch.randn(nbytes // 4)
    raw_proc, raw_port = _start(_raw_receiver, nbytes, args.transfers, args.rounds)
    rates = {"raw": [], "hpipe": []}
    for _ in range(args.rounds):
        rates["raw"].append(raw_rate(raw_port, payload, args.transfers))
        hp_proc, hp_port = _start(_hpipe_receiver, args.transfers)
        rates["hpipe"].append(hpipe_rate(hp_port, tensor, args.transfers))
        hp_proc.terminate()
    raw_proc.terminate()

    sink_proc, sink_port = _start(_sink)
    conn = connect("127.0.0.1", sink_port, None, 0)
    alone, busy, send_rates = [], [], []
    for _ in range(args.rounds):  # alone and while sending, alternating: the VM's speed drifts
        alone.append(worker_rate(args.compute_s, None))
        stop, sent = threading.Event(), [0]

        def keep_sending(stop=stop, sent=sent):
            while not stop.is_set():
                conn.send(pb.Frame(activation=pb.Activation(stage=1, payload_bytes=nbytes)), tensor)
                sent[0] += nbytes

        sender = threading.Thread(target=keep_sending, daemon=True)
        t0 = time.perf_counter()
        sender.start()
        busy.append(worker_rate(args.compute_s, stop))
        stop.set()
        sender.join()
        send_rates.append(sent[0] / (time.perf_counter() - t0))
    conn.close()
    sink_proc.terminate()
    worker_ratios = [b / a for a, b in zip(alone, busy)]
    out = {"mb": args.mb, "raw_MBps": [r / 1e6 for r in rates["raw"]], "hpipe_MBps": [r / 1e6 for r in rates["hpipe"]],
           "ratio": statistics.median(h / r for h, r in zip(rates["hpipe"], rates["raw"])),
           "worker_alone_per_s": alone, "worker_sending_per_s": busy, "worker_ratios": worker_ratios,
           "worker_ratio": statistics.median(worker_ratios), "sending_MBps_meanwhile": [r / 1e6 for r in send_rates]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.mb} MB messages, loopback, two processes, {args.rounds} rounds x {args.transfers} messages")
    print("  raw socket  MB/s: " + ", ".join(f"{r:.0f}" for r in out["raw_MBps"]))
    print("  hpipe       MB/s: " + ", ".join(f"{r:.0f}" for r in out["hpipe_MBps"]))
    print(f"  hpipe / raw (median of rounds): {out['ratio']:.2f}")
    print(f"worker matmuls/s, alone against while this process sends ({args.rounds} rounds, alternating):")
    for a, b, r in zip(alone, busy, send_rates):
        print(f"  {a:.1f} against {b:.1f} while sending {r / 1e6:.0f} MB/s ({b / a:.2f}x)")
    print(f"  median {out['worker_ratio']:.2f}x (rounds {min(worker_ratios):.2f}-{max(worker_ratios):.2f})")

if __name__ == "__main__":
    main()
