"""Seesaw's phase loop over real daemons: a prefill layout and a decode layout of the same three
daemons, switched between as the phases run dry; every request gets the tokens it gets alone,
however many switches it lives through, with its KV rebuilt by replays on the stages that moved."""

import pytest
import torch

from hpipe.core.plan import Stage
from hpipe.core.units import UnitRange
from hpipe.model.weights.sources import resolve_model
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.kv_moves import send_moved_kv, sent_stages
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.coordinator.seesaw import SeesawPhases, fine_stages
from tests.cluster_helpers import Served, cluster_of
from tests.runtime.test_engine import BLOCK, alone, chunks, pools_empty, workload


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    path = tiny_dirs["llama"]
    daemons = [Served(f"d{i}") for i in range(3)]
    pipe = Pipeline(cluster_of(*daemons))
    pipe.served = daemons  # the tests look into the daemons' stage servers
    yield pipe, resolve_model(str(path)), str(path)
    pipe.close()
    for d in daemons:
        d.stop()


def test_fine_stages_cut_each_layout_at_every_cut_of_both():
    def stage(daemon, a, b):
        return Stage(daemon, f"{daemon}:1", UnitRange(a, b, 4))
    prefill = [stage("a", 0, 3), stage("b", 3, 6)]
    decode = [stage("c", 0, 2), stage("a", 2, 6)]
    fine = fine_stages({"prefill": prefill, "decode": decode})
    assert [(s.daemon, s.units.start, s.units.end) for s in fine["prefill"]] == [("a", 0, 2), ("a", 2, 3), ("b", 3, 6)]
    assert [(s.daemon, s.units.start, s.units.end) for s in fine["decode"]] == [("c", 0, 2), ("a", 2, 3), ("a", 3, 6)]
    with pytest.raises(ValueError, match="does not cover"):
        fine_stages({"prefill": prefill, "decode": decode[:1]})


def run_seesaw(pipe, path: str, layouts: dict, pool: int, prompts, news, send_kv: bool = False,
               checked: bool = False, prefix_cache: float | None = None, sent: set[int] | None = None,
               **kw):
    """``prompts`` under :class:`SeesawPhases` (``kw``) switching ``pipe`` between ``layouts``
    (started on prefill), pools of ``pool`` bytes, the KV of every moved stage sent at a switch
    (``send_kv``; of the fine stages ``sent`` only, if given) or rebuilt by replays, with a ``prefix_cache`` of that share of the pools (None:
    none): (the requests, the policy, the engine). ``checked``: every
    micro-batch the policy forms names running requests only, none parked after it was planned (a request
    swapped out after its entry was laid out would be computed without its KV on a daemon that
    ran the swap before the entry)."""
    def deploy(phase, old):
        pipe.load(path, layouts[phase], torch.float32, kv_pool_bytes=pool, adjacent=True)
        return pipe.session(resume_from=old)

    def send(phase, old, ids=None):
        return send_moved_kv(pipe, old, layouts[phase], set(range(len(layouts[phase]))) if sent is None else sent,
                             ids)

    pipe.load(path, layouts["prefill"], torch.float32, kv_pool_bytes=pool, adjacent=True)
    phases = SeesawPhases(deploy, send_kv=send if send_kv else None, **kw)
    if checked:
        form = phases.form

        def checked_form(engine):
            planned = form(engine)
            assert all(p.request in engine.running for p in planned)  # none parked after it was planned
            return planned
        phases.form = checked_form
    session = pipe.session()
    try:
        engine = Engine(session, phases, depth=len(pipe.stages), prefix_cache=prefix_cache)
        requests = [engine.add(Request(p, m, slicer=chunks)) for p, m in zip(prompts, news)]
        engine.run()
    finally:
        engine.session.close()
    return requests, phases, engine


