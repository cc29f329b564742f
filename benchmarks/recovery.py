"""What a daemon's death costs a long prefill: the same request failure-free and with the middle
daemon SIGKILLed halfway through its prefill, on a live local cluster started with ``hpipe
cluster up`` (whose supervisor restarts the daemon).

    python benchmarks/recovery.py --cluster clusters/local-3.yaml [--tokens 2048] [--new-tokens 16]

Prints both times, the time added, and what the issue's bar allows: the daemon's restart (from
the kill until it answers again), plus its load (the ``Load`` it reports), plus half the
failure-free prefill. Checks that both runs give the same tokens, and reports how the request
resumed (positions kept, and rebuilt on the restarted stage by replaying its predecessor's log). The model is SmolLM2-135M,
fp32, in three even stages; the prompt is the bundled sample report, repeated to ``--tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from importlib.resources import files

import torch

from hpipe.core.cluster import ClusterSpec
from hpipe.model.weights.sources import resolve_model
from runtime.cluster import launcher
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline, coordinate_on_one_thread, cut_stages
from runtime.coordinator.policies import POLICIES
from runtime.coordinator.recovery import Redeploy
from runtime.wire.channels import DaemonClient

MODEL = "smollm2-135m"


def run(pipe, stages, prompt, new_tokens, slicer, kill: str | None, cluster) -> dict:
    redeploy = Redeploy(pipe, MODEL, stages, torch.float32, grace_s=120)
    engine = Engine(pipe.session(), POLICIES["gllm"](), depth=len(stages), recover=redeploy)
    request = engine.add(Request(prompt, new_tokens, slicer=slicer))
    out: dict = {}
    if kill:
        def killer():
            while request.laid_out < len(prompt) // 2:
                time.sleep(0.005)
            pid = int((launcher.state_dir(cluster) / f"{kill}.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            d = cluster.daemon(kill)
            client = DaemonClient(d.address, pipe.security, kill)
            while not client.health(timeout=0.5):
                time.sleep(0.05)
            out["restart_s"] = time.monotonic() - t_kill
            client.close()
        threading.Thread(target=killer, daemon=True).start()
    t0 = time.monotonic()
    engine.run()
    out["total_s"] = time.monotonic() - t0
    out["prefill_s"] = request.first_token_s - t0
    out["tokens"] = request.tokens
    out["recoveries"] = [{**event, **resumed} for event, resumed in zip(redeploy.events, engine.resumes)]
    out["load_s"] = max(load.load_s for load in pipe.loads)
    engine.session.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="clusters/local-3.yaml")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--slice", type=int, default=128, help="prefill slice length")
    args = ap.parse_args()
    cluster = ClusterSpec.load(args.cluster)
    source = resolve_model(MODEL)
    cfg = source.config
    text = files("hpipe").joinpath("data/sample_report.md").read_text(encoding="utf-8")
    ids = source.tokenizer()(text)["input_ids"]
    prompt = (ids * (args.tokens // len(ids) + 1))[: args.tokens - args.new_tokens]
    slicer = lambda n: [args.slice] * (n // args.slice) + ([n % args.slice] if n % args.slice else [])  # noqa: E731
    coordinate_on_one_thread()  # as hpipe run and hpipe serve do
    pipe = Pipeline(cluster)
    stages = cut_stages(cluster, [cfg.num_units // 3, 2 * cfg.num_units // 3], cfg.num_units)
    victim = stages[1].daemon
    try:
        pipe.load(MODEL, stages, torch.float32)
        clean = run(pipe, stages, prompt, args.new_tokens, slicer, None, cluster)
        print(f"failure-free: {clean['total_s']:.2f} s (prefill {clean['prefill_s']:.2f} s)", file=sys.stderr)
        killed = run(pipe, stages, prompt, args.new_tokens, slicer, victim, cluster)
        print(f"{victim} killed at half the prefill: {killed['total_s']:.2f} s; restarted in "
              f"{killed['restart_s']:.2f} s, loaded in {killed['load_s']:.2f} s", file=sys.stderr)
    finally:
        pipe.close()
    added = killed["total_s"] - clean["total_s"]
    allowed = killed["restart_s"] + killed["load_s"] + clean["prefill_s"] / 2
    print(json.dumps({"prompt_tokens": len(prompt), "failure_free_s": round(clean["total_s"], 3),
                      "with_kill_s": round(killed["total_s"], 3), "added_s": round(added, 3),
                      "restart_s": round(killed["restart_s"], 3), "load_s": round(killed["load_s"], 3),
                      "half_prefill_s": round(clean["prefill_s"] / 2, 3), "allowed_s": round(allowed, 3),
                      "within_bar": added <= allowed, "same_tokens": killed["tokens"] == clean["tokens"],
                      "recoveries": killed["recoveries"]}))


if __name__ == "__main__":
    main()
