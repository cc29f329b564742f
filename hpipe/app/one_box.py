"""``hpipe serve --model M`` and ``hpipe run --model M``: one command, no cluster file and no plan.

Without ``--plan``, the command makes one on the spot, as ``hpipe demo`` does, and says each step
on stderr: the cluster (``--cluster``, else one daemon on this machine using all its cores), which
it starts where it is not already serving and stops when the command ends; the cluster's profile
(measured once per device and model and cached, about a minute the first time, seconds after);
and a plan for the model up to ``--max-len`` tokens (``hpipe serve``: the serving split for a
mix of 1,024-token prompts and 128-token answers; ``hpipe run``: HPipe's plan for ``--max-len``
tokens, whose slicing table covers every shorter document).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from hpipe.core.paths import cache_root

#: the port of the daemon a one-box command starts (the bundled clusters use 50151 and up)
LOCAL_PORT = 50150
#: the longest input a plan made on the spot supports unless told (a model's context may be far longer)
DEFAULT_MAX_LEN = 4096


def say(msg: str) -> None:
    print(f"hpipe: {msg}", file=sys.stderr, flush=True)


def local_cluster(model: str):
    """One CPU daemon on this machine (all its cores), allowed to read ``model``'s directory when
    ``model`` is a path; its cluster file is kept in the cache, where ``cluster down`` finds it."""
    from hpipe.core.cluster import ClusterSpec

    daemon: dict = {"name": "local", "address": f"127.0.0.1:{LOCAL_PORT}", "device": "cpu"}
    path = Path(model).expanduser()
    if path.exists():
        daemon["model_dirs"] = [str(path.resolve().parent)]
    spec = cache_root() / "one-box" / "cluster.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump({"name": "one-box", "daemons": [daemon]}, sort_keys=False), encoding="utf-8")
    return ClusterSpec.load(spec)


@contextmanager
def planned(model: str, cluster_file: str | None, *, max_len: int | None, seq_len: int | None, serving: bool,
            output_len: int = 128, dequantize: bool = False) -> Iterator[tuple]:
    """``(plan, cluster, source)`` for ``model``, made on the spot (see the module's note); the
    daemons this started are stopped on leaving. ``seq_len``: the prompt length to plan for
    (default: ``max_len``, or 1,024 for serving); ``output_len``: the answer tokens (a job's, or
    the serving mix's mean)."""
    from hpipe.app.plan_report import plan_table
    from hpipe.core.cluster import ClusterSpec
    from hpipe.core.errors import InputError
    from hpipe.model.weights.sources import resolve_model
    from planner.costs import Workload
    from planner.serving import Mix
    from planner.strategies import plan as make_plan
    from profiler.measure import profile_cluster
    from runtime.cluster import launcher
    from runtime.coordinator.pipeline import coordinate_on_one_thread

    source = resolve_model(model)
    cfg = source.config
    max_len = max_len or min(DEFAULT_MAX_LEN, cfg.max_position_embeddings)
    if max_len > cfg.max_position_embeddings:
        raise InputError(f"--max-len {max_len} exceeds {model}'s context of {cfg.max_position_embeddings} tokens")
    seq_len = min(seq_len or (min(1024, max_len) if serving else max_len), max_len)
    cluster = ClusterSpec.load(cluster_file) if cluster_file else local_cluster(model)
    say(f"no --plan: planning {model} on {cluster.name} ({len(cluster.daemons)} daemon(s)) for up to {max_len} "
        "tokens; --plan skips this")
    started = launcher.up(cluster)
    try:
        say("profiling (cached per device and model: about a minute the first time)")
        profile = profile_cluster(cluster, model, cfg, max_len=max_len, say=say, **source.held_weights(dequantize))
        # a job's plan is the fastest to its answers: prefill, then output_len tokens decoded
        work = Workload(seq_len, 1, max_len, output_len=0 if serving else output_len)
        mix = Mix(seq_len, output_len, 16) if serving else None
        plan = make_plan(profile, work, strategy="throughput" if serving else "hpipe", mix=mix)
        print(plan_table(plan), file=sys.stderr)
        coordinate_on_one_thread()
        yield plan, cluster, source
    finally:
        if any(v.startswith("started") for v in started.values()):
            say(f"stopping the daemons this started ({cluster.name})")
            launcher.down(cluster)
