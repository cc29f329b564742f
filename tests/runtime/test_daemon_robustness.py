"""Bad messages sent straight to a daemon get a clear refusal, and the daemon keeps serving."""

import json
import os
import shutil
import subprocess
import time

import grpc
import pytest
import torch

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.daemon.deployment import check_source
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import MAX_MESSAGE_BYTES, pb, pb_grpc
from runtime.wire.transport import LinkError, connect, read_payload
from tests.app.serve_helpers import free_port
from tests.cluster_helpers import Served, cluster_of


@pytest.fixture
def daemon():
    d = Served(memory_budget=4 * 2**20)  # tiny model: ~0.5 MiB of weights, the rest for its KV pool
    yield d
    d.stop()


def code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def load(client, model, start, end, dtype=pb.FLOAT32, num_units=8, kv_pool_bytes=0):
    """Hold units [start, end) of a pipeline whose other stages (if any) are on an unused address."""
    bounds = sorted({0, start, end, num_units})
    stages = [pb.Stage(unit_start=a, unit_end=b, num_layers=(num_units - 2) // 2, daemon=f"d{i}",
                       address="127.0.0.1:1", data_port=1) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    held = [i for i, st in enumerate(stages) if st.unit_start == start]
    return client.call("Load", pb.LoadRequest(model=str(model), dtype=dtype, stages=stages, held=held,
                                              kv_pool_bytes=kv_pool_bytes))


class Coordinator:
    """A hand-driven session on one daemon's data plane: layouts and activations as we write them.
    The first stage's input goes on the session's connection, a later stage's on a daemon's link
    (session 0) with the session's key, as the stage before it would send it."""

    def __init__(self, d: Served, session: int = 7, token: str | None = None):
        host, port = d.address.split(":")[0], d.stage.data.port
        self.key = os.urandom(16)
        self.conn = connect(host, port, token, session, key=self.key)
        self.link = connect(host, port, token, 0)
        self.session, self.next = session, 0

    def send(self, entries, payload: torch.Tensor, stage: int, nbytes: int | None = None) -> int:
        mb, self.next = self.next, self.next + 1
        self.conn.send(pb.Frame(layout=pb.MicroBatch(id=mb, entries=entries)))
        data = payload.contiguous()
        (self.link if stage else self.conn).send(pb.Frame(activation=pb.Activation(
            session=self.session, micro_batch=mb, stage=stage, session_key=self.key if stage else b"",
            payload_bytes=nbytes if nbytes is not None else data.numel() * data.element_size())), data)
        return mb

    def close(self) -> None:
        self.conn.close()
        self.link.close()

    def result(self, vocab: int):
        frame = self.conn.read_frame()
        act = frame.activation
        logits = read_payload(self.conn.sock, act.payload_bytes).view(torch.float32).view(-1, vocab)
        return act, logits, {f.sequence_id: (f.code, f.message) for f in act.failed}


KEY = bytes(range(16))  # a session key for tests that open sessions by hand


def entry(seq, start, length, max_len=0, logits=pb.LAST_LOGITS):
    return pb.Entry(sequence_id=seq, start=start, length=length, max_len=max_len, logits=logits)


def test_bad_loads_then_a_good_one(daemon, tiny_dirs):
    c = daemon.client()
    model = tiny_dirs["llama"]
    assert code_of(lambda: load(c, "/no-such-model", 0, 8))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: load(c, model.parent / "no-such-model", 0, 8))[0] == grpc.StatusCode.FAILED_PRECONDITION
    code, msg = code_of(lambda: load(c, model, 0, 99))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the model's units [0, 8)" in msg
    code, msg = code_of(lambda: c.call("Load", pb.LoadRequest(model=str(model), dtype=pb.FLOAT32, stages=[
        pb.Stage(unit_start=0, unit_end=4, num_layers=3, address="127.0.0.1:1"),
        pb.Stage(unit_start=3, unit_end=8, num_layers=3, address="127.0.0.1:1")], held=[0, 1])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "do not cover the model's units" in msg
    assert code_of(lambda: c.call("Load", pb.LoadRequest(model=str(model), dtype=pb.FLOAT32)))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT
    code, msg = code_of(lambda: load(c, model, 0, 8, kv_pool_bytes=64 << 20))  # weights + pool past the budget
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in msg
    info = load(c, model, 3, 8)
    assert info.hidden_size == 64 and info.parameters > 0 and info.pools[0].blocks > 0


def test_running_out_of_memory_while_loading_is_a_clear_error_and_loses_nothing(daemon, tiny_dirs, monkeypatch):
    """Memory that was free at the check and is gone at the allocation (another daemon on the same
    GPU loading at once): the load is refused with RESOURCE_EXHAUSTED, naming the way out, and the
    daemon loads the next deployment."""
    from hpipe.model.compute.stage import StageModel

    c, model = daemon.client(), tiny_dirs["llama"]

    def taken(self, blocks):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.24 GiB.")

    with monkeypatch.context() as m:
        m.setattr(StageModel, "new_pool", taken)
        code, msg = code_of(lambda: load(c, model, 0, 8))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory on cpu loading units [0, 8)" in msg and "memory_budget or memory_share" in msg
    assert load(c, model, 0, 8).pools[0].blocks > 0


def test_a_redeployment_lets_the_old_stages_go_before_the_new_ones_load(tiny_dirs):
    """When a daemon loads other units, nothing still holds the stage it ran last (the outbox's
    thread held its last item, and with it the old stage, until the next send: on a GPU the old
    weights and the new were resident together). Checked with weak references, without a
    collection of our own."""
    import weakref

    from runtime.daemon import memory

    model, units = str(tiny_dirs["llama"]), 8
    first, second = Served("g"), Served("h")
    pipe = Pipeline(cluster_of(first, second))
    alive_at_load = []
    try:
        pipe.load(model, cut_stages(pipe.cluster, [5], units), torch.float32)
        with pipe.open(9) as seq:
            seq.submit(torch.tensor([5, 17, 99, 3, 250, 7, 64, 11]))
            seq.result()
        old = [weakref.ref(s.model) for s in first.stage.stages.values()]
        reset_peak = memory.reset_peak

        def spy(device):  # called once the new stages are loaded
            alive_at_load.append(sum(r() is not None for r in old))
            reset_peak(device)

        memory.reset_peak = spy
        pipe.load(model, cut_stages(pipe.cluster, [3], units), torch.float32)
    finally:
        memory.reset_peak = reset_peak
        pipe.close()
        first.stop(), second.stop()
    assert alive_at_load and alive_at_load == [0, 0], alive_at_load


def test_a_memory_share_is_a_budget_of_that_share_of_the_device():
    import psutil

    from runtime.daemon.memory import SHARE_USABLE

    d = Served(memory_share=0.01)
    try:
        budget = d.client().call("Status", pb.StatusRequest()).memory_budget
    finally:
        d.stop()
    assert budget == int(0.01 * psutil.virtual_memory().total * SHARE_USABLE)


def test_load_reads_model_files_only_from_allowed_directories(tiny_dirs, tmp_path):
    allowed = tmp_path / "models"
    shutil.copytree(tiny_dirs["llama"], allowed / "llama")
    d = Served(model_dirs=str(allowed))
    try:
        c = d.client()
        info = load(c, allowed / "llama", 0, 8)  # inside: loads
        outside = [tiny_dirs["llama"],                                  # another directory
                   allowed / ".." / tiny_dirs["llama"].relative_to(tiny_dirs["llama"].anchor),  # '..' out of it
                   f"random:{tiny_dirs['llama'] / 'config.json'}",     # a random-weight shape from any JSON
                   "random:/etc/hostname.json",
                   allowed / "link"]                                   # a link inside, pointing out
        (allowed / "link").symlink_to(tiny_dirs["llama"], target_is_directory=True)
        for model in outside:
            code, msg = code_of(lambda: load(c, model, 0, 8))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "--model-dirs" in msg, model
        assert d.stage.deployment is not None and d.stage.deployment.model == str(allowed / "llama")  # kept
        # a shard index naming files outside its directory is refused without opening them
        crafted = allowed / "crafted"
        shutil.copytree(allowed / "llama", crafted)
        weights = next(crafted.glob("*.safetensors"))
        names = list(json.loads(weights.read_bytes()[8:8 + int.from_bytes(weights.read_bytes()[:8], "little")]))
        for shard in ("/etc/hostname", "../llama/" + weights.name):
            (crafted / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {n: shard for n in names if n != "__metadata__"}}))
            code, msg = code_of(lambda: load(c, crafted, 0, 8))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "is not a file of this directory" in msg
        assert info.parameters > 0
        for builtin in ("smollm2-135m", "random:llama-7b"):  # read no path the caller names
            check_source(builtin, ())
    finally:
        d.stop()


