"""What the page costs ``hpipe serve``: serving throughput under ``--clients`` streaming clients with
nobody watching, with the page's endpoint polled every second, and with the page itself open in
headless Chromium on the cluster view (on the same machine, so the browser's own CPU counts too),
side by side, in interleaved rounds (loopback only, bounded in count and time).

    python benchmarks/page_overhead.py [--model smollm2-135m] [--cluster clusters/local-3.yaml] \
        [--clients 64] [--rounds 3] [--screenshots docs/]

Starts ``hpipe serve --model`` (its daemons, profile and plan made on the spot, as a user's first
command does); each run sends ``--clients`` completions at once (128-token prompts cut from the
bundled report, 64 answer tokens each, ``ignore_eos``) and times them all. Every round runs the
three watchers once each, their order rotated from one round to the next. Prints tokens/s per run,
the medians and each watcher's ratio to nobody. With ``--screenshots DIR``, last: the chat (a
document and two questions about it, the second read from the prefix cache) and the cluster view
while a run goes on, as ``DIR/page-chat.png`` and ``DIR/page-cluster.png``.
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
import threading
import time
from importlib.resources import files
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.app.browser import launch, wait_for  # noqa: E402 - the tests' browser, after the path

WATCHERS = ("nobody", "endpoint", "page")
MODEL = [""]  # the served model's id, once the server is up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(tokenizer, n: int, seed: int) -> list[str]:
    ids = tokenizer(files("hpipe").joinpath("data/sample_report.md").read_text())["input_ids"]
    rng = random.Random(seed)
    return [tokenizer.decode(ids[(s := rng.randrange(0, len(ids) - 128)):s + 128]) for _ in range(n)]


async def _one(http: httpx.AsyncClient, base: str, prompt: str, tokens: int) -> int:
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = await http.post(f"{base}/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def run(base: str, prompts: list[str], tokens: int) -> float:
    """Answer tokens per second of all ``prompts`` sent at once."""
    async def all_of():
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
            return await asyncio.gather(*(_one(http, base, p, tokens) for p in prompts))
    t0 = time.perf_counter()
    done = asyncio.run(all_of())
    return sum(done) / (time.perf_counter() - t0)


class Poller:
    """``/api/live`` asked every second, as the page does, without a browser."""

    def __init__(self, base: str):
        self.base, self.stop, self.asked = base, threading.Event(), 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.wait(1.0):
                http.get(f"{self.base}/api/live").raise_for_status()
                self.asked += 1


def endpoint_cost(base: str, n: int = 200) -> tuple[float, int]:
    """Seconds one ``/api/live`` takes, end to end on loopback (the server's share is less), and its bytes."""
    with httpx.Client(timeout=10) as http:
        size = len(http.get(f"{base}/api/live").content)
        t0 = time.perf_counter()
        for _ in range(n):
            http.get(f"{base}/api/live").raise_for_status()
    return (time.perf_counter() - t0) / n, size


def bookkeeping_cost(daemons: int = 3, rounds: int = 600) -> float:
    """Seconds one collector round of :class:`hpipe.app.live.Live` takes for ``daemons`` daemons with a
    full history (what the page adds to the collector's Status calls, which /health already made)."""
    from types import SimpleNamespace

    from hpipe.app.live import HISTORY_S, Live
    from hpipe.core.plan import Plan, Stage, StrategyPlan
    from hpipe.core.units import UnitRange
    from hpipe.model.weights.sources import resolve_model

    cfg = resolve_model("smollm2-135m").config
    bounds = [round(i * cfg.num_units / daemons) for i in range(daemons + 1)]
    stages = tuple(Stage(f"d{i}", f"h:{i}", UnitRange(a, b, cfg.num_layers)) for i, (a, b) in
                   enumerate(zip(bounds, bounds[1:])))
    plan = Plan("m", cfg, "float32", 1, 64, 64, 16, "hpipe", {"hpipe": StrategyPlan("hpipe", stages, 1, (64,), 1.0)},
                {64: (64,)})
    live = Live(plan, every_s=1.0)

    def reply(k):
        return SimpleNamespace(loaded=True, clock_s=float(k), busy_s=k / 2, device="cpu", device_name="cpu",
                               threads=1, weight_bytes=1, kv_bytes=1, resident_bytes=1, free_bytes=1,
                               memory_budget=1,
                               pools=[SimpleNamespace(stage=0, used_blocks=k, blocks=9, cached_blocks=0)])
    for k in range(HISTORY_S):  # a full history first
        live.round(state="ok", health="", waiting=0, running=0, tokens=k, totals={})
    t0 = time.perf_counter()
    for k in range(rounds):
        for i in range(daemons):
            live.daemon(f"d{i}", f"h:{i}", reply(k))
        live.round(state="ok", health="", waiting=1, running=2, tokens=k, totals={})
    return (time.perf_counter() - t0) / rounds


def _serve(args, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", "--model", args.model, "--cluster",
                               args.cluster, "--port", str(port), "--max-queue", str(4 * args.clients)],
                              start_new_session=True)
    deadline = time.monotonic() + 900
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                MODEL[0] = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("hpipe serve did not come up")
        time.sleep(0.5)


