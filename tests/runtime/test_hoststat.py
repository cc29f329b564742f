"""Reading the hypervisor's steal from /proc/stat."""

import os
import sys

import pytest

from runtime.daemon.hoststat import steal_seconds

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
