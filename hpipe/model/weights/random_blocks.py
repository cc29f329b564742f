"""``random:SHAPE@QUANT`` on a daemon without a file: each stage's tensors made as the blocks
``hpipe model make`` would write, only for the units the stage holds, when it asks for them.

For profiles and benchmarks at sizes no file here has (an 8B at Q4_K_M is 4.9 GB): the daemon holds
the stored types of the file (Q4_K, Q6_K, Q8_0 or F16 blocks, through the same kernels), so its
memory and speed are those of the file. A layer tensor is the file's own bytes (the same seed and
the same place in the file's order); the embedding and the output matrix have the shape's own
vocabulary here (the file carries SmolLM2's tokenizer, 49,152 rows), as a what-if profile of the
shape counts them.
"""

from __future__ import annotations

import numpy as np
import torch

from hpipe.core.config import ModelConfig
from hpipe.core.errors import ModelSourceError
from hpipe.core.shapes import RANDOM_PREFIX
from hpipe.model.weights.gguf import GGUFWeights, hf_name
from hpipe.model.weights.random_gguf import BLOCKS, F16, F32, QUANTS, random_blocks, tensors


def runnable(spec: str) -> bool:
    """Whether ``spec`` is ``random:SHAPE@QUANT`` of a type daemons can make (:data:`QUANTS`)."""
    return spec.startswith(RANDOM_PREFIX) and "@" in spec and spec.rsplit("@", 1)[1].lower() in QUANTS


class RandomBlocks(GGUFWeights):
    """The tensors of ``random:SHAPE@QUANT`` (seed ``seed``), each made when loaded."""

    def __init__(self, spec: str, cfg: ModelConfig, seed: int = 0):
        if not runnable(spec):
            raise ModelSourceError(f"{spec!r}: daemons make random blocks of {', '.join(QUANTS)} only")
        quant, self.seed = spec.rsplit("@", 1)[1].lower(), seed
        entries = {}
        for index, (name, shape, t) in enumerate(tensors(cfg, quant, cfg.vocab_size)):
            per, size = BLOCKS.get(t, (1, 4))  # F32: one value of 4 bytes
            values = shape[0] * (shape[1] if len(shape) > 1 else 1)
            entries[hf_name(name)] = {"gguf": name, "type": t, "shape": list(shape), "bytes": values // per * size,
                                      "index": index}
        self._setup(spec, "llama", entries, cfg)

    def load(self, names: list[str]) -> dict:
        return {n: self._tensor(n, self._bytes(n)) for n in names}

    def _bytes(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        shape, t = e["shape"], e["type"]
        rng = np.random.default_rng([self.seed, e["index"]])
        data = np.ones(shape, np.float32) if t == F32 else random_blocks(t, *shape, rng)
        if t == F16:
            data = data.view(np.uint8)
        return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
