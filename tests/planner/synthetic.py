"""Synthetic profiles for planner tests: random device speeds, memories and links."""

import random

from hpipe.core.config import ModelConfig
from hpipe.core.profile import ComputeGrid, DaemonProfile, LinkProfile, Profile

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096)


def grid(per_token: float, fixed: float, ctx_cost: float = 0.0, batches=(1,)):
    tokens = (1, 16, 64, 256, 1024, 4096)
    contexts = (0, 1024, 4096) if ctx_cost else (0,)
    secs = tuple(tuple(tuple(b * (fixed + per_token * s + ctx_cost * s * c) for c in contexts) for s in tokens)
                 for b in batches)
    return ComputeGrid(tuple(batches), tokens, contexts, secs)


def make_profile(rng: random.Random, n: int, layers: int = 2, memory=None, batches=(1,), tie=False) -> Profile:
    cfg = ModelConfig.from_dict({**TINY, "num_hidden_layers": layers, "tie_word_embeddings": tie})
    devices = []
    for i in range(n):
        speed = rng.uniform(0.2, 3.0)
        devices.append(DaemonProfile(
            f"d{i}", f"127.0.0.1:{5000 + i}", "cpu",
            memory if memory is not None else 10**9,
            {"embed": grid(1e-6 / speed, 1e-5, batches=batches),
             "attn": grid(2e-5 / speed, 1e-4 * rng.uniform(0.5, 2), 1e-9 / speed, batches=batches),
             "mlp": grid(3e-5 / speed, 1e-4 * rng.uniform(0.5, 2), batches=batches),
             "head": grid(1e-5 / speed, 5e-5, batches=batches)}))
    links = tuple(LinkProfile(a.name, b.name, rng.uniform(1e-5, 2e-3), rng.uniform(5e6, 5e9))
                  for a in devices for b in devices if a is not b)
    return Profile(cfg, "tiny", "float32", tuple(devices), links)
