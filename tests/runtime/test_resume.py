"""Resuming after a stage's loss: where each sequence goes on from, the replays that rebuild a
restarted daemon's caches, the logs they come from, and the whole path on an interleaved chain.

The end-to-end test with real daemon processes killed by SIGKILL is in test_recovery.py."""

import threading
import time
from dataclasses import dataclass, replace

import pytest
import torch

from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import LocalModel, decode_loop
from hpipe.model.generate.sampling import Sampler
from hpipe.model.kv.pool import KVPool
from runtime.coordinator.engine import Engine, Request
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.coordinator.policies import POLICIES
from runtime.coordinator.recovery import Redeploy
from runtime.coordinator.resume import Piece, Replay, replays, resume_point
from runtime.daemon.replay_log import ReplayLog
from runtime.daemon.sequences import Sequence
from runtime.wire.messages import pb
from tests.cluster_helpers import Served, cluster_of

MODEL = "smollm2-135m"


# --- where a sequence resumes ---------------------------------------------------------------------
def test_a_restarted_middle_stage_is_rebuilt_from_the_log_of_the_stage_before_it():
    # stage 1 came back empty; stage 2 had computed 256 of the 512 positions stage 0 had sent
    p, runs = resume_point({0: (512, 512), 2: (256, 0)}, stages=3, limit=1023)
    assert p == 512
    # positions stage 2 holds go through stage 1 only; the ones it lacks go on to it, and no further
    assert runs == [[Piece(1, 1, 0, 256), Piece(1, 2, 256, 512)]]


def test_a_restarted_first_stage_is_rebuilt_from_the_token_ids_and_interleaved_runs_apart():
    # a daemon holding stages 0 and 2 of 4 came back: two runs, the first fed by the coordinator
    p, runs = resume_point({1: (300, 300), 3: (300, 0)}, stages=4, limit=1000)
    assert p == 300 and runs == [[Piece(0, 0, 0, 300)], [Piece(2, 2, 0, 300)]]


def test_the_resume_point_is_where_the_logs_reach_and_zero_without_one():
    # stage 0 logged only 100 positions: stage 1 cannot be rebuilt past them, nor stage 2 kept at 512
    assert resume_point({0: (512, 100), 2: (256, 0)}, 3, 1023) == (0, [])
    # every stage kept the sequence, stage 0 without a log: stage 2 catches up from stage 1's
    assert resume_point({0: (512, 0), 1: (300, 300), 2: (280, 0)}, 3, 1023) == (300, [[Piece(2, 2, 280, 300)]])
    # with stage 0's log, stages 1 and 2 catch up together (stage 1 computes 280-300 again to pass them on)
    assert resume_point({0: (512, 512), 1: (300, 300), 2: (280, 0)}, 3, 1023) == (512, [[Piece(1, 2, 280, 512)]])
    # never past its tokens but one: that one gives the next token's logits
    assert resume_point({0: (41, 41), 1: (41, 41), 2: (41, 0)}, 3, 40) == (40, [])
    assert resume_point({}, 3, 100) == (0, [])


def test_replays_keep_each_sequence_in_position_order_and_within_the_token_budget():
    wanted = {7: [[Piece(1, 1, 0, 256), Piece(1, 2, 256, 512)]], 8: [[Piece(1, 1, 0, 30)]],
              9: [[Piece(0, 0, 0, 500)], [Piece(2, 2, 0, 500)]]}
    batches = replays(wanted, max_tokens=300)
    assert all(b.tokens <= 300 for b in batches)
    for b in batches:
        assert len({i for i, _, _ in b.entries}) == len(b.entries)  # a sequence once per micro-batch
    covered: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for b in batches:
        for i, start, n in b.entries:
            covered.setdefault((i, b.first, b.last), []).append((start, start + n))
    for key, spans in covered.items():  # contiguous, in order, from where each piece starts
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), key
    assert covered[7, 1, 1] == [(0, 256)] and covered[7, 1, 2] == [(256, 512)]
    assert covered[9, 0, 0][-1][1] == 500 and covered[9, 2, 2][0][0] == 0
    first_of_7 = [k for k, b in enumerate(batches) if any(i == 7 for i, _, _ in b.entries)]
    assert batches[first_of_7[0]].last == 1 and batches[first_of_7[-1]].last == 2


def test_a_replay_marks_where_each_prompt_ends():
    """A replay's entry says where its sequence's prompt ends (``prefill_end``): the stages compute
    the decoded tokens it covers as decode rows, so their KV is what their decode steps wrote."""
    requests = {7: Request(list(range(1, 41)), 8), 8: Request(list(range(1, 11)), 8)}
    for r in requests.values():
        r.restart(r.prompt + [5, 6, 7])
    entries, tokens, stages = Replay(1, 2, [(7, 0, 43), (8, 4, 9)]).micro_batch(requests.__getitem__)
    assert [(e.start, e.length, e.prefill_end, e.max_len) for e in entries] == [(0, 43, 40, 48), (4, 9, 10, 0)]
    assert tokens.tolist() == requests[7].prefix + requests[8].prefix[4:13] and (stages.first, stages.last) == (1, 2)


