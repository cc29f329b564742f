"""Who owns which session on a daemon: the key its coordinator sent in the session's first Hello.

The cluster's token lets a caller in; a session's key lets it touch only that session. A
coordinator makes a random key for each session it opens (:mod:`runtime.coordinator.session`) and
sends it in the Hello of each of the session's data connections. The first Hello that names a
session on a daemon makes its key the session's; a later Hello, a control RPC (``EndSession``,
``Resume``) or an activation between daemons that names the session with another key is refused,
and the refusal is logged. So a caller with the token cannot take over another session's result
stream, free its sequences, adopt them, or feed its stages data. A session is forgotten when its
last data connection closes (its sequences are freed then too).
"""

from __future__ import annotations

import hmac
import logging
import threading

log = logging.getLogger(__name__)

#: the shortest key a session may have: too long to guess
MIN_KEY_BYTES = 16


class SessionOwners:
    def __init__(self):
        self._keys: dict[int, tuple[bytes, int]] = {}  # session -> (its key, its open data connections)
        self._lock = threading.Lock()

    def claim(self, session: int, key: bytes, peer: str) -> str:
        """A data connection of ``session`` from ``peer``, with ``key``: "" when it may act for the
        session (the first one makes ``key`` the session's), else why not."""
        if len(key) < MIN_KEY_BYTES:
            return self._refused(peer, f"session {session} came without a key of {MIN_KEY_BYTES} bytes or more")
        with self._lock:
            held = self._keys.get(session)
            if held is not None and not hmac.compare_digest(held[0], key):
                error = f"session {session} belongs to another connection"
            else:
                self._keys[session] = (key, (held[1] if held else 0) + 1)
                return ""
        return self._refused(peer, error)

    def release(self, session: int) -> None:
        """One of ``session``'s data connections closed; the last one forgets the session."""
        with self._lock:
            held = self._keys.get(session)
            if held is None:
                return
            if held[1] <= 1:
                del self._keys[session]
            else:
                self._keys[session] = (held[0], held[1] - 1)

    def owns(self, session: int, key: bytes) -> bool:
        """Whether ``key`` is ``session``'s (False for a session this daemon does not know)."""
        with self._lock:
            held = self._keys.get(session)
        return held is not None and hmac.compare_digest(held[0], key)

    def known(self, session: int) -> bool:
        with self._lock:
            return session in self._keys

    def check(self, session: int, key: bytes, what: str, peer: str) -> str:
        """"" when ``key`` owns ``session``, else a logged refusal of ``what``."""
        if self.owns(session, key):
            return ""
        return self._refused(peer, f"{what} names session {session} without its key")

    @staticmethod
    def _refused(peer: str, why: str) -> str:
        log.warning("refused %s: %s", peer, why)
        return f"PERMISSION_DENIED: {why}"
