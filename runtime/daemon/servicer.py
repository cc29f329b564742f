"""The stage daemon's gRPC side: the stage service, the token check, and the server around them.

The servicer only translates between messages and :class:`StageServer` calls; every
:class:`StatusError` becomes the gRPC status it names, every other bad input an
``INVALID_ARGUMENT``, so a malformed request never takes the daemon down. Other services (the
profiler's) are added by whoever builds the server (``hpipe.app.daemon``), through ``services``.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hpipe.core.cluster import DaemonOptions, is_loopback
from hpipe.core.errors import HpipeError, InputError, ModelSourceError, StatusError, UnsupportedModelError
from hpipe.core.paths import cache_root
from hpipe.model.compute.stage import parse_dtype
from runtime.daemon import hoststat, kv_transfer, memory
from runtime.daemon.deployment import Deployment
from runtime.daemon.shipped import Shipped
from runtime.daemon.stage_server import StageServer
from runtime.daemon.weights_cache import WeightsCache
from runtime.wire.backoff import TokenBackoff, grpc_host
from runtime.wire.channels import TOKEN_HEADER, DaemonClient, Security
from runtime.wire.messages import SERVER_OPTIONS, dtype_from_wire, pb, pb_grpc, stage_from_wire, stage_to_wire
from runtime.wire.transport import client_context, server_context

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
#: the longest a switch's KV may take to reach the new owner
KV_SEND_TIMEOUT_S = 600.0
#: handler threads of a daemon's gRPC server
RPC_THREADS = 32
#: refusals of a wrong token that wait out their backoff at once (each holds a handler thread)
WAITING_REFUSALS = 4


def status_code(e: Exception) -> grpc.StatusCode:
    if isinstance(e, StatusError):
        return getattr(grpc.StatusCode, e.code)
    if isinstance(e, (ModelSourceError, UnsupportedModelError)):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


def handled(method):
    """Turn our errors into gRPC statuses with their message."""

    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except HpipeError as e:
            context.abort(status_code(e), str(e))

    wrapper.__name__ = method.__name__
    return wrapper


def compute_dtype(code: int, device: torch.device) -> torch.dtype:
    dtype = dtype_from_wire(code)
    if dtype == torch.int64:
        raise InputError("a stage computes in float32, bfloat16 or float16")
    return parse_dtype(dtype, device)


class StageServicer(pb_grpc.StageServiceServicer):
    def __init__(self, server: StageServer, security: Security = Security()):
        self.server = server
        self.security = security  # what it presents to other daemons (SendKv)

    @handled
    def Load(self, request, context):
        if not request.stages:
            raise StatusError("INVALID_ARGUMENT", "a deployment needs at least one stage")
        if request.kv_pool_bytes < 0:
            raise StatusError("INVALID_ARGUMENT", f"kv_pool_bytes must be >= 0, got {request.kv_pool_bytes}")
        dep = Deployment(request.model, compute_dtype(request.dtype, self.server.device),
                         tuple(stage_from_wire(s) for s in request.stages), tuple(request.held),
                         tuple(s.data_port for s in request.stages), request.kv_pool_bytes,
                         request.dequantize, Shipped.from_wire(request.shipped) if request.HasField("shipped") else None,
                         request.prefill_gemm)
        info = self.server.load(dep)
        pools = [pb.Pool(**p) for p in info.pop("pools")]
        return pb.LoadReply(pools=pools, **info)

    @handled
    def Status(self, request, context):
        owned = request.sequence_ids and self.server.owners.owns(request.session, request.key)
        info = self.server.status(list(request.sequence_ids), request.session if owned else None)
        seqs = [pb.SequenceState(**s) for s in info.pop("sequences")]
        pools = [pb.Pool(**p) for p in info.pop("pools")]
        dep = self.server.deployment
        reply = pb.StatusReply(sequences=seqs, pools=pools, clock_s=time.time(),
                               host_cpu_s=self.server.host_cpu_seconds(),
                               stages=[stage_to_wire(s, port) for s, port in zip(dep.stages, dep.data_ports)]
                               if dep else [],
                               held=list(dep.held) if dep else [], busy_s=self.server.worker.busy_s,
                               threads=torch.get_num_threads(), device_name=hoststat.device_name(info["device"]),
                               resident_bytes=memory.resident(self.server.device),
                               free_bytes=memory.available(self.server.device), **info)
        steal = hoststat.steal_seconds()
        if steal is not None:
            reply.cpu_steal_s = steal
        return reply

    @handled
    def EndSession(self, request, context):
        reply = pb.SessionStats()
        owners = self.server.owners
        if not owners.known(request.session):
            return reply  # ended here already (its connection closed), or never began here
        self._owned(request.session, request.key, "EndSession", context)
        for st in self.server.end_session(request.session):
            spans = [pb.Span(micro_batch=mb, tokens=n, received_s=r, begin_s=b, end_s=e)
                     for mb, n, r, b, e in st.spans()]
            reply.stats.append(pb.StageStats(stage=st.stage, compute_s=st.compute_s, send_s=st.send_s,
                                             recv_s=st.recv_s, micro_batches=st.micro_batches,
                                             bytes_sent=st.bytes_sent, spans=spans))
        return reply

    @handled
    def Resume(self, request, context):
        if not request.from_session or not request.to_session:
            raise StatusError("INVALID_ARGUMENT", "Resume needs the old and the new session")
        self._owned(request.to_session, request.to_key, "Resume", context)
        if self.server.owners.known(request.from_session):  # its own key first, whatever came with KV
            self._owned(request.from_session, request.from_key, "Resume", context)
        else:
            # its connections are gone; KV of it came only while they were here, checked by its key
            sent_here = self.server.kv_in.owns(request.from_session, request.from_key)  # None: no KV came
            if sent_here is None:
                return pb.ResumeReply()  # the old session holds nothing here (a restarted daemon's case)
            if not sent_here:
                raise StatusError("PERMISSION_DENIED", f"Resume names session {request.from_session} without its key")
        progress = self.server.resume(request.from_session, request.to_session)
        self.server.kv_in.forget(request.from_session)
        return pb.ResumeReply(progress=[pb.Progress(sequence_id=i, stage=st, computed=c, logged=g)
                                        for i, st, c, g in progress])

    @handled
    def CachedTensors(self, request, context):
        local = self.server.reads_locally(request.model, request.file_key)
        whole, partial = ([], {}) if local else self.server.weights_cache.claim(list(request.hashes), request.transfer_key)
        return pb.CachedReply(local=local, whole=whole, partial=partial)

    @handled
    def PutTensors(self, request_iterator, context):
        cache, received, completed, keys = self.server.weights_cache, 0, [], set()
        try:
            for chunk in request_iterator:
                keys.add(chunk.transfer_key)
                if cache.receive(chunk.hash, chunk.offset, chunk.total, chunk.data, chunk.transfer_key):
                    completed.append(chunk.hash)
                received += len(chunk.data)
        finally:
            for key in keys:
                cache.stream_ended(key)
        return pb.PutReply(bytes=received, completed=completed)

    @handled
    def SendKv(self, request, context):
        self._owned(request.session, request.key, "SendKv", context)
        client = DaemonClient(request.target_address, self.security)
        try:
            sent = kv_transfer.send(self.server.sequences, lambda: self.server.stages, self.server.run_on_device,
                                    request.session, request.key, list(request.stages),
                                    lambda parts: client.call("ReceiveKv", parts, timeout=KV_SEND_TIMEOUT_S),
                                    set(request.sequence_ids) or None, self.server.tier)
        except grpc.RpcError as e:
            raise StatusError(e.code().name, f"sending KV to {request.target_address}: {e.details()}") from None
        finally:
            client.close()
        return pb.KvReply(**sent)

    @handled
    def ReceiveKv(self, request_iterator, context):
        owners = self.server.owners
        got = self.server.kv_in.receive(request_iterator, owners.owns)
        return pb.KvReply(**got)

    def _owned(self, session: int, key: bytes, what: str, context) -> None:
        """Refuse the call unless ``key`` is ``session``'s (:mod:`runtime.daemon.owners`)."""
        error = self.server.owners.check(session, key, what, context.peer())
        if error:
            raise StatusError("PERMISSION_DENIED", error.removeprefix("PERMISSION_DENIED: "))


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every RPC (health checks included) that lacks the shared token. A refusal waits as
    the backoff says (guessing gets slow, :mod:`runtime.wire.backoff`), but only ``WAITING_REFUSALS``
    of them wait at once, each holding one of the server's ``RPC_THREADS`` handler threads; the
    others are refused at once (still counted), so callers without the token never take the
    threads the coordinator's calls need."""

    def __init__(self, token: str, backoff: TokenBackoff | None = None):
        self._expected = f"Bearer {token}".encode()
        backoff = backoff or TokenBackoff()
        waiting = threading.BoundedSemaphore(WAITING_REFUSALS)

        def deny(requests, context):  # never reads the request: its bytes are dropped with the stream
            host = grpc_host(context.peer())
            if waiting.acquire(blocking=False):
                try:
                    backoff.refused(host)
                finally:
                    waiting.release()
            else:
                backoff.delay(host)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(sent.encode(), self._expected):
            return continuation(handler_call_details)
        return self._deny


