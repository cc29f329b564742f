"""The daemon's memory measures: freed heap memory is handed back before a baseline or a peak."""

import threading

import psutil
import pytest
import torch

from runtime.daemon import memory

CPU = torch.device("cpu")


@pytest.mark.skipif(memory._TRIM is None, reason="not glibc: no malloc_trim")
def test_release_free_returns_heap_memory_a_thread_freed():
    # 64 KiB tensors come from the allocating thread's heap arena (below glibc's mmap threshold);
    # keeping the last one alive pins the arena's top, so free() alone cannot shrink the heap
    box = {}

    def allocate():
        chunks = [torch.ones(16 << 10) for _ in range(2400)]  # 2400 x 64 KiB = 150 MiB
        box["last"] = chunks[-1]
        del chunks

    t = threading.Thread(target=allocate)
    t.start()
    t.join()
    held = psutil.Process().memory_info().rss
    after = memory.current(CPU)  # releases first
    assert held - after > 100 << 20, f"only {(held - after) >> 20} MiB handed back"
    assert box["last"].sum().item() == 16 << 10


def test_peak_counts_from_the_reset():
    memory.reset_peak(CPU)
    start = memory.peak(CPU)
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert memory.peak(CPU) - start >= 60 << 20
    del x
