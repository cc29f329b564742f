"""``hpipe serve`` over real (in-process) daemons: the official openai client, SSE as curl sees it,
the same greedy answers as single-process generation, and every error status."""

import json
import socket
import time

import httpx
import pytest

from hpipe.app.serve_backend import RETRY_S, Backend
from hpipe.model.generate.local import LocalModel, decode_loop, encode_chat
from hpipe.model.generate.sampling import Sampler
from hpipe.model.weights.sources import resolve_model
from tests.app.serve_helpers import pools_empty, serving, tiny_plan
from tests.cluster_helpers import Served, cluster_of

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    source = resolve_model(str(tiny_chat_model))
    daemons = [Served(f"d{i}") for i in range(2)]
    backend = Backend(tiny_plan(source, daemons), cluster_of(*daemons), source, max_queue=4, api_key=KEY,
                      model_name="tiny")
    with serving(backend) as base:
        yield base, backend, source, backend.pipe, daemons  # (a test may replace a daemon in the list)
    for d in daemons:
        d.stop()


def reference(source, prompt: list[int], n: int) -> list[int]:
    model = LocalModel(source)
    return decode_loop(model.open(len(prompt) + n), prompt, max_new_tokens=n, sampler=Sampler(),
                       eos_ids=source.eos_token_ids(), slices=[len(prompt)])[0]


def test_openai_client_chat_completions_and_models(server):
    from openai import OpenAI

    base, backend, source, *_ = server
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = reference(source, encode_chat(backend.tokenizer, messages), 8)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == backend.decode(want)
    assert reply.usage.completion_tokens == len(want)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == backend.decode(want)
    assert chunks[-1].usage.completion_tokens == len(want)
    # vLLM's top_k: a draw among the likeliest one is the greedy answer, whatever the temperature
    one = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=1.5, seed=5,
                                         extra_body={"top_k": 1})
    assert one.choices[0].message.content == backend.decode(want)
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert text.choices[0].text == backend.decode(reference(source, backend.text_prompt("Once upon a time"), 6))
    with_lp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                             logprobs=True, top_logprobs=2)
    assert len(with_lp.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in with_lp.choices[0].logprobs.content)


def test_a_repeated_prefix_is_read_from_the_cache_and_reported_in_usage(server):
    """Two chats with one long system prompt: the second reads the prompt's shared blocks from the
    prefix cache (usage says how many tokens, as OpenAI's API does), and its answer is unchanged."""
    from openai import OpenAI

    base, backend, source, *_ = server
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    system = {"role": "system", "content": "You read ledgers of a harbour town and answer briefly. " * 3}
    usage = []
    for question in ("Who kept the ledger?", "What was shipped?"):
        messages = [system, {"role": "user", "content": question}]
        want = reference(source, encode_chat(backend.tokenizer, messages), 4)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert reply.choices[0].message.content == backend.decode(want)
        usage.append(reply.usage)
    assert usage[1].prompt_tokens_details.cached_tokens >= 32  # the system prompt's full blocks
    assert usage[1].prompt_tokens_details.cached_tokens > usage[0].prompt_tokens_details.cached_tokens
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "hpipe_prompt_tokens_cached_total" in text and "hpipe_prefix_cache_hits" in text


def test_sse_is_well_formed_and_ends_with_done(server):
    base, *_ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stop_string_cuts_the_answer_and_frees_the_request(server):
    base, backend, source, pipe, _ = server
    messages = [{"role": "user", "content": "Count."}]
    full = backend.decode(reference(source, encode_chat(backend.tokenizer, messages), 12))
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("no printable text to stop at")
    r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, "stop": stop})
    answer = r.json()["choices"][0]
    assert answer["message"]["content"] == full[:full.find(stop)] and answer["finish_reason"] == "stop"
    assert pools_empty(pipe)


