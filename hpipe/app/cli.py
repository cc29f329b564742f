"""The ``hpipe`` command: parses arguments and hands them to :mod:`hpipe.app.commands`.

Data goes to stdout (``--json`` for scripts), messages and progress to stderr; every failure a
user can cause ends with a one-line ``hpipe: error: ...`` and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import fields
from typing import Sequence

from hpipe import __version__
from hpipe.app import commands
from hpipe.app.leave import leave
from hpipe.core.cluster import DaemonOptions, option_flag
from hpipe.core.errors import HpipeError

log = logging.getLogger("hpipe")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one ``--help`` away)."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _daemon_arguments(p: argparse.ArgumentParser) -> None:
    """``hpipe daemon``'s flags, made from :class:`DaemonOptions` (their one definition)."""
    for f in fields(DaemonOptions):
        if f.type == "bool":  # a flag that turns the default over
            p.add_argument(option_flag(f), dest=f.name, action="store_false" if f.default else "store_true",
                           help=f.metadata["help"])
        else:
            p.add_argument(option_flag(f), dest=f.name, required=f.name == "port", help=f.metadata["help"])


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt (single process, or on a cluster)")
    g.add_argument("--model", default="smollm2-135m",
                   help="built-in name (smollm2-135m), Hugging Face model directory, or .gguf file")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=_positive, default=128)
    g.add_argument("--temperature", type=_at_least_zero, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (GPU)")
    g.add_argument("--device", default="cpu", help="cpu or cuda:N")
    g.add_argument("--threads", type=_positive, help="torch CPU threads")
    g.add_argument("--cuts", type=_int_list, help="unit indices where stages change (c1,c2,...)")
    g.add_argument("--slices", type=_int_list, help="prompt token slice lengths (must sum to the prompt length)")
    g.add_argument("--cluster", help="run through the daemons of this cluster file instead of in-process")
    g.add_argument("--speculate", choices=["off", "ngram"], default="off",
                   help="ngram: guess the next tokens from where the last ones occur in the prompt or the answer, "
                        "verify them in one pass (greedy answers unchanged; docs/runtime.md)")
    _dequantize_argument(g)
    _quantize_argument(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=commands.generate)


def _profile_parser(sub) -> None:
    from profiler.grid import DEFAULT_MAX_LEN

    pr = sub.add_parser("profile", help="measure every device and link of a cluster (or simulate from specs)")
    pr.add_argument("--cluster", required=True)
    pr.add_argument("--model", default="smollm2-135m", help="model source, config.json, or random:NAME shape")
    _quantize_argument(pr)
    pr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    pr.add_argument("--max-len", type=_positive,
                    help=f"longest input to profile for (default: the model's context, at most {DEFAULT_MAX_LEN}: "
                         "plans for longer inputs extrapolate attention past it)")
    pr.add_argument("--batch", type=_positive, default=1)
    pr.add_argument("--simulate", action="store_true", help="derive the profile from the cluster file's specs")
    pr.add_argument("--force", action="store_true", help="re-measure even when a cached profile matches")
    pr.add_argument("--repeats", type=_positive, default=None,
                    help="passes over the compute grid, each timing every point; the median across them is kept "
                         "(default: profiler.grid.SWEEPS, 7)")
    pr.add_argument("--no-colocation", action="store_true",
                    help="do not measure how daemons sharing a machine or GPU slow each other down")
    pr.add_argument("--colocation-rounds", type=_positive, default=3,
                    help="rounds (each alone, then all together) behind each co-location factor (median)")
    pr.add_argument("-o", "--output", default="profile.json")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=commands.profile)


