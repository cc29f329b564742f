"""Workloads: requests with arrival times and prompt and output lengths, to replay on a cluster.

A workload file is JSONL, one request a line: ``{"arrival_s": 0.0, "prompt_tokens": 512,
"output_tokens": 64}`` (arrival seconds from the start). Or one is generated from a seed:
``generate(n, seed, prompt=(64, 2048), output=(16, 256), rate=None)``, lengths uniform in their
ranges, arriving all at once (``rate`` None) or as a Poisson process of ``rate`` requests a second.
Prompts are token ids drawn from the seed too, so a workload needs no tokenizer and runs on
random-weight models alike.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from hpipe.core.errors import InputError


@dataclass(frozen=True)
class WorkItem:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def generate(n: int, seed: int = 0, prompt: tuple[int, int] = (64, 2048), output: tuple[int, int] = (16, 256),
             rate: float | None = None) -> list[WorkItem]:
    if n < 1:
        raise InputError(f"a workload needs at least one request, got {n}")
    if rate is not None and not rate > 0:
        raise InputError(f"an arrival rate must be > 0 requests a second, got {rate}")
    rng = random.Random(seed)
    t, items = 0.0, []
    for _ in range(n):
        items.append(WorkItem(round(t, 4), rng.randint(*prompt), rng.randint(*output)))
        if rate is not None:
            t += rng.expovariate(rate)
    return items


def bundled() -> dict[str, Path]:
    """The workloads shipped with hpipe, by name: ``mixed`` (24 requests, a third of them long
    documents with short answers, the rest chat turns, arriving about one every 4 s) and those
    docs/results.md's figures replay, each :func:`generate` d, all at once: ``pressure``
    (``generate(256, 1, prompt=(32, 288), output=(16, 64))``), ``w64`` (``generate(64, 64,
    prompt=(1000, 2000), output=(128, 256))``), ``w24w`` (its first 24) and ``w16dec``
    (``generate(16, 0, prompt=(300, 300), output=(400, 400))``)."""
    folder = files("hpipe").joinpath("data/workloads")
    return {Path(f.name).stem: Path(str(f)) for f in folder.iterdir() if f.name.endswith(".jsonl")}


def load(path: str | Path) -> list[WorkItem]:
    """A workload file, or a bundled workload by name (:func:`bundled`)."""
    if not Path(path).exists() and str(path) in bundled():
        path = bundled()[str(path)]
    items = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read workload {path}: {e}; bundled workloads: "
                         f"{', '.join(sorted(bundled()))}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item = WorkItem(float(row.get("arrival_s", 0.0)), int(row["prompt_tokens"]), int(row["output_tokens"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InputError(f"{path}:{i}: expected {{\"arrival_s\", \"prompt_tokens\", \"output_tokens\"}}") from None
        if item.arrival_s < 0 or item.prompt_tokens < 1 or item.output_tokens < 1:
            raise InputError(f"{path}:{i}: arrival must be >= 0, prompt and output lengths >= 1")
        items.append(item)
    if not items:
        raise InputError(f"workload {path} has no requests")
    return sorted(items, key=lambda w: w.arrival_s)


def dump(items: list[WorkItem]) -> str:
    return "".join(json.dumps({"arrival_s": w.arrival_s, "prompt_tokens": w.prompt_tokens,
                               "output_tokens": w.output_tokens}) + "\n" for w in items)


def prompt_ids(item: WorkItem, index: int, vocab: int, seed: int = 0) -> list[int]:
    """The token ids of request ``index``'s prompt (the same for every policy and round)."""
    rng = random.Random(f"{seed}:{index}")
    return [rng.randrange(vocab) for _ in range(item.prompt_tokens)]
