"""One-token decode steps of a stage as a CUDA graph: one launch instead of a thousand.

Design note. A decode step of a 7B model runs over a thousand small kernels; launched one by one
from Python they cost more than the step's arithmetic (an H100 took 38 ms per batch-6 step with
the weights streamed in about 5). :class:`DecodeStep` captures the whole stage's step once per
open sequence and replays it. Its shapes must not change between steps, so it attends over the
sequence's whole preallocated cache with a mask made on the device from the position
(:meth:`hpipe.model.layers.Attention.forward_static`), and reads its input and position from
static buffers that each step overwrites. Without ``graph`` the same static step runs eagerly:
that is how the CPU tests check it against the ordinary forward.
"""

from __future__ import annotations

import torch

from hpipe.model.kvcache import StageCache
from hpipe.model.layers import Attention
from hpipe.model.rope import cos_sin
from hpipe.model.stage import StageModel


class DecodeStep:
    """Run one-token steps of ``stage`` for the sequence whose cache is ``cache``."""

    def __init__(self, stage: StageModel, cache: StageCache, *, graph: bool, pool=None):
        self.stage, self.cache = stage, cache
        dev, b = stage.device, cache.batch
        if stage.units.has_embed:
            self.x = torch.zeros(b, 1, dtype=torch.long, device=dev)
        else:
            self.x = torch.zeros(b, 1, stage.cfg.hidden_size, dtype=stage.dtype, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self._want_graph, self._pool = graph, pool

    @torch.inference_mode()
    def _body(self) -> torch.Tensor:
        x = self.x
        cos, sin = cos_sin(self.stage.inv_freq, self.pos.view(1), self.stage.dtype)
        for block in self.stage.blocks.values():
            if isinstance(block, Attention):
                x = block.forward_static(x, self.pos, cos, sin, self.cache.layers[block.layer])
            else:
                x = block(x)  # embed, MLP, or the head on the one position
        return x

    def _capture(self) -> None:
        # CUDA graphs need the kernels warmed up on a side stream first; the warm-up runs the real
        # step (inputs are already in place), which the replay then repeats, writing the same K/V.
        side = torch.cuda.Stream(self.stage.device)
        side.wait_stream(torch.cuda.current_stream(self.stage.device))
        with torch.cuda.stream(side):
            self._body()
        torch.cuda.current_stream(self.stage.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the daemon's gRPC threads keep uploading slices while this one captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.out = self._body()
        self.graph = graph

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The stage's output for the one-token slice ``x`` at position ``start`` (a fresh tensor)."""
        self.cache.check_slice(start, 1, x.shape[0])
        self.x.copy_(x.to(self.x.dtype))
        self.pos.fill_(start)
        if self._want_graph and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            out = self.out.clone()  # the next replay overwrites self.out
        else:
            out = self._body()
        self.cache.length = start + 1
        return out
