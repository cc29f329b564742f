"""What each ``hpipe`` subcommand does with its parsed arguments: library calls, then printing.

Imports are inside the commands, so that ``hpipe plan`` never loads torch and ``hpipe --help``
answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path

from hpipe.app.inputs import (
    check_device,
    check_output,
    cluster_for,
    load_plan,
    load_profile,
    planned,
    read_text,
    templates,
    write_or_print,
)
from hpipe.core.errors import InputError

log = logging.getLogger("hpipe")


def pipeline(cluster):
    """An empty :class:`Pipeline` on ``cluster``, for stages without a plan (``--cuts``); this
    process coordinates on one CPU thread."""
    from runtime.coordinator.pipeline import Pipeline, coordinate_on_one_thread

    coordinate_on_one_thread()
    return Pipeline(cluster)


def generate(args: argparse.Namespace) -> int:
    check_device(args.device)
    import torch

    from hpipe.model.compute.stage import parse_dtype
    from hpipe.model.generate.local import LocalModel
    from hpipe.model.generate.local import generate as local_generate
    from hpipe.model.generate.sampling import SamplingParams
    from hpipe.model.weights.sources import quantized_model, resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompt = args.prompt if args.prompt is not None else (
        sys.stdin.read() if args.prompt_file == "-" else read_text(args.prompt_file, "prompt file"))
    cluster = None
    if args.cluster:
        from hpipe.core.cluster import ClusterSpec

        cluster = ClusterSpec.load(args.cluster)  # a bad cluster file fails before the model loads
    args.model = quantized_model(args.model, args.quantize)
    source = resolve_model(args.model)
    dtype = parse_dtype(args.dtype, args.device)
    if args.speculate != "off":
        from hpipe.model.generate.speculate import refused

        why = refused(source.gguf is not None and not args.dequantize,
                      [d.device for d in cluster.daemons] if cluster is not None else [args.device])
        if why:
            raise InputError(why)
    tokenizer = source.tokenizer()
    if cluster is not None:
        result = _generate_on_cluster(args, cluster, source, dtype, tokenizer, prompt, sampling)
    else:
        model = LocalModel(source, dtype=dtype, device=args.device, cuts=args.cuts or (), dequantize=args.dequantize)
        result = local_generate(model.open, tokenizer, prompt, context=source.config.max_position_embeddings,
                                eos_ids=source.eos_token_ids(), chat=args.chat, max_new_tokens=args.max_new_tokens,
                                sampling=sampling, slices=args.slices, speculate=args.speculate)
    if args.json:
        print(json.dumps({"model": source.name, **result.as_dict()}))
    else:
        print(result.text)
        log.info("%d prompt tokens, %d new tokens, prefill %.3fs, decode %.1f tok/s", result.prompt_tokens,
                 len(result.token_ids), result.prefill_s, len(result.token_ids) / max(result.decode_s, 1e-9))
    return 0


def _generate_on_cluster(args, cluster, source, dtype, tokenizer, prompt, sampling):
    from hpipe.core.units import even_cuts
    from runtime.coordinator.pipeline import cut_stages, generate_on_cluster

    cfg = source.config
    cuts = args.cuts if args.cuts is not None else even_cuts(cfg.num_units, min(len(cluster.daemons), cfg.num_units))
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    pipe = pipeline(cluster)
    pipe.dequantize = args.dequantize
    try:
        pipe.load(model, cut_stages(cluster, cuts, cfg.num_units), dtype)
        return generate_on_cluster(pipe, source, tokenizer, prompt, chat=args.chat,
                                   max_new_tokens=args.max_new_tokens, sampling=sampling, slices=args.slices,
                                   speculate=args.speculate)
    finally:
        pipe.close()


def daemon(args: argparse.Namespace) -> int:
    from hpipe.app.daemon import serve, systemd_unit
    from hpipe.core.cluster import DaemonOptions

    values = {f.name: getattr(args, f.name) for f in fields(DaemonOptions)}
    options = DaemonOptions.from_values({k: v for k, v in values.items() if v is not None}, "hpipe daemon")
    if args.print_systemd_unit:
        print(systemd_unit(options))
        return 0
    return serve(options)


def cluster(args: argparse.Namespace) -> int:
    from hpipe.core.cluster import ClusterSpec
    from runtime.cluster import launcher

    spec = ClusterSpec.load(args.file)
    if args.action == "status":
        rows = launcher.status(spec)
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
    if args.action == "supervise":
        from runtime.cluster.supervisor import supervise

        supervise(spec)
        return 0
    result = launcher.up(spec, restart=args.restart) if args.action == "up" else launcher.down(spec)
    if args.json:
        print(json.dumps(result))
    else:
        for name, state in result.items():
            print(f"{name}: {state}")
    return 0


def _held_weights(model: str) -> dict:
    """How a model's daemons hold its matrices, for the profiler: ``weight_bits`` (their memory)
    and ``weight_type`` (what the units are timed in); empty for float weights."""
    from hpipe.core.shapes import is_random
    from hpipe.model.weights.random_blocks import RandomBlocks, runnable
    from hpipe.model.weights.sources import model_shape, resolve_model

    if runnable(model):  # the blocks its daemons make (hpipe.model.weights.random_blocks)
        store = RandomBlocks(model, model_shape(model)[1])
        return {"weight_bits": store.matrix_bits(), "weight_type": store.main_type()}
    if is_random(model) or Path(model).name.endswith(".json"):
        return {}
    return resolve_model(model).held_weights()


def profile(args: argparse.Namespace) -> int:
    from hpipe.app.profile_report import summary
    from hpipe.core.cluster import ClusterSpec
    from hpipe.core.shapes import quantization_bits
    from hpipe.model.weights.sources import model_shape, quantized_model
    from profiler.grid import DEFAULT_MAX_LEN

    check_output(args.output, "profile")
    spec = ClusterSpec.load(args.cluster)
    args.model = quantized_model(args.model, args.quantize)
    name, cfg = model_shape(args.model)
    max_len = args.max_len or min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
    if not args.max_len and max_len < cfg.max_position_embeddings:
        print(f"hpipe: profiling inputs up to {max_len} tokens (the model's context is {cfg.max_position_embeddings}; "
              "plans for longer inputs extrapolate attention; --max-len N to measure further)", file=sys.stderr)
    if args.simulate:
        from profiler.roofline import simulated_profile

        missing = [d.name for d in spec.daemons if not d.spec]
        if missing:
            raise InputError(f"--simulate needs a 'spec' (peak_tflops, mem_bw_gbs, memory) for {', '.join(missing)}")
        result = simulated_profile(name, cfg, spec.daemons, spec.link_specs(), args.dtype, max_len, args.batch,
                                   weight_bits=quantization_bits(args.model))
    else:
        from profiler.grid import SWEEPS
        from profiler.measure import profile_cluster

        result = profile_cluster(spec, name, cfg, dtype=args.dtype, max_len=max_len, batch=args.batch,
                                 force=args.force, repeats=args.repeats or SWEEPS, colocation=not args.no_colocation,
                                 colocation_rounds=args.colocation_rounds, **_held_weights(args.model),
                                 say=lambda msg: print(f"hpipe: {msg}", file=sys.stderr, flush=True))
    print(summary(result), file=sys.stderr)
    write_or_print(result.to_json(), args.output)
    if args.json and args.output not in (None, "-"):
        print(json.dumps({"profile": args.output, "daemons": [d.name for d in result.daemons],
                          "source": result.source}))
    return 0


#: the serving mix's mean answer tokens where ``hpipe plan --output-len`` is not given
DEFAULT_OUTPUT_LEN = 128


def plan(args: argparse.Namespace) -> int:
    from hpipe.app.plan_report import plan_table
    from planner.costs import Workload
    from planner.serving import Mix
    from planner.strategies import plan as make_plan
    from planner.strategies import timeline

    check_output(args.output, "plan")
    prof = load_profile(args.profile)
    serving = args.objective in ("throughput", "seesaw")
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    # latency: the answer's decode counts only where asked for (HPipe's objective is the prefill)
    work = Workload(args.seq_len, args.batch, args.max_len, output_len=0 if serving else args.output_len or 0)
    measured = prof.meta.get("max_len")
    if measured and work.kv_len > measured:
        print(f"hpipe: the profile was measured up to {measured} tokens; attention past that is extrapolated "
              f"for this {work.kv_len}-token plan", file=sys.stderr)
    strategy = (args.strategy or ("throughput" if serving else "hpipe")).replace("-", "_")
    if strategy == "throughput" and not serving:
        raise InputError("--strategy throughput needs --objective throughput (the split is made for a request mix)")
    ranges = {} if args.max_ranges_per_device is None else {"max_ranges": args.max_ranges_per_device}
    mix = Mix(args.seq_len, output_len, args.decode_batch) if serving else None
    result = make_plan(prof, work, strategy=strategy, granularity=args.granularity, mix=mix, **ranges)
    if args.objective == "seesaw":
        result = _with_seesaw(result, prof, work, mix, args.seesaw_batch)
    print(plan_table(result), file=sys.stderr)
    write_or_print(result.to_json(), args.output)
    if args.chart:
        from hpipe.app.plan_chart import gantt

        gantt(result, {n: timeline(prof, work, sp) for n, sp in result.strategies.items()}, args.chart)
        print(f"chart: {args.chart}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "cuts": result.chosen.cuts, "daemons": [s.daemon for s in result.chosen.stages],
            "slices": list(result.chosen.slices), "micro_batches": result.chosen.micro_batches,
            "predicted": {n: sp.predicted_s for n, sp in result.strategies.items()}, "ideal_s": result.ideal_s,
            "planning_s": result.meta["planning_s"], "plan": args.output,
        }))
    return 0


def _with_seesaw(result, prof, work, mix, batch):
    """``result`` with Seesaw's prediction in its meta (planner.seesaw), printed side by side."""
    from dataclasses import replace

    from planner.costs import CostModel
    from planner.seesaw import seesaw, table

    cost = CostModel(prof)
    prediction = seesaw(cost, work, mix, batch)
    print(table(prediction, cost, mix), file=sys.stderr)
    if prediction.choice == "seesaw":
        print(f"hpipe: seesaw is predicted best: run it with hpipe run --policy seesaw (without it, this plan "
              f"executes {result.strategy!r})", file=sys.stderr)
    return replace(result, meta={**result.meta, "seesaw": prediction.to_dict(cost)})


