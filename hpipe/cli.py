"""The ``hpipe`` command: parses arguments, calls library functions, prints results.

Data goes to stdout (``--json`` for scripts), messages and progress to stderr; every failure a
user can cause ends with a one-line ``hpipe: error: ...`` and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from hpipe.errors import HpipeError, InputError

log = logging.getLogger("hpipe")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    return _read_text(args.prompt_file, "prompt file")


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from hpipe.generate import LocalModel, generate
    from hpipe.model.stage import parse_dtype
    from hpipe.sampling import SamplingParams
    from hpipe.sources import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompt = _read_prompt(args)
    source = resolve_model(args.model)
    dtype = parse_dtype(args.dtype, args.device)
    tokenizer = source.tokenizer()
    if args.cluster:
        result = _generate_on_cluster(args, source, dtype, tokenizer, prompt, sampling)
    else:
        model = LocalModel(source, dtype=dtype, device=args.device, cuts=args.cuts or ())
        result = generate(model.open, tokenizer, prompt, context=source.config.max_position_embeddings,
                          eos_ids=source.eos_token_ids(), chat=args.chat, max_new_tokens=args.max_new_tokens,
                          sampling=sampling, slices=args.slices)
    if args.json:
        print(json.dumps({"model": source.name, **result.as_dict()}))
    else:
        print(result.text)
        log.info("%d prompt tokens, %d new tokens, prefill %.3fs, decode %.1f tok/s", result.prompt_tokens,
                 len(result.token_ids), result.prefill_s, len(result.token_ids) / max(result.decode_s, 1e-9))
    return 0


def _generate_on_cluster(args, source, dtype, tokenizer, prompt, sampling):
    from pathlib import Path

    from hpipe.units import even_cuts
    from runtime.cluster import ClusterSpec
    from runtime.coordinator import Pipeline, generate_on_cluster

    cluster = ClusterSpec.load(args.cluster)
    cfg = source.config
    cuts = args.cuts if args.cuts is not None else even_cuts(cfg.num_units, min(len(cluster.daemons), cfg.num_units))
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    pipe = Pipeline(cluster)
    try:
        pipe.deploy(model, cuts, cfg.num_units, dtype)
        return generate_on_cluster(pipe, source, tokenizer, prompt, chat=args.chat,
                                   max_new_tokens=args.max_new_tokens, sampling=sampling, slices=args.slices)
    finally:
        pipe.close()


def cmd_daemon(args: argparse.Namespace) -> int:
    from runtime.channels import Security
    from runtime.cluster import parse_size
    from runtime.daemon import DaemonConfig, serve

    if bool(args.tls_cert) != bool(args.tls_key):
        raise InputError("--tls-cert and --tls-key go together")
    token = Security.from_files(args.token_file).token
    cfg = DaemonConfig(device=args.device, host=args.host, port=args.port, threads=args.threads,
                       memory_budget=parse_size(args.memory_budget), token=token, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, tls_ca=args.tls_ca, name=args.name,
                       cuda_graphs=not args.no_cuda_graphs)
    return serve(cfg)


def cmd_cluster(args: argparse.Namespace) -> int:
    from runtime import launcher
    from runtime.cluster import ClusterSpec

    cluster = ClusterSpec.load(args.file)
    if args.action == "status":
        rows = launcher.status(cluster)
        if args.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                units = r.get("units")
                print(f"{r['name']:<12} {r['address']:<22} {r['device']:<8} "
                      f"{'healthy' if r['healthy'] else 'DOWN':<8} "
                      f"{'units ' + ' '.join('[%d, %d)' % tuple(u) for u in units) if units else '-':<16} "
                      f"open sequences: {r.get('open_sequences', '-')}")
        return 0 if all(r["healthy"] for r in rows) else 1
    result = launcher.up(cluster) if args.action == "up" else launcher.down(cluster)
    if args.json:
        print(json.dumps(result))
    else:
        for name, state in result.items():
            print(f"{name}: {state}")
    return 0


def _write_or_print(text: str, path: str | None) -> None:
    if path and path != "-":
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text)


def cmd_profile(args: argparse.Namespace) -> int:
    from hpipe.shapes import model_shape
    from runtime.cluster import ClusterSpec

    cluster = ClusterSpec.load(args.cluster)
    name, cfg = model_shape(args.model)
    max_len = args.max_len or cfg.max_position_embeddings
    if args.simulate:
        from profiler.roofline import simulated_profile

        missing = [d.name for d in cluster.daemons if not d.spec]
        if missing:
            raise InputError(f"--simulate needs a 'spec' (peak_tflops, mem_bw_gbs, memory) for {', '.join(missing)}")
        profile = simulated_profile(name, cfg, cluster.daemons, cluster.link_specs(), args.dtype, max_len, args.batch)
    else:
        from profiler.measure import SWEEPS, profile_cluster

        profile = profile_cluster(cluster, name, cfg, dtype=args.dtype, max_len=max_len, batch=args.batch,
                                  force=args.force, repeats=args.repeats or SWEEPS, colocation=not args.no_colocation,
                                  colocation_rounds=args.colocation_rounds)
    from profiler.report import summary

    print(summary(profile), file=sys.stderr)
    _write_or_print(profile.to_json(), args.output)
    if args.json and args.output not in (None, "-"):
        print(json.dumps({"profile": args.output, "devices": [d.name for d in profile.devices],
                          "source": profile.source}))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.costs import Workload
    from planner.report import plan_table
    from planner.strategies import plan as make_plan
    from planner.strategies import timeline
    profile = _load_profile(args.profile)
    work = Workload(args.seq_len, args.batch, args.max_len)
    strategy = args.strategy.replace("-", "_")
    ranges = {} if args.max_ranges_per_device is None else {"max_ranges": args.max_ranges_per_device}
    plan = make_plan(profile, work, strategy=strategy, granularity=args.granularity, **ranges)
    print(plan_table(plan), file=sys.stderr)
    _write_or_print(plan.to_json(), args.output)
    if args.chart:
        from planner.chart import gantt

        gantt(plan, {n: timeline(profile, work, sp) for n, sp in plan.strategies.items()}, args.chart)
        print(f"chart: {args.chart}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "cuts": plan.chosen.cuts, "devices": [s.device for s in plan.chosen.stages],
            "slices": list(plan.chosen.slices), "micro_batches": plan.chosen.micro_batches,
            "predicted": {n: sp.predicted_s for n, sp in plan.strategies.items()}, "ideal_s": plan.ideal_s,
            "planning_s": plan.meta["planning_s"], "plan": args.output,
        }))
    return 0


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"cannot read {what}: {e}") from None


def _load_profile(path: str):
    from profiler.schema import Profile

    return Profile.from_json(_read_text(path, "profile"))


def _load_plan(path: str):
    from planner.plan import Plan

    return Plan.from_json(_read_text(path, "plan"))


def _cluster_for(plan, cluster_file: str | None):
    """The cluster file if given, else one made of the plan's stage addresses (no token, no TLS)."""
    from runtime.cluster import ClusterSpec, DaemonSpec

    if cluster_file:
        return ClusterSpec.load(cluster_file)
    seen = {}
    for sp in plan.strategies.values():
        for st in sp.stages:
            seen.setdefault(st.device, st.address)
    return ClusterSpec("from-plan", tuple(DaemonSpec(n, a) for n, a in seen.items()))


def cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpipe.sources import resolve_model
    from runtime.coordinator import Pipeline
    from runtime.jobs import JobConfig, run_job

    plan = _load_plan(args.plan)
    if args.strategy and args.strategy.replace("-", "_") not in plan.strategies:
        raise InputError(f"the plan has no strategy {args.strategy!r} (it has {', '.join(plan.strategies)})")
    source = resolve_model(plan.model_name)
    pipe = Pipeline(_cluster_for(plan, args.cluster))
    job = JobConfig(instruction=args.instruction, chat=args.chat, max_new_tokens=args.max_new_tokens,
                    truncate=args.truncate, parallel=args.parallel,
                    strategy=args.strategy.replace("-", "_") if args.strategy else None)
    try:
        summary = run_job(plan, pipe, source, args.documents, Path(args.output), job)
    finally:
        pipe.close()
    print(json.dumps(summary) if args.json else
          f"{summary['documents']} analysed, {summary['skipped']} skipped, {len(summary['failed'])} failed; "
          f"{summary['tokens_per_s']} tokens/s -> {args.output}", file=sys.stdout if args.json else sys.stderr)
    if summary["failed"]:
        print("hpipe: error: failed documents: " + "; ".join(f"{k}: {v}" for k, v in summary["failed"].items()),
              file=sys.stderr)
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from hpipe.shapes import model_shape
    from runtime.bench import bench, table
    from runtime.coordinator import Pipeline

    plan = _load_plan(args.plan)
    _, cfg = model_shape(plan.model_name)
    strategies = [s.strip().replace("-", "_") for s in args.strategies.split(",")] if args.strategies else None
    profile = _load_profile(args.profile) if args.profile else None
    pipe = Pipeline(_cluster_for(plan, args.cluster))
    try:
        result = bench(plan, pipe, cfg.num_units, seq_len=args.seq_len, batch=args.batch, strategies=strategies,
                       repeat=args.repeat, interleave=args.interleave, profile=profile)
    finally:
        pipe.close()
    print(table(result), file=sys.stderr)
    if args.chart:
        from runtime.bench_chart import draw

        draw(result, args.chart)
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on built-in defaults (see hpipe.demo)."""
    from pathlib import Path

    from hpipe.demo import run_demo

    result = run_demo(Path(args.cluster) if args.cluster else None, args.instruction, args.max_new_tokens,
                      args.repeat)
    if args.json:
        print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpipe", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (single process, or on a cluster)")
    g.add_argument("--model", default="smollm2-135m",
                   help="built-in name (smollm2-135m), Hugging Face model directory, or .gguf file")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (GPU)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, help="torch CPU threads")
    g.add_argument("--cuts", type=_int_list, help="unit indices where stages change (c1,c2,...)")
    g.add_argument("--slices", type=_int_list, help="prompt token slice lengths (must sum to the prompt length)")
    g.add_argument("--cluster", help="run through the daemons of this cluster file instead of in-process")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    dm = sub.add_parser("daemon", help="serve this device as a pipeline stage (gRPC)")
    dm.add_argument("--device", default="cpu", help="cpu or cuda:N")
    dm.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    dm.add_argument("--port", type=int, required=True)
    dm.add_argument("--threads", type=int, help="torch CPU threads")
    dm.add_argument("--memory-budget", help="cap on weights + KV cache, e.g. 2GiB")
    dm.add_argument("--token-file", help="shared secret every RPC must carry")
    dm.add_argument("--tls-cert")
    dm.add_argument("--tls-key")
    dm.add_argument("--tls-ca", help="CA to verify the successor's certificate (default: --tls-cert)")
    dm.add_argument("--name", default="", help="name in logs")
    dm.add_argument("--no-cuda-graphs", action="store_true", help="run GPU decode steps eagerly")
    dm.set_defaults(func=cmd_daemon)

    cl = sub.add_parser("cluster", help="start, stop or inspect the local daemons of a cluster file")
    cl.add_argument("action", choices=["up", "down", "status"])
    cl.add_argument("file")
    cl.add_argument("--json", action="store_true")
    cl.set_defaults(func=cmd_cluster)

    pr = sub.add_parser("profile", help="measure every device and link of a cluster (or simulate from specs)")
    pr.add_argument("--cluster", required=True)
    pr.add_argument("--model", default="smollm2-135m", help="model source, config.json, or random:NAME shape")
    pr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    pr.add_argument("--max-len", type=int, help="longest context to profile (default: the model's)")
    pr.add_argument("--batch", type=int, default=1)
    pr.add_argument("--simulate", action="store_true", help="derive the profile from the cluster file's specs")
    pr.add_argument("--force", action="store_true", help="re-measure even when a cached profile matches")
    pr.add_argument("--repeats", type=_positive, default=None,
                    help="passes over the compute grid, each timing every point; the median across them is kept "
                         "(default: profiler.measure.SWEEPS, 7)")
    pr.add_argument("--no-colocation", action="store_true",
                    help="do not measure how daemons sharing a machine or GPU slow each other down")
    pr.add_argument("--colocation-rounds", type=_positive, default=3,
                    help="rounds (each alone, then all together) behind each co-location factor (median)")
    pr.add_argument("-o", "--output", default="profile.json")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="choose layer cuts and token slicing from a profile")
    pl.add_argument("--profile", required=True)
    pl.add_argument("--seq-len", type=int, required=True)
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--max-len", type=int, help="longest input the plan supports (default: --seq-len)")
    pl.add_argument("--strategy", default="hpipe", choices=["hpipe", "base", "gpipe", "gp-b", "terapipe"])
    pl.add_argument("--granularity", type=int, default=16, help="slice lengths are multiples of this")
    pl.add_argument("--max-ranges-per-device", type=int, choices=(1, 2, 3), metavar="V",
                    help="hpipe may give a device up to V unit ranges (an interleaved chain: shorter pipeline fill "
                         "and drain, V times the hops per slice and per decoded token), where the simulator finds "
                         "it faster; default: the planner's MAX_RANGES (3); 1: one range each")
    pl.add_argument("-o", "--output", default="plan.json")
    pl.add_argument("--chart", help="write the predicted pipelines as a Gantt chart (PNG)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    rn = sub.add_parser("run", help="analyse documents with one instruction on a deployed plan (JSONL out)")
    rn.add_argument("--plan", required=True)
    rn.add_argument("--cluster", help="cluster file (token, TLS); default: the plan's daemon addresses")
    rn.add_argument("--instruction", required=True)
    rn.add_argument("--chat", action="store_true")
    rn.add_argument("--max-new-tokens", type=int, default=128)
    rn.add_argument("--truncate", choices=["none", "head", "tail"], default="none",
                    help="documents over the plan's max length: fail (none), keep the start (head) or end (tail)")
    rn.add_argument("--parallel", type=int, default=2, help="documents in flight at once")
    rn.add_argument("--strategy", help="run a baseline of the plan instead (base, gpipe, gp-b, terapipe)")
    rn.add_argument("-o", "--output", default="results.jsonl")
    rn.add_argument("--json", action="store_true")
    rn.add_argument("documents", nargs="+", help="text or markdown files; '-' for stdin")
    rn.set_defaults(func=cmd_run)

    bn = sub.add_parser("bench", help="measure hpipe against the baselines on the live cluster")
    bn.add_argument("--plan", required=True)
    bn.add_argument("--cluster", help="cluster file (token, TLS); default: the plan's daemon addresses")
    bn.add_argument("--seq-len", type=int, help="default: the plan's")
    bn.add_argument("--batch", type=int, help="default: the plan's")
    bn.add_argument("--strategies", help="comma-separated (default: all in the plan)")
    bn.add_argument("--repeat", type=int, default=3)
    bn.add_argument("--interleave", action="store_true",
                    help="run the strategies round by round (redeploying each time) rather than one after another, "
                         "so a drifting machine speed hits them alike")
    bn.add_argument("--profile", help="the profile the plan came from: every daemon re-times its reference stage "
                                      "before and after, and predictions are re-simulated at today's speeds "
                                      "(predicted_now_s)")
    bn.add_argument("--chart", help="chart (PNG): measured vs predicted latency, and hpipe's pipeline as it ran "
                    "(under the one planned, with --profile)")
    bn.add_argument("--json", action="store_true")
    bn.set_defaults(func=cmd_bench)

    from hpipe.demo import INSTRUCTION

    d = sub.add_parser("demo", help="the main job on built-in defaults: local cluster, SmolLM2, sample report")
    d.add_argument("--cluster", help="default: clusters/emulated-hetero.yaml as root, else clusters/local-3.yaml")
    d.add_argument("--instruction", default=INSTRUCTION)
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--repeat", type=_positive, default=3, help="bench runs per strategy (median)")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except HpipeError as e:
        print(f"hpipe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
