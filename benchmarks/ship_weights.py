"""Weights sent to daemons that hold no model file: bytes, seconds and rate per daemon, then a
second deploy after the daemons restart.

    python benchmarks/ship_weights.py --cluster clusters/emulated-hetero.yaml [--model smollm2-135m]

(root for an emulated cluster). Each daemon gets an empty weights cache of its own and reads no
model file (the GGUF is copied to a directory outside its --model-dirs and hpipe's cache), so all
it holds is sent by the coordinator (runtime.coordinator.ship). The rate is compared with the
daemon's shaped link (``emulate: {rate: ...}``). The daemons are then restarted and the plan
deployed again: nothing moves, and the load reads the cache (each entry's hash checked).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import yaml

from hpipe.core.cluster import ClusterSpec
from hpipe.model.weights.sources import resolve_model
from runtime.cluster import launcher
from runtime.coordinator.pipeline import Pipeline, cut_stages

UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_rate(rate: str | None) -> float | None:
    """Bytes a second of an ``emulate: {rate: ...}`` (None: unshaped)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", str(rate or ""))
    return float(m.group(1)) * UNITS[m.group(2)] / 8 if m else None


def deploy(spec: ClusterSpec, model: str, num_units: int) -> tuple[float, list]:
    """Deploy an even split of the model on every daemon: seconds, and what each was sent."""
    pipe = Pipeline(spec)
    t0 = time.perf_counter()
    n = len(spec.daemons)
    pipe.load(model, cut_stages(spec, [num_units * i // n for i in range(1, n)], num_units), torch.float32)
    seconds = time.perf_counter() - t0
    transfers = pipe.transfers
    for t, loaded in zip(transfers, pipe.loads):
        t.load_s = loaded.load_s  # the daemon's own Load, after the transfer
    pipe.close()
    return seconds, transfers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    source = resolve_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="hpipe-ship-"))
    model = work / "model" / source.gguf.name
    model.parent.mkdir()
    shutil.copy(source.gguf, model)
    raw = yaml.safe_load(Path(args.cluster).read_text())
    raw["name"] = f"{raw['name']}-ship"
    for d in raw["daemons"]:
        d["weights_cache"] = str(work / "caches" / d["name"])
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = ClusterSpec.load(path)
    units = source.config.num_units
    try:
        launcher.up(spec)
        first_s, first = deploy(spec, str(model), units)
        launcher.down(spec)
        launcher.up(spec)
        second_s, second = deploy(spec, str(model), units)
    finally:
        launcher.down(spec)
    rows = []
    for d, t, again in zip(spec.daemons, first, second):
        shaped = link_rate(d.emulate.get("rate"))
        rows.append({"daemon": d.name, "bytes": t.sent_bytes, "seconds": round(t.seconds, 3),
                     "MB_s": round(t.rate / 1e6, 1), "link_MB_s": round(shaped / 1e6, 1) if shaped else None,
                     "of_link": round(t.rate / shaped, 2) if shaped else None, "second_deploy_bytes": again.sent_bytes,
                     "load_s": [round(t.load_s, 2), round(again.load_s, 2)]})
    result = {"model": args.model, "first_deploy_s": round(first_s, 2), "second_deploy_s": round(second_s, 2),
              "speedup": round(first_s / second_s, 1), "daemons": rows}
    if args.json:
        print(json.dumps(result))
        return
    for r in rows:
        print(f"{r['daemon']:>6}: {r['bytes'] / 1e6:7.1f} MB in {r['seconds']:6.2f} s = {r['MB_s']:6.1f} MB/s"
              + (f" ({r['of_link']:.2f} of its {r['link_MB_s']} MB/s link)" if r["of_link"] else "")
              + f"; its Load {r['load_s'][0]} s; second deploy sent {r['second_deploy_bytes']} bytes, "
              f"its Load {r['load_s'][1]} s")
    print(f"deploy: first {first_s:.2f} s (sending), second {second_s:.2f} s (from the caches, after a restart): "
          f"{first_s / second_s:.1f}x faster")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