def outgoing_security(options: DaemonOptions) -> Security:
    """What the daemon presents to other daemons (its successor, link probes): the cluster's token,
    and the CA (default: its own certificate) their certificates are checked against."""
    security = Security.from_files(options.token_file)
    return Security(token=security.token, tls_ca=(options.tls_ca or options.tls_cert) if options.tls_cert else None)


#: adds a service to a daemon's gRPC server: (grpc server, the stage server, outgoing security) -> None
Service = Callable[[grpc.Server, StageServer, Security], None]


def build_server(options: DaemonOptions, services: tuple[Service, ...] = (),
                 on_worker_start: Callable[[], None] | None = None) -> tuple[grpc.Server, StageServer, int]:
    """The daemon's gRPC server (not started), its stage server, and the port it bound."""
    security = outgoing_security(options)
    budget = options.memory_budget
    if budget is None and options.memory_share is not None:
        budget = memory.budget_of_share(torch.device(options.device), options.memory_share)
        log.info("memory budget: %.1f GiB (%.0f%% of %s)", budget / 2**30, 100 * options.memory_share, options.device)
    stage = StageServer(options.device, budget, host=options.host, token=security.token,
                        tls_server=server_context(options.tls_cert, options.tls_key),
                        tls_client=client_context(security.tls_ca), on_worker_start=on_worker_start,
                        cuda_graphs=options.cuda_graphs, model_dirs=options.model_dir_list,
                        replay_budget=options.replay_budget, data_port=options.data_port,
                        weights_cache=WeightsCache(options.weights_cache or cache_root() / "weights",
                                                   int(options.weights_cache_gb * 1e9)))
    interceptors = [TokenInterceptor(security.token)] if security.token else []
    # so_reuseport off: a second daemon on a port in use must fail to bind, not share it unseen
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="grpc"),
                         interceptors=interceptors, options=SERVER_OPTIONS + [("grpc.so_reuseport", 0)])
    pb_grpc.add_StageServiceServicer_to_server(StageServicer(stage, security), server)
    for add in services:
        add(server, stage, security)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = options.address
    try:
        if options.tls_cert:
            try:
                with open(options.tls_key, "rb") as k, open(options.tls_cert, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            except OSError as e:
                raise HpipeError(f"cannot read the TLS key or certificate: {e}") from None
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises this when the port cannot be bound
        port = 0
        log.debug("bind failed: %s", e)
    if port == 0:
        stage.shutdown()
        raise HpipeError(f"cannot bind {address} (is another daemon or program using that port?)")
    return server, stage, port


def bind_warning(host: str) -> str | None:
    if is_loopback(host):
        return None
    return (f"binding {host}: a stage daemon runs whatever requests reach it and holds model weights; keep "
            "daemons on a trusted network and give them a --token-file (and TLS on shared links)")
