"""Where does a verification entry's row stop being a lone decode step's? Module by module.

    python benchmarks/row_invariance.py --model FILE.gguf|NAME [--device cuda] [--dtype float32] [--guesses 5]

Speculation's answers equal plain decoding's only where each row of an entry of k guesses has the
bits a lone decode step at its position has. This runs, in one process (``LocalModel``), a prompt,
then k tokens one step at a time, then the same k tokens as one verification entry, with a hook
on every module of the stages; it prints, in the order the modules ran, each module's largest
difference between the entry's rows and the lone steps' outputs, and names the first that
differs (the place to make the sums independent of the row count). On the CPU every row is
expected equal (tests/model/test_speculative.py checks the logits).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from hpipe.model.generate.local import LocalModel
from hpipe.model.weights.sources import resolve_model


def capture(model: LocalModel) -> tuple[dict, list, list]:
    """Hooks recording each module's tensor outputs (as rows) by name: (outputs, call order, handles)."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    order: list[str] = []
    handles = []
    for s, stage in enumerate(model.stages):
        for name, module in stage.named_modules():
            key = f"{s}.{name or type(module).__name__}"

            def hook(_m, _inputs, out, key=key):
                if isinstance(out, torch.Tensor) and out.dim() >= 1:
                    if key not in seen:
                        order.append(key)
                    seen[key].append(out.detach().float().reshape(-1, out.shape[-1]).cpu())

            handles.append(module.register_forward_hook(hook))
    return seen, order, handles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--guesses", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=40)
    args = ap.parse_args()
    source = resolve_model(args.model)
    model = LocalModel(source, dtype=getattr(torch, args.dtype), device=args.device)
    vocab = source.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, vocab, (args.guesses,), generator=torch.Generator().manual_seed(2)).tolist()
    n = args.prompt_len + args.guesses + 1

    lone = model.open(n)
    lone.prefill(prompt.to(args.device), [args.prompt_len])
    steps, order, handles = capture(model)
    for t in tokens:
        lone.step(t)
    for h in handles:
        h.remove()
    entry = model.open(n)
    entry.prefill(prompt.to(args.device), [args.prompt_len])
    rows, _, handles = capture(model)
    entry.verify(tokens)
    for h in handles:
        h.remove()

    first = None
    print(f"{args.model} on {args.device} in {args.dtype}, {args.guesses} guesses: largest |entry row - lone step|")
    for key in order:
        alone = torch.cat(steps[key])  # one row a step (a module that ran once a step)
        many = torch.cat(rows[key])
        if alone.shape != many.shape:
            print(f"  {key}: shapes {tuple(alone.shape)} / {tuple(many.shape)} (not row by row)")
            continue
        diff = float((alone - many).abs().max())
        print(f"  {key}: {diff:.3g}")
        if diff and first is None:
            first = key
    print(f"first module to differ: {first or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
