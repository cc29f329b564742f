"""One answer's decode with and without speculative decoding (prompt lookup), side by side.

    python benchmarks/speculative.py [--cluster clusters/wifi-3.yaml] [--model smollm2-135m]
                                     [--prompts 4] [--max-new-tokens 96] [--rounds 2]

Prompts that ask about a document (passages of the shipped licence text, each asked to quote or
restate a part of it, as document questions do), greedy, each decoded with ``--speculate off``
and ``ngram`` alternately, ``--rounds`` times: in this process, or through the daemons of
``--cluster`` (the model cut evenly over them). Prints each way's decode tokens/s (median over
prompts and rounds), the ratio, the guesses kept, and whether every answer was the same token for
token (it must be: a difference exits non-zero).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from hpipe.core import cpuinfo
from hpipe.core.cluster import ClusterSpec
from hpipe.core.units import even_cuts
from hpipe.model.generate.local import LocalModel, generate
from hpipe.model.generate.sampling import SamplingParams
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.pipeline import Pipeline, coordinate_on_one_thread, cut_stages, generate_on_cluster

TEXT = Path(__file__).parents[1] / "tests" / "data" / "apache-2.0.txt"
ASKS = ["Quote the sentence of the text above that defines \"{word}\".",
        "Repeat the paragraph of the text above that mentions \"{word}\", word for word.",
        "What does the text above say about \"{word}\"? Quote it.",
        "Copy the first two sentences of the text above."]
WORDS = ["Contribution", "Derivative Works", "Licensor", "Source form", "Work", "Legal Entity"]


def prompts(n: int) -> list[str]:
    paragraphs = [p for p in TEXT.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out = []
    for i in range(n):
        passage = "\n\n".join(paragraphs[(3 * i) % len(paragraphs):(3 * i) % len(paragraphs) + 4])
        out.append(passage + "\n\n" + ASKS[i % len(ASKS)].format(word=WORDS[i % len(WORDS)]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", help="decode through these daemons (default: in this process)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    source = resolve_model(args.model)
    tok, cfg = source.tokenizer(), source.config
    chat = bool(getattr(tok, "chat_template", None))
    pipe = None
    if args.cluster:
        coordinate_on_one_thread()
        cluster = ClusterSpec.load(args.cluster)
        pipe = Pipeline(cluster)
        pipe.load(args.model, cut_stages(cluster, even_cuts(cfg.num_units, len(cluster.daemons)), cfg.num_units),
                  torch.float32)
    else:
        model = LocalModel(source)

    def run(prompt: str, speculate: str):
        kw = dict(chat=chat, max_new_tokens=args.max_new_tokens, speculate=speculate)
        if pipe is not None:
            return generate_on_cluster(pipe, source, tok, prompt, sampling=SamplingParams(), slices=None, **kw)
        return generate(model.open, tok, prompt, context=cfg.max_position_embeddings, eos_ids=source.eos_token_ids(),
                        **kw)

    rates: dict[str, list[float]] = {"off": [], "ngram": []}
    proposed = accepted = 0
    same = True
    try:
        for r in range(args.rounds):
            for prompt in prompts(args.prompts):
                results = {}
                for mode in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                    results[mode] = run(prompt, mode)
                    d = results[mode].as_dict()
                    if d["decode_tokens_per_s"]:
                        rates[mode].append(d["decode_tokens_per_s"])
                same &= results["off"].token_ids == results["ngram"].token_ids
                stats = results["ngram"].extra["speculation"]
                proposed += stats["proposed"]
                accepted += stats["accepted"]
    finally:
        if pipe is not None:
            pipe.close()
    cpu = cpuinfo.model_name()
    report = {"cpu": cpu, "where": args.cluster or "in-process", "model": args.model, "prompts": args.prompts,
              "rounds": args.rounds, "off_tok_s": statistics.median(rates["off"]),
              "ngram_tok_s": statistics.median(rates["ngram"]), "proposed": proposed, "accepted": accepted,
              "same_tokens": same}
    report["speedup"] = round(report["ngram_tok_s"] / report["off_tok_s"], 3)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{cpu}, {report['where']}, {args.model}: decode {report['off_tok_s']:.1f} tokens/s without guesses, "
              f"{report['ngram_tok_s']:.1f} with ({report['speedup']:.2f}x); {accepted} of {proposed} guesses kept; "
              f"the same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
