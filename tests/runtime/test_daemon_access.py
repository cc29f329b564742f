"""Who may reach a daemon: the token on both planes, TLS, binding beyond loopback, the ports asked
for, and the cap on data connections."""

import shutil
import subprocess
import time

import grpc
import pytest
import torch

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import MAX_MESSAGE_BYTES, pb, pb_grpc
from runtime.wire.transport import LinkError, connect
from tests.app.serve_helpers import free_port
from tests.cluster_helpers import Served
from tests.runtime.test_daemon_robustness import KEY, code_of


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
        # a message larger than a daemon takes, without the token: refused for the token, unread
        with grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]) as ch:
            profile = pb_grpc.ProfilerServiceStub(ch).ProfileCompute
            huge = pb.ProfileRequest(config_json="x" * (MAX_MESSAGE_BYTES + 1))
            with pytest.raises(grpc.RpcError) as refused:
                profile(huge, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
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
            odd = [f.result() for f in flood if f.result()[0] != grpc.StatusCode.UNAUTHENTICATED]
            assert not odd, odd[:3]
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
