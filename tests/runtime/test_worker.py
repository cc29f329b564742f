"""The daemon's worker: small micro-batches first, a sequence's micro-batches in order, calls as
barriers, and nothing passed over for good."""

from __future__ import annotations

import threading
import time

from runtime.daemon.worker import MAX_PASSED, Worker


class Recorder:
    """A worker whose first micro-batch blocks until released, so the rest queue up behind it."""

    def __init__(self):
        self.order: list[str] = []
        self.gate, self.started, self.done = threading.Event(), threading.Event(), threading.Event()
        self.worker = Worker(self.compute, shape=lambda item: (item[1], frozenset(item[2])))

    def compute(self, name, tokens, seqs):
        if name == "blocker":
            self.started.set()
            self.gate.wait(10)
        self.order.append(name)
        if name == "last":
            self.done.set()

    def put(self, name, tokens, *seqs):
        self.worker.put((name, tokens, seqs))
        if name == "blocker":
            assert self.started.wait(10)  # being computed: what comes next queues behind it

    def run(self) -> list[str]:
        self.put("last", 10_000, 999)
        self.gate.set()
        assert self.done.wait(10)
        self.worker.stop()
        return self.order


def test_the_fewest_tokens_run_first_when_they_share_no_sequence():
    r = Recorder()
    r.put("blocker", 500, 1)
    r.put("chunk-a", 500, 2)
    r.put("chunk-b", 480, 3)
    r.put("question", 30, 4, 5)
    r.put("decode", 16, 6)
    assert r.run() == ["blocker", "decode", "question", "chunk-b", "chunk-a", "last"]


def test_a_sequence_is_computed_in_order():
    r = Recorder()
    r.put("blocker", 500, 1)
    r.put("slice-1", 500, 2)
    r.put("slice-2", 20, 2)  # the same sequence's later positions: after slice-1, however small
    r.put("other", 40, 3)
    assert r.run() == ["blocker", "other", "slice-1", "slice-2", "last"]


def test_a_call_runs_after_what_was_queued_before_it_and_before_what_came_after():
    r = Recorder()
    r.put("blocker", 500, 1)
    r.put("chunk", 500, 2)
    called = threading.Thread(target=lambda: r.worker.call(lambda: r.order.append("call"), timeout_s=10))
    called.start()
    while not r.worker._queue or len(r.worker._queue) < 2:  # the call is queued behind the chunk
        time.sleep(0.001)
    r.put("small", 10, 3)
    r.gate.set()
    called.join(10)
    assert r.run() == ["blocker", "chunk", "call", "small", "last"]


def test_a_micro_batch_passed_over_often_enough_runs_next():
    r = Recorder()
    r.put("blocker", 500, 1)
    r.put("big", 500, 2)
    for i in range(MAX_PASSED + 3):
        r.put(f"small-{i}", 10, 100 + i)
    order = r.run()
    assert order.index("big") == 1 + MAX_PASSED  # after MAX_PASSED smaller ones went first