# --- the logs and the blocks ----------------------------------------------------------------------
def _seq(max_len: int = 64) -> Sequence:
    return Sequence(1, 1, max_len, {}, {0: 0})


def test_a_replay_log_keeps_rows_in_order_within_its_budget_and_frees_them_with_the_sequence():
    log = ReplayLog(budget=64 * 8 * 4)  # one sequence of 64 positions, 8 wide, in float32
    seq, other = _seq(), _seq()
    rows = torch.arange(40 * 8, dtype=torch.float32).view(40, 8)
    log.append(seq, 0, 0, rows[:16])
    log.append(seq, 0, 16, rows[16:40])
    assert log.logged(seq, 0) == 40 and torch.equal(log.rows(seq, 0, 10, 30), rows[10:30])
    assert log.rows(seq, 0, 30, 41) is None  # not all logged
    log.append(other, 0, 0, rows[:8])  # past the budget: that sequence has no log
    assert log.logged(other, 0) == 0 and log.rows(other, 0, 0, 8) is None
    log.truncate(seq, 0, 20)  # rewound: positions from 20 on are computed again
    log.append(seq, 0, 20, rows[20:24] + 1)
    assert log.logged(seq, 0) == 24 and torch.equal(log.rows(seq, 0, 20, 24), rows[20:24] + 1)
    log.append(seq, 0, 30, rows[30:31])  # a gap: the log is of no use any more
    assert log.logged(seq, 0) == 0
    log.append(seq, 1, 0, rows[:4])
    log.drop(seq)
    assert log.nbytes == 0
    log.append(seq, 1, 4, rows[4:8])  # after it closed: nothing is kept
    assert log.nbytes == 0


