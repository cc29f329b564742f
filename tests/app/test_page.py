"""``hpipe serve``'s page in a real browser (headless Chromium): over three daemons, a chat answer
streams in, the cluster view shows the three daemons, the plan and busy fractions that move while
16 requests run, and nothing of the cluster reaches a client without the key."""

import sys
import threading
import time
from dataclasses import replace

import httpx
import pytest

from hpipe.app.serve_backend import Backend
from hpipe.model.weights.sources import resolve_model
from tests.app.browser import chromium, wait_for
from tests.app.serve_helpers import serving, tiny_plan
from tests.cluster_helpers import Served, cluster_of
from tests.helpers import make_tiny_model

KEY = "sk-page-test"
#: a GET from another namespace: prints the status (urllib raises on 4xx: its code is the status)
ASK = """import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], headers={"Authorization": f"Bearer {sys.argv[2]}"} if sys.argv[2] else {})
try:
    print(urllib.request.urlopen(req, timeout=10).status)
except urllib.error.HTTPError as e:
    print(e.code)
"""
LINKS = [{"src": "d0", "dst": "d1", "bandwidth_Bps": 1.25e8, "latency_s": 2e-4},
         {"src": "d1", "dst": "d2", "bandwidth_Bps": 1.25e8, "latency_s": 2e-4}]


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def three(tmp_path_factory, smollm2):
    model = make_tiny_model("llama", tmp_path_factory.mktemp("page-model"), vocab_size=49152, layers=4,
                            tokenizer_from=smollm2.path, context=256)
    source = resolve_model(str(model))
    daemons = [Served(f"d{i}") for i in range(3)]
    plan = tiny_plan(source, daemons, max_len=128, cuts=(2, 4))
    plan = replace(plan, meta={"links": LINKS})
    backend = Backend(plan, cluster_of(*daemons), source, api_key=KEY, model_name="tiny")
    with serving(backend) as base:
        yield base, backend
    for d in daemons:
        d.stop()


def _key_in(driver, base):
    """Open the page afresh (no key kept from a test before) and give it the key."""
    driver.get(base + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(base + "/")
    wait_for(lambda: driver.find_element("id", "key-box").is_displayed(), why="the page asks for the key")
    driver.find_element("id", "key").send_keys(KEY)
    driver.find_element("id", "key-save").click()
    wait_for(lambda: driver.find_element("id", "model").text == "tiny", why="the model's name with the key")


def _ask(driver, text: str, max_tokens: int) -> None:
    """Send ``text`` from the chat with an answer budget of ``max_tokens``."""
    driver.find_element("id", "max_tokens").clear()
    driver.find_element("id", "max_tokens").send_keys(str(max_tokens))
    driver.find_element("id", "prompt").send_keys(text)
    driver.find_element("id", "send").click()


def test_without_the_key_the_page_loads_but_shows_nothing_of_the_cluster(three, browser):
    base, _ = three
    assert httpx.get(f"{base}/").status_code == 200  # the page itself holds no data
    assert httpx.get(f"{base}/page/vendor/uPlot.iife.min.js").status_code == 200
    for path in ("/api/live", "/v1/models"):
        r = httpx.get(f"{base}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/api/live", headers={"Authorization": "Bearer wrong"}).status_code == 401
    browser.get(base + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(base + "/")
    wait_for(lambda: browser.find_element("id", "key-box").is_displayed(), why="the page asks for the key")
    assert browser.find_elements("css selector", ".card.daemon") == []


def test_a_chat_answer_streams_in_with_its_counts(three, browser):
    base, _ = three
    _key_in(browser, base)
    _ask(browser, "Tell me about pipelines.", 40)
    stats = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant .stats[data-done='1']"),
                     why="the answer ends")[0]
    answer = browser.find_element("css selector", ".msg.assistant")
    assert int(answer.get_attribute("data-pieces")) >= 2, "the answer came in one piece, not streamed"
    assert answer.find_element("css selector", ".content").text
    text = stats.text
    assert "prompt " in text and "answer " in text and "first token" in text and "tokens/s" in text, text


def test_stop_ends_an_answer_and_frees_its_kv(three, browser):
    from tests.app.serve_helpers import pools_empty

    base, backend = three
    _key_in(browser, base)
    # other requests beside it, so that the answer takes seconds, not the moment a click takes
    others = [threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",), kwargs=dict(
        headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
        json={"model": "tiny", "prompt": "busy " * 8, "max_tokens": 200, "ignore_eos": True})) for _ in range(8)]
    for t in others:
        t.start()
    _ask(browser, "Go on for a long time.", 180)
    wait_for(lambda: browser.execute_script("return document.querySelector('.msg.assistant')?.dataset.pieces"),
             why="the answer begins")
    browser.find_element("id", "stop").click()
    stats = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant .stats[data-done='1']"),
                     why="the answer stops")[0]
    assert stats.text.endswith("stopped"), stats.text
    for t in others:
        t.join(120)
    assert pools_empty(backend.pipe), "the stopped answer's KV is still held"
    assert browser.find_element("id", "send").is_enabled()


def _read(driver, selector: str, what: str = "e.textContent") -> list[str]:
    """``what`` of every element ``selector`` finds, read in one go in the page (it redraws every second)."""
    return driver.execute_script(f"return [...document.querySelectorAll(arguments[0])].map(e => {what})", selector)