def _plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="choose layer cuts and token slicing from a profile")
    pl.add_argument("--profile", required=True)
    pl.add_argument("--seq-len", type=_positive, required=True)
    pl.add_argument("--batch", type=_positive, default=1)
    pl.add_argument("--max-len", type=_positive, help="longest input the plan supports (default: --seq-len)")
    pl.add_argument("--strategy", choices=["hpipe", "throughput", "base", "gpipe", "gp-b", "terapipe"],
                    help="the strategy the plan executes (default: hpipe, or throughput with --objective throughput)")
    pl.add_argument("--objective", choices=["latency", "throughput", "seesaw"], default="latency",
                    help="latency: one --seq-len document as fast as possible (HPipe); throughput: also plan a split "
                         "for serving many requests of --seq-len prompt and --output-len answer tokens, and execute it; "
                         "seesaw: as throughput, and also a prefill layout and a decode layout with the price of "
                         "switching between them, their predicted throughput beside one layout's (Seesaw)")
    pl.add_argument("--seesaw-batch", type=_positive,
                    help="requests per phase seesaw is priced at (default: as many as the KV pools hold)")
    pl.add_argument("--output-len", type=_positive,
                    help="answer tokens: with --objective latency, hpipe's plan is the fastest to the prompt's "
                         "prefill and then these tokens decoded one at a time (a job's --max-new-tokens; default: "
                         "the prefill alone, as HPipe); with throughput and seesaw, the mix's mean answer "
                         f"(default {commands.DEFAULT_OUTPUT_LEN})")
    pl.add_argument("--decode-batch", type=_positive, default=16,
                    help="decode tokens per micro-batch the serving split is costed at (--objective throughput, "
                         "seesaw)")
    pl.add_argument("--granularity", type=_positive, default=16, help="slice lengths are multiples of this")
    pl.add_argument("--max-ranges-per-device", type=int, choices=(1, 2, 3), metavar="V",
                    help="hpipe may give a daemon up to V unit ranges (an interleaved chain: shorter pipeline fill "
                         "and drain, V times the hops per slice and per decoded token), where the simulator finds "
                         "it faster; default: the planner's MAX_RANGES (3); 1: one range each")
    pl.add_argument("-o", "--output", default="plan.json")
    pl.add_argument("--chart", help="write the predicted pipelines as a Gantt chart (PNG)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=commands.plan)


def _dequantize_argument(parser) -> None:
    parser.add_argument("--dequantize", action="store_true", help="a GGUF model's weights as float32 (the path "
                        "before quantized kernels; the reference they are tested against)")


def _quantize_argument(parser) -> None:
    parser.add_argument("--quantize", choices=["q8_0", "q4_0", "q4_k"], help="a safetensors model's matrices in these "
                        "GGUF blocks, made once and cached (the daemons compute on the blocks, as with a GGUF file)")


def _prefix_cache_arguments(parser) -> None:
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="prefill every prompt whole, reusing no KV block of an earlier one (to compare)")
    parser.add_argument("--prefix-cache-budget", type=_share, default=1.0,
                        help="cached KV blocks no request uses are kept up to this share of the pool (default 1: "
                             "all free room; they are given back whenever a request needs the room)")


def _plan_or_model(parser) -> None:
    """``--plan``, or ``--model`` to plan on the spot (:mod:`hpipe.app.one_box`)."""
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", help="a plan (hpipe plan)")
    which.add_argument("--model", help="no plan: start a local daemon (or use --cluster), profile (cached) and "
                                       "plan for this model here, and stop what was started at the end")
    parser.add_argument("--cluster", help="cluster file (token, TLS); default: the plan's daemon addresses, or "
                                          "with --model one daemon on this machine")
    _quantize_argument(parser)
    parser.add_argument("--max-len", type=_positive, help="with --model: the longest input to plan for "
                                                          "(default: 4096, or the model's context if shorter)")


