"""This machine's CPU as Linux describes it (``/proc/cpuinfo``: psutil does not give its model or
vendor), read once; the fallbacks of :mod:`platform` elsewhere."""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=None)
def _field(name: str) -> str:
    """The first ``name : value`` line's value in ``/proc/cpuinfo`` ("" when absent or unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def model_name() -> str:
    """The CPU's model ("AMD EPYC 9B14"), for people to read and for profile fingerprints."""
    return _field("model name") or platform.processor() or platform.machine()


def vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``; "" when unknown)."""
    return _field("vendor_id") or ("GenuineIntel" if "intel" in platform.processor().lower() else "")
