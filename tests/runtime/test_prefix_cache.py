"""The prefix cache: its index alone, and the engine over real daemons, where every answer must
equal the answer without it (in any order, interleaved with other documents, after evictions, in a
pool too small to cache everything, after a daemon restart) and the blocks held stay bounded."""

import random

import pytest
import torch

from hpipe.model.generate.local import LocalModel, decode_loop
from hpipe.model.generate.sampling import Sampler
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.coordinator.policies import POLICIES
from runtime.coordinator.prefix_cache import PrefixCache
from runtime.wire.messages import pb
from tests.cluster_helpers import Served, cluster_of
from tests.runtime.test_engine import BLOCK, chunks, pools_empty


# --- the index alone --------------------------------------------------------------------------
def test_names_chain_over_the_whole_prefix():
    cache = PrefixCache(4, budget=8, salt="m|float32")
    a = cache.names(list(range(10)))
    assert len(a) == 2  # full blocks only
    assert cache.names(list(range(8)) + [99]) == a  # the same first two blocks
    b = cache.names([0, 1, 2, 9] + list(range(4, 8)))
    assert b[0] != a[0] and b[1] != a[1]  # block 1's name depends on block 0's tokens too
    assert PrefixCache(4, 8, salt="other").names(list(range(8))) != a  # and on the model


def test_a_hit_needs_filled_blocks_and_a_pending_block_makes_others_wait():
    cache = PrefixCache(4, budget=8)
    names = cache.names(list(range(16)))
    assert cache.lookup(names) == (0, False)
    claimed, dropped = cache.claim(names, 0)
    assert claimed == names and dropped == []
    assert cache.lookup(names) == (0, True)  # being filled: wait for it
    cache.filled(names[:2])
    assert cache.lookup(names) == (2, True)
    cache.filled(names[2:])
    assert cache.lookup(names) == (4, False)
    assert cache.release(names) == [] and cache.idle == 4


def test_blocks_never_filled_are_forgotten_when_their_request_lets_go():
    cache = PrefixCache(4, budget=8)
    names = cache.names(list(range(12)))
    cache.claim(names, 0)
    cache.filled(names[:1])
    assert cache.release(names) == names[1:]  # the daemons are told to forget them
    assert cache.lookup(names) == (1, False) and cache.size == 1


def test_eviction_takes_the_least_recently_released_and_the_deepest_first():
    cache = PrefixCache(4, budget=0)
    a = cache.names(list(range(12)))
    b = cache.names(list(range(100, 108)))
    for names in (a, b):
        cache.claim(names, 0)
        cache.filled(names)
    cache.release(a)
    cache.release(b)
    assert cache.evict(2) == [a[2], a[1]]  # a was released first: its deepest blocks go first
    held = cache.names(list(range(100, 108)))
    hit, _ = cache.lookup(held)
    cache.claim(held, hit)  # b is held again: it cannot be evicted
    assert cache.evict(10) == [a[0]]
    assert cache.idle == 0 and cache.size == 2


def test_trim_keeps_idle_blocks_within_the_budget():
    cache = PrefixCache(4, budget=3)
    names = cache.names(list(range(40)))
    cache.claim(names, 0)
    cache.filled(names)
    cache.release(names)
    assert len(cache.trim()) == 7 and cache.idle == 3
    assert cache.lookup(names) == (3, False)  # the first blocks stayed


def test_the_kept_counts_match_the_blocks_after_any_sequence_of_operations():
    """``ready`` and ``idle`` are kept as blocks change, not counted each time the engine asks."""
    cache, gen = PrefixCache(4, budget=5), random.Random(8)
    prompts = [[gen.randrange(1, 9) for _ in range(gen.randrange(4, 24))] for _ in range(6)]
    held: list[list[int]] = []
    for _ in range(300):
        op = gen.randrange(5)
        if op == 0:
            names = cache.names(gen.choice(prompts))
            hit, pending = cache.lookup(names)
            if not pending:
                claimed, _ = cache.claim(names, hit)
                held.append(names[:hit] + claimed)
        elif op == 1 and held:
            cache.filled(gen.choice(held))
        elif op == 2 and held:
            cache.release(held.pop(gen.randrange(len(held))))
            cache.trim()
        elif op == 3:
            cache.evict(gen.randrange(3))
        elif op == 4 and held:
            cache.drop(gen.choice(held)[:1])
        blocks = cache._blocks.values()
        assert cache.ready == sum(b.ready for b in blocks)
        assert cache.idle == sum(b.ready and not b.holders for b in blocks)


