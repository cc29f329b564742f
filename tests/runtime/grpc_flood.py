"""Callers without the token, each on its own connection, sending large messages to a daemon's
gRPC port: a unary call (Load) and a stream (PutTensors) each. Prints what they were answered,
as JSON. Used by tests/runtime/test_daemon_trust.py and benchmarks/preauth_flood.py.

    python -m tests.runtime.grpc_flood HOST:PORT --clients 500 --mib 64 [--at-once 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import grpc

SERVICE = "/hpipe.v1.StageService/"


async def caller(address: str, payload: bytes, answers: Counter, timeout: float) -> None:
    # a connection of its own (no shared subchannel), as a caller on another host would have
    channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                          ("grpc.max_send_message_length", len(payload) + 1024)])
    try:
        for kind in ("unary", "stream"):
            try:
                if kind == "unary":
                    await channel.unary_unary(SERVICE + "Load")(payload, timeout=timeout)
                else:
                    async def chunks():
                        for _ in range(4):
                            yield payload
                    await channel.stream_unary(SERVICE + "PutTensors")(chunks(), timeout=timeout)
                answers[f"{kind} OK"] += 1
            except grpc.aio.AioRpcError as e:
                answers[f"{kind} {e.code().name}"] += 1
    finally:
        await channel.close()


async def flood(address: str, clients: int, size: int, at_once: int, timeout: float) -> dict:
    payload, answers, gate = b"\0" * size, Counter(), asyncio.Semaphore(at_once)

    async def one():
        async with gate:
            await caller(address, payload, answers, timeout)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(clients)))
    return {"seconds": round(time.perf_counter() - t0, 2), "answers": dict(answers)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("address")
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--mib", type=int, default=64, help="each message's size")
    ap.add_argument("--at-once", type=int, default=None, help="callers in flight at once (default: all)")
    ap.add_argument("--timeout", type=float, default=20.0, help="each call's deadline, seconds")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(flood(args.address, args.clients, args.mib << 20, args.at_once or args.clients,
                                       args.timeout))), flush=True)


if __name__ == "__main__":
    main()
