"""gRPC channels and the client side of a daemon's services: auth token, TLS, limits, deadlines."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from hpipe.core.errors import HpipeError
from runtime.wire.messages import CHANNEL_OPTIONS, pb, pb_grpc

TOKEN_HEADER = "authorization"


@dataclass(frozen=True)
class Security:
    """Shared secret and TLS settings, the same for every daemon of a cluster and its clients."""

    token: str | None = None
    tls_ca: Path | None = None  # CA (or self-signed cert) that daemon certificates are checked against

    @classmethod
    def from_files(cls, token_file: str | Path | None, tls_ca: str | Path | None = None) -> "Security":
        token = None
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as e:
                raise HpipeError(f"cannot read token file: {e}") from None
            if not token:
                raise HpipeError(f"token file {token_file} is empty")
        return cls(token=token, tls_ca=Path(tls_ca) if tls_ca else None)

    @classmethod
    def of(cls, cluster) -> "Security":
        """What a client of ``cluster`` (a :class:`hpipe.core.cluster.ClusterSpec`) presents and checks."""
        return cls.from_files(cluster.token_file, cluster.tls_ca)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_HEADER, f"Bearer {self.token}"),) if self.token else ()


def open_channel(address: str, security: Security = Security()) -> grpc.Channel:
    if security.tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=security.tls_ca.read_bytes())
        return grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class DaemonClient:
    """A thin client of one daemon; every call carries the token and a deadline."""

    def __init__(self, address: str, security: Security = Security(), name: str | None = None):
        self.address, self.name = address, name or address
        self.channel = open_channel(address, security)
        self.stub = pb_grpc.StageServiceStub(self.channel)
        self.profiler = pb_grpc.ProfilerServiceStub(self.channel)
        self.metadata = security.metadata()

    def call(self, method: str, request, timeout: float = 30.0):
        """``method`` of the stage service, or of the profiler service every daemon also serves."""
        stub = self.stub if hasattr(self.stub, method) else self.profiler
        return getattr(stub, method)(request, timeout=timeout, metadata=self.metadata)

    def clock_offset(self, tries: int = 5, timeout: float = 5.0) -> float:
        """The daemon's wall clock minus ours, in seconds (Cristian's method: the round trip with the
        least delay, taking its reply to have been made half-way through)."""
        best = None
        for _ in range(tries):
            t0 = time.time()
            reply = self.call("Status", pb.StatusRequest(), timeout=timeout)
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, reply.clock_s - (t0 + t1) / 2)
        return best[1]

    def health(self, timeout: float = 2.0) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout, metadata=self.metadata)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()
