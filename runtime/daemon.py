"""``hpipe daemon``: serve one device as a pipeline stage over gRPC.

The servicer only translates between messages and :class:`StageServer` calls; every
:class:`StageError` becomes the gRPC status it names, every bad input an ``INVALID_ARGUMENT``,
so a malformed request never takes the daemon down.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import asdict, dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hpipe.errors import HpipeError, InputError, ModelSourceError, UnsupportedModelError
from runtime import hoststat
from runtime.channels import TOKEN_HEADER, Security, StageClient
from runtime.stage_server import PartSpec, StageError, StageServer
from runtime.wire import CHANNEL_OPTIONS, dtype_from_wire, pb, pb_grpc, tensor_to_proto

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DaemonConfig:
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50151
    threads: int | None = None
    memory_budget: int | None = None
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # to verify the successor's certificate (defaults to our own cert)
    name: str = ""
    cuda_graphs: bool = True  # decode steps as CUDA graphs (GPU daemons)


def _status(e: Exception) -> grpc.StatusCode:
    if isinstance(e, StageError):
        return getattr(grpc.StatusCode, e.code)
    if isinstance(e, (ModelSourceError, UnsupportedModelError)):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT


def _handled(method):
    """Turn our errors into gRPC statuses with their message."""

    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except HpipeError as e:
            context.abort(_status(e), str(e))

    wrapper.__name__ = method.__name__
    return wrapper


class StageServicer(pb_grpc.StageServicer):
    def __init__(self, server: StageServer, security: Security = Security()):
        self.server = server
        self.security = security  # for the daemon's own calls to other daemons (link probes)

    def _compute_dtype(self, code: int) -> torch.dtype:
        from hpipe.model.stage import parse_dtype

        dtype = dtype_from_wire(code)
        if dtype == torch.int64:
            raise InputError("a stage computes in float32, bfloat16 or float16")
        return parse_dtype(dtype, self.server.device)

    @_handled
    def Load(self, request, context):
        from profiler.device import release_timed_stages

        dtype = self._compute_dtype(request.dtype)
        release_timed_stages()  # the profiler's random stages are not needed once a stage is deployed
        parts = [PartSpec(p.unit_start, p.unit_end, p.next_address, p.next_name, p.stage_index) for p in request.parts]
        info = self.server.load(request.model, dtype, parts)
        return pb.LoadReply(**info)

    @_handled
    def Open(self, request, context):
        kv = self.server.open(request.sequence_id, request.batch, request.max_len, request.idle_timeout_s)
        return pb.OpenReply(kv_bytes=sum(kv), parts_kv_bytes=kv)

    @_handled
    def Submit(self, request, context):
        self.server.submit(request.sequence_id, request.unit_start, request.start, request.length, request.payload,
                           request.all_logits, request.want_logits)
        return pb.Ack()

    def Results(self, request, context):
        try:
            for out in self.server.results(request.sequence_id, context.is_active):
                msg = pb.SliceResult(sequence_id=request.sequence_id, start=out.start, length=out.length,
                                     error=out.error)
                if out.logits is not None:
                    msg.logits.CopyFrom(tensor_to_proto(out.logits))
                yield msg
        except HpipeError as e:
            context.abort(_status(e), str(e))

    @_handled
    def Close(self, request, context):
        parts = self.server.close(request.sequence_id)
        if parts is None:
            return pb.CloseReply(existed=False)
        reply = pb.CloseReply(existed=True)
        for stats in parts:
            fields = {k: v for k, v in vars(stats).items() if k != "spans"}
            spans = [pb.SliceSpan(start=a, length=n, received_s=r, begin_s=b, end_s=e) for a, n, r, b, e in stats.spans]
            reply.stats.append(pb.StageStats(spans=spans, **fields))
        return reply

    @_handled
    def GetDeviceInfo(self, request, context):
        from profiler.device import available_bytes, fingerprint, host_id

        dev = self.server.device
        return pb.DeviceInfo(device=str(dev), fingerprint=fingerprint(dev), available_bytes=available_bytes(dev),
                             memory_budget=self.server.memory_budget or 0, threads=torch.get_num_threads(),
                             host_id=host_id())

    @_handled
    def ProfileCompute(self, request, context):
        import time

        from profiler.device import measure_units

        cfg = _config_from_json(request.config_json)
        dtype = self._compute_dtype(request.dtype)
        axes = (list(request.batches), list(request.tokens), list(request.contexts))
        if any(not a or min(a) < (0 if i == 2 else 1) for i, a in enumerate(axes)):
            raise InputError("profile grid axes must be non-empty (batches, tokens >= 1; contexts >= 0)")
        if max(request.tokens) > request.max_len:
            raise InputError(f"slice of {max(request.tokens)} tokens exceeds max_len {request.max_len}")
        _check_extent(cfg, max(request.batches), max(request.tokens), max(request.contexts))
        if len(axes[0]) * len(axes[1]) * len(axes[2]) > 4096:
            raise InputError("profile grid has more than 4096 points")
        t0 = time.perf_counter()
        times = self.server.run_on_device(lambda: measure_units(cfg, dtype, self.server.device, *axes,
                                                                request.max_len, max(1, request.repeats)))
        units = [pb.UnitTimes(kind=k, batches=axes[0], tokens=axes[1],
                              contexts=axes[2] if k == "attn" else [0],
                              seconds=[t for plane in v for row in plane for t in row]) for k, v in times.items()]
        return pb.ProfileReply(units=units, elapsed_s=time.perf_counter() - t0)

    @_handled
    def TimeStage(self, request, context):
        from hpipe.units import UnitRange
        from profiler.device import time_stage

        cfg = _config_from_json(request.config_json)
        units = UnitRange(request.unit_start, request.unit_end, cfg.num_layers)
        if request.batch < 1 or request.tokens < 1 or request.context < 0:
            raise InputError("batch and tokens must be >= 1 and context >= 0")
        _check_extent(cfg, request.batch, request.tokens, request.context)
        dtype = self._compute_dtype(request.dtype)
        seconds = self.server.run_on_device(lambda: time_stage(
            cfg, dtype, self.server.device, units, request.batch, request.tokens, request.context,
            min(max(1, request.repeats), 500)))
        return pb.StageTimeReply(seconds=seconds)

    @_handled
    def MeasureLink(self, request, context):
        from profiler.links import time_probes

        if not request.sizes or min(request.sizes) < 0 or max(request.sizes) > (256 << 20):
            raise InputError("probe sizes must lie in [0, 256 MiB]")
        client = StageClient(request.target_address, self.security)
        try:
            seconds = time_probes(lambda payload: client.call("Probe", pb.ProbeRequest(payload=payload),
                                                              timeout=SEND_TIMEOUT_S),
                                  list(request.sizes), max(1, request.repeats))
        except grpc.RpcError as e:
            raise StageError("UNAVAILABLE", f"cannot reach {request.target_address}: {e.code().name}: "
                             f"{e.details()}") from None
        finally:
            client.close()
        return pb.LinkReply(sizes=list(request.sizes), seconds=seconds)

    def Probe(self, request, context):
        return pb.Ack()

    @_handled
    def Status(self, request, context):
        info = self.server.status(list(request.sequence_ids))
        seqs = [pb.SequenceState(**s) for s in info.pop("sequences")]
        parts = [pb.StagePart(**asdict(p)) for p in info.pop("parts")]
        reply = pb.StatusReply(sequences=seqs, parts=parts, clock_s=time.time(),
                               host_cpu_s=self.server.host_cpu_seconds(), **info)
        steal = hoststat.steal_seconds()
        if steal is not None:
            reply.cpu_steal_s = steal
        return reply


def _config_from_json(text: str):
    import json

    from hpipe.config import ModelConfig

    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InputError(f"config_json is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InputError("config_json must be a JSON object")
    return ModelConfig.from_dict(raw)


def _check_extent(cfg, batch: int, tokens: int, context: int) -> None:
    """Refuse profiling requests far beyond anything the model could run (they would only exhaust memory)."""
    limit = 2 * cfg.max_position_embeddings
    if tokens + context > limit or batch > 1024:
        raise InputError(f"profiling {batch} x ({context} + {tokens}) tokens exceeds twice the model's context "
                         f"({limit}) or batch 1024")


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every RPC (health checks included) that lacks the shared token."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(sent.encode(), self._expected):
            return continuation(handler_call_details)
        return self._deny_stream if handler_call_details.method.endswith("/Results") else self._deny


def _outgoing_security(cfg: DaemonConfig) -> Security:
    from pathlib import Path

    return Security(token=cfg.token, tls_ca=Path(cfg.tls_ca or cfg.tls_cert) if cfg.tls_cert else None)


def _sender_factory(cfg: DaemonConfig):
    security = _outgoing_security(cfg)

    def connect(address: str):
        client = StageClient(address, security)

        def send(seq_id: int, unit_start: int, start: int, length: int, payload: bytes, all_logits: bool,
                 want_logits: bool) -> None:
            try:
                client.call("Submit", pb.Slice(sequence_id=seq_id, unit_start=unit_start, start=start, length=length,
                                               payload=payload, all_logits=all_logits, want_logits=want_logits),
                            timeout=SEND_TIMEOUT_S)
            except grpc.RpcError as e:
                raise HpipeError(f"{e.code().name}: {e.details()}") from None

        return send

    return connect


def build_server(cfg: DaemonConfig) -> tuple[grpc.Server, StageServer, int]:
    from runtime.emulate import WORKER_THREAD_NAME, name_this_thread

    stage = StageServer(cfg.device, cfg.memory_budget, connect=_sender_factory(cfg),
                        on_worker_start=lambda: name_this_thread(WORKER_THREAD_NAME), cuda_graphs=cfg.cuda_graphs)
    interceptors = [TokenInterceptor(cfg.token)] if cfg.token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc"),
                         interceptors=interceptors, options=CHANNEL_OPTIONS)
    pb_grpc.add_StageServicer_to_server(StageServicer(stage, _outgoing_security(cfg)), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert:
        with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise HpipeError(f"cannot bind {address}")
    return server, stage, port


def bind_warning(host: str) -> str | None:
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (f"binding {host}: a stage daemon runs whatever requests reach it and holds model weights; keep "
            "daemons on a trusted network and give them a --token-file (and TLS on shared links)")


def serve(cfg: DaemonConfig) -> int:
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise HpipeError(f"--device {cfg.device}: CUDA is not available on this machine")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    warning = bind_warning(cfg.host)
    if warning:
        log.warning("%s", warning)
    server, stage, port = build_server(cfg)
    server.start()
    log.warning("hpipe daemon %s serving %s on %s:%d (pid-safe stop: SIGTERM)", cfg.name, cfg.device, cfg.host, port)
    stopped = threading.Event()

    def on_signal(signum, frame):
        log.warning("signal %d: stopping", signum)
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopped.wait()
    stage.shutdown()
    server.stop(grace=3).wait()
    return 0
