"""A caller with the cluster's token touches only its own sessions, and connections that never
authenticate cost a daemon next to nothing (runtime.daemon.owners, runtime.wire.data_server)."""

import logging
import os
import random
import socket
import struct
import threading
import time

import grpc
import pytest
import torch

from runtime.wire.channels import Security
from runtime.wire.messages import pb
from runtime.wire.transport import LinkError, connect
from tests.cluster_helpers import Served
from tests.runtime.test_daemon_robustness import Coordinator, code_of, entry, load

TOKEN = "s3cret"
VOCAB = 384


@pytest.fixture
def daemon():
    d = Served(token=TOKEN, memory_budget=4 * 2**20)
    yield d
    d.stop()


def residuals(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def run_steps(co: Coordinator, seq: int, between=lambda step, mb: None) -> list[torch.Tensor]:
    """A 6-token prefill and 4 one-token steps of sequence ``seq`` on stage 1; ``between(step,
    micro_batch)`` runs after each step has been laid out, before its input is sent."""
    out = []
    for step, (start, n) in enumerate([(0, 6), (6, 1), (7, 1), (8, 1), (9, 1)]):
        mb, co.next = co.next, co.next + 1
        co.conn.send(pb.Frame(layout=pb.MicroBatch(id=mb, entries=[entry(seq, start, n, max_len=32 if not start
                                                                                       else 0)])))
        between(step, mb)
        x = residuals(n, 100 + step)
        co.link.send(pb.Frame(activation=pb.Activation(session=co.session, micro_batch=mb, stage=1,
                                                       session_key=co.key, payload_bytes=x.numel() * 4)), x)
        _, logits, failed = co.result(VOCAB)
        assert not failed, failed
        out.append(logits)
    return out


def reference_run(daemon) -> list[torch.Tensor]:
    co = Coordinator(daemon, session=8, token=TOKEN)
    try:
        return run_steps(co, seq=50)
    finally:
        co.close()


def test_a_token_holder_cannot_touch_another_session(daemon, tiny_dirs, caplog):
    caplog.set_level(logging.WARNING)
    c = daemon.client(Security(token=TOKEN))
    load(c, tiny_dirs["llama"], 3, 8)  # stage 1 of 2: its input is the residual stream
    reference = reference_run(daemon)
    victim = Coordinator(daemon, session=7, token=TOKEN)
    attacker = Coordinator(daemon, session=99, token=TOKEN)
    host, port = "127.0.0.1", daemon.stage.data.port
    refusals = []

    def attack(step, mb):
        if step == 0:  # its Hello claims the victim's session: refused, so its results stay the victim's
            for key in (b"", os.urandom(16)):
                with pytest.raises(LinkError, match="PERMISSION_DENIED"):
                    connect(host, port, TOKEN, victim.session, key=key)
            refusals.append("hello")
        elif step == 1:  # a close frame naming the victim's sequence, on the attacker's own session
            attacker.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=[1])))
            attacker.send([entry(60, 0, 1, max_len=4)], residuals(1, 0), stage=1)  # in order after the close
            assert not attacker.result(VOCAB)[2]
            mine = pb.StatusRequest(sequence_ids=[1], session=victim.session, key=victim.key)
            assert c.call("Status", mine).sequences[0].open
            # the attacker's Status does not see it (nor keep it alive), named with its own key or none
            for session, key in ((attacker.session, attacker.key), (victim.session, attacker.key), (0, b"")):
                asked = pb.StatusRequest(sequence_ids=[1], session=session, key=key)
                assert not c.call("Status", asked).sequences[0].open
            refusals.append("close")
        elif step == 2:  # Resume and EndSession naming the victim's session
            for request in (pb.ResumeRequest(from_session=victim.session, to_session=attacker.session,
                                             to_key=attacker.key),
                            pb.ResumeRequest(from_session=victim.session, from_key=attacker.key,
                                             to_session=attacker.session, to_key=attacker.key)):
                code, message = code_of(lambda: c.call("Resume", request))
                assert code == grpc.StatusCode.PERMISSION_DENIED and "without its key" in message
            code, _ = code_of(lambda: c.call("EndSession", pb.SessionRequest(session=victim.session)))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            refusals.append("control")
        elif step == 3:  # data for the victim's laid-out micro-batch, sent before the real one
            junk = torch.full((1, 64), 1e4)
            for key, conn in ((b"", attacker.link), (os.urandom(16), attacker.link), (b"", attacker.conn)):
                conn.send(pb.Frame(activation=pb.Activation(session=victim.session, micro_batch=mb, stage=1,
                                                            session_key=key, payload_bytes=256)), junk)
            attacker.send([entry(61, 0, 1, max_len=4)], residuals(1, 0), stage=1)  # the link read them all
            assert not attacker.result(VOCAB)[2]
            refusals.append("data")

    got = run_steps(victim, seq=1, between=attack)
    assert refusals == ["hello", "close", "control", "data"]
    for a, b in zip(got, reference):
        assert torch.equal(a, b)  # the victim's answers are those of a session nobody attacked
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    for what in ("belongs to another connection", "without a key", "closing sequence 1 of another session",
                 "Resume names session 7", "EndSession names session 7",
                 "an activation for session 7 without its key", "a coordinator's connection sent stage 1"):
        assert any(what in m for m in logged), (what, logged)
    # the victim's own calls still work: it ends its session and frees its sequence
    assert c.call("EndSession", pb.SessionRequest(session=victim.session, key=victim.key)) is not None
    assert not c.call("Status", pb.StatusRequest(sequence_ids=[1], session=victim.session,
                                                 key=victim.key)).sequences[0].open
    for co in (victim, attacker):
        co.close()