# --- the engine over daemons ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    path = tiny_dirs["llama"]
    source = resolve_model(str(path))
    daemons = [Served(f"p{i}") for i in range(3)]
    pipe = Pipeline(cluster_of(*daemons))
    yield pipe, source, str(path), daemons
    pipe.close()
    for d in daemons:
        d.stop()


def documents(vocab: int, seed: int, docs: int = 3, questions: int = 4):
    """(document, question) prompts: documents of 34-71 tokens, questions of 3-9 tokens."""
    gen = random.Random(seed)
    out = []
    for _ in range(docs):
        doc = [gen.randrange(1, vocab) for _ in range(gen.randrange(34, 72))]
        out += [doc + [gen.randrange(1, vocab) for _ in range(gen.randrange(3, 10))] for _ in range(questions)]
    return out


def alone(source, prompts, new):
    model = LocalModel(source)
    return [decode_loop(model.open(len(p) + new), p, max_new_tokens=new, sampler=Sampler(), eos_ids=[],
                        slices=[len(p)])[0] for p in prompts]


def run(pipe, prompts, new, cache: float | None, policy="gllm", max_running=64, recover=None):
    session = pipe.session()
    try:
        engine = Engine(session, POLICIES[policy](), depth=len(pipe.stages), max_running=max_running,
                        prefix_cache=cache, recover=recover)
        requests = [engine.add(Request(p, new, slicer=chunks)) for p in prompts]
        engine.run()
    finally:
        engine.session.close()
    assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
    return [r.tokens for r in requests], requests, engine


def stage_pools(pipe) -> list[pb.Pool]:
    return [p for c in pipe.clients for p in c.call("Status", pb.StatusRequest()).pools]


@pytest.mark.parametrize("order", ["by document", "interleaved", "shuffled"])
def test_answers_equal_those_without_the_cache(tiny, order):
    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    prompts = documents(cfg.vocab_size, seed=1)
    if order == "interleaved":  # every document's first question, then every second one, ...
        prompts = [prompts[d * 4 + q] for q in range(4) for d in range(3)]
    elif order == "shuffled":
        random.Random(2).shuffle(prompts)
    before = {p.stage: p for p in stage_pools(pipe)}
    tokens, requests, engine = run(pipe, prompts, 6, cache=1.0)
    assert tokens == alone(source, prompts, 6)
    # each document is computed once: its other questions begin with its blocks on every stage
    assert engine.cache.hits >= 9
    assert sum(r.cached_tokens for r in requests) == engine.cache.cached_tokens > 9 * 32
    for p in stage_pools(pipe):  # every stage reused what the engine decided, and nothing else
        assert p.prefix_hits - before[p.stage].prefix_hits == engine.cache.hits
        assert p.cached_tokens - before[p.stage].cached_tokens == engine.cache.cached_tokens
    assert pools_empty(pipe)  # the session ended: every cached block is free again


def test_questions_on_one_document_wait_for_its_first_prefill(tiny):
    """Eight questions about one document, submitted together: the document's prompt is prefilled
    once, and the other seven prefill only their questions."""
    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    prompts = documents(cfg.vocab_size, seed=3, docs=1, questions=8)
    shared = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)  # the document
    tokens, requests, engine = run(pipe, prompts, 4, cache=1.0)
    assert tokens == alone(source, prompts, 4)
    assert engine.cache.hits == 7
    cached = sorted(r.cached_tokens for r in requests)
    assert cached[0] == 0 and all(c == shared // 16 * 16 for c in cached[1:]), (cached, shared)


def test_a_small_pool_evicts_cached_blocks_before_preempting_and_loses_nothing(tiny):
    """Pools of 12 blocks for 12 requests of 3-6 blocks each, with a budget of a quarter of the
    pool: cached blocks are given up (evicted) when a request needs room, the idle cached blocks
    stay within the budget, and every answer is the uncached one."""
    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32, kv_pool_bytes=12 * BLOCK)
    prompts = documents(cfg.vocab_size, seed=4)
    budget = []

    class Watches(POLICIES["gllm"]):
        def form(self, engine):
            budget.append(engine.cache.idle)
            return super().form(engine)

    session = pipe.session()
    try:
        engine = Engine(session, Watches(), depth=3, prefix_cache=0.25)
        requests = [engine.add(Request(p, 8, slicer=chunks)) for p in prompts]
        engine.run()
    finally:
        session.close()
    assert all(not r.error for r in requests), [r.error for r in requests if r.error]
    assert [r.tokens for r in requests] == alone(source, prompts, 8)
    assert engine.cache.evictions > 0 and engine.cache.hits > 0
    assert max(budget) <= 3  # a quarter of 12 blocks
    assert pools_empty(pipe)


