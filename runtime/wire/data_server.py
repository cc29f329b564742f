"""Accepting data connections: a connection costs a thread only once its Hello has been checked.

Design note. One thread (``data-accept``) accepts every data connection, runs its TLS handshake and
reads its :class:`pb.Hello` with a selector, for all connections not yet checked at once. Before the
check a connection is a socket and at most :data:`MAX_HELLO_BYTES` of buffer; at most
:data:`MAX_PENDING` of them wait at a time (the next is closed at once) and each has
:data:`HELLO_TIMEOUT_S` to finish. So a flood of connections that never authenticate costs the
daemon sockets, not threads or memory. A wrong token's refusal is delayed
(:mod:`runtime.wire.backoff`) without holding up the others. A connection with the right token is
then admitted (``admit``: the session's key, :mod:`runtime.daemon.owners`) and, within
:data:`MAX_CONNECTIONS`, handed to ``serve(conn, session)`` on a thread of its own.
"""

from __future__ import annotations

import heapq
import hmac
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Callable

from hpipe.core.errors import HpipeError
from runtime.wire.backoff import TokenBackoff
from runtime.wire.messages import pb
from runtime.wire.transport import LENGTH, Connection

log = logging.getLogger(__name__)

#: the largest Hello a connection may announce (a token, a session and its key fit in far less)
MAX_HELLO_BYTES = 4096
#: connections whose Hello is not yet checked; the next one is closed at once
MAX_PENDING = 1024
HELLO_TIMEOUT_S = 10.0
#: data connections a daemon serves at once (each has a thread): the next is refused, not queued
MAX_CONNECTIONS = 256
REPLY_TIMEOUT_S = 5.0

#: (session, key, peer) -> "" when the connection may act for the session, else why not
Admit = Callable[[int, bytes, str], str]


class _Pending:
    """A connection whose Hello is being read."""

    __slots__ = ("sock", "peer", "deadline", "buf", "need", "shaken")

    def __init__(self, sock, peer: str, deadline: float, shaken: bool):
        self.sock, self.peer, self.deadline, self.shaken = sock, peer, deadline, shaken
        self.buf, self.need = bytearray(), LENGTH.size