def test_bad_micro_batches_fail_alone_and_the_daemon_keeps_serving(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 3, 8)  # no embedding: takes the residual stream [tokens, 64] float32
    co = Coordinator(daemon)
    good = torch.randn(4, 64)
    co.send([entry(1, 0, 4, max_len=16)], good, stage=1)
    act, logits, failed = co.result(384)
    assert act.micro_batch == 0 and logits.shape == (1, 384) and not failed
    cases = {  # (entries, payload, stage, payload bytes) -> (code, message) for sequence 2
        "unknown sequence": ([entry(2, 0, 4)], good, 1, None, "NOT_FOUND", "unknown sequence 2"),
        "beyond max length": ([entry(2, 0, 17, max_len=16)], torch.randn(17, 64), 1, None, "OUT_OF_RANGE",
                              "declared max length 16"),
        "max length past the context": ([entry(2, 0, 4, max_len=97)], good, 1, None, "OUT_OF_RANGE",
                                        "model's context of 96"),
        "wrong byte count": ([entry(2, 0, 4, max_len=16)], good[:3], 1, None, "INVALID_ARGUMENT",
                             "its layout of 4 tokens needs 1024"),
        "wrong dtype": ([entry(2, 0, 4, max_len=16)], good.bfloat16(), 1, None, "INVALID_ARGUMENT", "needs 1024"),
        "twice in one micro-batch": ([entry(2, 0, 2, max_len=16), entry(2, 2, 2)], good, 1, None,
                                     "INVALID_ARGUMENT", "appears twice"),
    }
    for name, (entries, payload, stage, nbytes, code, message) in cases.items():
        co.send(entries, payload, stage, nbytes)
        act, logits, failed = co.result(384)
        assert failed.get(2, ("", ""))[0] == code and message in failed[2][1], (name, failed)
        mine = pb.StatusRequest(sequence_ids=[2], session=co.session, key=co.key)
        assert c.call("Status", mine).sequences[0].error in ("", failed[2][1]), name
        co.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=[2])))
    # sequence 1 was untouched by all of that, and continues where it was: not past it, but an
    # entry may rewind it (how a recovering coordinator resumes)
    co.send([entry(1, 5, 1)], torch.randn(1, 64), stage=1)
    _, _, failed = co.result(384)
    assert failed[1][0] == "FAILED_PRECONDITION" and "continues at 4" in failed[1][1]
    co.send([entry(1, 3, 1)], torch.randn(1, 64), stage=1)
    assert not co.result(384)[2]
    assert c.call("Status", pb.StatusRequest(sequence_ids=[1], session=co.session, key=co.key)).sequences[0].length == 4
    # another session (or no session) reads it as not open here, and does not keep it alive
    assert not c.call("Status", pb.StatusRequest(sequence_ids=[1], session=99, key=co.key)).sequences[0].open
    assert not c.call("Status", pb.StatusRequest(sequence_ids=[1])).sequences[0].open
    co2 = Coordinator(daemon, session=8)
    co2.send([entry(9, 0, 2, max_len=8)], torch.randn(2, 64), stage=1)
    assert not co2.result(384)[2]
    co.close()
    co2.close()
    deadline = time.monotonic() + 5  # a coordinator that disconnects frees its sequences
    while c.call("Status", pb.StatusRequest()).kv_bytes:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_token_ids_out_of_range(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    co = Coordinator(daemon)
    co.send([entry(1, 0, 1, max_len=8)], torch.tensor([5000]), stage=0)
    _, logits, failed = co.result(384)
    assert failed[1][0] == "INVALID_ARGUMENT" and "token ids must lie" in failed[1][1] and logits.shape == (1, 384)
    co.close()


def test_kv_pool_exhausted_fails_only_the_sequences_that_do_not_fit(daemon, tiny_dirs):
    c = daemon.client()
    block = 2 * 3 * 2 * 16 * 16 * 4  # K and V, 3 layers, 2 KV heads of 16, 16 tokens, float32
    info = load(c, tiny_dirs["llama"], 0, 8, kv_pool_bytes=10 * block)
    assert info.pools[0].blocks == 10
    co = Coordinator(daemon)
    # 12 sequences of 16 tokens: 10 fit, 2 do not
    co.send([entry(i, 0, 16, max_len=16) for i in range(12)], torch.randint(0, 384, (12 * 16,)), stage=0)
    _, logits, failed = co.result(384)
    assert logits.shape == (12, 384) and sorted(failed) == [10, 11]
    assert all(code == "RESOURCE_EXHAUSTED" and "KV pool is full" in msg for code, msg in failed.values())
    assert c.call("Status", pb.StatusRequest()).pools[0].used_blocks == 10
    co.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=list(range(12)))))
    deadline = time.monotonic() + 5
    while c.call("Status", pb.StatusRequest()).pools[0].used_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    co.close()