def test_without_the_cache_nothing_is_named(tiny):
    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    prompts = documents(cfg.vocab_size, seed=5, docs=1, questions=3)
    before = {p.stage: p.prefix_hits for p in stage_pools(pipe)}
    tokens, requests, engine = run(pipe, prompts, 3, cache=None)
    assert tokens == alone(source, prompts, 3)
    assert engine.cache is None and all(r.cached_tokens == 0 for r in requests)
    assert all(p.prefix_hits == before[p.stage] and p.cached_blocks == 0 for p in stage_pools(pipe))


def test_a_daemon_restarted_mid_job_loses_no_answer(tiny_dirs):
    """Questions about three documents; once some of them began with cached blocks, daemon b is
    stopped and started again empty on its port. The engine recovers on a new session with an
    empty cache (b's blocks are gone), and every answer is still the one without the cache."""
    from runtime.coordinator.recovery import Redeploy

    path = str(tiny_dirs["llama"])
    source = resolve_model(path)
    cfg = source.config
    served = {name: Served(name) for name in "abc"}
    try:
        pipe = Pipeline(cluster_of(*served.values()))
        stages = cut_stages(pipe.cluster, [3, 5], cfg.num_units)
        pipe.load(path, stages, torch.float32)
        redeploy = Redeploy(pipe, path, stages, torch.float32, grace_s=60)
        prompts = documents(cfg.vocab_size, seed=6)
        restarted = []

        class RestartsB(POLICIES["gllm"]):
            def form(self, engine):
                if not restarted and engine.cache.hits >= 3:
                    port = int(served["b"].address.rsplit(":", 1)[1])
                    served["b"].stop()
                    served["b"] = Served("b", port=port)
                    restarted.append(engine.cache.hits)
                return super().form(engine)

        engine = Engine(pipe.session(), RestartsB(), depth=3, prefix_cache=1.0, recover=redeploy)
        requests = [engine.add(Request(p, 8, slicer=chunks)) for p in prompts]
        engine.run()
        assert restarted and engine.recoveries == 1
        assert all(not r.error for r in requests), [r.error for r in requests if r.error]
        assert [r.tokens for r in requests] == alone(source, prompts, 8)
        engine.session.close()
        assert pools_empty(pipe)
        pipe.close()
    finally:
        for s in served.values():
            s.stop()


def test_a_stage_that_lost_cached_blocks_fails_the_hit_and_the_question_is_computed_again(tiny):
    """One daemon forgets the session's cached blocks behind the coordinator's back: the next
    question that begins with them fails there (DATA_LOSS), the index forgets them, and the
    question is prefilled whole, with its answer unchanged."""
    pipe, source, path, daemons = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    prompts = documents(cfg.vocab_size, seed=7, docs=1, questions=4)
    lost = []

    class LosesBlocks(POLICIES["fcfs"]):  # one question at a time: the first fills the document's blocks
        def form(self, engine):
            if not lost and engine.cache.ready and not engine.running:
                daemons[1].stage.prefixes.end(engine.session.id)
                lost.append(engine.cache.ready)
            return super().form(engine)

    session = pipe.session()
    try:
        engine = Engine(session, LosesBlocks(), depth=3, prefix_cache=1.0)
        requests = [engine.add(Request(p, 5, slicer=chunks)) for p in prompts]
        engine.run()
    finally:
        session.close()
    assert lost and all(not r.error for r in requests), [r.error for r in requests if r.error]
    assert [r.tokens for r in requests] == alone(source, prompts, 5)
    assert requests[1].preemptions == 1 and requests[1].cached_tokens == 0  # computed whole
    assert engine.cache.hits >= 3  # the later questions hit the blocks it filled again
