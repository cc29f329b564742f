"""The real Gemma 3 270M (Q4_K_M GGUF: Q5_0, Q8_0, Q4_K and Q6_K blocks) against Hugging Face's
Gemma3ForCausalLM on the same file's dequantized weights, in one process and through three
daemons, and its quantized blocks against that float32 copy."""

import json

import pytest
import torch

from hpipe.app.cli import main
from hpipe.model.compute.linear import QuantLinear
from hpipe.model.generate.local import LocalModel, encode_prompt, generate
from hpipe.model.generate.sampling import SamplingParams
from runtime.coordinator.pipeline import Pipeline, cut_stages, generate_on_cluster
from tests.helpers import hf_model, max_rel_diff

#: prompts no other test uses
PROMPTS = ["The three largest planets in the solar system are", "def merge_sorted(a, b):\n    "]
NEW = 16


@pytest.fixture(scope="module")
def hf_greedy(gemma3):
    """Hugging Face's greedy continuation of each prompt, and its all-position logits of the first."""
    tok, model = gemma3.tokenizer(), hf_model(gemma3.path)
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([encode_prompt(tok, p, False)])
            out[p] = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:]
        ids = torch.tensor([encode_prompt(tok, PROMPTS[0], False)])
        out["logits"] = (ids, model(ids).logits[0])
    return out


def test_float32_equals_hf_logits_and_greedy_tokens(gemma3, hf_greedy):
    """The dequantized weights, cut inside blocks (6: attn_2 | mlp_2) and between a sliding and a
    global layer, prefill sliced: transformers' logits (1e-4) and greedy tokens."""
    tok = gemma3.tokenizer()
    model = LocalModel(gemma3, cuts=[6, 12, 25], dequantize=True)
    ids, ref = hf_greedy["logits"]
    n = ids.shape[1]
    runner = model.open(n)
    logits = torch.stack([runner.prefill(ids[:, :3], [3]), *[runner.step(int(t)) for t in ids[0, 3:]]])
    assert max_rel_diff(logits, ref[2:]) <= 1e-4
    for p in PROMPTS:
        out = generate(model.open, tok, p, context=2048, eos_ids=[], max_new_tokens=NEW,
                       slices=[4, len(encode_prompt(tok, p, False)) - 4])
        assert out.token_ids == hf_greedy[p].tolist(), p


@pytest.mark.usefixtures("cpu_kernels")
def test_quantized_blocks_give_the_dequantized_tokens(gemma3, hf_greedy):
    """Its blocks computed as stored (activations float32): the float32 copy's greedy tokens, which
    are transformers', whole and cut, prefill sliced; through ``hpipe generate`` too."""
    tok = gemma3.tokenizer()
    for cuts in ((), (5, 20, 31)):
        model = LocalModel(gemma3, cuts=cuts)
        assert any(isinstance(m, QuantLinear) for s in model.stages for m in s.modules())
        for p in PROMPTS:
            out = generate(model.open, tok, p, context=2048, eos_ids=[], max_new_tokens=NEW,
                           slices=[3, len(encode_prompt(tok, p, False)) - 3])
            assert out.token_ids == hf_greedy[p].tolist(), (cuts, p)


def test_hpipe_generate_runs_the_builtin_model(gemma3, hf_greedy, capsys):
    assert main(["generate", "--model", "gemma3-270m", "--prompt", PROMPTS[0], "--json", "--max-new-tokens",
                 str(NEW), "--cuts", "9,24"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = hf_greedy[PROMPTS[0]].tolist()
    assert out["token_ids"] == want[:len(out["token_ids"])] and out["token_ids"]


def test_three_daemons_give_the_in_process_tokens(cluster3, gemma3, hf_greedy):
    """Three daemon processes, the quantized stages cut inside blocks: transformers' greedy tokens."""
    pipe = Pipeline(cluster3.spec)
    try:
        pipe.load("gemma3-270m", cut_stages(pipe.cluster, [6, 23], gemma3.config.num_units), torch.float32)
        for p in PROMPTS:
            n = len(encode_prompt(gemma3.tokenizer(), p, False))
            result = generate_on_cluster(pipe, gemma3, gemma3.tokenizer(), p, chat=False, max_new_tokens=NEW,
                                         sampling=SamplingParams(), slices=[5, n - 5])
            want = hf_greedy[p].tolist()  # up to an end of turn, where this stops
            assert result.token_ids and result.token_ids == want[:len(result.token_ids)], p
    finally:
        pipe.close()
