"""The generated protobuf messages, and the conversions of dtypes and stages to and from them.

Tensors never travel inside messages: activations and logits move on the data plane as raw bytes
after a frame that says how many (:mod:`runtime.wire.transport`), and the receiver reads them
into a tensor of the size its layout declares, refusing any other count. No pickle anywhere.
"""

from __future__ import annotations

import os

import torch

from hpipe.core.errors import InputError
from hpipe.core.plan import Stage
from hpipe.core.units import UnitRange
from runtime.wire.protogen import ensure as _ensure_generated

_ensure_generated()
from runtime.wire.proto_gen import stage_pb2 as pb  # noqa: E402
from runtime.wire.proto_gen import stage_pb2_grpc as pb_grpc  # noqa: E402,F401

TO_WIRE = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16, torch.int64: pb.INT64}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}

#: the control plane's largest message (activations travel on the data plane, runtime/wire/transport.py):
#: a link probe of up to 32 MiB, with room.
MAX_MESSAGE_BYTES = 64 << 20
#: the HTTP/2 stream window a client gives a daemon's replies (link probes' echoes). With the default
#: 64 KB window and bandwidth-delay probing, a 100 Mbit/s tc-shaped link carried gRPC at 7.8-11.7 MB/s
#: from run to run while raw TCP held 11.3-12.0; with a fixed 16 MiB one, five runs measured 11.57-11.65.
CLIENT_WINDOW_BYTES = 16 << 20
#: the window a daemon gives each stream sent to it (weights, KV, probes), smaller: it admits these
#: bytes on every stream before the token check has refused it, so 500 callers without the token
#: sending large messages would make a daemon hold 500 windows (16 MiB ones: gigabytes). 2 MiB still
#: covers a 1 Gbit/s link's bandwidth-delay product up to 16 ms.
SERVER_WINDOW_BYTES = int(os.environ.get("HPIPE_SERVER_WINDOW", 2 << 20))
_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 0),
]
CHANNEL_OPTIONS = _COMMON + [("grpc.http2.lookahead_bytes", CLIENT_WINDOW_BYTES)]
#: the most streams one connection may have open on a daemon. A coordinator uses a handful; a client
#: that opens more at once has the surplus refused (RST_STREAM REFUSED_STREAM, seen as UNAVAILABLE)
#: when they race the count of the streams closing, so this stays well above any caller's own use.
MAX_STREAMS_PER_CONNECTION = 256
SERVER_OPTIONS = _COMMON + [("grpc.http2.lookahead_bytes", SERVER_WINDOW_BYTES),
                            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)]


def dtype_to_wire(dtype: torch.dtype) -> int:
    try:
        return TO_WIRE[dtype]
    except KeyError:
        raise InputError(f"dtype {dtype} cannot travel on the wire") from None


def dtype_from_wire(code: int) -> torch.dtype:
    try:
        return FROM_WIRE[code]
    except KeyError:
        raise InputError(f"unknown wire dtype {code}") from None


def stage_to_wire(s: Stage, data_port: int = 0) -> pb.Stage:
    return pb.Stage(unit_start=s.units.start, unit_end=s.units.end, num_layers=s.units.num_layers, daemon=s.daemon,
                    address=s.address, data_port=data_port)


def stage_from_wire(m: pb.Stage) -> Stage:
    """A stage from the wire (its unit range checked: :class:`InputError` if it is not one of the model's)."""
    return Stage(m.daemon, m.address, UnitRange(m.unit_start, m.unit_end, m.num_layers))


def cpu_steal(status: pb.StatusReply) -> float | None:
    """The CPU steal a daemon's ``StatusReply`` reports (:mod:`runtime.daemon.hoststat`), or None
    where the daemon does not know it."""
    return status.cpu_steal_s if status.HasField("cpu_steal_s") else None