def run(args: argparse.Namespace) -> int:
    check_output(args.output, "results (JSONL)")
    if args.profile and not args.plan:
        raise InputError("--profile goes with --plan (the profile that plan came from)")
    with planned(args, serving=False) as (the_plan, cluster, source):
        return _run(args, the_plan, cluster, source)


def _run(args: argparse.Namespace, the_plan, cluster, source) -> int:
    from hpipe.app.jobs import JobConfig, describe, read_questions, run_job
    from hpipe.app.page_job import start_page
    from hpipe.app.replan import replanner

    if args.strategy and args.strategy.replace("-", "_") not in the_plan.strategies:
        raise InputError(f"the plan has no strategy {args.strategy!r} (it has {', '.join(the_plan.strategies)})")
    output = Path(args.output)
    job = JobConfig(instruction=args.instruction or "", chat=args.chat, max_new_tokens=args.max_new_tokens,
                    truncate=args.truncate, long=args.long or ("truncate" if args.truncate != "none" else "map-reduce"),
                    templates=templates(args), parallel=args.parallel, policy=args.policy, speculate=args.speculate,
                    ignore_eos=args.ignore_eos, grace_s=args.grace, dequantize=args.dequantize,
                    strategy=args.strategy.replace("-", "_") if args.strategy else None,
                    questions=read_questions(args.questions) if args.questions else (),
                    prefix_cache=args.prefix_cache_budget if args.prefix_cache else None)
    page = start_page(the_plan, args.serve_page) if args.serve_page else None
    try:
        summary = run_job(the_plan, cluster, source, args.documents, output, job,
                          replan=replanner(the_plan, load_profile(args.profile)) if args.profile else None,
                          on_engine=page.watch.deployed if page else None)
    finally:
        if page is not None:
            page.stop()
    for event in summary["recoveries"]:
        print(f"hpipe: the pipeline broke ({event['error']}); {event['action']} in {event['seconds']:.1f} s; "
              f"{event.get('resumed', 0)} documents resumed ({event.get('replayed_positions', 0)} positions "
              f"replayed), {event.get('restarted', 0)} started again", file=sys.stderr)
    print(json.dumps(summary) if args.json else
          f"{describe(summary)} -> {args.output}", file=sys.stdout if args.json else sys.stderr)
    if summary["failed"]:
        print("hpipe: error: failed documents: " + "; ".join(f"{k}: {v}" for k, v in summary["failed"].items()),
              file=sys.stderr)
        return 1
    return 0