def test_resume_moves_sequences_only_between_sessions_of_one_owner(daemon, tiny_dirs):
    c = daemon.client(Security(token=TOKEN))
    load(c, tiny_dirs["llama"], 3, 8)
    old = Coordinator(daemon, session=7, token=TOKEN)
    old.send([entry(1, 0, 4, max_len=16)], residuals(4, 1), stage=1)
    assert not old.result(VOCAB)[2]
    new = Coordinator(daemon, session=9, token=TOKEN)
    code, _ = code_of(lambda: c.call("Resume", pb.ResumeRequest(from_session=7, from_key=old.key,
                                                                to_session=9, to_key=old.key)))
    assert code == grpc.StatusCode.PERMISSION_DENIED  # the new session's key is not the caller's
    reply = c.call("Resume", pb.ResumeRequest(from_session=7, from_key=old.key, to_session=9, to_key=new.key))
    assert [(p.sequence_id, p.computed) for p in reply.progress] == [(1, 4)]
    # a session this daemon never saw holds nothing here: nothing to refuse, nothing moves
    assert not c.call("Resume", pb.ResumeRequest(from_session=12345, to_session=9, to_key=new.key)).progress
    old.close()
    new.send([entry(1, 4, 1)], residuals(1, 2), stage=1)  # the adopted sequence goes on in the new session
    assert not new.result(VOCAB)[2]
    new.close()


