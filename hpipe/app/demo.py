"""The main job on built-in defaults: a local cluster, the bundled SmolLM2, the bundled sample report.

cluster up -> profile -> plan (for the sample's length) -> run (answer) -> bench (hpipe vs the
baselines, measured) -> cluster down. Every step is the same library call the CLI commands make.
The cluster is clusters/emulated-hetero.yaml (three CPU daemons of different speeds, 1 Gbit/s
links) where the machine can emulate it (root), else clusters/local-3.yaml.
"""

from __future__ import annotations

import json
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

from hpipe.core.cluster import bundled_clusters

EMULATED_CLUSTER = bundled_clusters()["emulated-hetero"]
LOCAL_CLUSTER = bundled_clusters()["local-3"]
INSTRUCTION = "What was the direct cause of the outage described in this report? Answer in one sentence."


def default_cluster() -> Path:
    """The emulated heterogeneous cluster where this machine can emulate one (root), else plain local daemons."""
    from runtime.cluster.emulate import unavailable

    why = unavailable()
    if why is None:
        return EMULATED_CLUSTER
    say(f"emulating devices of different speeds {why}; using {LOCAL_CLUSTER.name} (three equal local daemons)")
    return LOCAL_CLUSTER


def say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def distinct_strategies(plan) -> list[str]:
    """hpipe, and each baseline whose stages and slicing differ from an earlier baseline's (GPipe is Base at batch 1)."""
    seen, out = set(), []
    for name, sp in plan.strategies.items():
        key = (tuple((st.daemon, st.units.start, st.units.end) for st in sp.stages), sp.micro_batches, sp.slices)
        if name == "hpipe" or key not in seen:
            out.append(name)
        if name != "hpipe":
            seen.add(key)
    return out


def run_demo(cluster_file: Path | None = None, instruction: str = INSTRUCTION, max_new_tokens: int = 48,
             bench_repeat: int = 3) -> dict:
    from hpipe.app.bench import bench, table
    from hpipe.app.jobs import JobConfig, build_prompt, run_job
    from hpipe.app.plan_report import plan_table
    from hpipe.app.profile_report import summary
    from hpipe.core.cluster import ClusterSpec
    from hpipe.model.weights.sources import resolve_model
    from planner.costs import Workload
    from planner.strategies import plan as make_plan
    from profiler.measure import profile_cluster
    from runtime.cluster import launcher
    from runtime.coordinator.pipeline import coordinate_on_one_thread

    cluster_file = cluster_file or default_cluster()
    source = resolve_model("smollm2-135m")
    cfg = source.config
    document = files("hpipe").joinpath("data/sample_report.md").read_text(encoding="utf-8")
    cluster = ClusterSpec.load(cluster_file)
    say(f"starting cluster {cluster.name} ({len(cluster.daemons)} daemons)")
    started = launcher.up(cluster)
    try:
        say("profiling devices and links (cached per device after the first run)")
        profile = profile_cluster(cluster, "smollm2-135m", cfg, max_len=2048, **source.held_weights())
        print(summary(profile), file=sys.stderr)
        ids, _ = build_prompt(source.tokenizer(), instruction, document, True, 2048, "none")
        say(f"planning for the sample report: {len(ids)} prompt tokens")
        plan = make_plan(profile, Workload(seq_len=len(ids), max_len=2048))
        print(plan_table(plan), file=sys.stderr)
        work = Path(tempfile.mkdtemp(prefix="hpipe-demo-"))
        doc_path = work / "sample_report.md"
        doc_path.write_text(document, encoding="utf-8")
        plan_path = work / "plan.json"
        plan_path.write_text(plan.to_json())
        coordinate_on_one_thread()
        say("analysing the document through the pipeline")
        job = run_job(plan, cluster, source, [str(doc_path)], work / "results.jsonl",
                      JobConfig(instruction=instruction, chat=True, max_new_tokens=max_new_tokens))
        if job["failed"]:
            raise RuntimeError(f"demo document failed: {job['failed']}")
        row = json.loads((work / "results.jsonl").read_text().splitlines()[-1])
        print(f"\nQ: {instruction}\nA: {row['answer'].strip()}\n")
        strategies = distinct_strategies(plan)
        say(f"measuring hpipe against the baselines on the same input ({', '.join(strategies[1:])}; "
            f"median of {bench_repeat})")
        result = bench(plan, cluster, strategies=strategies, repeat=bench_repeat)
        print(table(result))
        return {"answer": row["answer"], "prompt_tokens": row["prompt_tokens"], "bench": result,
                "plan": str(plan_path)}
    finally:
        if any(v.startswith("started") for v in started.values()):
            say("stopping the cluster")
            launcher.down(cluster)