def test_the_cluster_view_shows_three_daemons_the_plan_and_busy_fractions_that_move(three, browser):
    base, _ = three
    _key_in(browser, base)
    browser.find_element("id", "tab-cluster").click()
    wait_for(lambda: len(_read(browser, ".card.daemon")) == 3, why="three daemon cards")
    assert _read(browser, ".card.daemon", "e.dataset.name") == ["d0", "d1", "d2"]
    assert _read(browser, "#plan .stage", "e.dataset.daemon") == ["d0", "d1", "d2"]
    assert "embed" in _read(browser, "#plan .stage")[0]
    assert len(_read(browser, "#links tr.cut")) == 2
    assert _read(browser, "#chart-busy canvas", "e.width")  # uPlot drew it

    answers: list[int] = []

    def ask(i: int) -> None:
        r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"model": "tiny", "prompt": f"request {i} " * 8, "max_tokens": 96, "ignore_eos": True})
        answers.append(r.status_code)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    seen, running = set(), set()
    after = None  # the page polls every second: look on for 2.5 s more once all have answered
    while any(t.is_alive() for t in threads) or (after := after or time.monotonic()) > time.monotonic() - 2.5:
        seen.add(tuple(_read(browser, ".card.daemon .busy", "e.dataset.value")))
        running.update(_read(browser, "#sum-requests .big"))
        threading.Event().wait(0.2)
    for t in threads:
        t.join()
    assert answers == [200] * 16
    values = {float(v) for b in seen for v in b if v}
    assert len(seen) >= 2 and values and max(values) > 0, f"busy fractions seen: {seen}"
    assert any(not r.endswith("· 0") for r in running), f"requests running never shown: {running}"


def test_a_job_shows_its_cluster_on_the_page_without_a_chat(tmp_path, smollm2, browser):
    from hpipe.app.jobs import JobConfig, run_job
    from hpipe.app.page_job import JobWatch, PageServer
    from tests.app.serve_helpers import free_port

    model = make_tiny_model("llama", tmp_path / "model", vocab_size=49152, layers=4, tokenizer_from=smollm2.path,
                            context=256)
    source = resolve_model(str(model))
    daemons = [Served(f"j{i}") for i in range(3)]
    plan = tiny_plan(source, daemons, max_len=128, cuts=(2, 4))
    docs = []
    for i in range(12):
        docs.append(tmp_path / f"doc{i}.md")
        docs[-1].write_text(f"Document {i}. " * 10)
    page = PageServer(JobWatch(plan), free_port())
    page.start()
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(run_job(
        plan, cluster_of(*daemons), source, [str(d) for d in docs], tmp_path / "out.jsonl",
        JobConfig(instruction="Summarize.", max_new_tokens=100, ignore_eos=True, parallel=4),
        on_engine=page.watch.deployed)))
    try:
        job.start()
        browser.get(page.address)
        wait_for(lambda: len(_read(browser, ".card.daemon")) == 3, why="the job's three daemons on its page")
        assert _read(browser, ".card.daemon", "e.dataset.name") == ["j0", "j1", "j2"]
        assert browser.execute_script("return document.getElementById('tab-chat').hidden")
        assert not browser.execute_script("return document.getElementById('view-cluster').hidden")
        assert httpx.get(page.address.rstrip("/") + "/v1/models").status_code == 404  # no chat behind it
        job.join(120)
        assert not job.is_alive() and not result["failed"] and result["documents"] == 12, result
    finally:
        job.join(120)
        page.stop()
        for d in daemons:
            d.stop()


def test_off_loopback_the_live_data_and_the_api_need_the_key(three, tmp_path):
    """The server bound to the emulated network's bridge, asked from another host's namespace."""
    import subprocess

    import uvicorn

    from hpipe.app.openai_api import create_app
    from hpipe.core.cluster import ClusterSpec
    from runtime.cluster import emulate
    from runtime.cluster.emulate import Emulation
    from runtime.cluster.emulate.net import BRIDGE_IP, names
    from runtime.cluster.processes import state_dir
    from tests.app.serve_helpers import free_port
    from tests.cluster_helpers import discard_state

    if emulate.unavailable():
        pytest.skip(emulate.unavailable())
    _, backend = three
    (tmp_path / "viewer.yaml").write_text("name: page-viewer\ndaemons:\n  - name: viewer\n"
                                          "    address: 198.18.0.71:50301\n")
    viewer = ClusterSpec.load(tmp_path / "viewer.yaml")
    emu = Emulation(viewer, state_dir(viewer))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host=BRIDGE_IP, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    try:
        emu.setup_network()
        thread.start()
        wait_for(lambda: server.started, 10, why="the server on the bridge")

        def status(path: str, key: str | None = None) -> str:
            """The status of ``GET path`` asked from the viewer's namespace (Python's own urllib)."""
            return subprocess.run(["ip", "netns", "exec", names(viewer.daemons[0])[0], sys.executable, "-c", ASK,
                                   f"http://{BRIDGE_IP}:{port}{path}", key or ""], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        assert status("/") == "200" and status("/page/app.js") == "200"  # no data in them
        assert status("/api/live") == "401" and status("/v1/models") == "401"
        assert status("/api/live", "wrong") == "401"
        assert status("/api/live", KEY) == "200" and status("/v1/models", KEY) == "200"
    finally:
        server.should_exit = True
        thread.join(10)
        emu.teardown()
        discard_state(viewer)