def test_idle_sequence_is_freed(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    daemon.stage.sequences.idle_timeout_s = 0.5
    co = Coordinator(daemon)
    co.send([entry(3, 0, 2, max_len=32)], torch.tensor([1, 2]), stage=0)
    co.result(384)
    assert c.call("Status", pb.StatusRequest()).open_sequences == 1
    deadline = time.monotonic() + 5
    while c.call("Status", pb.StatusRequest()).open_sequences:  # (naming it in a status would keep it alive)
        assert time.monotonic() < deadline, "idle sequence was not freed"
        time.sleep(0.1)
    co.close()
    assert c.call("Status", pb.StatusRequest()).kv_bytes == 0


def test_a_sequence_closed_before_its_micro_batch_is_computed_fails_it_rather_than_sending_its_row(daemon, tiny_dirs):
    """Its layout found the sequence, then a close freed it: the micro-batch computes its row dead
    and names it failed, so no later stage writes its cache from that row and nobody samples it
    (a daemon shutting down frees its sequences under micro-batches still queued alike)."""
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    co = Coordinator(daemon)
    co.send([entry(3, 0, 2, max_len=32), entry(4, 0, 2, max_len=32)], torch.tensor([1, 2, 5, 6]), stage=0)
    _, _, failed = co.result(384)
    assert not failed
    co.conn.send(pb.Frame(layout=pb.MicroBatch(id=co.next, entries=[entry(3, 2, 1), entry(4, 2, 1)])))
    co.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=[3])))  # in order: after the layout, before the data
    data = torch.tensor([7, 8])
    co.conn.send(pb.Frame(activation=pb.Activation(session=co.session, micro_batch=co.next, stage=0,
                                                   payload_bytes=data.numel() * data.element_size())), data)
    _, logits, failed = co.result(384)
    assert set(failed) == {3} and failed[3][0] == "NOT_FOUND", failed
    assert logits.shape[0] == 2 and torch.isfinite(logits[1]).all()  # the other sequence is computed
    co.close()