def _run_parser(sub) -> None:
    rn = sub.add_parser("run", help="analyse documents with one instruction, or several questions, on a deployed "
                                    "plan (JSONL out)")
    _plan_or_model(rn)
    asked = rn.add_mutually_exclusive_group(required=True)
    asked.add_argument("--instruction", help="what to do with each document")
    asked.add_argument("--questions", help="a file of questions to ask about each document: one a line, or JSON "
                                           "lines (a string, or an object with \"question\"); each document is "
                                           "prefilled once, its questions reuse it (the prefix cache)")
    rn.add_argument("--chat", action="store_true")
    rn.add_argument("--max-new-tokens", type=_positive, default=128)
    rn.add_argument("--long", choices=["map-reduce", "refine", "truncate", "refuse"],
                    help="documents over the plan's length: cut into parts, each answered and the answers combined "
                         "(map-reduce, the default), carry an answer through the parts in order (refine), keep what "
                         "fits (truncate: --truncate says which end), or fail (refuse)")
    rn.add_argument("--truncate", choices=["none", "head", "tail"], default="none",
                    help="with --long truncate (head or tail alone implies it): keep the start (head, the default) "
                         "or the end (tail)")
    for kind in ("map", "reduce", "refine"):
        rn.add_argument(f"--{kind}-prompt", metavar="TEMPLATE",
                        help=f"the {kind} prompt of a long document ('@FILE' reads it from a file; placeholders: "
                             "{instruction} {text} {part} {parts} {answers} {answer}: docs/runtime.md)")
    rn.add_argument("--speculate", choices=["off", "ngram"], default="off",
                    help="ngram: guess each answer's next tokens from where its last ones occur in the document or "
                         "the answer, verified in one pass through the pipeline (greedy answers unchanged)")
    rn.add_argument("--parallel", type=_positive, default=16,
                    help="prompts in flight at once (a document's, each question's, a long document's parts each "
                         "count): their prefill chunks and decode tokens share micro-batches")
    rn.add_argument("--policy", choices=["gllm", "sarathi", "fcfs", "single", "seesaw"], default="gllm",
                    help="how micro-batches are formed (docs/runtime.md): gllm (token throttling, the default), "
                         "sarathi (a fixed token budget), fcfs (one document at a time), single (one sequence per "
                         "micro-batch, as hpipe ran before batching), seesaw (a plan made with --objective seesaw: "
                         "prefill on its prefill layout, decode on its decode layout, switching between them)")
    rn.add_argument("--ignore-eos", action="store_true",
                    help="decode --max-new-tokens tokens whatever the model answers (for measurements)")
    rn.add_argument("--strategy", help="run another strategy of the plan (hpipe, throughput, base, gpipe, gp-b, terapipe)")
    rn.add_argument("--profile", help="the profile the plan came from: a daemon that dies and does not come back "
                                      "is planned around on the survivors")
    rn.add_argument("--grace", type=float, default=60.0,
                    help="seconds a broken pipeline waits for a dead daemon to come back (default: 60)")
    _dequantize_argument(rn)
    _prefix_cache_arguments(rn)
    rn.add_argument("--serve-page", type=_positive, metavar="PORT",
                    help="show the cluster page (daemons, plan, busy, KV, tokens/s, events) at http://127.0.0.1:PORT/ "
                         "while the job runs (loopback only: forward the port to watch from elsewhere)")
    rn.add_argument("-o", "--output", default="results.jsonl")
    rn.add_argument("--json", action="store_true")
    rn.add_argument("documents", nargs="+", help="text or markdown files; '-' for stdin")
    rn.set_defaults(func=commands.run)


def _bench_parser(sub) -> None:
    bn = sub.add_parser("bench", help="measure hpipe against the baselines on the live cluster")
    bn.add_argument("--plan", required=True)
    bn.add_argument("--cluster", help="cluster file (token, TLS); default: the plan's daemon addresses")
    bn.add_argument("--seq-len", type=_positive, help="default: the plan's")
    bn.add_argument("--batch", type=_positive, help="default: the plan's")
    bn.add_argument("--strategies", help="comma-separated (default: all in the plan)")
    bn.add_argument("--repeat", type=_positive, default=3)
    bn.add_argument("--interleave", action="store_true",
                    help="run the strategies round by round (redeploying each time) rather than one after another, "
                         "so a drifting machine speed hits them alike")
    bn.add_argument("--profile", help="the profile the plan came from: every daemon re-times its reference stage "
                                      "before and after, and predictions are re-simulated at today's speeds "
                                      "(predicted_now_s)")
    bn.add_argument("--chart", help="chart (PNG): measured vs predicted latency, and hpipe's pipeline as it ran "
                    "(under the one planned, with --profile)")
    bn.add_argument("--workload", help="replay requests instead of one prefill: a JSONL file of arrival_s, "
                                       "prompt_tokens, output_tokens per line; a bundled one by name (mixed, "
                                       "pressure, w64, w24w, w16dec); or 'generate' (--requests, --rate, --seed)")
    bn.add_argument("--policies", default="gllm,sarathi,fcfs", help="with --workload: the policies to compare")
    bn.add_argument("--requests", type=_positive, default=64, help="with --workload generate: how many")
    bn.add_argument("--rate", type=float, help="with --workload generate: Poisson arrivals a second (default: all at once)")
    bn.add_argument("--seed", type=int, default=0, help="with --workload: lengths, arrivals and prompts")
    bn.add_argument("--kv-pool-mb", type=_positive, help="with --workload: each daemon's KV pools in all, MiB")
    _dequantize_argument(bn)
    bn.add_argument("--json", action="store_true")
    bn.set_defaults(func=commands.bench)