def _fuzz_once(rng: random.Random, host: str, port: int) -> None:
    """One connection that sends something malformed, hostile or cut short, and goes away."""
    s = socket.create_connection((host, port), timeout=5)
    try:
        case = rng.randrange(7)
        if case == 0:  # random bytes from the first byte on
            s.sendall(rng.randbytes(rng.randrange(1, 64)))
            return
        token = TOKEN if case != 1 else rng.choice(["", "s3cre", "s3cret!", TOKEN.upper()])
        session = rng.choice([0, 0, rng.getrandbits(63) or 1])
        hello = pb.Hello(token=token, session=session, key=rng.randbytes(rng.choice([0, 8, 16]))).SerializeToString()
        s.sendall(struct.pack("<I", len(hello)) + hello)
        if case == 1:
            return
        s.settimeout(5)
        try:
            n = struct.unpack("<I", s.recv(4))[0]
            reply = pb.HelloReply.FromString(s.recv(n))
        except (OSError, struct.error):
            return
        if reply.error:
            return
        for _ in range(rng.randrange(1, 6)):
            if case == 2:  # a random header
                body = rng.randbytes(rng.randrange(0, 200))
                s.sendall(struct.pack("<I", rng.choice([len(body), 1 << 31, 5 << 20, 0])) + body)
            elif case == 3:  # huge or negative payloads
                frame = pb.Frame(activation=pb.Activation(session=session, micro_batch=rng.randrange(4), stage=1,
                                                          payload_bytes=rng.choice([-5, 1 << 40, 2 << 30, 777])))
                body = frame.SerializeToString()
                s.sendall(struct.pack("<I", len(body)) + body + rng.randbytes(64))
            elif case == 4:  # layouts of random entries, then data of a random size
                entries = [pb.Entry(sequence_id=rng.getrandbits(64), start=rng.randrange(-5, 100),
                                    length=rng.randrange(-2, 70000), max_len=rng.randrange(-1, 4096),
                                    logits=rng.randrange(3), cached=[rng.getrandbits(64)] * rng.randrange(2),
                                    keep=[rng.getrandbits(64)] * rng.randrange(2))
                           for _ in range(rng.randrange(1, 4))]
                mb = rng.randrange(3)
                for frame in (pb.Frame(layout=pb.MicroBatch(id=mb, entries=entries,
                                                            replay=pb.Replay(first=rng.randrange(-1, 3),
                                                                             last=rng.randrange(-1, 3)))),
                              pb.Frame(activation=pb.Activation(session=session, micro_batch=mb, stage=rng.randrange(3),
                                                                payload_bytes=256))):
                    body = frame.SerializeToString()
                    s.sendall(struct.pack("<I", len(body)) + body)
                s.sendall(rng.randbytes(256))
            elif case == 5:  # closes and evictions of anything
                frame = rng.choice([pb.Frame(close=pb.CloseSequences(sequence_ids=[rng.getrandbits(64)])),
                                    pb.Frame(evict=pb.Evict(blocks=[rng.getrandbits(64)]))])
                body = frame.SerializeToString()
                s.sendall(struct.pack("<I", len(body)) + body)
            else:  # a valid header cut short
                body = pb.Frame(close=pb.CloseSequences(sequence_ids=[1, 2, 3])).SerializeToString()
                s.sendall(struct.pack("<I", len(body)) + body[:rng.randrange(len(body))])
    except OSError:
        pass  # the daemon hung up on us: what it should do
    finally:
        s.close()


def test_a_fuzzer_on_the_data_port_leaves_it_serving(daemon, tiny_dirs):
    c = daemon.client(Security(token=TOKEN))
    load(c, tiny_dirs["llama"], 3, 8)
    reference = reference_run(daemon)
    threads = _connection_threads()
    rng = random.Random(41)
    for _ in range(300):
        _fuzz_once(rng, "127.0.0.1", daemon.stage.data.port)
    assert c.health()
    co = Coordinator(daemon, session=9, token=TOKEN)
    got = run_steps(co, seq=51)
    co.close()
    for a, b in zip(got, reference):
        assert torch.equal(a, b)
    deadline = time.monotonic() + 20  # every fuzzing connection is let go, with what it opened
    while _connection_threads() > threads or daemon.stage.kv_bytes():
        assert time.monotonic() < deadline, (threads, _connection_threads(), daemon.stage.kv_bytes())
        time.sleep(0.2)


def _connection_threads() -> int:
    """The daemon's threads that a data connection starts (one per connection, each with its
    sender). Not the process's OS threads: gRPC's executor and OpenMP's per-thread pools add and
    keep threads of their own, whatever the fuzzer does."""
    return sum(t.name in ("data-conn", "stage-sender") for t in threading.enumerate())


def test_a_coordinators_generation_survives_the_attacks(tiny_dirs, caplog):
    """The three attacks of issue #41, by a caller holding the token who knows the victim's session
    and sequence ids, mid-generation through two daemons: each is refused, and the tokens are those
    of an undisturbed run."""
    from hpipe.model.generate.local import decode_loop
    from hpipe.model.generate.sampling import Sampler
    from runtime.coordinator.pipeline import RemoteRunner
    from tests.runtime.test_daemon_access import _two_stage_pipeline

    caplog.set_level(logging.WARNING)
    a, b, pipe = _two_stage_pipeline(tiny_dirs, Security(token=TOKEN), token=TOKEN)
    attacked = []

    class Attacked(RemoteRunner):
        def step(self, token):
            if not attacked:
                attacked.append(self.seq.ids[0])
                _attack(a, self.seq.session.id, self.seq.ids, caplog)
            return super().step(token)

    def greedy(runner):
        with pipe.open(32) as seq:
            return decode_loop(runner(seq), list(range(1, 11)), max_new_tokens=8, sampler=Sampler(), eos_ids=[],
                               slices=[4, 6])[0]
    try:
        clean = greedy(RemoteRunner)
        assert greedy(Attacked) == clean and attacked
    finally:
        pipe.close(), a.stop(), b.stop()