class DataServer:
    """Accepts data connections, checks each one's token (and ``admit``'s say on its session), and
    hands it to ``serve(conn, session, key)`` on a thread of its own."""

    def __init__(self, host: str, token: str | None, serve: Callable[[Connection, int, bytes], None],
                 tls: ssl.SSLContext | None = None, port: int = 0, admit: Admit | None = None):
        self._token, self._serve, self._tls = (token or "").encode(), serve, tls
        self._admit = admit or (lambda session, key, peer: "")
        self._backoff = TokenBackoff()
        self._open = 0  # connections being served
        self._count_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise HpipeError(f"cannot bind the data port {port or '(any)'} on {host}: {e}") from None
        self._sock.listen(256)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._pending: dict[socket.socket, _Pending] = {}
        self._refusals: list[tuple[float, int, socket.socket, str]] = []  # (when, tie-break, sock, why)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="data-accept", daemon=True)
        self._thread.start()

    # --- the acceptor thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(self._wait_s()):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, _Pending):
                        self._advance(key.data)
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline < now]:
                    log.debug("data connection from %s sent no Hello in %.0f s", p.peer, HELLO_TIMEOUT_S)
                    self._drop(p)
                while self._refusals and self._refusals[0][0] <= now:
                    _, _, sock, why = heapq.heappop(self._refusals)
                    self._reply(sock, why)
                    sock.close()
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
            for _, _, sock, _ in self._refusals:
                sock.close()
            self._selector.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    def _wait_s(self) -> float:
        now = time.monotonic()
        soonest = min((p.deadline for p in self._pending.values()), default=now + 1.0)
        if self._refusals:
            soonest = min(soonest, self._refusals[0][0])
        return min(max(soonest - now, 0.0), 1.0)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the pending ones expire, then it goes on
                log.warning("accepting a data connection failed: %s", e)
                return
            if len(self._pending) + len(self._refusals) >= MAX_PENDING:
                sock.close()  # a flood: nothing is spent on it
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._tls is not None:
                    sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ssl.SSLError):
                sock.close()
                continue
            p = _Pending(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + HELLO_TIMEOUT_S, self._tls is None)
            self._pending[sock] = p
            self._selector.register(sock, selectors.EVENT_READ, p)

    def _advance(self, p: _Pending) -> None:
        """Go on with ``p``'s TLS handshake and Hello as far as its bytes allow."""
        try:
            if not p.shaken:
                p.sock.do_handshake()
                p.shaken = True
            while len(p.buf) < p.need:
                chunk = p.sock.recv(p.need - len(p.buf))
                if not chunk:
                    self._drop(p)
                    return
                p.buf += chunk
                if p.need == LENGTH.size and len(p.buf) == LENGTH.size:
                    (n,) = LENGTH.unpack(p.buf)
                    if n > MAX_HELLO_BYTES:
                        log.debug("refused a data connection from %s: a Hello of %d bytes", p.peer, n)
                        self._drop(p)
                        return
                    p.need += n
        except ssl.SSLWantWriteError:
            self._selector.modify(p.sock, selectors.EVENT_WRITE, p)
            return
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._selector.modify(p.sock, selectors.EVENT_READ, p)
            return
        except (OSError, ssl.SSLError) as e:
            log.debug("data handshake with %s failed: %s", p.peer, e)
            self._drop(p)
            return
        self._selector.unregister(p.sock)
        del self._pending[p.sock]
        hello = pb.Hello()
        try:
            hello.ParseFromString(bytes(p.buf[LENGTH.size:]))
        except Exception:  # noqa: BLE001 - protobuf raises its own DecodeError
            log.debug("refused a data connection from %s: a Hello that does not parse", p.peer)
            p.sock.close()
            return
        self._decide(p, hello)

    def _decide(self, p: _Pending, hello: pb.Hello) -> None:
        host = p.peer.rsplit(":", 1)[0]
        if not hmac.compare_digest(hello.token.encode(), self._token):
            log.warning("refused a data connection from %s: missing or wrong token", p.peer)
            delay = self._backoff.delay(host)  # guessing gets slow (runtime.wire.backoff)
            heapq.heappush(self._refusals, (time.monotonic() + delay, id(p.sock), p.sock, "missing or wrong token"))
            return
        self._backoff.accepted(host)
        with self._count_lock:
            full = self._open >= MAX_CONNECTIONS
            if not full:
                self._open += 1
        error = ""
        if full:
            error = f"RESOURCE_EXHAUSTED: this daemon already serves {MAX_CONNECTIONS} data connections"
            log.warning("refused a data connection from %s: %s", p.peer, error)
        elif hello.session and (error := self._admit(hello.session, hello.key, p.peer)):
            with self._count_lock:
                self._open -= 1
        if error:
            self._reply(p.sock, error)
            p.sock.close()
            return
        self._reply(p.sock, "")  # if it cannot be sent, the connection's first read fails and cleans up
        p.sock.settimeout(None)
        threading.Thread(target=self._run, args=(Connection(p.sock, p.peer), hello.session, hello.key),
                         name="data-conn", daemon=True).start()

    def _run(self, conn: Connection, session: int, key: bytes) -> None:
        try:
            self._serve(conn, session, key)
        finally:
            conn.close()
            with self._count_lock:
                self._open -= 1

    @staticmethod
    def _reply(sock, error: str) -> bool:
        body = pb.HelloReply(error=error).SerializeToString()
        try:
            sock.settimeout(REPLY_TIMEOUT_S)
            sock.sendall(LENGTH.pack(len(body)) + body)
            return True
        except (OSError, ssl.SSLError):
            return False

    def _drop(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._selector.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
