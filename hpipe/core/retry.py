"""Waiting for something to come true, and trying again what failed: tenacity, in two shapes."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_delay,
    stop_when_event_set,
    wait_fixed,
)

T = TypeVar("T")


def poll(ready: Callable[[], bool], timeout_s: float, every_s: float) -> bool:
    """Whether ``ready()`` came true within ``timeout_s``, asked every ``every_s``. An exception
    ``ready`` raises (the thing waited for is gone for good) ends the wait at once."""
    try:
        return Retrying(stop=stop_after_delay(timeout_s), wait=wait_fixed(every_s),
                        retry=retry_if_result(lambda ok: not ok))(ready)
    except RetryError:
        return False


def until_done(attempt: Callable[[], T], *, again: Callable[[BaseException], bool], stop: threading.Event,
               wait_s: float, failed: Callable[[BaseException], None] | None = None) -> T | None:
    """``attempt()`` until it returns, trying again every ``wait_s`` after an exception that
    ``again(e)`` accepts (``failed(e)`` told of each); None once ``stop`` is set. Any other exception
    is raised."""
    try:
        return Retrying(retry=retry_if_exception(again), stop=stop_when_event_set(stop), wait=wait_fixed(wait_s),
                        sleep=stop.wait, reraise=True,
                        before_sleep=(lambda state: failed(state.outcome.exception())) if failed else None)(attempt)
    except BaseException as e:  # noqa: BLE001 - stopped while failing: the caller asked to stop
        if stop.is_set() and again(e):
            return None
        raise
