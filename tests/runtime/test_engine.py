"""The engine over real daemons: every policy gives each request the tokens it gets alone, and a
KV pool too small for the load preempts (into the daemons' host tier, or to recompute), losing
nothing."""

import shutil
import time

import pytest
import torch

from hpipe.model.generate.local import LocalModel, decode_loop
from hpipe.model.generate.sampling import Sampler
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.coordinator.policies import POLICIES
from runtime.wire.messages import pb
from tests.cluster_helpers import Served, cluster_of
from tests.helpers import make_tiny_model

BLOCK = 2 * 2 * 16 * 16 * 4  # a block of one layer of the tiny llama: K and V, 2 KV heads of 16, 16 tokens


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    path = tiny_dirs["llama"]
    source = resolve_model(str(path))
    daemons = [Served(f"d{i}") for i in range(3)]
    pipe = Pipeline(cluster_of(*daemons))
    yield pipe, source, str(path), daemons
    pipe.close()
    for d in daemons:
        d.stop()


def workload(n: int, vocab: int):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab, (int(k),), generator=gen).tolist()
               for k in torch.randint(3, 40, (n,), generator=gen)]
    news = [int(k) for k in torch.randint(1, 20, (n,), generator=gen)]
    return prompts, news


def alone(source, prompts, news):
    model = LocalModel(source)
    return [decode_loop(model.open(len(p) + m), p, max_new_tokens=m, sampler=Sampler(), eos_ids=[],
                        slices=[len(p)])[0] for p, m in zip(prompts, news)]


