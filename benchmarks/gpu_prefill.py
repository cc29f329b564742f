"""Prefill speed of one stage daemon holding a whole model vs Hugging Face transformers, same GPU, same run.

    python benchmarks/gpu_prefill.py [--model random:llama-7b] [--batch 6] [--seq-len 2048] [--dtype bfloat16]

1. One daemon process on cuda:0 (gRPC, as in a cluster) loads the whole model with random weights;
   the coordinator times prefill of batch x seq_len token ids in one slice (last-position logits
   back), then in --slices equal slices, then --decode single-token steps.
2. In this process: our stage model alone (no RPC), and transformers' LlamaForCausalLM of the same
   shape (sdpa attention, KV cache kept, logits of the last position only), same batch and length.
Each number is the median of --repeat runs after a warm-up; GPU work is synchronised before a
clock is read. The ratio printed is HF seconds / hpipe seconds (>= 1: hpipe at least as fast).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hpipe.core.cluster import ClusterSpec
from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel, parse_dtype
from hpipe.model.weights.sources import model_shape
from runtime.cluster import launcher
from runtime.coordinator.pipeline import Pipeline, cut_stages


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    """Give a deleted model's memory back before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_time(fn, repeat: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def through_daemon(args, cfg, ids, dtype, graphs: bool = True, decode_only: bool = False) -> dict:
    work = Path(tempfile.mkdtemp(prefix="hpipe-gpu-"))
    cluster_file = work / "one.yaml"
    cluster_file.write_text(f"name: gpu-one\ndaemons:\n  - name: g0\n    address: 127.0.0.1:{free_port()}\n"
                            f"    device: {args.device}\n    threads: 2\n    cuda_graphs: {str(graphs).lower()}\n")
    cluster = ClusterSpec.load(cluster_file)
    launcher.up(cluster)
    out = {}
    try:
        pipe = Pipeline(cluster)
        t0 = time.perf_counter()
        pipe.load(args.model, cut_stages(pipe.cluster, [], cfg.num_units), dtype)
        out["deploy_s"] = time.perf_counter() - t0
        b, n = ids.shape

        def prefill(slices: list[int]) -> float:
            seq = pipe.open(n + args.decode, batch=b)
            try:
                t = time.perf_counter()
                start = 0
                for k, s in enumerate(slices):
                    seq.submit(ids[:, start:start + s], want_logits=k == len(slices) - 1, prefill=True)
                    start += s
                for _ in slices:
                    seq.result()
                elapsed = time.perf_counter() - t
                t = time.perf_counter()
                for _ in range(args.decode):
                    seq.submit(ids[:, :1], prefill=False)
                    seq.result()
                decode = (time.perf_counter() - t) / max(args.decode, 1)
            finally:
                seq.close()
            return elapsed, decode

        def med(slices):
            prefill(slices)  # warm-up
            runs = [prefill(slices) for _ in range(args.repeat)]
            return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

        out["one_slice_s"], out["decode_step_s"] = med([n])
        k = args.slices
        if not decode_only:
            out[f"{k}_slices_s"], _ = med([n // k] * (k - 1) + [n - (n // k) * (k - 1)])
        pipe.close()
    finally:
        launcher.down(cluster)
    return out


def in_process(cfg, ids, dtype) -> float:
    stage = StageModel.random(cfg, UnitRange.full(cfg.num_layers), dtype=dtype, device=ARGS.device)
    b, n = ids.shape

    def run():
        cache = stage.new_cache(b, n)
        stage(ids, 0, cache)

    t = median_time(run, ARGS.repeat)
    stage = None  # free it before the next measurement
    free()
    return t


def huggingface(cfg, ids, dtype) -> float:
    import transformers

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_dict().items() if k != "architectures"})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(ARGS.device):
        model = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()

    @torch.inference_mode()
    def run():
        model(ids, logits_to_keep=1, use_cache=True)

    t = median_time(run, ARGS.repeat)
    model = None  # free it before the next measurement
    free()
    return t


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-7b")
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--slices", type=int, default=16, help="also time prefill in this many equal slices")
    ap.add_argument("--decode", type=int, default=16, help="also time this many single-token decode steps")
    ap.add_argument("--device", default="cuda:0", help="cpu only to check the script itself")
    ap.add_argument("--json", action="store_true")
    ARGS = args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_prefill: needs a CUDA GPU", file=sys.stderr)
        return 2
    _, cfg = model_shape(args.model)
    dtype = parse_dtype(args.dtype, args.device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    result = {"model": args.model, "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    result["daemon"] = through_daemon(args, cfg, ids, dtype)
    result["daemon_eager_decode"] = through_daemon(args, cfg, ids, dtype, graphs=False, decode_only=True)
    result["in_process_s"] = in_process(cfg, ids.to(args.device), dtype)
    result["hf_s"] = huggingface(cfg, ids.to(args.device), dtype)
    d = result["daemon"]
    result["hf_over_daemon"] = result["hf_s"] / d["one_slice_s"]
    result["hf_over_in_process"] = result["hf_s"] / result["in_process_s"]
    if args.json:
        print(json.dumps(result))
    tokens = args.batch * args.seq_len
    print(f"{args.model} {args.dtype}, {args.batch} x {args.seq_len} tokens on {result['gpu']}")
    print(f"  hpipe daemon, 1 slice      {d['one_slice_s'] * 1e3:8.1f} ms  {tokens / d['one_slice_s']:9.0f} tok/s")
    print(f"  hpipe daemon, {args.slices} slices    {d[f'{args.slices}_slices_s'] * 1e3:8.1f} ms")
    print(f"  hpipe stage in-process     {result['in_process_s'] * 1e3:8.1f} ms")
    print(f"  transformers forward       {result['hf_s'] * 1e3:8.1f} ms  {tokens / result['hf_s']:9.0f} tok/s")
    print(f"  decode step (batch {args.batch})     {d['decode_step_s'] * 1e3:8.2f} ms with CUDA graphs, "
          f"{result['daemon_eager_decode']['decode_step_s'] * 1e3:.2f} ms eager")
    print(f"  speed vs transformers: daemon {result['hf_over_daemon']:.3f}x, in-process "
          f"{result['hf_over_in_process']:.3f}x")
    return 0


ARGS: argparse.Namespace


if __name__ == "__main__":
    sys.exit(main())
