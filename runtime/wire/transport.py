"""The data plane: micro-batches over one persistent TCP connection per link, as raw bytes.

Design note. Python gRPC moved large activations at about 430 MB/s (170 MB/s under load) and
held the GIL while it copied them, stalling the worker that shares the process. Here a message is
a 4-byte length, a :class:`pb.Frame` header (the proto is the format's one source), then the
payload's raw bytes: the sender hands the socket a view of the tensor's memory (``sendall``
releases the GIL while the kernel copies), and the receiver reads straight into the tensor it
will compute on (``recv_into``). So the only copies are the kernel's.

A connection starts with a :class:`pb.Hello` carrying the cluster's token (and a coordinator's
session with its key), checked before any other byte is read and before the connection costs a
thread (:mod:`runtime.wire.data_server`); the reply says why a connection is refused. With TLS
configured, the same certificates as the gRPC services protect it.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
from pathlib import Path

import torch

from hpipe.core.errors import HpipeError
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

#: the length before each message
LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 4 << 20
#: the largest payload a frame may declare: a 32k-token slice of a 4096-wide model in fp32 is 512 MiB
MAX_PAYLOAD_BYTES = 1 << 30
CONNECT_TIMEOUT_S = 10.0


class LinkError(HpipeError):
    """A data connection failed: refused, broken, or sent something malformed."""


def _recv_exactly(sock, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except OSError as e:  # reset, or closed under a reader by our own side
            raise LinkError(f"the connection broke: {e}") from None
        if n == 0:
            raise LinkError("the connection closed")
        got += n


def read_header(sock, message):
    """Read one length-prefixed proto ``message`` (of the given class) from ``sock``."""
    head = bytearray(LENGTH.size)
    _recv_exactly(sock, memoryview(head))
    (n,) = LENGTH.unpack(head)
    if n > MAX_HEADER_BYTES:
        raise LinkError(f"a frame header of {n} bytes (the limit is {MAX_HEADER_BYTES})")
    body = bytearray(n)
    _recv_exactly(sock, memoryview(body))
    msg = message()
    try:
        msg.ParseFromString(bytes(body))
    except Exception:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise LinkError("a frame header that does not parse") from None
    return msg


def read_payload(sock, nbytes: int, pin: bool = False) -> torch.Tensor:
    """Read ``nbytes`` raw bytes into a new uint8 tensor (pinned for a GPU's upload if asked)."""
    if not 0 <= nbytes <= MAX_PAYLOAD_BYTES:
        raise LinkError(f"a payload of {nbytes} bytes (the limit is {MAX_PAYLOAD_BYTES})")
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if nbytes:
        _recv_exactly(sock, memoryview(buf.numpy()))
    return buf


def skip_payload(sock, nbytes: int) -> None:
    if not 0 <= nbytes <= MAX_PAYLOAD_BYTES:
        raise LinkError(f"a payload of {nbytes} bytes (the limit is {MAX_PAYLOAD_BYTES})")
    scratch = bytearray(min(nbytes, 1 << 20))
    while nbytes:
        try:
            n = sock.recv_into(memoryview(scratch)[:min(nbytes, len(scratch))])
        except OSError as e:  # reset, or closed under a reader by our own side
            raise LinkError(f"the connection broke: {e}") from None
        if n == 0:
            raise LinkError("the connection closed")
        nbytes -= n


def payload_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


class Connection:
    """One side of a data connection: framed sends (thread-safe) and reads (one reader thread)."""

    def __init__(self, sock, peer: str):
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, frame: pb.Frame, payload: torch.Tensor | memoryview | None = None) -> int:
        """Send ``frame`` and its payload; returns the bytes sent. Raises :class:`LinkError`."""
        header = frame.SerializeToString()
        view = payload_view(payload) if isinstance(payload, torch.Tensor) else payload
        try:
            with self._send_lock:
                self.sock.sendall(LENGTH.pack(len(header)) + header)
                if view is not None and len(view):
                    self.sock.sendall(view)
        except OSError as e:
            self.close()
            raise LinkError(f"sending to {self.peer} failed: {e}") from None
        return len(header) + (len(view) if view is not None else 0)

    def send_hello(self, token: str | None, session: int, key: bytes = b"") -> None:
        body = pb.Hello(token=token or "", session=session, key=key).SerializeToString()
        self.sock.sendall(LENGTH.pack(len(body)) + body)

    def read_frame(self) -> pb.Frame:
        return read_header(self.sock, pb.Frame)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def client_context(tls_ca: Path | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None


def server_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if not cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise HpipeError(f"cannot read the TLS key or certificate: {e}") from None
    return ctx


def connect(host: str, port: int, token: str | None, session: int = 0,
            tls: ssl.SSLContext | None = None, key: bytes = b"") -> Connection:
    """Open a data connection and introduce ourselves (as ``session``, with its ``key``, or as a
    daemon's link with session 0); :class:`LinkError` if it is refused."""
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        conn = Connection(sock, where)
        conn.send_hello(token, session, key)
        reply = read_header(sock, pb.HelloReply)
        sock.settimeout(None)
    except (OSError, LinkError) as e:
        raise LinkError(f"cannot open a data connection to {where}: {e}") from None
    if reply.error:
        conn.close()
        raise LinkError(f"{where} refused the data connection: {reply.error}")
    return conn