def bench(args: argparse.Namespace) -> int:
    if args.workload:
        return bench_workload(args)
    from hpipe.app.bench import bench as run_bench
    from hpipe.app.bench import table

    the_plan = load_plan(args.plan)
    strategies = [s.strip().replace("-", "_") for s in args.strategies.split(",")] if args.strategies else None
    prof = load_profile(args.profile) if args.profile else None
    result = run_bench(the_plan, cluster_for(the_plan, args.cluster), seq_len=args.seq_len,
                       batch=args.batch, strategies=strategies, repeat=args.repeat, interleave=args.interleave,
                       profile=prof, dequantize=args.dequantize)
    print(table(result), file=sys.stderr)
    if args.chart:
        from hpipe.app.bench_chart import draw

        draw(result, args.chart)
    if args.json:
        print(json.dumps(result))
    return 0


def bench_workload(args: argparse.Namespace) -> int:
    from hpipe.app.workload_bench import run_workload, table
    from hpipe.core import workload

    if args.workload == "generate":
        items = workload.generate(args.requests, args.seed, rate=args.rate)
    else:
        items = workload.load(args.workload)
    the_plan = load_plan(args.plan)
    too_long = [w for w in items if w.prompt_tokens + w.output_tokens > the_plan.model.max_position_embeddings]
    if too_long:
        raise InputError(f"{len(too_long)} requests run past the model's context of "
                         f"{the_plan.model.max_position_embeddings} tokens")
    result = run_workload(the_plan, cluster_for(the_plan, args.cluster), items,
                          [p.strip() for p in args.policies.split(",")], rounds=args.repeat, seed=args.seed,
                          kv_pool_bytes=(args.kv_pool_mb or 0) << 20, dequantize=args.dequantize)
    print(table(result), file=sys.stderr)
    if args.chart:
        from hpipe.app.workload_chart import draw

        draw(result, args.chart)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"} | {"runs": {
            p: [{k: v for k, v in run.items() if k not in ("outputs", "log")} for run in rs]
            for p, rs in result["runs"].items()}}))
    return 0