def _attack(d: Served, session: int, seq_ids: list[int], caplog) -> None:
    host, port = "127.0.0.1", d.stage.data.port
    with pytest.raises(LinkError, match="PERMISSION_DENIED: session .* belongs to another connection"):
        connect(host, port, TOKEN, session, key=os.urandom(16))  # would take over its results
    mine = connect(host, port, TOKEN, session + 1, key=os.urandom(16))
    mine.send(pb.Frame(close=pb.CloseSequences(sequence_ids=seq_ids)))  # would kill its stream
    c = d.client(Security(token=TOKEN))
    code, _ = code_of(lambda: c.call("Resume", pb.ResumeRequest(from_session=session, to_session=session + 1)))
    assert code == grpc.StatusCode.PERMISSION_DENIED  # would list its sequences and fail its request
    deadline = time.monotonic() + 5
    while not any(f"closing sequence {seq_ids[0]} of another session" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the close frame was not refused"
        time.sleep(0.05)
    assert d.stage.sequences.find(seq_ids[0]) is not None
    mine.close()
    c.close()


def test_a_switchs_kv_moves_only_for_its_sessions_owner(daemon, tiny_dirs):
    """SendKv sends a session's KV only for the caller with its key; KV sent here must carry the
    key of a session connected here (runtime.daemon.kv_transfer)."""
    c = daemon.client(Security(token=TOKEN))
    load(c, tiny_dirs["llama"], 3, 8)
    old = Coordinator(daemon, session=7, token=TOKEN)
    old.send([entry(1, 0, 4, max_len=16)], residuals(4, 1), stage=1)
    assert not old.result(VOCAB)[2]
    send = pb.SendKvRequest(session=7, key=os.urandom(16), stages=[1], target_address="127.0.0.1:9")
    code, message = code_of(lambda: c.call("SendKv", send))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "without its key" in message

    def part(session, key, data=bytes(32), **kw):
        return pb.KvPart(session=session, key=key, sequence_id=5, max_len=16, stage=1, positions=1, layer=0,
                         start=0, count=1, dtype=pb.FLOAT32, kv_heads=2, head_dim=4, data=data, **kw)
    code, _ = code_of(lambda: c.call("ReceiveKv", iter([part(7, os.urandom(16))])))
    assert code == grpc.StatusCode.PERMISSION_DENIED  # a session it knows, without its key
    code, message = code_of(lambda: c.call("ReceiveKv", iter([part(7, old.key, data=bytes(31))])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs 32" in message
    assert c.call("ReceiveKv", iter([part(7, old.key)])).bytes == 32  # its own key: taken
    code, message = code_of(lambda: c.call("ReceiveKv", iter([part(555, os.urandom(16))])))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "no connection here" in message
    old.close()


def test_kv_sent_ahead_of_a_session_cannot_claim_it(daemon, tiny_dirs):
    """The attack of issue 64: a token holder sends KV for a session the daemon does not know yet,
    with a key of its own; once the session connects and computes, the holder's Resume would adopt
    its sequences (the daemon trusted the key the KV came with before the session's own), and the
    session's own transfers would be refused. KV now needs the key of a session connected here."""
    c = daemon.client(Security(token=TOKEN))
    load(c, tiny_dirs["llama"], 3, 8)
    attacker_key = os.urandom(16)
    part = pb.KvPart(session=555, key=attacker_key, sequence_id=5, max_len=16, stage=1, positions=1, layer=0,
                     start=0, count=1, dtype=pb.FLOAT32, kv_heads=2, head_dim=4, data=bytes(32))
    code, _ = code_of(lambda: c.call("ReceiveKv", iter([part])))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    victim = Coordinator(daemon, session=555, token=TOKEN)
    victim.send([entry(1, 0, 4, max_len=16)], residuals(4, 1), stage=1)
    assert not victim.result(VOCAB)[2]
    thief = Coordinator(daemon, session=9, token=TOKEN)
    code, _ = code_of(lambda: c.call("Resume", pb.ResumeRequest(from_session=555, from_key=attacker_key,
                                                                to_session=9, to_key=thief.key)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    part.key = victim.key
    assert c.call("ReceiveKv", iter([part])).bytes == 32  # the session's own transfer still goes
    victim.send([entry(1, 4, 1)], residuals(1, 2), stage=1)  # its sequence is still its own
    assert not victim.result(VOCAB)[2]
    for co in (victim, thief):
        co.close()