@pytest.mark.parametrize("low_water", [0.0, 0.75])
def test_switching_layouts_loses_no_token(tiny, low_water):
    """Pools that hold a third of the requests at once force several prefill/decode rounds; with
    ``low_water`` 0.75, decode gives way while most requests still decode, so requests cross
    switches in the middle of their answers."""
    pipe, source, path = tiny
    cfg = source.config
    n = cfg.num_units
    names = [d.name for d in pipe.cluster.daemons]
    prefill = cut_stages(pipe.cluster, [3, 5], n)
    decode = cut_stages(pipe.cluster, [2, 6], n, daemons=[names[1], names[2], names[0]])
    layouts = fine_stages({"prefill": prefill, "decode": decode})
    prompts, news = workload(24, cfg.vocab_size)
    news = [m + 8 for m in news]  # answers long enough to be cut by switches
    requests, phases, engine = run_seesaw(pipe, path, layouts, 24 * BLOCK, prompts, news, low_water=low_water)
    assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
    assert [r.tokens for r in requests] == alone(source, prompts, news)
    to = [s["to"] for s in phases.switches]
    assert len(to) >= 3 and to[::2] == ["decode"] * len(to[::2]) and to[1::2] == ["prefill"] * len(to[1::2])
    # the stages that moved rebuilt their KV from the logs: nothing started again
    assert sum(s["replayed_positions"] for s in phases.switches) > 0
    assert sum(s["restarted"] for s in phases.switches) == 0
    # from the second switch on, a daemon takes back the weights of the stages it gave up
    assert sum(d.stage.parked.reused for d in pipe.served) >= len(to) - 1
    if low_water:  # some requests were decoding when decode gave way
        assert any(s["to"] == "prefill" and s["resumed"] for s in phases.switches)
    assert engine.preemptions == 0  # the prefill phase admits only what the pools hold to the end
    assert pools_empty(pipe)


