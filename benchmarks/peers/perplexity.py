"""Perplexity the way ``llama-perplexity`` computes it, for hpipe's side of the peer benchmark.

llama-perplexity cuts the tokenized text into chunks of ``n_ctx`` tokens (the first token of each
made the BOS where the model adds one), evaluates each chunk alone from an empty cache, and scores
only the second half of each: the mean negative log-likelihood of tokens ``n_ctx/2 + 1 ..
n_ctx - 1`` given those before them in the chunk. ``perplexity(stage, ids)`` does the same on a
whole-model stage; ``llama_perplexity`` runs the tool and reads its final estimate.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

from hpipe.model.compute.stage import StageModel

FINAL = re.compile(r"Final estimate: PPL = ([\d.]+)")


def chunks(ids: list[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """The whole chunks of ``n_ctx`` tokens, each beginning with ``bos`` where one is given."""
    out = [list(ids[i:i + n_ctx]) for i in range(0, len(ids) - n_ctx + 1, n_ctx)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


@torch.inference_mode()
def perplexity(stage: StageModel, ids: list[int], n_ctx: int = 512, bos: int | None = None) -> float:
    """exp of the mean negative log-likelihood over the second half of every chunk."""
    nll, count = 0.0, 0
    first = n_ctx // 2
    for chunk in chunks(ids, n_ctx, bos):
        logits = stage(torch.tensor([chunk]), 0, stage.new_cache(1, n_ctx), all_logits=True)[0]
        logp = torch.log_softmax(logits[first:n_ctx - 1].double(), dim=-1)
        targets = torch.tensor(chunk[first + 1:n_ctx])
        nll -= logp.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    if not count:
        raise ValueError(f"the text has fewer than {n_ctx} tokens")
    return float(torch.tensor(nll / count).exp())


def llama_perplexity(bin_dir: Path, gguf: Path, text: Path, n_ctx: int, threads: int) -> float:
    """llama-perplexity's final estimate on ``text``."""
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx),
                          "-b", str(n_ctx), "-t", str(threads)], capture_output=True, text=True, check=True)
    found = FINAL.search(out.stdout + out.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{out.stderr[-2000:]}")
    return float(found[1])
