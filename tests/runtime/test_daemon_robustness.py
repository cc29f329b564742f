"""Bad messages sent straight to a daemon get a clear gRPC status, and the daemon keeps serving."""

import shutil
import subprocess
import time

import grpc
import pytest
import torch

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from runtime.channels import DaemonClient, Security
from runtime.coordinator import Pipeline, cut_stages
from runtime.wire import pb, tensor_bytes
from tests.cluster_helpers import Served


@pytest.fixture
def daemon():
    d = Served(memory_budget=2 * 2**20)  # tiny model: ~0.5 MiB of weights
    yield d
    d.stop()


def code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def load(client, model, start, end, dtype=pb.FLOAT32, num_units=8):
    """Hold units [start, end) of a pipeline whose other stages (if any) are on an unused address."""
    bounds = sorted({0, start, end, num_units})
    stages = [pb.Stage(unit_start=a, unit_end=b, daemon=f"d{i}", address="127.0.0.1:1")
              for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    held = [i for i, st in enumerate(stages) if st.unit_start == start]
    return client.call("Load", pb.LoadRequest(model=str(model), dtype=dtype, stages=stages, held=held))


def test_bad_messages_then_good_request(daemon, tiny_dirs):
    c = daemon.client()
    model = tiny_dirs["llama"]
    code, msg = code_of(lambda: c.call("Submit", pb.Slice(sequence_id=1, length=1, payload=b"x")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no model is loaded" in msg
    assert code_of(lambda: load(c, "no-such-model", 0, 8))[0] == grpc.StatusCode.FAILED_PRECONDITION
    code, msg = code_of(lambda: load(c, model, 0, 99))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the model's units [0, 8)" in msg
    code, msg = code_of(lambda: c.call("Load", pb.LoadRequest(model=str(model), dtype=pb.FLOAT32, stages=[
        pb.Stage(unit_start=0, unit_end=4, address="127.0.0.1:1"),
        pb.Stage(unit_start=3, unit_end=8, address="127.0.0.1:1")], held=[0, 1])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "do not cover the model's units" in msg
    assert code_of(lambda: c.call("Load", pb.LoadRequest(model=str(model), dtype=pb.FLOAT32)))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT

    info = load(c, model, 3, 8)  # no embedding: takes the residual stream [1, s, 64] float32
    assert info.hidden_size == 64 and info.parameters > 0
    c.call("Open", pb.OpenRequest(sequence_id=7, batch=1, max_len=16))
    good = tensor_bytes(torch.randn(1, 4, 64))

    def submit(**kw):
        args = dict(sequence_id=7, stage=1, start=0, length=4, payload=good)
        args.update(kw)
        return c.call("Submit", pb.Slice(**args))

    cases = {
        "truncated": (dict(payload=good[:-3]), grpc.StatusCode.INVALID_ARGUMENT, "payload has"),
        "wrong dtype": (dict(payload=tensor_bytes(torch.randn(1, 4, 64).bfloat16())),
                        grpc.StatusCode.INVALID_ARGUMENT, "float32 needs"),
        "wrong shape": (dict(length=3), grpc.StatusCode.INVALID_ARGUMENT, "[1, 3, 64]"),
        "unknown sequence": (dict(sequence_id=999), grpc.StatusCode.NOT_FOUND, "unknown sequence 999"),
        "beyond max length": (dict(start=0, length=17, payload=tensor_bytes(torch.randn(1, 17, 64))),
                              grpc.StatusCode.OUT_OF_RANGE, "declared max length 16"),
        "gap in positions": (dict(start=2), grpc.StatusCode.FAILED_PRECONDITION, "continues at 0"),
        "units not held": (dict(stage=0), grpc.StatusCode.FAILED_PRECONDITION, "holds units [3, 8)"),
        "empty slice": (dict(length=0, payload=b""), grpc.StatusCode.INVALID_ARGUMENT, "length must be >= 1"),
    }
    for name, (kw, want_code, want_msg) in cases.items():
        code, msg = code_of(lambda: submit(**kw))
        assert code == want_code and want_msg in msg, (name, code, msg)

    code, msg = code_of(lambda: c.call("Open", pb.OpenRequest(sequence_id=8, batch=64, max_len=96)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in msg
    assert code_of(lambda: c.call("Open", pb.OpenRequest(sequence_id=7, batch=1, max_len=4)))[0] == \
        grpc.StatusCode.ALREADY_EXISTS

    # still serving: a good slice computes and its logits come back on the results stream
    submit(want_logits=True)
    stream = c.results(7)
    first = next(stream)
    assert first.start == 0 and first.length == 4 and list(first.logits.shape) == [1, 384]
    closed = c.call("Close", pb.SequenceRequest(sequence_id=7))
    assert closed.existed and closed.stats[0].slices == 1 and closed.stats[0].stage == 1
    assert c.call("Status", pb.StatusRequest()).kv_bytes == 0


def test_token_ids_out_of_range_and_results_on_middle_stage(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 3)
    c.call("Open", pb.OpenRequest(sequence_id=1, batch=1, max_len=8))
    code, msg = code_of(lambda: c.call("Submit", pb.Slice(sequence_id=1, stage=0, start=0, length=1,
                                                           payload=tensor_bytes(torch.tensor([[5000]])))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token ids must lie" in msg
    code, msg = code_of(lambda: next(c.results(1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not the head" in msg


def test_idle_sequence_is_freed(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    c.call("Open", pb.OpenRequest(sequence_id=3, batch=1, max_len=32, idle_timeout_s=0.5))
    assert c.call("Status", pb.StatusRequest(sequence_ids=[3])).sequences[0].open
    deadline = time.monotonic() + 5
    while c.call("Status", pb.StatusRequest(sequence_ids=[3])).sequences[0].open:
        assert time.monotonic() < deadline, "idle sequence was not freed"
        time.sleep(0.1)
    assert c.call("Status", pb.StatusRequest()).kv_bytes == 0


def test_token_required(tiny_dirs):
    d = Served(token="s3cret")
    try:
        code, _ = code_of(lambda: d.client().call("Status", pb.StatusRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: d.client(Security(token="wrong")).call("Status", pb.StatusRequest()))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
        assert not d.client().health()
        good = d.client(Security(token="s3cret"))
        assert good.health() and not good.call("Status", pb.StatusRequest()).loaded
    finally:
        d.stop()


def _two_stage_pipeline(tiny_dirs, security, **kw):
    a, b = Served(**kw), Served(**kw)
    spec = ClusterSpec("t", (DaemonSpec.at("a", a.address), DaemonSpec.at("b", b.address)))
    pipe = Pipeline(spec, security)
    pipe.deploy(str(tiny_dirs["llama"]), cut_stages(spec, [3], 8), torch.float32)
    return a, b, pipe


def _greedy(pipe, n=6):
    from hpipe.model.generate import decode_loop
    from hpipe.model.sampling import Sampler
    from runtime.coordinator import RemoteRunner

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
    from runtime.daemon import bind_warning

    assert bind_warning("127.0.0.1") is None and bind_warning("localhost") is None
    assert "trusted network" in bind_warning("0.0.0.0")
