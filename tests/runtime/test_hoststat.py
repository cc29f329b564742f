"""Reading the hypervisor's steal (psutil's per-CPU times), and a worker thread's CPU clock."""

import os
import sys
import threading
from collections import namedtuple

import pytest

from runtime.daemon.hoststat import host_cpu_seconds, steal_seconds, thread_clock


def _times(*steal):
    """psutil's per-CPU times with these steal seconds (None: a kernel that does not count it)."""
    fields = ("user", "system", "idle") + (("steal",) if steal and steal[0] is not None else ())
    row = namedtuple("scputimes", fields)
    return [row(1.0, 1.0, 1.0, *(() if s is None else (s,))) for s in steal]


def test_steal_is_summed_over_the_cpus_asked_for():
    times = _times(1.0, 2.5)
    assert steal_seconds([0], times) == pytest.approx(1.0)
    assert steal_seconds([1], times) == pytest.approx(2.5)
    assert steal_seconds([0, 1], times) == pytest.approx(3.5)


def test_unknown_steal_is_none_not_zero():
    assert steal_seconds([5], _times(1.0, 2.5)) is None  # no such CPU
    assert steal_seconds([0], _times(None)) is None  # no steal counted


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_machine_reports_its_steal_on_the_cpus_it_may_use():
    mine = steal_seconds()
    assert mine is not None and mine >= 0
    assert steal_seconds(range(os.cpu_count())) >= mine


def test_host_cpu_outside_a_worker_is_read_safely_after_the_worker_ends():
    """A daemon answers Status while it stops: the worker's clock, taken while it ran, is read after
    the thread has ended and been joined (asking for the clock of an ended thread crashed one)."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (sum(i * i for i in range(200_000)), done.wait(5)))
    worker.start()
    clock = thread_clock(worker)
    assert host_cpu_seconds(clock) >= 0.0
    done.set()
    worker.join()
    for _ in range(50):  # its stack and descriptor are gone; the kernel refuses the clock
        threading.Thread(target=lambda: None).start()
        assert host_cpu_seconds(clock) >= 0.0
    assert host_cpu_seconds(None) > 0.0