def screenshots(browser, base: str, prompts: list[str], tokens: int, out: Path) -> None:
    """The chat with a document and two questions on it, then the cluster view under a run."""
    browser.get(base + "/")
    wait_for(lambda: browser.find_element("id", "model").text == MODEL[0], why="the page loads the model")
    report = files("hpipe").joinpath("data/sample_report.md").read_text()
    browser.execute_script("document.getElementById('documents').value = arguments[0]", report[:3000])
    browser.find_element("id", "system").send_keys("Answer from the document.")
    for question in ("What is this report about?", "Which figure does it give first?"):
        done = len(browser.find_elements("css selector", ".stats[data-done='1']"))
        browser.find_element("id", "prompt").send_keys(question)
        browser.find_element("id", "send").click()
        wait_for(lambda: len(browser.find_elements("css selector", ".stats[data-done='1']")) > done, 300,
                 why="the answer ends")
    browser.save_screenshot(str(out / "page-chat.png"))
    browser.find_element("id", "tab-cluster").click()
    load = threading.Thread(target=run, args=(base, prompts, tokens), daemon=True)
    load.start()
    time.sleep(12)  # a few points of every chart under load
    browser.set_window_size(1500, 1750)  # the whole view
    time.sleep(2)
    browser.save_screenshot(str(out / "page-cluster.png"))
    load.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cluster", default="clusters/local-3.yaml")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--screenshots", type=Path, help="save the page's two views here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from hpipe.model.weights.sources import resolve_model

    prompts = _prompts(resolve_model(args.model).tokenizer(), args.clients, args.seed)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = _serve(args, port)
    browser = launch(1500, 1100)
    rates: dict[str, list[float]] = {w: [] for w in WATCHERS}
    try:
        run(base, prompts[:8], 8)  # warm up
        for r in range(args.rounds):
            order = WATCHERS[r % 3:] + WATCHERS[:r % 3]
            for watcher in order:
                poller = None
                if watcher == "page":
                    browser.get(base + "/")
                    browser.find_element("id", "tab-cluster").click()
                elif watcher == "endpoint":
                    poller = Poller(base)
                    poller.thread.start()
                rate = run(base, prompts, args.tokens)
                if poller is not None:
                    poller.stop.set()
                    poller.thread.join()
                if watcher == "page":
                    browser.get("about:blank")
                rates[watcher].append(rate)
                print(f"round {r + 1} {watcher:>8}: {rate:7.1f} answer tokens/s", file=sys.stderr)
        poll_s, size = endpoint_cost(base)
        if args.screenshots:
            args.screenshots.mkdir(parents=True, exist_ok=True)
            screenshots(browser, base, prompts, args.tokens, args.screenshots)
    finally:
        browser.quit()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    round_s = bookkeeping_cost()
    med = {w: statistics.median(v) for w, v in rates.items()}
    paired = {w: sorted(a / b for a, b in zip(rates[w], rates["nobody"])) for w in ("endpoint", "page")}
    cores = len(os.sched_getaffinity(0))
    # per second of serving the page costs the server one round of bookkeeping and one poll
    bound = (round_s + poll_s) / cores
    out = {"clients": args.clients, "tokens": args.tokens, "rates": rates, "median": med, "paired": paired,
           "endpoint_over_nobody": statistics.median(paired["endpoint"]),
           "page_over_nobody": statistics.median(paired["page"]),
           "poll_s": poll_s, "live_bytes": size, "round_s": round_s, "cores": cores, "cost_bound": bound}
    print(f"median answer tokens/s: nobody {med['nobody']:.1f}, endpoint polled {med['endpoint']:.1f}, "
          f"page open in Chromium {med['page']:.1f}")
    for w in ("endpoint", "page"):
        print(f"  {w} / nobody, per round: {', '.join(f'{x:.3f}' for x in paired[w])} "
              f"(median {statistics.median(paired[w]):.3f})")
    print(f"cost per second of serving: one /api/live {1000 * poll_s:.2f} ms ({size / 1000:.0f} KB, loopback, "
          f"end to end) + one round of the page's bookkeeping {1000 * round_s:.2f} ms = "
          f"{100 * bound:.3f}% of {cores} cores")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