def build_parser() -> argparse.ArgumentParser:
    from hpipe.app.demo import INSTRUCTION

    parser = _Parser(prog="hpipe", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output on stderr")
    parser.add_argument("--version", action="version", version=f"hpipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)

    dm = sub.add_parser("daemon", help="serve this device as a pipeline stage (gRPC)")
    _daemon_arguments(dm)
    dm.add_argument("--print-systemd-unit", action="store_true",
                    help="print a systemd unit that runs this daemon and restarts it when it fails, then exit")
    dm.set_defaults(func=commands.daemon)

    cl = sub.add_parser("cluster", help="start, stop or inspect the daemons of a cluster file (here, or over SSH)")
    cl.add_argument("action", choices=["up", "down", "status", "supervise"],
                    help="supervise: what `up` starts in the background to restart daemons that die")
    cl.add_argument("file")
    cl.add_argument("--no-restart", dest="restart", action="store_false",
                    help="up: do not start the supervisor that restarts daemons that die")
    cl.add_argument("--json", action="store_true")
    cl.set_defaults(func=commands.cluster)

    _profile_parser(sub)
    _plan_parser(sub)
    _run_parser(sub)
    _bench_parser(sub)

    sv = sub.add_parser("serve", help="an OpenAI-compatible API (chat, completions, streaming) over a plan")
    _plan_or_model(sv)
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    sv.add_argument("--port", type=_positive, default=8000)
    _dequantize_argument(sv)
    _prefix_cache_arguments(sv)
    sv.add_argument("--api-key-file", help="clients must send this key as a Bearer token (required beyond loopback)")
    sv.add_argument("--metrics-public", action="store_true",
                    help="/metrics without the API key (every other route but /health needs it where there is one)")
    sv.add_argument("--policy", choices=["gllm", "sarathi", "fcfs", "single"], default="gllm")
    sv.add_argument("--speculate", choices=["off", "ngram"], default="off",
                    help="requests that do not say (the request field \"speculate\"): ngram guesses tokens from the "
                         "prompt and the answer so far, verified in one pass (greedy answers unchanged)")
    sv.add_argument("--max-running", type=_positive, default=256,
                    help="requests decoding at once (their KV held); the others wait to start (default 256)")
    sv.add_argument("--max-queue", type=_positive, default=256,
                    help="requests waiting to start before new ones get 429 (default 256)")
    sv.add_argument("--served-model-name", help="the model's id in the API (default: the plan's model)")
    sv.add_argument("--default-max-tokens", type=_positive, default=1024,
                    help="the answer budget of a request that sets no max_tokens (default 1024)")
    sv.add_argument("--grace", type=float, default=60.0,
                    help="seconds a broken pipeline waits for its daemons before failing the requests in flight "
                         "(it goes on recovering in the background; default 60)")
    sv.add_argument("--drain", type=float, default=10.0,
                    help="on SIGTERM, seconds running requests may take to finish before they are cancelled "
                         "(default 10)")
    sv.set_defaults(func=commands.serve)

    md = sub.add_parser("model", help="model files: make a random-weight GGUF of a named shape")
    md.add_argument("action", choices=["make"])
    md.add_argument("spec", help="random:SHAPE@TYPE, e.g. random:llama3-8b@q4_k_m (types: f16, q8_0, q4_k_m, q4_k, "
                                 "q6_k)")
    md.add_argument("-o", "--output", help="where to write it (default: hpipe's cache; made once, then reused)")
    md.add_argument("--seed", type=int, default=0)
    md.set_defaults(func=commands.model)

    d = sub.add_parser("demo", help="the main job on built-in defaults: local cluster, SmolLM2, sample report")
    d.add_argument("--cluster", help="default: clusters/emulated-hetero.yaml as root, else clusters/local-3.yaml")
    d.add_argument("--instruction", default=INSTRUCTION)
    d.add_argument("--max-new-tokens", type=_positive, default=48)
    d.add_argument("--repeat", type=_positive, default=3, help="bench runs per strategy (median)")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=commands.demo)
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


def console() -> None:
    """The ``hpipe`` command as a process. It ends without the interpreter's teardown, output
    flushed (:func:`leave`): what a command wrote is on disk when it returns, and a teardown can
    abort in gRPC's or torch's C++ threads ("terminate called without an active exception", seen
    once in three ``hpipe generate --cluster`` runs of Gemma 3 on an AVX2 EPYC),
    turning a command that succeeded into a crash. Interrupted, it leaves at once the same way.

    SIGINT always interrupts: a process started in the background of a non-interactive shell (a
    script's ``hpipe run ... &``, a CI runner) inherits SIGINT *ignored*, and Python then never
    installs its KeyboardInterrupt handler, so a ``kill -INT`` (or a Ctrl-C forwarded by a
    wrapper) was silently lost and the job ran to its end."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = main()
    leave(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    console()
