"""Qwen3, Phi-3 and Gemma 3 through daemons: each family cut inside blocks over three daemons,
requests of mixed lengths batched by the engine with sliced prefill, give each request the tokens
it gets in one process (whose logits equal transformers', tests/model/test_model_equivalence.py)."""

import pytest

from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.coordinator.policies import POLICIES
from tests.cluster_helpers import Served, cluster_of
from tests.model.test_families import NEW_FAMILIES
from tests.runtime.test_engine import alone, chunks, pools_empty, workload


@pytest.fixture(scope="module")
def daemons():
    served = [Served(f"d{i}") for i in range(3)]
    yield served
    for d in served:
        d.stop()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_each_family_through_daemons_gives_each_request_its_own_tokens(family, daemons, tiny_dirs):
    import torch

    path = str(tiny_dirs[family])
    source = resolve_model(path)
    prompts, news = workload(6, source.config.vocab_size)  # 3 to 40 tokens, past the windows of 8
    pipe = Pipeline(cluster_of(*daemons))
    try:
        # cuts 2 and 5: attn_0 | mlp_0 ... and mlp_1 | attn_2: inside blocks
        pipe.load(path, cut_stages(pipe.cluster, [2, 5], source.config.num_units), torch.float32)
        session = pipe.session()
        try:
            engine = Engine(session, POLICIES["gllm"](), depth=len(pipe.stages))
            requests = [engine.add(Request(p, m, slicer=chunks)) for p, m in zip(prompts, news)]
            engine.run()
        finally:
            session.close()
        assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
        assert [r.tokens for r in requests] == alone(source, prompts, news)
        assert pools_empty(pipe)
    finally:
        pipe.close()