def test_a_client_that_disconnects_mid_stream_frees_its_kv_on_every_stage(server):
    base, backend, source, pipe, _ = server
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 80, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        backend.engine._lock.acquire()  # hold the engine while the client goes away mid-answer
    try:
        assert any(p.used_blocks for p in pipe.pools())  # the request holds blocks
    finally:
        backend.engine._lock.release()
    # the connection is gone after one chunk: the request ends and its blocks go back
    assert pools_empty(pipe)
    assert backend.metrics.finished.labels("cancelled")._value.get() >= 1


@pytest.mark.parametrize("case,status,code", [
    ("malformed", 400, None), ("bad key", 401, "invalid_api_key"), ("unknown model", 404, "model_not_found"),
    ("too long", 413, "context_length_exceeded"), ("n > 1", 400, None), ("top_k < -1", 400, None),
    ("speculate on dense weights", 400, None), ("speculate how", 400, None)])
def test_error_statuses(server, case, status, code):
    base, *_ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    if case == "malformed":
        body = {"model": "tiny", "messages": "not a list"}
    elif case == "bad key":
        headers = {"Authorization": "Bearer wrong"}
    elif case == "unknown model":
        body["model"] = "gpt-17"
    elif case == "too long":
        body["messages"][0]["content"] = "word " * 200  # the plan takes 64 tokens
    elif case == "n > 1":
        body["n"] = 2
    elif case == "top_k < -1":
        body["top_k"] = -2
    elif case == "speculate on dense weights":  # the tiny model's float32 rows could change with guesses
        body["speculate"] = "ngram"
    elif case == "speculate how":
        body["speculate"] = "draft"
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == status, r.text
    if case == "speculate on dense weights":
        assert "quantized (GGUF) weights" in r.json()["error"]["message"]
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == code


def test_queue_full_is_429_with_retry_after_and_down_stage_is_503(server, monkeypatch):
    from hpipe.app.serve_metrics import Health

    base, backend, *_ = server
    engine = backend.engine
    with engine._lock:  # hold the engine: everything submitted now waits
        for _ in range(backend.max_queue - len(engine.waiting)):
            engine.waiting.append(engine.waiting[0] if engine.waiting else _parked(engine))
        r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        engine.waiting.clear()
    assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
    monkeypatch.setattr(backend.collector, "collect", lambda: None)  # it would see the daemons answer
    with backend.collector.lock:  # after the round in progress, if any
        backend.collector.health = Health(False, "daemon d1 is not responding")
    assert httpx.get(f"{base}/health").status_code == 503
    r = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    backend.collector.health = Health()


def _parked(engine):
    from runtime.coordinator.engine import Request

    return Request([1, 2, 3], 1)


def test_metrics_are_prometheus(server):
    base, *_ = server
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("hpipe_http_requests_total", "hpipe_time_to_first_token_seconds_bucket", "hpipe_kv_blocks_used",
                 "hpipe_queue_length", "hpipe_generated_tokens_total", "hpipe_speculative_guesses_kept"):
        assert name in text, name


