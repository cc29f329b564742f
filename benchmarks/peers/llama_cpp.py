"""hpipe against llama.cpp on the same GGUF file, side by side in interleaved rounds.

    python benchmarks/peers/llama_cpp.py [--model smollm2-135m] [--also Q8_0,Q4_K_M] [--shapes decode_1,...]
                                         [--rounds 3] [--threads 2] [--isa avx2] [--json]

llama.cpp is built once from the ``llama-cpp-python==0.3.36`` sdist on the package index (its
``vendor/llama.cpp``; cmake and a C++ compiler; about five minutes on two cores) into
``~/.cache/hpipe-peers``. The build names the instruction sets itself rather than asking for the
build machine's (``GGML_NATIVE=OFF``): on a Xeon whose VM hides AMX, ggml's native build crashed
with SIGILL in its AMX kernels. ``--also`` makes more files from the model with
``llama-quantize`` (cached beside the build).

Each round runs, for every file, ``llama-batched-bench`` (a 512-token prompt, 64 new tokens; one
sequence and 16) and a 2,048-token prefill, then hpipe's :func:`hpipe_side.measure` of the same
shapes on the same threads (``--shapes`` picks some: a billion-parameter file's 16-sequence
prefill alone takes many minutes on two cores). Each side's peak resident memory is reported
beside (llama.cpp's per run; hpipe's this process's, so one file a run where it matters). ``--isa avx2`` caps both sides at AVX2 with FMA and F16C, as on an
AVX2-only CPU (an AMD EPYC of this project's VMs): llama.cpp built without AVX-512, hpipe's
kernels, MKL, oneDNN and ATen capped by their environment variables (set, then the script runs
itself again), and no bfloat16 prefill. The table gives each figure's median over the rounds, hpipe's ratio
to llama.cpp's per round, and the ratios' range (this VM drifts 10-20% over minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hpipe.core import cpuinfo

sys.path.insert(0, str(Path(__file__).parent))
from hpipe_side import load, measure  # noqa: E402
from perplexity import llama_perplexity, perplexity  # noqa: E402

VERSION = "0.3.36"
TARGETS = ["llama-batched-bench", "llama-quantize", "llama-perplexity"]
SHAPES = [("decode_1", 512, 64, 1), ("decode_16", 512, 64, 16), ("prefill_512", 512, 1, 1),
          ("prefill_2048", 2048, 1, 1)]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_model() -> str:
    return cpuinfo.model_name()


#: what ``--isa avx2`` leaves of the CPU, and the environment that caps each library at it
AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX2_ENV = dict(kv.split("=", 1) for line in (Path(__file__).parents[2] / "scripts" / "avx2.env").read_text().splitlines()
                if line.startswith("export ") for kv in line.split()[1:])  # the one list, scripts/avx2.env


def build(cap: set[str] | None = None) -> Path:
    """llama.cpp's tools, built once for this CPU's instruction sets (AMX off; only those in
    ``cap`` where given); their folder."""
    flags = cpu_flags() if cap is None else cpu_flags() & cap
    isa = {"GGML_AVX": "avx" in flags, "GGML_AVX2": "avx2" in flags, "GGML_FMA": "fma" in flags,
           "GGML_F16C": "f16c" in flags, "GGML_AVX512": "avx512f" in flags and "avx512bw" in flags,
           "GGML_AVX512_VNNI": "avx512_vnni" in flags, "GGML_AVX512_BF16": "avx512_bf16" in flags,
           "GGML_AVX_VNNI": "avx_vnni" in flags}
    tag = "-".join(k[5:].lower() for k, on in isa.items() if on) or "portable"
    dest = Path.home() / ".cache" / "hpipe-peers" / f"llama.cpp-{VERSION}-{tag}"
    bin_dir = dest / "build" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    print(f"building llama.cpp {VERSION} into {dest} (once, about five minutes)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        work, f"llama-cpp-python=={VERSION}"], check=True)
        subprocess.run(["tar", "-xzf", f"{work}/llama_cpp_python-{VERSION}.tar.gz", "-C", work], check=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["rm", "-rf", str(dest)], check=True)
        os.rename(f"{work}/llama_cpp_python-{VERSION}/vendor/llama.cpp", dest)
    options = [f"-D{k}={'ON' if on else 'OFF'}" for k, on in isa.items()]
    subprocess.run(["cmake", "-S", str(dest), "-B", str(dest / "build"), "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF",
                    "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    *options], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(dest / "build"), f"-j{os.cpu_count() or 2}", "--target", *TARGETS],
                   check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def quantized(bin_dir: Path, source: Path, kind: str) -> Path:
    """``source`` requantized to ``kind`` by llama-quantize (cached beside the build)."""
    out = bin_dir.parent.parent / "models" / f"{source.stem}.{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), kind],
                       check=True, capture_output=True)
        tmp.rename(out)
    return out


ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|\s*[\d.]+\s*\|\s*([\d.]+)\s*\|\s*[\d.]+\s*\|"
                 r"\s*([\d.]+)\s*\|")


def llama_round(bin_dir: Path, gguf: Path, threads: int, shapes: set[str]) -> dict[str, float]:
    """llama-batched-bench's prefill and decode tokens/s for ``shapes`` (of SHAPES), and its peak
    resident memory in bytes (``peak_rss``)."""
    out = {"peak_rss": 0.0}
    npl = ",".join(n for n, s in (("1", {"decode_1", "prefill_512"}), ("16", {"decode_16"})) if s & shapes)
    runs = [(["-npp", "512", "-ntg", "64", "-npl", npl, "-c", "9216" if "16" in npl else "576"],
             {(512, 64, 1): ("decode_1", "prefill_512"), (512, 64, 16): ("decode_16", None)}),
            (["-npp", "2048", "-ntg", "1", "-npl", "1", "-c", "2560"], {(2048, 1, 1): (None, "prefill_2048")})]
    if not npl:
        runs.pop(0)
    if "prefill_2048" not in shapes:
        runs.pop()
    for args, wanted in runs:
        child = subprocess.Popen([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-b",
                                  "2048", "-ub", "512", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
        text = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        if status:
            raise SystemExit(f"llama-batched-bench failed on {gguf} (status {status})")
        out["peak_rss"] = max(out["peak_rss"], usage.ru_maxrss * 1024.0)
        for line in text.splitlines():
            m = ROW.match(line)
            if m and (int(m[1]), int(m[2]), int(m[3])) in wanted:
                decode, prefill = wanted[(int(m[1]), int(m[2]), int(m[3]))]
                if decode:
                    out[decode] = float(m[5])
                if prefill:
                    out[prefill] = float(m[4])
    return out


def hpipe_round(stage, seed: int, shapes: set[str]) -> dict[str, float]:
    out = {}
    for name, npp, ntg, npl in SHAPES:
        if name in shapes:
            r = measure(stage, npp, ntg, npl, seed=seed)
            out[name] = r["prefill_tok_s"] if name.startswith("prefill") else r["decode_tok_s"]
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # this process: one file's
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a built-in name or a .gguf file")
    ap.add_argument("--also", default="", help="more files made from it with llama-quantize, e.g. Q8_0,Q4_K_M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--perplexity", metavar="TEXT", help="also each file's perplexity on this text, as "
                    "llama-perplexity computes it, against hpipe's (and the --dequantize model's)")
    ap.add_argument("--ctx", type=int, default=512, help="--perplexity's chunk length (llama-perplexity's -c)")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: both sides capped at AVX2 (an AVX2-only CPU's code paths)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="which of decode_1, decode_16, prefill_512, prefill_2048 (billion-parameter files: fewer)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shapes = set(args.shapes.split(","))
    if not shapes <= {s[0] for s in SHAPES}:
        raise SystemExit(f"--shapes: choose among {', '.join(s[0] for s in SHAPES)}")
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        # the caps must be in the environment before torch, MKL and oneDNN start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    from hpipe.model.kernels.precision import prefill_in_bfloat16
    from hpipe.model.weights.sources import resolve_model

    torch.set_num_threads(args.threads)
    bin_dir = build(AVX2 if args.isa == "avx2" else None)
    base = resolve_model(args.model).gguf
    if base is None:
        raise SystemExit(f"{args.model} is not a GGUF model")
    files = {"as shipped": base} | {k: quantized(bin_dir, base, k) for k in filter(None, args.also.split(","))}
    stages = {name: load(str(path), dequantize=False) for name, path in files.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in files}
    for r in range(args.rounds):
        for name, path in files.items():
            theirs = llama_round(bin_dir, path, args.threads, shapes)
            ours = hpipe_round(stages[name], seed=r, shapes=shapes)
            rounds[name].append({"llama.cpp": theirs, "hpipe": ours})
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {ours[k]:.0f}/{theirs.get(k, 0):.0f}" for k in ours),
                  file=sys.stderr)
    report = {"cpu": cpu_model(), "threads": args.threads, "isa": torch.ops.hpipe.quant_variant(),
              "capped": args.isa, "torch_cpu": torch.backends.cpu.get_cpu_capability(),
              "prefill_gemm": "bfloat16" if prefill_in_bfloat16() else "float32", "files": {}}
    for name, rs in rounds.items():
        rows = {}
        for shape in [s[0] for s in SHAPES if s[0] in shapes] + ["peak_rss"]:
            ratios = [x["hpipe"][shape] / x["llama.cpp"][shape] for x in rs if x["llama.cpp"].get(shape)]
            rows[shape] = {"hpipe": statistics.median(x["hpipe"][shape] for x in rs),
                           "llama.cpp": statistics.median(x["llama.cpp"].get(shape, 0.0) for x in rs),
                           "ratio": statistics.median(ratios) if ratios else None,
                           "ratio_range": [min(ratios), max(ratios)] if ratios else None}
        report["files"][f"{name} ({files[name].name})"] = rows
    if args.perplexity:
        report["perplexity"] = perplexities(bin_dir, files, stages, Path(args.perplexity), args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['cpu']}, {args.threads} threads, hpipe kernels: {report['isa']} (torch: {report['torch_cpu']}, "
          f"prefill GEMM {report['prefill_gemm']}); tokens/s, medians of "
          f"{args.rounds} interleaved rounds")
    for name, rows in report["files"].items():
        print(f"\n{name}\n  {'':14}{'hpipe':>9}{'llama.cpp':>11}{'ratio':>8}  range")
        for shape, row in rows.items():
            lo, hi = row["ratio_range"] or (0, 0)
            scale, unit = (1e9, " GB") if shape == "peak_rss" else (1, "")
            print(f"  {shape:14}{row['hpipe'] / scale:9.2f}{row['llama.cpp'] / scale:11.2f}{row['ratio'] or 0:8.2f}  "
                  f"{lo:.2f}-{hi:.2f}{unit}")
    if args.perplexity:
        print(f"\nperplexity on {args.perplexity}, chunks of {args.ctx} (hpipe's prefill GEMM: {report['prefill_gemm']})")
        for name, row in report["perplexity"].items():
            print(f"  {name:14} hpipe {row['hpipe']:.4f}  llama.cpp {row['llama.cpp']:.4f}  ratio {row['ratio']:.4f}"
                  f"  (the --dequantize model: {row['dequantized']:.4f})")


def perplexities(bin_dir: Path, files: dict[str, Path], stages: dict, text: Path, args) -> dict:
    """Each file's perplexity on ``text`` from llama-perplexity and from hpipe (its blocks, and the
    float32 --dequantize model of the same file)."""
    from gguf import GGUFReader

    from hpipe.model.weights.sources import resolve_model

    ids = resolve_model(args.model).tokenizer()(text.read_text())["input_ids"]
    out = {}
    for name, path in files.items():
        fields = GGUFReader(str(path)).fields
        adds = fields.get("tokenizer.ggml.add_bos_token")
        bos = None
        if adds is not None and bool(adds.parts[adds.data[0]][0]):
            bos = int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0])
        ours = perplexity(stages[name], ids, args.ctx, bos)
        reference = perplexity(load(str(path), dequantize=True), ids, args.ctx, bos)
        theirs = llama_perplexity(bin_dir, path, text, args.ctx, args.threads)
        out[name] = {"hpipe": ours, "llama.cpp": theirs, "ratio": ours / theirs, "dequantized": reference}
    return out


if __name__ == "__main__":
    main()
