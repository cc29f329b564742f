"""The profiler's gRPC service, served by every daemon beside its stage service.

What a daemon measures about itself (device identity, free memory, per-unit compute grids, a
whole stage's time) and about its links (timed probes to another daemon over the data plane,
the transport activations take). Measurements run on
the stage server's device worker (:meth:`StageServer.run_on_device`), so they use the thread and
limits that run slices and never overlap one. ``hpipe.app.daemon`` adds it with :func:`add_to`.
"""

from __future__ import annotations

import json
import time

import grpc
import torch

from hpipe.core.cluster import split_address
from hpipe.core.config import ModelConfig
from hpipe.core.errors import InputError, StatusError
from hpipe.core.units import UnitRange
from hpipe.model.kernels.precision import prefill_gemm_as
from hpipe.model.weights.blocks import TYPES
from profiler.device import cpu_counts, fingerprint, host_id, measure_units, release_timed_stages, time_stage
from profiler.links import MAX_PROBE_BYTES, time_probes
from runtime.daemon import memory
from runtime.daemon.servicer import SEND_TIMEOUT_S, compute_dtype, handled
from runtime.daemon.stage_server import StageServer
from runtime.wire.channels import Security
from runtime.wire.messages import pb, pb_grpc
from runtime.wire.transport import LinkError, client_context, connect

MAX_GRID_POINTS = 4096
MAX_REPEATS = 500


class ProfilerServicer(pb_grpc.ProfilerServiceServicer):
    def __init__(self, server: StageServer, security: Security = Security()):
        self.server = server
        self.security = security  # for the daemon's own calls to other daemons (link probes)

    @handled
    def GetDeviceInfo(self, request, context):
        dev = self.server.device
        cpus, host_cpus = cpu_counts()
        return pb.DeviceInfo(device=str(dev), fingerprint=fingerprint(dev), available_bytes=memory.available(dev),
                             memory_budget=self.server.memory_budget or 0, threads=torch.get_num_threads(),
                             host_id=host_id(), cpus=cpus, host_cpus=host_cpus)

    @handled
    def ProfileCompute(self, request, context):
        cfg, weight_type = config_from_json(request.config_json)
        dtype = compute_dtype(request.dtype, self.server.device)
        axes = (list(request.batches), list(request.tokens), list(request.contexts))
        if any(not a or min(a) < (0 if i == 2 else 1) for i, a in enumerate(axes)):
            raise InputError("profile grid axes must be non-empty (batches, tokens >= 1; contexts >= 0)")
        if max(request.tokens) > request.max_len:
            raise InputError(f"slice of {max(request.tokens)} tokens exceeds max_len {request.max_len}")
        check_extent(cfg, max(request.batches), max(request.tokens), max(request.contexts))
        if len(axes[0]) * len(axes[1]) * len(axes[2]) > MAX_GRID_POINTS:
            raise InputError(f"profile grid has more than {MAX_GRID_POINTS} points")
        repeats = min(max(1, request.repeats), MAX_REPEATS)
        t0 = time.perf_counter()

        def caller_still_there():
            # a grid of a big model runs for many minutes: one whose caller went away (a profile
            # stopped with Ctrl-C) ends after its current slice length's points, not at the grid's end
            if not context.is_active():
                raise StatusError("CANCELLED", "the caller of this profile went away")

        def measure():
            with prefill_gemm_as(request.prefill_gemm):
                return measure_units(cfg, dtype, self.server.device, *axes, request.max_len, repeats,
                                     progress=caller_still_there, weight_type=weight_type)
        times = self.server.run_on_device(measure)
        units = [pb.UnitTimes(kind=k, batches=axes[0], tokens=axes[1],
                              contexts=axes[2] if k == "attn" else [0],
                              seconds=[t for plane in v for row in plane for t in row]) for k, v in times.items()]
        return pb.ProfileReply(units=units, elapsed_s=time.perf_counter() - t0)

    @handled
    def TimeStage(self, request, context):
        cfg, weight_type = config_from_json(request.config_json)
        units = UnitRange(request.unit_start, request.unit_end, cfg.num_layers)
        if request.batch < 1 or request.tokens < 1 or request.context < 0:
            raise InputError("batch and tokens must be >= 1 and context >= 0")
        check_extent(cfg, request.batch, request.tokens, request.context)
        dtype = compute_dtype(request.dtype, self.server.device)
        def measure():
            with prefill_gemm_as(request.prefill_gemm):
                return time_stage(cfg, dtype, self.server.device, units, request.batch, request.tokens,
                                  request.context, min(max(1, request.repeats), MAX_REPEATS), weight_type)
        seconds = self.server.run_on_device(measure)
        return pb.StageTimeReply(seconds=seconds)

    @handled
    def MeasureLink(self, request, context):
        if not request.sizes or min(request.sizes) < 0 or max(request.sizes) > MAX_PROBE_BYTES:
            raise InputError(f"probe sizes must lie in [0, {MAX_PROBE_BYTES >> 20} MiB]")
        host = split_address(request.target_address, "the target")[0]
        where = f"{host}:{request.target_data_port}"
        try:
            conn = connect(host, request.target_data_port, self.security.token, 0,
                           client_context(self.security.tls_ca))
        except LinkError as e:
            raise StatusError("UNAVAILABLE", f"cannot reach {where}: {e}") from None
        conn.sock.settimeout(SEND_TIMEOUT_S)

        def send(payload: bytes) -> None:
            conn.send(pb.Frame(probe=pb.Probe(payload_bytes=len(payload))), memoryview(payload))
            if conn.read_frame().WhichOneof("kind") != "probe":
                raise LinkError(f"{where} answered a probe with something else")
        try:
            seconds = time_probes(send, list(request.sizes), min(max(1, request.repeats), MAX_REPEATS))
        except (LinkError, OSError) as e:
            raise StatusError("UNAVAILABLE", f"the link to {where} failed: {e}") from None
        finally:
            conn.close()
        return pb.LinkReply(sizes=list(request.sizes), seconds=seconds)


def config_from_json(text: str) -> tuple[ModelConfig, int]:
    """The model's config, and the ggml type its matrices are held in (0: float weights), which a
    ``quantization_config`` of ``{"quant_method": "gguf", "ggml_type": T}`` names (profiler.measure)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise InputError(f"config_json is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InputError("config_json must be a JSON object")
    quant = raw.pop("quantization_config", None) or {}
    weight_type = quant.get("ggml_type", 0) if isinstance(quant, dict) else 0
    if weight_type not in (0, *TYPES) or isinstance(weight_type, bool):
        raise InputError(f"quantization_config names ggml type {weight_type!r}, which hpipe's kernels do not read")
    return ModelConfig.from_dict(raw), int(weight_type)


def check_extent(cfg: ModelConfig, batch: int, tokens: int, context: int) -> None:
    """Refuse profiling requests far beyond anything the model could run (they would only exhaust memory)."""
    limit = 2 * cfg.max_position_embeddings
    if tokens + context > limit or batch > 1024:
        raise InputError(f"profiling {batch} x ({context} + {tokens}) tokens exceeds twice the model's context "
                         f"({limit}) or batch 1024")


def add_to(server: grpc.Server, stage: StageServer, security: Security) -> None:
    """Serve the profiler beside ``stage`` (a :data:`runtime.daemon.servicer.Service`)."""
    stage.before_load.append(release_timed_stages)  # a deployed stage no longer needs the timed ones
    pb_grpc.add_ProfilerServiceServicer_to_server(ProfilerServicer(stage, security), server)