def test_a_stream_survives_a_daemon_restart(server):
    """The last stage's daemon goes away mid-stream and comes back on its port: the engine
    redeploys, the request starts again from its tokens, and the stream goes on to the answer a
    failure-free run gives."""
    base, backend, source, pipe, daemons = server
    messages = [{"role": "user", "content": "Tell a long story."}]
    prompt = encode_chat(backend.tokenizer, messages)
    n = 40
    model = LocalModel(source)
    want = decode_loop(model.open(len(prompt) + n), prompt, max_new_tokens=n, sampler=Sampler(), eos_ids=[],
                       slices=[len(prompt)])[0]
    body = {"model": "tiny", "messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    engine = backend.engine
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if events[-1]["choices"] and events[-1]["choices"][0]["delta"].get("content"):
                    break
        with engine._lock:  # hold the engine between micro-batches while its last stage goes away
            old = daemons[1]
            port = int(old.address.rsplit(":", 1)[1])
            old.stop()
        time.sleep(1.0)  # the engine finds the pipeline broken and waits for the daemon
        daemons[1] = Served("d1", port=port)
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == backend.decode(want)
    assert engine.recoveries == 1
    assert pools_empty(pipe)


def test_a_request_right_after_a_recovery_is_served_though_the_last_health_round_saw_the_daemon_empty(
        server, monkeypatch):
    """The interleaving that refused a request with 503 in CI: a health round sees a restarted
    daemon without the model, the engine redeploys it, and a request comes before the next round.
    What that round saw predates the new session (whose deployment reached every daemon): the
    request is answered, and the idle pipeline is not redeployed again for it."""
    base, backend, source, pipe, daemons = server
    collect = backend.collector.collect
    monkeypatch.setattr(backend.collector, "collect", lambda: None)  # rounds only when this test runs one
    engine = backend.engine
    with backend.collector.lock:  # after the round in progress, if any
        old = daemons[1]
        port = int(old.address.rsplit(":", 1)[1])
        old.stop()
        daemons[1] = Served("d1", port=port)  # back on its port, empty
        before = engine.session
        collect()  # sees d1 without the model; the idle engine is woken to redeploy
    assert backend.collector.health.lost_model
    deadline = time.monotonic() + 60
    while engine.session is before or backend.state != "ok":  # the redeploy the round asked for
        assert time.monotonic() < deadline, backend.state
        time.sleep(0.05)
    recovered = engine.session
    prompt = backend.text_prompt("Hello")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == backend.decode(reference(source, prompt, 3))
    assert engine.session is recovered  # no second redeploy for what the old round saw
    with backend.collector.lock:
        collect()  # a round of the new session: every daemon answers and holds the model
    assert backend.collector.health.ok


def test_the_key_guards_every_route_but_health_and_the_body_is_bounded_before_parsing(server):
    """Issue 64: with a key, /docs, /openapi.json and /metrics need it as the API does (only
    /health does not); a body over the bound is refused before it is read, whether it declares
    its length or comes in chunks; one within it is answered as before."""
    base, backend, *_ = server
    for path in ("/docs", "/openapi.json", "/metrics", "/v1/models"):
        r = httpx.get(f"{base}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{base}/health").status_code in (200, 503)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{base}/openapi.json", headers=auth).status_code == 200
    bound = (1 << 20) + 12 * 64 * backend.plan.max_len
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # declares 10x the bound, sends none
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {10 * bound}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")

    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(bound // (1 << 16) + 2):
            yield b"x" * (1 << 16)
        yield b'"}'
    r = httpx.post(f"{base}/v1/completions", headers={**auth, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{base}/v1/completions", headers=auth, json=body, timeout=60).status_code == 200


def test_a_deploy_that_cannot_succeed_stops_retrying_and_says_so(tiny_chat_model, tmp_path, monkeypatch):
    """A daemon that answers and refuses the plan (here: its model is not in the daemon's allowed
    directories) is a lasting failure: ``hpipe serve`` tries once, stops, and ``/health`` says why
    until it is restarted (issue 64: it retried once a second, forever)."""
    from runtime.coordinator import pipeline

    source = resolve_model(str(tiny_chat_model))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    daemons = [Served(f"d{i}", model_dirs=str(elsewhere)) for i in range(2)]
    loads = []
    real_call = pipeline.DaemonClient.call

    def counted(self, method, *a, **kw):
        loads.append(method) if method == "Load" else None
        return real_call(self, method, *a, **kw)

    monkeypatch.setattr(pipeline.DaemonClient, "call", counted)
    backend = Backend(tiny_plan(source, daemons), cluster_of(*daemons), source, max_queue=4, model_name="tiny")
    try:
        with serving(backend) as base:
            time.sleep(3 * RETRY_S)  # three retry periods
            r = httpx.get(f"{base}/health")
            assert r.status_code == 503 and "not deployed" in r.text and "restart hpipe serve" in r.text, r.text
            assert 1 <= loads.count("Load") <= len(daemons), loads  # one attempt, on each daemon at most
    finally:
        for d in daemons:
            d.stop()