def chunks(n: int) -> list[int]:
    """Slices of 7 tokens (the plan's stand-in), so prompts span several micro-batches."""
    return [7] * (n // 7) + ([n % 7] if n % 7 else [])


def run(pipe, prompts, news, policy: str, max_running: int = 64, swap: bool = True) -> tuple[list, Engine]:
    session = pipe.session()
    try:
        engine = Engine(session, POLICIES[policy](), depth=len(pipe.stages), max_running=max_running, swap=swap)
        requests = [engine.add(Request(p, m, slicer=chunks)) for p, m in zip(prompts, news)]
        engine.run()
    finally:
        session.close()
    assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
    return [r.tokens for r in requests], engine


def pools_empty(pipe, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        status = [c.call("Status", pb.StatusRequest()) for c in pipe.clients]
        if all(s.open_sequences == 0 and all(p.used_blocks == 0 for p in s.pools) for s in status):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_gives_each_request_its_own_tokens(tiny, policy):
    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    prompts, news = workload(12, cfg.vocab_size)
    tokens, engine = run(pipe, prompts, news, policy, max_running=2 if policy == "single" else 64)
    assert tokens == alone(source, prompts, news)
    if policy in ("gllm", "sarathi"):  # several requests per micro-batch
        assert engine.micro_batches < sum(news) + sum(len(chunks(len(p))) for p in prompts)
    assert pools_empty(pipe)


def swaps(pipe) -> tuple[int, int, int]:
    """The daemons' host tiers: sequences swapped out and in, and blocks still held (summed)."""
    tiers = {c.name: next(iter(c.call("Status", pb.StatusRequest()).pools)) for c in pipe.clients}
    return tuple(sum(getattr(p, k) for p in tiers.values()) for k in ("swapped_out", "swapped_in", "tier_used_blocks"))


@pytest.mark.parametrize("swap", [True, False])
def test_a_pool_too_small_for_the_load_preempts_and_loses_nothing(tiny, swap):
    """Preempted requests' KV goes to the daemons' host tier and comes back (nothing recomputed
    while the tier has room), or, without it, is recomputed; the tokens are the same either way."""
    pipe, source, path, _ = tiny
    cfg = source.config
    prompts, news = workload(24, cfg.vocab_size)
    # each stage's pool: 20 blocks of 16 tokens, about a quarter of what the 24 requests hold at once
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32, kv_pool_bytes=20 * BLOCK)
    assert min(p.blocks for p in pipe.pools()) == 20
    assert min(p.tier_blocks for p in pipe.pools()) == 60
    before = swaps(pipe)
    tokens, engine = run(pipe, prompts, news, "sarathi", swap=swap)
    assert tokens == alone(source, prompts, news)
    assert engine.preemptions > 0
    out, back, held = (a - b for a, b in zip(swaps(pipe), before))
    if swap:
        assert engine.swaps == engine.preemptions and engine.recomputed == 0
        assert out == back == 3 * engine.swaps and held == 0  # every daemon swapped each one out and in
    else:
        assert engine.swaps == 0 and engine.recomputed > 0 and out == back == 0
    assert pools_empty(pipe)


def test_gllm_brings_back_a_request_swapped_mid_answer_when_nothing_else_runs(tiny, monkeypatch):
    """A request preempted into the host tier mid-answer waits with no prompt tokens left to send;
    with nothing else running, gllm must still admit it (it only admitted while prompt tokens
    waited, so the engine stalled: caught by the stall guard in fresh-clone CI), and its tokens
    are the ones it gets alone."""
    from runtime.coordinator import stall

    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32, kv_pool_bytes=20 * BLOCK)
    monkeypatch.setattr(stall, "STALL_S", 1.0)
    prompt = torch.randint(1, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    swapped: list[Request] = []

    class SwapsItOnce(POLICIES["gllm"]):  # two tokens in, the request goes to the host tier
        def form(self, engine):
            for r in engine.running:
                if len(r.tokens) == 2 and not r.in_flight and not swapped:
                    swapped.append(r)
                    engine._preempt(r)
            return super().form(engine)

    session = pipe.session()
    try:
        engine = Engine(session, SwapsItOnce(), depth=len(pipe.stages))
        r = engine.add(Request(prompt, 6, slicer=chunks))
        engine.run()
    finally:
        session.close()
    assert swapped and engine.swaps == 1 and engine.recomputed == 0
    assert not r.error and [r.tokens] == alone(source, [prompt], [6]), r.error
    assert pools_empty(pipe)


@pytest.mark.parametrize("policy,blocked", [("gllm", False), ("sarathi", True)])
def test_a_short_request_is_not_stuck_behind_a_long_prefill(tiny, tmp_path_factory, policy, blocked):
    """A 64-token request arriving while a 4,096-token document is prefilled is sent before that
    prefill is, and gets its first token before the document's, under gllm (shortest prompt first);
    sarathi's arrival order makes it wait until the document is all sent, which shows the test can
    tell (the daemons then still run its small micro-batch before the document's queued chunks)."""
    pipe = tiny[0]
    path = str(make_tiny_model("llama", tmp_path_factory.mktemp("long"), context=4160))
    source = resolve_model(path)
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    gen = torch.Generator().manual_seed(5)
    doc = Request(torch.randint(1, cfg.vocab_size, (4096,), generator=gen).tolist(), 2,
                  slicer=lambda n: [512] * (n // 512) + ([n % 512] if n % 512 else []))
    short = Request(torch.randint(1, cfg.vocab_size, (64,), generator=gen).tolist(), 4, slicer=lambda n: [n])
    arrived, sent_at = [], []

    class ShortArrivesMidway(POLICIES[policy]):
        def form(self, engine):
            if doc.laid_out and not arrived:  # the document is being prefilled: the short request comes
                arrived.append(doc.laid_out)
                engine.add(short)
            planned = super().form(engine)
            if not sent_at and any(p.request is short for p in planned):
                sent_at.append(doc.laid_out)  # how much of the document was sent before it
            return planned

    session = pipe.session()
    try:
        engine = Engine(session, ShortArrivesMidway(), depth=len(pipe.stages))
        engine.add(doc)
        engine.run()
    finally:
        session.close()
    assert arrived and arrived[0] < len(doc.prompt)
    assert [doc.tokens, short.tokens] == alone(source, [doc.prompt, short.prompt], [2, 4])
    assert (sent_at[0] == len(doc.prompt)) == blocked, sent_at
    if not blocked:
        assert short.first_token_s < doc.first_token_s
    assert pools_empty(pipe)


def test_gllm_keeps_one_decode_micro_batch_a_lane_in_flight(tiny):
    """Requests that finish their prefill at different times merge into one decode group a lane:
    a ready decode token waits while every decode lane has a micro-batch of decode tokens only in
    flight, instead of going as one more small micro-batch that reads every weight for a token or
    two, step after step (hpipe run of a long document's parts decoded 70 tokens/s that way, 110
    merged). Two lanes, three stages: before the rule, a third decode micro-batch went whenever
    one token was ready."""
    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    prompts, _ = workload(12, cfg.vocab_size)
    news = [24] * len(prompts)
    over = []

    class Watched(POLICIES["gllm"]):
        def form(self, engine):
            lanes = min(engine.lanes, engine.depth)
            planned = super().form(engine)
            if any(not p.request.prefilling for p in planned) and engine.decode_batches >= lanes:
                over.append(engine.decode_batches)
            return planned

    session = pipe.session()
    try:
        engine = Engine(session, Watched(), depth=len(pipe.stages))
        engine.lanes = 2
        requests = [engine.add(Request(p, m, slicer=chunks)) for p, m in zip(prompts, news)]
        engine.run()
    finally:
        session.close()
    assert [r.tokens for r in requests] == alone(source, prompts, news)
    assert over == []
    assert pools_empty(pipe)


def test_decode_micro_batches_as_static_steps_give_the_same_tokens(tiny_dirs):
    """The daemon's static decode step (CUDA graphs on a GPU; the same step uncaptured here) takes
    every all-decode micro-batch and changes no token."""
    source = resolve_model(str(tiny_dirs["llama"]))
    daemons = [Served(f"s{i}") for i in range(2)]
    for d in daemons:
        d.stage.decode_steps = "eager"
    pipe = Pipeline(cluster_of(*daemons))
    try:
        pipe.load(str(tiny_dirs["llama"]), cut_stages(pipe.cluster, [4], source.config.num_units), torch.float32)
        prompts, news = workload(8, source.config.vocab_size)
        tokens, _ = run(pipe, prompts, news, "gllm")
        assert tokens == alone(source, prompts, news)
        assert all(s.graphs.runs > 0 for d in daemons for s in d.stage.stages.values())
    finally:
        pipe.close()
        for d in daemons:
            d.stop()


def test_static_decode_steps_take_no_block_the_coordinator_counts_on(tiny_dirs):
    """A static decode step's padded rows write into a block past the pool's: with pools a
    quarter of the load, the daemons refuse no sequence the engine made room for (when the
    padding took one of the pool's blocks, GPU daemons did, and preempted requests were
    recomputed instead of swapped)."""
    source = resolve_model(str(tiny_dirs["llama"]))
    daemons = [Served(f"s{i}") for i in range(3)]
    for d in daemons:
        d.stage.decode_steps = "eager"
    pipe = Pipeline(cluster_of(*daemons))
    try:
        pipe.load(str(tiny_dirs["llama"]), cut_stages(pipe.cluster, [3, 5], source.config.num_units), torch.float32,
                  kv_pool_bytes=20 * BLOCK)
        prompts, news = workload(24, source.config.vocab_size)
        tokens, engine = run(pipe, prompts, news, "sarathi")
        assert tokens == alone(source, prompts, news)
        assert engine.preemptions > 0 and engine.swaps == engine.preemptions and engine.recomputed == 0
        assert any(s.graphs.runs > 0 for d in daemons for s in d.stage.stages.values())
        assert all(s.pool.trash_slot() == s.pool.num_blocks * s.pool.block_size and s.pool.used_blocks == 0
                   for d in daemons for s in d.stage.stages.values() if s.pool is not None)
    finally:
        pipe.close()
        for d in daemons:
            d.stop()


def test_a_running_request_that_waits_is_never_freed_by_a_stage_idle_timeout(tiny, monkeypatch):
    """A request whose prompt is in waits its turn far longer than the daemons' idle timeout (with
    nothing in flight, so the session never polls them): the engine's keep-alives hold its
    sequence on every stage, and its tokens come out as if it never waited."""
    from runtime.coordinator import engine as engine_module

    pipe, source, path, daemons = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    monkeypatch.setattr(engine_module, "KEEPALIVE_S", 0.2)
    for d in daemons:
        monkeypatch.setattr(d.stage.sequences, "idle_timeout_s", 0.5)  # freed within 1.5 s unnamed
    prompt = torch.randint(1, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    waits = Request(prompt, 3)
    held = []

    class HoldsItBack(POLICIES["fcfs"]):  # its prompt goes in, then nothing for 3 s
        def form(self, engine):
            if waits.tokens and not held:
                held.append(time.monotonic())
            if held and time.monotonic() - held[0] < 3.0:
                return []
            return super().form(engine)

    session = pipe.session()
    try:
        engine = Engine(session, HoldsItBack(), depth=len(pipe.stages))
        engine.add(waits)
        engine.run()
    finally:
        session.close()
    assert not waits.error and engine.preemptions == 0, waits.error
    assert [waits.tokens] == alone(source, [prompt], [3])


def test_an_engine_that_can_send_nothing_ends_a_request_with_an_error_instead_of_waiting(tiny, monkeypatch):
    """A policy that never sends one running request (a scheduling bug, as one that waits for room
    the pools cannot give) and never admits another: the engine ends the stuck ones with a clear
    error after the stall guard's deadline, the others get their own tokens, and run() returns."""
    from runtime.coordinator import stall

    pipe, source, path, _ = tiny
    cfg = source.config
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32)
    monkeypatch.setattr(stall, "STALL_S", 0.5)
    prompts, news = workload(4, cfg.vocab_size)

    class Shuns(POLICIES["gllm"]):  # prompt 0 is admitted but never sent; prompt 3 never admitted
        def form(self, engine):
            if shunned[1] in engine.waiting:
                engine.waiting.remove(shunned[1])
                formed = [p for p in super().form(engine) if p.request is not shunned[0]]
                engine.waiting.append(shunned[1])
                return formed
            return [p for p in super().form(engine) if p.request is not shunned[0]]

    session = pipe.session()
    try:
        engine = Engine(session, Shuns(), depth=len(pipe.stages))
        requests = [engine.add(Request(p, m, slicer=chunks)) for p, m in zip(prompts, news)]
        shunned = (requests[0], requests[3])
        t0 = time.monotonic()
        engine.run()
        took = time.monotonic() - t0
    finally:
        session.close()
    for r in shunned:
        assert r.stop_reason == "error" and r.error.startswith("INTERNAL: the scheduler stalled"), r.error
        assert r.tokens == []
    assert [r.tokens for r in requests[1:3]] == alone(source, prompts[1:3], news[1:3])
    assert took < 30
    assert pools_empty(pipe)


def test_non_finite_logits_fail_the_request_with_a_clear_error(tiny, tmp_path):
    """A model whose hidden states overflow gives NaN logits: the request fails saying so, it does
    not answer with argmax-of-NaN tokens, and the daemons free its sequence."""
    from safetensors.torch import load_file, save_file

    pipe, source, path, _ = tiny
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = broken / "model.safetensors"
    state = load_file(str(weights))
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("nan"))
    save_file(state, str(weights), metadata={"format": "pt"})
    pipe.load(str(broken), cut_stages(pipe.cluster, [3, 5], source.config.num_units), torch.float32)
    session = pipe.session()
    try:
        engine = Engine(session, POLICIES["gllm"](), depth=len(pipe.stages))
        r = engine.add(Request([5, 6, 7, 8], 4, slicer=chunks))
        engine.run()
    finally:
        session.close()
    assert r.stop_reason == "error" and "non-finite logits" in r.error and r.tokens == []
    assert pools_empty(pipe)


def test_swapped_requests_that_began_with_a_cached_prefix_lose_nothing(tiny):
    """Under memory pressure with a prefix cache, a request that began with shared cached blocks
    is swapped out whole and comes back into blocks of its own: the tokens are still its own."""
    pipe, source, path, _ = tiny
    cfg = source.config
    prompts, news = workload(24, cfg.vocab_size)
    shared = torch.randint(1, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [shared + p for p in prompts]
    pipe.load(path, cut_stages(pipe.cluster, [3, 5], cfg.num_units), torch.float32, kv_pool_bytes=30 * BLOCK)
    session = pipe.session()
    try:
        engine = Engine(session, POLICIES["gllm"](), depth=len(pipe.stages), prefix_cache=0.2)
        requests = [engine.add(Request(p, m, slicer=chunks)) for p, m in zip(prompts, news)]
        engine.run()
    finally:
        session.close()
    assert all(not r.error for r in requests), [r.error for r in requests]
    assert [r.tokens for r in requests] == alone(source, prompts, news)
    assert engine.swaps > 0 and engine.cache.hits > 0
    assert any(r.preemptions and r.cached_tokens for r in requests)
    assert pools_empty(pipe)
