"""Weights travel from the coordinator: a daemon that does not hold the model's files gets its units'.

Design note. At deploy (:meth:`runtime.coordinator.pipeline.Pipeline.load`), the coordinator asks
each daemon (``CachedTensors``) whether it reads the model itself (the same GGUF file, by its
identity, where its ``--model-dirs`` allow) and, if not, which of its units' tensors its weights
cache holds (:mod:`runtime.daemon.weights_cache`) and how much of the others arrived before. Only
the missing bytes move (``PutTensors``, a stream of 4 MiB chunks read straight from the file,
quantized blocks as stored), to every daemon at once, one stream each; the ``Load`` then names
the tensors by content hash (:mod:`hpipe.model.weights.manifest`). So a second deploy moves nothing, a
transfer cut off goes on from where it stopped, a re-plan or a recovery moves only the units
that changed hands, and a cache entry found corrupt when the daemon loads it (``DATA_LOSS``) is
sent again. Safetensors directories and random-weight shapes are not shipped: a daemon reads
the first from its own disk and makes the second.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc

from hpipe.core.errors import ModelSourceError
from hpipe.core.shapes import is_random
from hpipe.core.units import UnitRange
from hpipe.model.compute.layers import tensors_of
from hpipe.model.weights.files import file_key
from hpipe.model.weights.manifest import Manifest, TensorEntry, manifest
from hpipe.model.weights.sources import ModelSource, resolve_model
from runtime.wire.channels import DaemonClient
from runtime.wire.messages import pb

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
#: the slowest rate a transfer's deadline allows for (bytes/s), beyond a minute's grace
SLOWEST_RATE = 1 << 20


@dataclass
class Transfer:
    """What deploying to one daemon moved."""

    daemon: str
    local: bool = False      # it read the model's files itself
    tensors: int = 0         # sent (wholly or what was missing of them)
    sent_bytes: int = 0
    cached_bytes: int = 0    # its cache had them already
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Bytes a second while sending (0 when nothing moved)."""
        return self.sent_bytes / self.seconds if self.sent_bytes and self.seconds > 0 else 0.0

    def describe(self) -> str:
        if self.local:
            return f"{self.daemon}: reads the model's files itself"
        return (f"{self.daemon}: sent {self.tensors} tensors, {self.sent_bytes / 1e6:.1f} MB in {self.seconds:.2f} s"
                f"{f' ({self.rate / 1e6:.1f} MB/s)' if self.sent_bytes else ''}; "
                f"{self.cached_bytes / 1e6:.1f} MB were in its cache")


class Shipment:
    """A GGUF model as the coordinator ships it: its manifest and its file."""

    def __init__(self, model: str, source: ModelSource):
        self.model, self.source = model, source

    @classmethod
    def of(cls, model: str) -> "Shipment | None":
        """What can be shipped of ``model`` (None: a random shape, a safetensors directory, or a
        path only the daemons have)."""
        if is_random(model):
            return None
        try:
            source = resolve_model(model)
        except ModelSourceError:
            return None
        return cls(model, source) if source.gguf is not None else None

    @cached_property
    def manifest(self) -> Manifest:
        return manifest(self.source.gguf, self.source.path)

    @cached_property
    def key(self) -> str:
        return file_key(self.source.gguf)

    def to(self, client: DaemonClient, ranges: list[UnitRange], name: str) -> tuple[pb.ShippedModel | None, Transfer]:
        """Bring ``client``'s daemon the tensors of ``ranges`` it lacks; what its ``Load`` names
        (None: it reads the model itself) and what moved."""
        entries = self.manifest.entries(tensors_of(self.source.config, ranges))
        hashes = list(dict.fromkeys(e.hash for e in entries))
        key = secrets.token_bytes(16)  # this transfer's: only its chunks add to the tensors it asks for
        reply = client.call("CachedTensors", pb.CachedRequest(model=self.model, file_key=self.key, hashes=hashes,
                                                              transfer_key=key), timeout=60.0)
        if reply.local:
            return None, Transfer(name, local=True)
        whole, partial = set(reply.whole), dict(reply.partial)
        missing = list({e.hash: e for e in entries if e.hash not in whole}.values())
        transfer = Transfer(name, tensors=len(missing),
                            cached_bytes=sum(e.nbytes for e in {e.hash: e for e in entries if e.hash in whole}.values()))
        if missing:
            todo = sum(e.nbytes - partial.get(e.hash, 0) for e in missing)
            t0 = time.perf_counter()
            put = client.call("PutTensors", _chunks(self.source.gguf, missing, partial, key), timeout=60.0 + todo / SLOWEST_RATE)
            transfer.seconds = time.perf_counter() - t0
            transfer.sent_bytes = put.bytes
        (log.warning if transfer.sent_bytes else log.info)("weights: %s", transfer.describe())
        tensors = [pb.TensorRef(name=e.name, hash=e.hash, type=e.type, shape=list(e.shape), bytes=e.nbytes)
                   for e in entries]
        return pb.ShippedModel(config_json=(self.source.path / "config.json").read_text(),
                               architecture=self.manifest.architecture, tensors=tensors), transfer


def _chunks(gguf: Path, entries: list[TensorEntry], partial: dict[str, int], key: bytes):
    """The bytes of ``entries`` still missing, as chunks, read from the file as they are sent."""
    with open(gguf, "rb") as f:
        for e in entries:
            offset = partial.get(e.hash, 0)
            if not 0 <= offset < e.nbytes:
                offset = 0  # the daemon starts it over
            f.seek(e.offset + offset)
            while offset < e.nbytes:
                data = f.read(min(CHUNK_BYTES, e.nbytes - offset))
                if not data:
                    return  # the file shrank under us: the daemon's hash check refuses what came
                yield pb.TensorChunk(hash=e.hash, offset=offset, total=e.nbytes, data=data, transfer_key=key)
                offset += len(data)


def is_data_loss(e: grpc.RpcError) -> bool:
    """A ``Load`` refused because shipped entries were missing or corrupt (they were deleted: ship again)."""
    return e.code() == grpc.StatusCode.DATA_LOSS
