"""``hpipe serve`` under load: concurrent streaming clients, against the engine replaying the same
requests, on a live cluster (loopback only, bounded in count and time).

    python benchmarks/serve_load.py --plan plan.json --cluster clusters/local-3.yaml \
        [--clients 64] [--cancel 16] [--seed 0]

Starts ``hpipe serve`` on a free loopback port; ``--clients`` streaming completions start at once
(prompts of 64-2,048 tokens cut from the bundled sample report, outputs of 16-256 tokens with
``ignore_eos``); checks every one completes with its tokens and none is lost. Then the same
requests (the prompt and output lengths the server reported) replayed by the engine directly
(``hpipe bench --workload``'s code), side by side: the server's total tokens/s over the engine's.
Last, ``--cancel`` clients are cut off mid-stream, and every stage's KV pool must then return to
empty. Prints throughput, time to first token p50/p99, and the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import httpx

from hpipe.app.workload_bench import run_once
from hpipe.core.cluster import ClusterSpec
from hpipe.core.plan import Plan
from hpipe.core.workload import WorkItem
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.deploy import deploy
from runtime.coordinator.pipeline import coordinate_on_one_thread
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import pb


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(tokenizer, n: int, seed: int, most: int) -> list[tuple[str, int]]:
    text = files("hpipe").joinpath("data/sample_report.md").read_text()
    ids = tokenizer(text * 4)["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, start = rng.randint(64, min(2048, most)), rng.randrange(0, len(ids) // 2)
        out.append((tokenizer.decode(ids[start:start + length]), rng.randint(16, 256)))
    return out


async def client(base: str, model: str, prompt: str, max_tokens: int, cancel_after: int | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.monotonic()
    first, chunks, usage = None, 0, None
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as http:
        async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {await r.aread()}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if event["choices"] and event["choices"][0].get("text"):
                    chunks += 1
                    first = first or time.monotonic()
                    if cancel_after is not None and chunks >= cancel_after:
                        return {"cancelled": True}
    return {"ttft": (first or time.monotonic()) - t0, "done": time.monotonic(), "usage": usage}


def _pools_drain(cluster: ClusterSpec, deadline_s: float) -> bool:
    """Whether every daemon's KV pools hold nothing but the prefix cache's blocks within
    ``deadline_s`` (idle cached blocks stay, by design, until the pool needs them), asked over the
    control plane."""
    clients = [DaemonClient(d.address, Security.of(cluster), d.name) for d in cluster.daemons]
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            pools = [p for c in clients for p in c.call("Status", pb.StatusRequest(), timeout=10.0).pools]
            used = [p.used_blocks - p.cached_blocks for p in pools]
            if not any(used):
                return True
            if time.monotonic() > deadline:
                print(f"[serve] blocks held beyond the prefix cache's: {used}", file=sys.stderr)
                return False
            time.sleep(0.2)
    finally:
        for c in clients:
            c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cancel", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = Plan.from_json(Path(args.plan).read_text())
    source = resolve_model(plan.model_name)
    tokenizer = source.tokenizer()
    cluster = ClusterSpec.load(args.cluster)
    work = prompts(tokenizer, args.clients, args.seed, plan.max_len - 8)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", "--plan", args.plan, "--cluster",
                               args.cluster, "--port", str(port), "--max-queue", str(4 * args.clients),
                               "--served-model-name", "m"], start_new_session=True)
    out: dict = {"clients": args.clients}
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("hpipe serve did not come up")
            time.sleep(0.5)

        async def all_clients():
            return await asyncio.gather(*(client(base, "m", p, n) for p, n in work))

        t0 = time.monotonic()
        results = asyncio.run(all_clients())
        errors = [r["error"] for r in results if "error" in r]
        served = [r for r in results if r.get("usage")]
        complete = sum(r["usage"]["completion_tokens"] == n for r, (_, n) in zip(results, work) if r.get("usage"))
        span = max(r["done"] for r in served) - t0
        ttfts = sorted(r["ttft"] for r in served)
        out.update(errors=errors, complete=complete, span_s=round(span, 2),
                   server_tokens_per_s=round(sum(r["usage"]["total_tokens"] for r in served) / span, 1),
                   ttft_p50_s=round(statistics.median(ttfts), 3),
                   ttft_p99_s=round(ttfts[int(0.99 * (len(ttfts) - 1))], 3))
        print(f"[serve] {complete}/{args.clients} complete in {span:.1f} s, {out['server_tokens_per_s']} "
              f"tokens/s, ttft p50 {out['ttft_p50_s']} s p99 {out['ttft_p99_s']} s, errors {len(errors)}",
              file=sys.stderr, flush=True)

        async def cancelled():
            return await asyncio.gather(*(client(base, "m", p, 256, cancel_after=3) for p, _ in work[:args.cancel]))

        asyncio.run(cancelled())
        out["pools_empty_after_cancel"] = _pools_drain(cluster, deadline_s=30)
        print(f"[serve] {args.cancel} clients cut off mid-stream: pools empty: {out['pools_empty_after_cancel']}",
              file=sys.stderr, flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    items = [WorkItem(0.0, r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) for r in served]
    coordinate_on_one_thread()  # as hpipe run and hpipe serve do
    with deploy(plan, cluster) as deployed:
        engine = run_once(plan, deployed.pipe, items, "gllm", args.seed)
    out["engine_tokens_per_s"] = engine["total_tokens_per_s"]
    out["server_over_engine"] = round(out["server_tokens_per_s"] / engine["total_tokens_per_s"], 3)
    if args.json:
        print(json.dumps(out))
        return
    print(f"server {out['server_tokens_per_s']} tokens/s, engine on the same requests {out['engine_tokens_per_s']}: "
          f"{out['server_over_engine']:.2f}; {out['complete']}/{args.clients} complete, ttft p50 "
          f"{out['ttft_p50_s']} s p99 {out['ttft_p99_s']} s; pools empty after {args.cancel} cancelled: "
          f"{out['pools_empty_after_cancel']}")


if __name__ == "__main__":
    main()