def test_token_required(tiny_dirs):
    d = Served(token="s3cret")
    try:
        with pytest.raises(LinkError, match="missing or wrong token"):  # the data plane checks it too
            connect("127.0.0.1", d.stage.data.port, "wrong", 1, key=KEY)
        connect("127.0.0.1", d.stage.data.port, "s3cret", 1, key=KEY).close()
        code, _ = code_of(lambda: d.client().call("Status", pb.StatusRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: d.client(Security(token="wrong")).call("Status", pb.StatusRequest()))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
        assert not d.client().health()
        good = d.client(Security(token="s3cret"))
        assert good.health() and not good.call("Status", pb.StatusRequest()).loaded
        # guessing is slowed down: each wrong token waits longer (0.05, 0.1, 0.2, 0.4, 0.8, 1 s ...)
        wrong = d.client(Security(token="guess"))
        t0 = time.monotonic()
        for _ in range(6):
            assert code_of(lambda: wrong.call("Status", pb.StatusRequest()))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - t0 > 1.0
        t0 = time.monotonic()
        assert good.call("Status", pb.StatusRequest()) is not None and time.monotonic() - t0 < 0.5  # the token still works
        # gRPC reads a message whole before the token check: a large one is refused for its size
        # (a client that would send it: ours refuses to)
        with grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]) as ch:
            profile = pb_grpc.ProfilerServiceStub(ch).ProfileCompute
            huge = pb.ProfileRequest(config_json="x" * (MAX_MESSAGE_BYTES + 1))
            with pytest.raises(grpc.RpcError) as refused:
                profile(huge, timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    finally:
        d.stop()


def _two_stage_pipeline(tiny_dirs, security, **kw):
    a, b = Served(**kw), Served(**kw)
    spec = ClusterSpec("t", (DaemonSpec.at("a", a.address), DaemonSpec.at("b", b.address)))
    pipe = Pipeline(spec, security)
    pipe.load(str(tiny_dirs["llama"]), cut_stages(spec, [3], 8), torch.float32)
    return a, b, pipe


def _greedy(pipe, n=6):
    from hpipe.model.generate.local import decode_loop
    from hpipe.model.generate.sampling import Sampler
    from runtime.coordinator.pipeline import RemoteRunner

    with pipe.open(32) as seq:
        out, *_ = decode_loop(RemoteRunner(seq), list(range(1, 11)), max_new_tokens=n, sampler=Sampler(),
                              eos_ids=[], slices=[4, 6])
    return out


def test_token_flows_between_daemons(tiny_dirs):
    a, b, pipe = _two_stage_pipeline(tiny_dirs, Security(token="t0k"), token="t0k")
    try:
        assert len(_greedy(pipe)) == 6
    finally:
        pipe.close(), a.stop(), b.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a test certificate")
def test_callers_without_the_token_do_not_take_the_handler_threads(tiny_dirs):
    """96 wrong-token calls at once, each owed a full second of backoff: only a few wait it out
    (the rest are refused at once), so the coordinator's call is answered without waiting for them
    (with every handler thread asleep it would wait for all three waves of the flood, 96 calls over
    32 threads, about 2.7 s; answered, it takes milliseconds, so 2 s leaves a wide margin either
    side on a slow machine)."""
    import concurrent.futures

    d = Served(token="s3cret")
    try:
        wrong = d.client(Security(token="guess"))
        for _ in range(6):  # the host's backoff at its most: a second each
            code_of(lambda: wrong.call("Status", pb.StatusRequest()))
        good = d.client(Security(token="s3cret"))
        with concurrent.futures.ThreadPoolExecutor(96) as pool:
            flood = [pool.submit(code_of, lambda: wrong.call("Status", pb.StatusRequest())) for _ in range(96)]
            time.sleep(0.3)
            t0 = time.monotonic()
            assert good.call("Status", pb.StatusRequest(), timeout=30) is not None
            waited = time.monotonic() - t0
            assert all(f.result()[0] == grpc.StatusCode.UNAUTHENTICATED for f in flood)
        assert waited < 2.0, waited
    finally:
        d.stop()


def test_tls(tiny_dirs, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    a, b, pipe = _two_stage_pipeline(tiny_dirs, Security(tls_ca=cert), tls_cert=str(cert), tls_key=str(key))
    try:
        assert len(_greedy(pipe)) == 6
        plain = DaemonClient(a.address)  # a plaintext client cannot talk to a TLS daemon
        assert not plain.health(timeout=1.0)
    finally:
        pipe.close(), a.stop(), b.stop()


def test_bind_warning():
    from runtime.daemon.servicer import bind_warning

    assert bind_warning("127.0.0.1") is None and bind_warning("localhost") is None
    assert "trusted network" in bind_warning("0.0.0.0")


def test_a_daemon_beyond_loopback_needs_a_token_or_says_insecure(tmp_path):
    """Bound beyond loopback without a token, ``hpipe daemon`` does not start; --insecure says so
    out loud and it starts (with the warning); loopback needs neither."""
    import subprocess
    import sys

    from hpipe.core.cluster import DaemonOptions
    from hpipe.core.errors import HpipeError

    with pytest.raises(HpipeError, match="without a token: give it --token-file"):
        DaemonOptions(name="x", host="0.0.0.0").refuse_open_binding()
    token = tmp_path / "token"
    token.write_text("secret")
    DaemonOptions(host="0.0.0.0", token_file=token).refuse_open_binding()
    DaemonOptions(host="0.0.0.0", insecure=True).refuse_open_binding()
    DaemonOptions(host="127.0.0.2").refuse_open_binding()
    assert DaemonOptions(host="0.0.0.0", insecure=True).argv()[-1] == "--insecure"
    refused = subprocess.run([sys.executable, "-m", "hpipe", "daemon", "--host", "0.0.0.0", "--port",
                              str(free_port())], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "without a token" in refused.stderr


def test_the_data_port_is_the_one_asked_for():
    """--data-port (data_port: in a cluster file) fixes the port activations arrive on."""
    from hpipe.core.cluster import DaemonOptions
    from hpipe.core.errors import HpipeError

    port = free_port()
    served = Served("d", data_port=port)
    try:
        assert served.stage.data.port == port
        assert served.client().call("Status", pb.StatusRequest()).data_port == port
    finally:
        served.stop()
    with pytest.raises(HpipeError, match="both"):
        DaemonOptions(port=port, data_port=port)


def test_data_connections_are_capped(monkeypatch):
    import runtime.wire.data_server as data_server

    monkeypatch.setattr(data_server, "MAX_CONNECTIONS", 2)
    d = Served()
    try:
        host, port = "127.0.0.1", d.stage.data.port
        held = [connect(host, port, None, s, key=KEY) for s in (1, 2)]
        with pytest.raises(LinkError, match="RESOURCE_EXHAUSTED: this daemon already serves 2"):
            connect(host, port, None, 3, key=KEY)
        held.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the daemon counts it gone once its reader sees the close
            try:
                held.append(connect(host, port, None, 4, key=KEY))
                break
            except LinkError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for c in held:
            c.close()
    finally:
        d.stop()


def test_a_port_in_use_is_refused_not_shared():
    from hpipe.core.errors import HpipeError

    a = Served("a")
    try:
        port = int(a.address.rsplit(":", 1)[1])
        with pytest.raises(HpipeError, match=f"cannot bind 127.0.0.1:{port}"):
            Served("b", port=port)
        assert a.client().health()
    finally:
        a.stop()
