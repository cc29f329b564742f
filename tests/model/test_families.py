"""Qwen3, Phi-3 and Gemma 3 beside the Llama family: what the shared golden tests
(test_model_equivalence, test_cpu_kernel, test_decode_step run every family of tests.helpers) do
not reach: LongRoPE past its original length in decode, a mixed micro-batch of each family, and a
clear error for what is not supported."""

import pytest
import torch

from hpipe.core.config import ModelConfig
from hpipe.core.errors import ModelSourceError, UnsupportedModelError
from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import LocalModel
from hpipe.model.kv.pool import Entry, KVPool
from hpipe.model.weights.sources import resolve_model
from tests.helpers import hf_model, max_rel_diff

NEW_FAMILIES = ["qwen3-sliding", "qwen3-bias", "gemma3", "gemma3-pattern", "phi3-longrope", "phi3-partial"]


def test_longrope_turns_by_the_long_factors_past_its_original_length(tiny_dirs):
    """Past original_max_position_embeddings (32) a position turns by the long factors: the logits
    of transformers' model fed token by token with its cache (generate() instead drops its cache
    once at the crossing and recomputes the whole sequence with the long factors; hpipe does not,
    see hpipe/model/compute/rope.py), and below the boundary generate()'s own greedy tokens."""
    from transformers import DynamicCache

    source = resolve_model(str(tiny_dirs["phi3-longrope"]))
    assert source.config.rope.original_max_position_embeddings == 32
    prompt = torch.randint(0, source.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    hf = hf_model(source.path)
    with torch.no_grad():
        greedy = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                             pad_token_id=0)[0, 12:].tolist()  # positions up to 31
    tokens = greedy + [7, 300, 12, 99, 5, 250, 31, 8]  # fed on, past the boundary
    cache, ref = DynamicCache(), []
    with torch.no_grad():
        logits = hf(prompt, cache=cache, use_cache=True).logits[0, -1]
        for t in tokens:
            ref.append(logits)
            logits = hf(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
    runner = LocalModel(source, cuts=[2, 5]).open(12 + len(tokens) + 1)
    ours = [runner.prefill(prompt, [7, 5])]
    ours += [runner.step(t) for t in tokens[:-1]]
    assert [int(x.argmax()) for x in ours[:20]] == greedy
    assert max(max_rel_diff(a, b) for a, b in zip(ours, ref)) <= 1e-4


PROMPTS = [20, 5, 33, 9, 1]  # tokens already in each sequence's cache (past the sliding window of 8)
NEXT = [1, 11, 1, 6, 3]      # what the mixed micro-batch adds (1: a decode token)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_mixed_micro_batch_equals_each_sequence_alone(family, tiny_dirs):
    """Prefill chunks and decode tokens of sequences of different lengths in one micro-batch give
    each sequence the logits it gets alone."""
    source = resolve_model(str(tiny_dirs[family]))
    cfg = source.config
    stage = StageModel.from_checkpoint(source.weights(), cfg, UnitRange.full(cfg.num_layers))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.vocab_size, (p + n,), generator=gen) for p, n in zip(PROMPTS, NEXT)]
    alone = []
    for x, p in zip(ids, PROMPTS):
        cache = stage.new_cache(1, len(x))
        stage(x[None, :p], 0, cache, logits=False)
        alone.append(stage(x[None, p:], p, cache)[0, -1])
    pool = KVPool(UnitRange.full(cfg.num_layers).attention_layers(), 40, cfg.num_kv_heads, cfg.head_dim,
                  stage.dtype, stage.device)
    seqs = [pool.sequence(len(x)) for x in ids]
    entries = []
    for s, p in zip(seqs, PROMPTS):
        s.grow(p)
        entries.append(Entry(0, p, s, "none"))
    stage.forward_batch(torch.cat([x[:p] for x, p in zip(ids, PROMPTS)]), entries, pool)
    entries = []
    for s, p, n in zip(seqs, PROMPTS, NEXT):
        s.grow(p + n)
        entries.append(Entry(p, n, s, "last"))
    together = stage.forward_batch(torch.cat([x[p:] for x, p in zip(ids, PROMPTS)]), entries, pool)
    for i, want in enumerate(alone):
        assert max_rel_diff(together[i], want) <= 1e-5, (family, i)


BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
GEMMA = dict(BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, sliding_window=4,
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16)


@pytest.mark.parametrize("change, named", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "relu"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "yarn"),
])
def test_an_unsupported_option_is_named_at_load(change, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_dict({**GEMMA, **change})


def test_family_traits_come_from_the_config():
    """Gemma 3 in transformers 4's layout: every sixth layer global, the sliding ones on their own
    base; its traits follow from the architecture and keys, not from a name."""
    cfg = ModelConfig.from_dict({**GEMMA, "num_hidden_layers": 7, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert cfg.sliding_windows == (4, 4, 4, 4, 4, None, 4)
    assert cfg.rope_of(5).theta == 1e6 and cfg.rope_of(0).theta == 1e4
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset == 1.0 and cfg.embed_scale == 8.0
    assert cfg.attention_scale == 0.25 and cfg.hidden_act == "gelu_pytorch_tanh"
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert qwen3.qk_norm and not qwen3.sandwich_norms and not qwen3.qkv_bias and qwen3.embed_scale == 1.0
    phi3 = ModelConfig.from_dict({**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                                  "partial_rotary_factor": 0.5})
    assert phi3.rope.partial_rotary_factor == 0.5 and not phi3.qk_norm
    with pytest.raises(ModelSourceError, match="long_factor need 4 entries"):
        ModelConfig.from_dict({**BASE, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5,
                               "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                "original_max_position_embeddings": 64}})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5})