def test_a_truncated_sequence_gives_its_later_blocks_back():
    pool = KVPool([0], num_blocks=8, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", block_size=4)
    seq = pool.sequence(32)
    seq.grow(20)
    assert pool.used_blocks == 5
    seq.truncate(9)
    assert pool.used_blocks == 3 and seq.capacity == 12 and seq.run(9) is not None
    seq.grow(16)  # grows back into the blocks right after
    assert pool.used_blocks == 4 and seq.run(16) is not None
    seq.truncate(0)  # starts afresh: nothing held, nothing reserved
    assert pool.used_blocks == 0
    other = pool.sequence(32)
    other.grow(32)
    assert pool.used_blocks == 8


# --- the whole path, in process ---------------------------------------------------------------------
@pytest.mark.parametrize("lost,budget", [("a", None), ("b", None), ("b", 0)])
def test_a_restarted_daemon_of_an_interleaved_chain_is_rebuilt_by_replays(smollm2, lost, budget, monkeypatch):
    """Daemons a and b hold stages 0, 2 and 1, 3 of four. One is stopped while a long prompt is
    prefilled and 6 others decode, and started again empty on the same port: every request
    resumes (replays from the token ids for stage 0, from the logs for the others) and ends with
    the tokens of a single-process run; nothing stays behind on the daemons. With no replay
    budget, every request is prefilled again from its token ids instead, with the same tokens.
    Either way the stages compute the decoded tokens again as decode rows, the prompt's as
    prefill rows (``Entry.prefill_end``: what keeps that KV exact under bfloat16 prefill)."""
    cfg = smollm2.config
    computed = []  # (start, length, prefill rows) of every entry of several tokens a stage computed
    forward_batch = StageModel.forward_batch

    def recording(self, x, entries, pool):
        computed.extend((e.start, e.length, e.prefill) for e in entries if e.length > 1)
        return forward_batch(self, x, entries, pool)
    monkeypatch.setattr(StageModel, "forward_batch", recording)
    kw = {} if budget is None else {"replay_budget": budget}
    served = {name: Served(name, **kw) for name in "ab"}
    try:
        spec = cluster_of(*served.values())
        pipe = Pipeline(spec)
        q = cfg.num_units // 4
        stages = cut_stages(spec, [q, 2 * q, 3 * q], cfg.num_units, daemons=["a", "b", "a", "b"])
        pipe.load(MODEL, stages, torch.float32)
        redeploy = Redeploy(pipe, MODEL, stages, torch.float32, grace_s=60)
        engine = Engine(pipe.session(), POLICIES["gllm"](), depth=4, recover=redeploy)
        running = _requests_halfway(engine, cfg, seed=11, long_len=640, new_tokens=48)
        port = int(served[lost].address.rsplit(":", 1)[1])
        served[lost].stop()
        served[lost] = Served(lost, port=port, **kw)  # back, empty
        _finish(running, smollm2)
        resumed = engine.resumes[0]
        if budget is None:
            assert resumed["resumed"] == 7 and resumed["restarted"] == 0 and resumed["replayed_positions"] > 0, resumed
        else:
            assert resumed["resumed"] == 0 and resumed["restarted"] == 7, resumed
        prompts = {len(r.prompt) for r in running.requests}
        # every multi-token entry ends its prefill rows where some prompt does, or holds only prompt
        # rows, or only decoded tokens (however the budget cut the prefix)
        assert all(n in (0, length) or start + n in prompts for start, length, n in computed)
        if budget == 0:  # prompts and decoded tokens prefilled again in one entry: the latter as decode rows
            assert any(n < length for _, length, n in computed)
        engine.session.close()
        deadline = time.monotonic() + 10
        while True:
            status = [c.call("Status", pb.StatusRequest()) for c in pipe.clients]
            if all(s.open_sequences == 0 and s.kv_bytes == 0 and s.replay_bytes == 0 for s in status):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        pipe.close()
    finally:
        for s in served.values():
            s.stop()


@dataclass
class _Running:
    requests: list[Request]
    thread: threading.Thread
    errors: list[Exception]


def _requests_halfway(engine, cfg, seed: int, long_len: int, new_tokens: int) -> _Running:
    """6 short requests and a long one, running on ``engine`` in a thread of their own; returns
    once the long prompt is half prefilled and every short one decodes."""
    gen = torch.Generator().manual_seed(seed)
    slicer = lambda n: [64] * (n // 64) + ([n % 64] if n % 64 else [])  # noqa: E731
    requests = [engine.add(Request(torch.randint(1, cfg.vocab_size, (int(n),), generator=gen).tolist(), new_tokens,
                                   slicer=slicer)) for n in torch.randint(8, 40, (6,), generator=gen)]
    long = engine.add(Request(torch.randint(1, cfg.vocab_size, (long_len,), generator=gen).tolist(), 4, slicer=slicer))
    errors: list[Exception] = []

    def run():
        try:
            engine.run()
        except Exception as e:  # noqa: BLE001 - reported by _finish
            errors.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not (long.laid_out >= long_len // 2 and all(r.tokens for r in requests)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return _Running(requests + [long], thread, errors)


def _finish(running: _Running, smollm2) -> None:
    """Wait for the engine to finish; every answer equals single-process generation."""
    running.thread.join(timeout=300)
    assert not running.thread.is_alive() and not running.errors, running.errors
    model = LocalModel(smollm2)
    for r in running.requests:
        assert not r.error, r.error
        want = decode_loop(model.open(r.max_len), r.prompt, max_new_tokens=r.max_new_tokens, sampler=Sampler(),
                           eos_ids=[], slices=[len(r.prompt)])[0]
        assert r.tokens == want


def test_a_stage_of_a_daemon_lost_for_good_moves_and_nothing_else_is_reloaded(smollm2):
    """Daemons a, b, c hold stages 0, 1, 2. b is stopped for good while 6 sequences decode and a
    long prompt is prefilled; the re-plan moves stage 1 to c. a and c keep the models they had
    loaded (the same objects), c loads only stage 1's units beside its own, every request resumes
    by replay from a's log, and every answer equals single-process generation."""
    cfg = smollm2.config
    served = {name: Served(name) for name in "abc"}
    try:
        spec = cluster_of(*served.values())
        pipe = Pipeline(spec)
        stages = cut_stages(spec, [cfg.num_units // 3, 2 * cfg.num_units // 3], cfg.num_units)
        pipe.load(MODEL, stages, torch.float32)
        models = {name: {i: s.model for i, s in served[name].stage.stages.items()} for name in "ac"}
        moved = [stages[0], replace(stages[1], daemon="c"), stages[2]]
        redeploy = Redeploy(pipe, MODEL, stages, torch.float32, grace_s=2, replan=lambda alive, old: moved)
        engine = Engine(pipe.session(), POLICIES["gllm"](), depth=3, recover=redeploy)
        running = _requests_halfway(engine, cfg, seed=12, long_len=512, new_tokens=32)
        served["b"].stop()
        _finish(running, smollm2)
        assert redeploy.events[0]["action"] == f"moved units {stages[1].units} to c (without b)", redeploy.events
        resumed = engine.resumes[0]
        assert resumed["resumed"] == 7 and resumed["restarted"] == 0 and resumed["replayed_positions"] > 0, resumed
        held = {name: served[name].stage.stages for name in "ac"}
        assert sorted(held["a"]) == [0] and sorted(held["c"]) == [1, 2]
        assert held["a"][0].model is models["a"][0] and held["c"][2].model is models["c"][2]  # not reloaded
        engine.session.close()
        pipe.close()
    finally:
        for name in "ac":
            served[name].stop()