def test_a_moved_first_stage_rebuilds_a_cached_prefix_from_the_token_ids(tiny):
    """Requests that begin with a cached prefix (shared blocks on every stage, no replay log before
    them), and a switch that moves the first stage to a daemon that held other stages of them
    (the KV of the other moved stages sent, the first stage's recomputed, as a plan may choose):
    the replay from the token ids rebuilds the new owner's first stage from position 0, which
    holds none of the shared blocks there (the shared prefix is a stage's, not a sequence's), and
    every request decodes on with its own tokens, none computed again. Before the fix the replay
    was refused on the new owner ("inside the cached positions it began with"), its failure went
    nowhere (a replay has no result), and the next decode entry failed: "an entry starts at
    position P; the sequence continues at 0" (a lost answer, as `hpipe run --policy seesaw` lost 3
    of 4 on an AVX2 EPYC, whenever its documents hit the prefix cache before the switch)."""
    pipe, source, path = tiny
    cfg = source.config
    n = cfg.num_units
    names = [d.name for d in pipe.cluster.daemons]
    layouts = fine_stages({"prefill": cut_stages(pipe.cluster, [3, 5], n),
                           "decode": cut_stages(pipe.cluster, [2, 6], n, daemons=[names[1], names[2], names[0]])})
    prompts, news = workload(8, cfg.vocab_size)
    shared = torch.randint(1, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [shared + p for p in prompts]
    news = [m + 4 for m in news]
    requests, phases, engine = run_seesaw(pipe, path, layouts, 48 * BLOCK, prompts, news, prefix_cache=0.5,
                                          send_kv=True, sent=set(range(1, len(layouts["decode"]))), low_water=0.0)
    assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
    assert [r.tokens for r in requests] == alone(source, prompts, news)
    assert engine.cache.hits > 0 and any(r.cached_tokens for r in requests)
    to_decode = [s for s in phases.switches if s["to"] == "decode"]
    assert to_decode and sum(s["replayed_positions"] for s in to_decode) > 0
    # rebuilt where they stood: none started again at the switch, none refused and computed again after
    assert sum(s["restarted"] for s in phases.switches) == 0 and engine.recomputed == 0
    assert pools_empty(pipe)


def test_a_switch_that_moves_every_stage_recomputes_in_the_decode_phase(tiny):
    """Layouts with the same cuts on rotated daemons: every stage moves at every switch, so no
    daemon keeps a sequence and each request mid-answer starts again. It recomputes its prompt and
    tokens in the decode phase and decodes on there, instead of going back to wait for a prefill
    phase (which gave one token per pair of switches: 100 switches for 8 short requests), and
    its tokens are the ones it gets alone."""
    pipe, source, path = tiny
    cfg = source.config
    names = [d.name for d in pipe.cluster.daemons]
    layouts = fine_stages({"prefill": cut_stages(pipe.cluster, [3, 5], cfg.num_units),
                           "decode": cut_stages(pipe.cluster, [3, 5], cfg.num_units,
                                                daemons=[names[1], names[2], names[0]])})
    prompts, news = workload(12, cfg.vocab_size)
    news = [m + 8 for m in news]
    requests, phases, _ = run_seesaw(pipe, path, layouts, 24 * BLOCK, prompts, news)
    assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
    assert [r.tokens for r in requests] == alone(source, prompts, news)
    assert sum(s["restarted"] for s in phases.switches if s["to"] == "decode") > 0
    assert len(phases.switches) <= 12, len(phases.switches)  # a pool-full a round: 6 at most here
    assert pools_empty(pipe)


@pytest.mark.parametrize("rotate", [False, True])
def test_a_switch_that_sends_the_kv_rebuilds_nothing(tiny, rotate, monkeypatch):
    """With the KV of every moved stage sent to its new owner before the switch, every running
    request goes on where it stood: nothing replayed, nothing started again — even where a switch
    moves every stage (``rotate``: the same cuts on rotated daemons, so a daemon gets sequences it
    never held; with the daemons' static decode steps, as CUDA graphs run them) — and the tokens
    are the ones each request gets alone. A prompt's KV is sent as soon as it is read, while the
    prefill phase goes on (the switch sends the rest)."""
    pipe, source, path = tiny
    for d in pipe.served:
        monkeypatch.setattr(d.stage, "decode_steps", "eager" if rotate else "off")
    cfg = source.config
    names = [d.name for d in pipe.cluster.daemons]
    decode_cuts = [3, 5] if rotate else [2, 6]
    layouts = fine_stages({"prefill": cut_stages(pipe.cluster, [3, 5], cfg.num_units),
                           "decode": cut_stages(pipe.cluster, decode_cuts, cfg.num_units,
                                                daemons=[names[1], names[2], names[0]])})
    prompts, news = workload(16, cfg.vocab_size)
    news = [m + 8 for m in news]
    requests, phases, engine = run_seesaw(pipe, path, layouts, 24 * BLOCK, prompts, news, send_kv=True,
                                          low_water=0.75)
    assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
    assert [r.tokens for r in requests] == alone(source, prompts, news)
    assert len(phases.switches) >= 2
    assert sum(s["replayed_positions"] for s in phases.switches) == 0
    assert sum(s["restarted"] for s in phases.switches) == 0
    to_decode = [s for s in phases.switches if s["to"] == "decode"]
    assert all(s["sent_bytes"] > 0 and s["sent_stages"] > 0 for s in to_decode), to_decode
    # most prompts' KV went while the prefill phase computed the others
    assert sum(s.get("sent_ahead_bytes", 0) for s in to_decode) > sum(s["sent_bytes"] for s in to_decode) / 2
    assert any(s["to"] == "prefill" and s["resumed"] for s in phases.switches)  # mid-answer requests moved too
    assert all(not d.stage.kv_in.nbytes for d in pipe.served)  # nothing left waiting on a daemon
    assert pools_empty(pipe)
    if rotate:
        assert any(s.graphs is not None and s.graphs.runs for d in pipe.served for s in d.stage.stages.values())


@pytest.mark.parametrize("rotate,low_water,n", [(False, 0.25, 16), (True, 0.25, 16), (False, 0.75, 48),
                                                 (True, 0.75, 48)])
def test_prefilled_requests_park_in_the_host_tier(tiny, rotate, low_water, n):
    """Seesaw's tiered buffer (§4.2): with pools that hold a few of the requests, the prefill
    phase parks prompts it has read in the daemons' host tier and goes on prefilling; at the
    switch a parked sequence's KV goes from the old owner's tier to the new owner's (``rotate``:
    every stage moves), and the decode phase brings parked requests back as others finish. Fewer
    switches than without parking, nothing replayed or started again, every request's tokens the
    ones it gets alone, and the tiers and pools empty at the end. With ``low_water`` 0.75 and more
    requests than pools and tiers hold, requests cross switches mid-answer, and a prefill phase
    that parks begins with requests a switch resumed (computing their last token again)."""
    pipe, source, path = tiny
    cfg = source.config
    names = [d.name for d in pipe.cluster.daemons]
    layouts = fine_stages({"prefill": cut_stages(pipe.cluster, [3, 5], cfg.num_units),
                           "decode": cut_stages(pipe.cluster, [3, 5] if rotate else [2, 6], cfg.num_units,
                                                daemons=[names[1], names[2], names[0]])})
    prompts, news = workload(n, cfg.vocab_size)
    news = [m + 8 for m in news]
    switches = {}
    for park in (False, True):
        requests, phases, engine = run_seesaw(pipe, path, layouts, (24 if n == 16 else 12) * BLOCK, prompts, news,
                                              send_kv=True, park=park, low_water=low_water, checked=True)
        assert all(r.stop_reason == "length" and not r.error for r in requests), [r.error for r in requests]
        assert [r.tokens for r in requests] == alone(source, prompts, news)
        assert sum(s["replayed_positions"] for s in phases.switches) == 0
        assert sum(s["restarted"] for s in phases.switches) == 0 and engine.recomputed == 0
        switches[park] = len(phases.switches)
        assert pools_empty(pipe) and all(not d.stage.tier.used_blocks(BLOCK) for d in pipe.served)
    assert phases.parked > 0 and engine.swaps >= phases.parked
    assert switches[True] < switches[False], switches


def test_the_plan_says_which_stages_send_their_kv():
    def stage(daemon, a, b):
        return Stage(daemon, f"{daemon}:1", UnitRange(a, b, 4))
    fine = [stage("a", 0, 2), stage("a", 2, 3), stage("b", 3, 6), stage("b", 6, 10)]
    runs = [{"from": "a", "to": "c", "units": [0, 2], "kv": "send"},
            {"from": "b", "to": "a", "units": [3, 10], "kv": "recompute"}]
    assert sent_stages("plan", fine, runs) == {0}
    assert sent_stages("plan", fine, None) == set()  # a plan made before the choice was kept
    assert sent_stages("send", fine, runs) == {0, 1, 2, 3}
    assert sent_stages("recompute", fine, runs) == set()
    with pytest.raises(ValueError, match="one of"):
        sent_stages("sometimes", fine, runs)


def test_a_request_longer_than_the_pools_fails_instead_of_waiting(tiny):
    """The prefill phase admits only what the pools hold to the end; a request that could never
    fit is failed by the engine (as under any policy), not kept waiting for room."""
    pipe, source, path = tiny
    cfg = source.config
    layouts = fine_stages({"prefill": cut_stages(pipe.cluster, [3, 5], cfg.num_units),
                           "decode": cut_stages(pipe.cluster, [2, 6], cfg.num_units)})
    def deploy(phase, old):
        pipe.load(path, layouts[phase], torch.float32, kv_pool_bytes=2 * BLOCK, adjacent=True)
        return pipe.session(resume_from=old)

    pipe.load(path, layouts["prefill"], torch.float32, kv_pool_bytes=2 * BLOCK, adjacent=True)
    session = pipe.session()
    try:
        engine = Engine(session, SeesawPhases(deploy), depth=len(pipe.stages))
        long = engine.add(Request(list(range(1, 40)), 8, slicer=chunks))  # 3 blocks: the pools have 2
        short = engine.add(Request([5, 6, 7], 4, slicer=chunks))
        engine.run()
    finally:
        engine.session.close()
    assert long.stop_reason == "error" and "RESOURCE_EXHAUSTED" in long.error
    assert short.stop_reason == "length" and not short.error
