"""Slowing down token guessing: a peer that sends a wrong token waits before it hears so.

After each wrong token from a host, its next refusal waits twice as long, from
:data:`FIRST_DELAY_S` up to :data:`MAX_DELAY_S`; a right token from it starts over. A guesser gets
about one try a second per connection instead of thousands, while a daemon started with the wrong
token file still hears why within a second. Both planes use it: the gRPC token check and the data
plane's hello.
"""

from __future__ import annotations

import threading
import time

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0
#: hosts remembered at most (beyond it, the table starts over: a flood of addresses gains nothing)
MAX_HOSTS = 4096


class TokenBackoff:
    def __init__(self, first_s: float = FIRST_DELAY_S, max_s: float = MAX_DELAY_S):
        self.first_s, self.max_s = first_s, max_s
        self._delay: dict[str, float] = {}
        self._lock = threading.Lock()

    def refused(self, host: str) -> float:
        """Wait as long as ``host``'s wrong tokens so far call for; returns the seconds waited."""
        delay = self.delay(host)
        time.sleep(delay)
        return delay

    def delay(self, host: str) -> float:
        """Count a wrong token from ``host``; how long its refusal should wait (for a caller that
        waits without blocking a thread: the data plane's acceptor)."""
        with self._lock:
            if len(self._delay) >= MAX_HOSTS:
                self._delay.clear()
            delay = self._delay.get(host, 0.0)
            self._delay[host] = min(self.max_s, max(self.first_s, 2 * delay))
        return delay

    def accepted(self, host: str) -> None:
        if host in self._delay:
            with self._lock:
                self._delay.pop(host, None)


def grpc_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``), port dropped."""
    kind, _, rest = peer.partition(":")
    return rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else peer
