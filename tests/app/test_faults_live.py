"""Jobs and the server on real daemon processes that are killed, stopped and restarted (``hpipe
cluster up``'s supervisor brings a killed one back): every phase recovers, and answers equal
single-process generation; a server whose daemon stalls past the grace heals without a restart;
SIGTERM drains within its deadline."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hpipe.app.jobs import JobConfig, answer_budget, prompt_limit, run_job
from hpipe.app.serve_backend import Backend
from hpipe.model.generate.local import LocalModel, encode_prompt, generate_ids
from hpipe.model.weights.sources import resolve_model
from tests.app.serve_helpers import await_served, free_port, serving, tiny_plan
from tests.cluster_helpers import RunningCluster, Served, cluster_of, daemon_pid, write_cluster
from tests.helpers import make_tiny_model

INSTRUCTION = "Summarize."
NEW_TOKENS = 300


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's tokenizer and a context long enough to decode for seconds."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("long-tiny"), vocab_size=49152, layers=2,
                           tokenizer_from=smollm2.path, context=4096)
    return resolve_model(str(path))


@pytest.fixture(scope="module")
def live(tmp_path_factory, long_model):
    with RunningCluster(write_cluster(tmp_path_factory.mktemp("live"), 3)) as cluster:
        plan = tiny_plan(long_model, cluster.spec.daemons, max_len=512, cuts=(2, 4))
        yield cluster, plan


def documents(folder, n: int) -> list[str]:
    docs = []
    for i in range(n):
        p = folder / f"doc{i}.md"
        p.write_text(f"Report {i}. " + "The cat sat on the mat and looked at the door. " * (3 + 2 * i))
        docs.append(str(p))
    return docs


def reference(source, prompt: list[int], n: int) -> list[int]:
    return generate_ids(LocalModel(source).open, source.tokenizer(), prompt, context=source.config.max_position_embeddings,
                        eos_ids=(), max_new_tokens=n).token_ids


def check_answers(source, out, docs) -> None:
    rows = {r["document"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == sorted(docs) and not [r for r in rows.values() if "error" in r], rows
    tok = source.tokenizer()
    for name, row in rows.items():
        ids = encode_prompt(tok, f"{open(name).read()}\n\n{INSTRUCTION}", False)
        assert row["token_ids"] == reference(source, ids, NEW_TOKENS), name


def test_a_daemon_killed_while_a_job_deploys_or_decodes_loses_no_document(live, long_model, tmp_path):
    cluster, plan = live
    docs = documents(tmp_path, 6)
    job = JobConfig(instruction=INSTRUCTION, max_new_tokens=NEW_TOKENS, ignore_eos=True, parallel=2)
    # deploying: the middle daemon is killed as the job starts; its supervisor brings it back
    os.kill(daemon_pid(cluster, "s1"), signal.SIGKILL)
    out = tmp_path / "deploy.jsonl"
    summary = run_job(plan, cluster.spec, long_model, docs, out, job)
    assert summary["documents"] == 6 and not summary["failed"], summary
    check_answers(long_model, out, docs)
    # decoding: killed once the first answer is written, with the others mid-answer
    out = tmp_path / "decode.jsonl"
    result = {}
    runner = threading.Thread(target=lambda: result.update(run_job(plan, cluster.spec, long_model, docs, out, job)))
    runner.start()
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") >= 1):
        assert runner.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    victim = daemon_pid(cluster, "s1")
    os.kill(victim, signal.SIGKILL)
    runner.join(300)
    assert not runner.is_alive() and result["documents"] == 6 and not result["failed"], result
    assert result["recoveries"] and daemon_pid(cluster, "s1") != victim
    check_answers(long_model, out, docs)


def test_a_stall_past_the_grace_fails_the_stream_and_then_heals(live, long_model):
    cluster, plan = live
    backend = Backend(plan, cluster.spec, long_model, model_name="tiny", grace_s=3.0)
    with serving(backend) as base:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        events, stopped_at = [], []

        def stream():
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    events.append((time.monotonic(), line))
                    if len(events) == 3:  # tokens flow: stop the middle daemon
                        stopped_at.append(time.monotonic())
                        os.kill(daemon_pid(cluster, "s1"), signal.SIGSTOP)
        reader = threading.Thread(target=stream)
        reader.start()
        try:
            reader.join(60)
            assert not reader.is_alive() and stopped_at, "the stream neither ended nor errored"
            errors = [t for t, line in events if line.startswith("data: {\"error\"")]
            assert errors and errors[0] - stopped_at[0] < 40, events[-3:]
            assert httpx.get(f"{base}/health").status_code == 503  # still stopped: said truthfully
            time.sleep(4.0)  # longer than the grace again: the server keeps trying
        finally:
            os.kill(daemon_pid(cluster, "s1"), signal.SIGCONT)
        resumed = time.monotonic()
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() - resumed < 10, httpx.get(f"{base}/health").text
            time.sleep(0.1)
        r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_sigterm_drains_within_its_deadline(live, long_model, tmp_path):
    cluster, plan = live
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", "--plan", str(plan_file), "--cluster",
                               str(cluster.path), "--port", str(port), "--served-model-name", "tiny", "--drain", "2"],
                              stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        await_served(base, server, 60)
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # a stream is running
            server.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            code = server.wait(timeout=30)
        assert code == 0 and time.monotonic() - t0 < 2 + 8, (code, server.stderr.read())
    finally:
        if server.poll() is None:
            server.kill()


def test_a_prompt_that_leaves_no_room_is_refused_and_a_cut_budget_is_reported(tiny_chat_model, tmp_path):
    source = resolve_model(str(tiny_chat_model))
    context = source.config.max_position_embeddings
    daemons = [Served(f"d{i}") for i in range(2)]
    try:
        plan = tiny_plan(source, daemons, max_len=context)
        assert prompt_limit(plan) == context - 1 and answer_budget(20, context - 5, context) == 5
        tok = source.tokenizer()
        def doc_of(tokens: int):  # a document whose prompt has exactly this many tokens
            for n in range(1, 200):
                text = "word " * n
                if len(encode_prompt(tok, f"{text}\n\n{INSTRUCTION}", False)) == tokens:
                    return text
            pytest.skip(f"no document of exactly {tokens} prompt tokens")
        full, short = tmp_path / "full.md", tmp_path / "short.md"
        full.write_text(doc_of(context))
        short.write_text(doc_of(context - 5))
        out = tmp_path / "out.jsonl"
        summary = run_job(plan, cluster_of(*daemons), source, [str(full), str(short)], out,
                          JobConfig(instruction=INSTRUCTION, max_new_tokens=20, ignore_eos=True, long="refuse"))
        assert "room in the model's context for the answer" in summary["failed"][str(full)]
        row = [json.loads(line) for line in out.read_text().splitlines() if "short" in line][0]
        assert row["max_new_tokens"] == 5 and row["answer_tokens"] == 5
    finally:
        for d in daemons:
            d.stop()
