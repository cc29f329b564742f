"""Reading the hypervisor's steal from /proc/stat, and a worker thread's CPU clock."""

import os
import sys
import threading

import pytest

from runtime.daemon.hoststat import host_cpu_seconds, steal_seconds, thread_clock

HZ = os.sysconf("SC_CLK_TCK")
STAT = """cpu  2894300 0 346040 4989651 13983 0 48407 350 0 0
cpu0 1140016 0 139620 2756649 3355 0 16228 100 0 0
cpu1 1754284 0 206420 2233001 10627 0 32178 250 0 0
intr 123 4 5
ctxt 99
"""


def test_steal_is_summed_over_the_cpus_asked_for_not_the_total_line():
    assert steal_seconds([0], STAT) == pytest.approx(100 / HZ)
    assert steal_seconds([1], STAT) == pytest.approx(250 / HZ)
    assert steal_seconds([0, 1], STAT) == pytest.approx(350 / HZ)


def test_unknown_steal_is_none_not_zero():
    assert steal_seconds([5], STAT) is None  # no such CPU
    old_kernel = "cpu  1 2 3 4\ncpu0 1 2 3 4\n"  # no steal column
    assert steal_seconds([0], old_kernel) is None


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