def serve(args: argparse.Namespace) -> int:
    from hpipe.app.serve import read_key
    from hpipe.app.serve import serve as run_server

    key = read_key(args.api_key_file)
    with planned(args, serving=True) as (the_plan, cluster, source):
        code = run_server(the_plan, cluster, source, host=args.host,
                          port=args.port, api_key=key, policy=args.policy, max_queue=args.max_queue,
                          max_running=args.max_running,
                          model_name=args.served_model_name,
                          default_max_tokens=args.default_max_tokens,
                          grace_s=args.grace, drain_s=args.drain, dequantize=args.dequantize,
                          prefix_cache=args.prefix_cache_budget if args.prefix_cache else None,
                          metrics_public=args.metrics_public, speculate=args.speculate)
    # without the interpreter's teardown: a gRPC or torch C++ thread still alive then aborted the
    # process (``terminate called without an active exception``, exit -6) in about one SIGTERM of
    # eight even with the backend's threads joined, so a clean drain read as a crash to a supervisor
    from hpipe.app.leave import leave

    leave(code)


def model(args: argparse.Namespace) -> int:
    """``hpipe model make``: a random-weight GGUF file of a named shape (:mod:`hpipe.model.weights.random_gguf`)."""
    from hpipe.model.weights.random_gguf import Spec, make

    path = make(Spec.parse(args.spec, args.seed), Path(args.output) if args.output else None)
    print(path)
    return 0


def demo(args: argparse.Namespace) -> int:
    """The main job on built-in defaults (see :mod:`hpipe.app.demo`)."""
    from hpipe.app.demo import run_demo

    result = run_demo(Path(args.cluster) if args.cluster else None, args.instruction, args.max_new_tokens,
                      args.repeat)
    if args.json:
        print(json.dumps(result))
    return 0
