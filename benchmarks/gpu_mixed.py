"""A model of the size users run on a GPU daemon beside CPU daemons: the tokens all-CPU daemons give.

    python benchmarks/gpu_mixed.py [--model random:llama3-8b@q4_k_m] [--gpu-units 22] [--new 16]

Four daemon processes on this machine (loopback): ``g0`` on ``--gpu-device`` and ``c0``, ``c1``,
``c2`` on the CPU (``--threads`` each). The model (by default an 8B shape at Q4_K_M, each daemon
making only its own units' blocks: ``random:SHAPE@QUANT``) is cut in three at the same units twice:

- **mixed**: the first ``--gpu-units`` units on the GPU daemon, the rest split over ``c0`` and ``c1``;
- **cpu**: the same three ranges on ``c2``, ``c0`` and ``c1``.

Both greedy-decode ``--new`` tokens after the same random prompt, in float32 (the GPU dequantizes
the Q4_K/Q6_K blocks and multiplies in float32 without TF32; the CPU daemons keep float32 prefill
rows: ``HPIPE_PREFILL_GEMM=float32``). Prints each run's prefill seconds and decode tokens/s, the
prompt's last-position logits' largest relative difference, and whether the tokens are equal (exit
1 where not). ``--gpu-device cpu`` dry-runs it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HPIPE_PREFILL_GEMM", "float32")  # the daemons (children) inherit it

import torch  # noqa: E402

from hpipe.core.cluster import ClusterSpec  # noqa: E402
from hpipe.core.shapes import random_config  # noqa: E402
from hpipe.model.generate.local import decode_loop  # noqa: E402
from hpipe.model.generate.sampling import Sampler  # noqa: E402
from runtime.cluster import launcher  # noqa: E402
from runtime.coordinator.pipeline import Pipeline, RemoteRunner, cut_stages  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_file(work: Path, gpu: str, threads: int) -> Path:
    lines = ["name: gpu-mixed", "daemons:"]
    for name, device in (("g0", gpu), ("c0", "cpu"), ("c1", "cpu"), ("c2", "cpu")):
        lines.append(f"  - {{name: {name}, address: '127.0.0.1:{free_port()}', device: '{device}', "
                     f"threads: {threads}}}")
    path = work / "gpu-mixed.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(pipe: Pipeline, model: str, daemons: list[str], cuts: list[int], units: int, prompt: list[int],
        new: int) -> dict:
    t0 = time.perf_counter()
    pipe.load(model, cut_stages(pipe.cluster, cuts, units, daemons=daemons), torch.float32)
    load_s = time.perf_counter() - t0
    with pipe.open(len(prompt)) as seq:
        first = RemoteRunner(seq).prefill(torch.tensor([prompt]), [len(prompt)]).float().reshape(-1)
    with pipe.open(len(prompt) + new) as seq:
        tokens, prefill_s, decode_s, _ = decode_loop(RemoteRunner(seq), prompt, max_new_tokens=new,
                                                     sampler=Sampler(), eos_ids=[], slices=[len(prompt)])
    return {"daemons": daemons, "load_s": round(load_s, 1), "prefill_s": round(prefill_s, 3),
            "decode_tokens_per_s": round((len(tokens) - 1) / decode_s, 2), "tokens": tokens, "logits": first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama3-8b@q4_k_m")
    ap.add_argument("--gpu-device", default="cuda:0")
    ap.add_argument("--gpu-units", type=int, default=22, help="units on the GPU daemon (the first ones)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 3) // 3))
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    cfg = random_config(args.model.split("@")[0])
    units = cfg.num_units
    rest = units - args.gpu_units
    cuts = [args.gpu_units, args.gpu_units + rest // 2]
    prompt = torch.randint(0, min(cfg.vocab_size, 49152), (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    cluster = ClusterSpec.load(cluster_file(Path(tempfile.mkdtemp(prefix="hpipe-mixed-")), args.gpu_device,
                                            args.threads))
    launcher.up(cluster)
    try:
        pipe = Pipeline(cluster)
        try:
            mixed = run(pipe, args.model, ["g0", "c0", "c1"], cuts, units, prompt, args.new)
            cpu = run(pipe, args.model, ["c2", "c0", "c1"], cuts, units, prompt, args.new)
        finally:
            pipe.close()
    finally:
        launcher.down(cluster)
    a, b = mixed.pop("logits"), cpu.pop("logits")
    rel = float((a - b).abs().max() / b.abs().max())
    same = mixed["tokens"] == cpu["tokens"]
    report = {"model": args.model, "cuts": cuts, "units": units, "gpu": args.gpu_device,
              "threads": args.threads, "mixed": mixed, "cpu": cpu, "prompt_logits_max_rel_diff": rel,
              "tokens_equal": same}
    if torch.cuda.is_available():
        report["gpu_name"] = torch.cuda.get_device_name(0)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
