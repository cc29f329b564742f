"""A deployment whose weights the coordinator shipped: what it names, and the store stages read.

A daemon without a model's files gets, in its ``Load``, the model's config and a reference to
each tensor of its units (name, ggml type, shape, bytes, content hash); the bytes arrived before
in its weights cache (:mod:`runtime.daemon.weights_cache`). Its stages read them there, through
the same GGUF store as a local file (:class:`hpipe.model.weights.gguf.GGUFWeights`), each entry's
hash checked again as it loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hpipe.core.config import ModelConfig
from hpipe.core.errors import HpipeError, ModelSourceError, StatusError
from hpipe.core.shapes import is_random
from hpipe.model.weights.files import file_key
from hpipe.model.weights.gguf import GGUFWeights
from hpipe.model.weights.sources import resolve_model
from runtime.daemon.weights_cache import WeightsCache, check_hash
from runtime.wire.messages import pb


@dataclass(frozen=True)
class Shipped:
    config_json: str
    architecture: str
    tensors: tuple[tuple[str, str, int, tuple[int, ...], int], ...]  # (name, hash, ggml type, shape, bytes)

    @classmethod
    def from_wire(cls, m: pb.ShippedModel) -> "Shipped":
        tensors = tuple((t.name, check_hash(t.hash), t.type, tuple(t.shape), t.bytes) for t in m.tensors)
        if not tensors or not m.config_json:
            raise StatusError("INVALID_ARGUMENT", "shipped weights need the model's config and its tensors")
        return cls(m.config_json, m.architecture, tensors)

    def config(self) -> ModelConfig:
        try:
            return ModelConfig.from_dict(json.loads(self.config_json))
        except (ValueError, TypeError) as e:
            raise StatusError("INVALID_ARGUMENT", f"the shipped config.json does not parse: {e}") from None

    def hashes(self) -> set[str]:
        return {h for _, h, *_ in self.tensors}

    def store(self, label: str, cfg: ModelConfig, cache: WeightsCache) -> GGUFWeights:
        """The store over the cache's entries, each one's hash checked now (``DATA_LOSS`` naming the
        ones that are gone or wrong: the coordinator ships them again)."""
        files, lost = {}, []
        for name, h, t, shape, nbytes in self.tensors:
            try:
                files[name] = {"type": t, "shape": list(shape), "bytes": nbytes, "offset": 0,
                               "file": str(cache.path(h))}
            except StatusError:
                lost.append(h)
        if lost:
            raise StatusError("DATA_LOSS", f"{len(lost)} shipped tensor(s) are missing or corrupt in the weights "
                              f"cache: {' '.join(lost)}")
        try:
            return GGUFWeights.of_files(label, self.architecture, files, cfg)
        except ModelSourceError as e:
            raise StatusError("INVALID_ARGUMENT", str(e)) from None


def reads_locally(model: str, key: str, check_source) -> bool:
    """Whether this daemon reads ``model`` itself: it may (``check_source``), it finds it, and a GGUF
    file there is the coordinator's (its ``key``), so nothing needs shipping."""
    try:
        check_source(model)
        if is_random(model):
            return True
        source = resolve_model(model)
    except (HpipeError, OSError):
        return False
    return source.gguf is None or not key or file_key(source.gguf) == key
