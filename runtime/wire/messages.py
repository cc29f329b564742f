"""The one place that converts between wire messages and tensors. No pickle: raw bytes only.

Every decode checks the byte count against the shape and dtype the receiver expects, so a
truncated, padded or mistyped payload is refused before it reaches the model.
"""

from __future__ import annotations

import math
import warnings

import torch

from hpipe.core.errors import InputError
from hpipe.core.plan import Stage
from runtime.wire.protogen import ensure as _ensure_generated

_ensure_generated()
from runtime.wire.proto_gen import stage_pb2 as pb  # noqa: E402
from runtime.wire.proto_gen import stage_pb2_grpc as pb_grpc  # noqa: E402,F401

TO_WIRE = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16, torch.int64: pb.INT64}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}

#: the control plane's largest message (activations travel on the data plane, runtime/wire/transport.py):
#: a link probe of up to 32 MiB, with room. gRPC reads a message whole before the token check, so
#: this also bounds what an unauthenticated caller can make a daemon hold.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A fixed 16 MiB HTTP/2 stream window. With the default 64 KB window and bandwidth-delay probing,
    # a 100 Mbit/s tc-shaped link carried gRPC at 7.8-11.7 MB/s from run to run while raw TCP held
    # 11.3-12.0; with this, five runs measured 11.57-11.65.
    ("grpc.http2.lookahead_bytes", 16 << 20),
    ("grpc.http2.bdp_probe", 0),
]


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


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    # bfloat16 has no numpy dtype: view the storage as raw bytes instead.
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()


def _check_size(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    if any(d < 0 for d in shape):
        raise InputError(f"negative dimension in shape {shape}")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise InputError(
            f"payload has {len(data)} bytes; {list(shape)} {str(dtype).removeprefix('torch.')} needs {expected}"
        )
    return expected


def bytes_to_tensor(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` from ``data``, refusing any size mismatch."""
    if _check_size(data, shape, dtype) == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy owned by the tensor (frombuffer on bytes would warn and alias).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def checked_view(data: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A read-only view of ``data`` as ``shape`` and ``dtype`` (size-checked), to copy from once."""
    if _check_size(data, shape, dtype) == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only read it
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    return pb.Tensor(data=tensor_bytes(t), shape=list(t.shape), dtype=dtype_to_wire(t.dtype))


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    return bytes_to_tensor(msg.data, tuple(msg.shape), dtype_from_wire(msg.dtype))


def stage_to_wire(s: Stage, data_port: int = 0) -> pb.Stage:
    return pb.Stage(unit_start=s.unit_start, unit_end=s.unit_end, daemon=s.daemon, address=s.address,
                    data_port=data_port)


def stage_from_wire(m: pb.Stage) -> Stage:
    return Stage(m.daemon, m.address, m.unit_start, m.unit_end)
