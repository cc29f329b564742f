"""A GGUF model on a GPU from its blocks (dequantized at each use) against its ``--dequantize``
checkpoint in the same dtype, in one process, in interleaved rounds: bytes held on the card,
prefill and one-sequence decode speed, and whether the greedy tokens agree.

    python benchmarks/gpu_blocks.py [--model smollm2-135m] [--device cuda] [--rounds 4]

In-process stages (``hpipe generate --device cuda``'s path: eager, no CUDA graphs); the first
round warms up and is left out of the medians. ``--device cpu`` runs the same in float32 (the
blocks through the C++ kernels), to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hpipe.model.generate.local import LocalModel, generate
from hpipe.model.weights.sources import resolve_model

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "apache-2.0.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    src = resolve_model(args.model)
    src.weights(dequantize=True)  # the float32 import, once, before anything is timed
    tok = src.tokenizer()
    prompt = tok.decode(tok(TEXT.read_text())["input_ids"][:args.prompt_tokens])

    def sync():
        if cuda:
            torch.cuda.synchronize()

    models, held = {}, {}
    for name in ("blocks", "dequantized"):
        sync()
        before = torch.cuda.memory_allocated() if cuda else 0
        models[name] = LocalModel(src, dtype=dtype, device=args.device, dequantize=name == "dequantized")
        sync()
        held[name] = torch.cuda.memory_allocated() - before if cuda else sum(s.weight_bytes() for s in models[name].stages)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{src.gguf.name if src.gguf else src.name}: {src.config.num_layers} layers, {where}, {dtype}")
    print("bytes held: " + ", ".join(f"{n} {b / 1e6:.1f} MB" for n, b in held.items()))
    rates, tokens = {n: [] for n in models}, {}
    for rnd in range(args.rounds):
        for name, m in models.items():
            sync()
            r = generate(m.open, tok, prompt, context=args.prompt_tokens + args.new_tokens + 16, eos_ids=[],
                         max_new_tokens=args.new_tokens)
            if rnd:
                rates[name].append((r.prompt_tokens / r.prefill_s, len(r.token_ids) / r.decode_s))
            tokens[name] = r.token_ids
            print(f"round {rnd} {name}: prefill {r.prompt_tokens} tokens {r.prefill_s * 1e3:.1f} ms, "
                  f"decode {len(r.token_ids) / r.decode_s:.1f} tokens/s", flush=True)
    for name, rs in rates.items():
        p, d = zip(*rs)
        print(f"{name}: prefill tokens/s {statistics.median(p):.0f} ({min(p):.0f}-{max(p):.0f}), "
              f"decode tokens/s {statistics.median(d):.1f} ({min(d):.1f}-{max(d):.1f})")
    same = sum(a == b for a, b in zip(tokens["blocks"], tokens["dequantized"]))
    print(f"greedy tokens equal: {same} of {len(tokens['blocks'])}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
