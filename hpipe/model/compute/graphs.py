"""Decode micro-batches as CUDA graphs, one per batch-size bucket (and context bucket).

Design note. A decode step of a 7B model runs over a thousand small kernels; launched one by one
from Python they cost more than the step's arithmetic (an H100 took 38 ms per batch-6 step with
the weights streamed in about 5). :class:`DecodeGraphs` runs a micro-batch whose entries are all
one decode token as a static step: its rows padded to the next bucket size (1, 2, 4, ... 64), its
keys gathered from the KV pool into a fixed context length (the next multiple of
``CONTEXT_BUCKET``), masked per row. Shapes never change within a bucket, so the step is captured
once per bucket as a CUDA graph and replayed; inputs are written into the graph's static buffers,
and padded rows write their keys into the pool's trash block. Without ``graph`` the same static
step runs eagerly: that is how the CPU tests check it against :meth:`StageModel.forward_batch`.
"""

from __future__ import annotations

import math
import threading

import torch

from hpipe.model.compute.layers import Attention
from hpipe.model.compute.stage import StageModel, logit_rows
from hpipe.model.kv.pool import Entry, KVPool

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_BUCKET = 256

#: Held while a CUDA graph is captured or destroyed. Both register the graph with the device's
#: default generator, in a set PyTorch does not lock; daemons sharing a process (and a card) each
#: capture on their own worker thread, and a layout switch drops one's stages, graphs and all,
#: while another captures: unguarded, the set broke and a graph's destructor aborted the process
#: ("The graph should be registered to the state"). Reentrant: a collection may run a destructor
#: on the capturing thread.
_GRAPH_LOCK = threading.RLock()


class _Graph:
    """A captured CUDA graph, destroyed under :data:`_GRAPH_LOCK` when the last reference goes."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()

    def __del__(self):
        with _GRAPH_LOCK:
            self.graph = None  # the only reference: the C++ destructor runs here, under the lock


class _Static:
    """The buffers of one bucket's step, and its graph once captured."""

    def __init__(self, stage: StageModel, rows: int, context: int, windows: set[int]):
        dev = stage.device
        if stage.units.has_embed:
            self.x = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        else:
            self.x = torch.zeros(rows, 1, stage.cfg.hidden_size, dtype=stage.dtype, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.write = torch.zeros(rows, dtype=torch.long, device=dev)
        self.gather = torch.zeros(rows, context, dtype=torch.long, device=dev)
        self.mask = torch.zeros(rows, context, dtype=torch.bool, device=dev)
        self.windowed = {w: torch.zeros(rows, context, dtype=torch.bool, device=dev) for w in windows}
        self.out: torch.Tensor | None = None
        self.graph: _Graph | None = None
        self.runs = 0


class DecodeGraphs:
    """Decode micro-batches of ``stage`` over ``pool``, as static steps (CUDA graphs where ``graph``)."""

    def __init__(self, stage: StageModel, pool: KVPool | None, *, graph: bool):
        self.stage, self.pool, self.graph = stage, pool, graph
        self._steps: dict[tuple[int, int], _Static] = {}
        self._trash = pool.trash_slot() if pool is not None else 0
        self._windows = {a.window for a in self._attention() if a.window is not None}

    @property
    def runs(self) -> int:
        """Micro-batches run as static steps."""
        return sum(s.runs for s in self._steps.values())

    @property
    def captured(self) -> int:
        """Steps captured as CUDA graphs."""
        return sum(s.graph is not None for s in self._steps.values())

    @staticmethod
    def fits(entries: list[Entry]) -> bool:
        """Whether a micro-batch is one this can run: one decode token per entry, every entry live."""
        return (0 < len(entries) <= BUCKETS[-1]
                and all(e.length == 1 and not e.prefill and e.kv is not None for e in entries))

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, entries: list[Entry]) -> torch.Tensor | None:
        """What :meth:`StageModel.forward_batch` returns for ``x`` and ``entries``."""
        n = len(entries)
        rows = next(b for b in BUCKETS if b >= n)
        context = CONTEXT_BUCKET * math.ceil(max(e.start + 1 for e in entries) / CONTEXT_BUCKET)
        step = self._steps.get((rows, context))
        if step is None:
            step = self._steps[rows, context] = _Static(self.stage, rows, context, self._windows)
        self._fill(step, x, entries, context)
        if self.graph and step.graph is None and step.runs >= 1:
            self._capture(step)
        if step.graph is not None:
            step.graph.replay()
            out = step.out
        else:
            out = self._body(step)
        step.runs += 1
        if not self.stage.units.has_head:
            return out[:n, 0].clone()
        rows_wanted = logit_rows(entries)
        return None if rows_wanted is None else out[rows_wanted, 0].clone()

    def _fill(self, step: _Static, x: torch.Tensor, entries: list[Entry], context: int) -> None:
        n = len(entries)
        step.x[:n].copy_(x.view(n, 1, *x.shape[1:]).to(step.x.dtype))
        step.x[n:].zero_()
        starts = torch.tensor([e.start for e in entries])
        step.pos[:n].copy_(starts)
        step.pos[n:].zero_()
        if self.pool is None:
            return
        step.write[:n].copy_(torch.cat([e.kv.slots(e.start, e.start + 1, torch.device("cpu")) for e in entries]))
        step.write[n:].fill_(self._trash)
        gather = torch.full((step.gather.shape[0], context), self._trash, dtype=torch.long)
        for i, e in enumerate(entries):
            gather[i, :e.start + 1] = e.kv.slots(0, e.start + 1, torch.device("cpu"))
        step.gather.copy_(gather)
        k_pos = torch.arange(context)[None, :]
        q_pos = step.pos.cpu()[:, None]
        mask = k_pos <= q_pos
        step.mask.copy_(mask)
        for w, buf in step.windowed.items():
            buf.copy_(mask & (k_pos > q_pos - w))

    def _attention(self) -> list[Attention]:
        return [b for b in self.stage.blocks.values() if isinstance(b, Attention)]

    def _body(self, step: _Static) -> torch.Tensor:
        stage, x = self.stage, step.x
        tables = stage.rotations(step.pos)
        for u, block in stage.blocks.items():
            if isinstance(block, Attention):
                mask = step.windowed[block.window] if block.window is not None else step.mask
                x = block.forward_decode(x, *tables[block.rope], self.pool.k[block.layer], self.pool.v[block.layer],
                                         step.write, step.gather, mask)
            else:
                x = block(x)  # embed, MLP, or the head on each row's one position
        return x

    def _capture(self, step: _Static) -> None:
        # CUDA graphs need the kernels warmed up on a side stream first; the warm-up runs the real
        # step (inputs are already in place), which the replay then repeats, writing the same K/V.
        dev = self.stage.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._body(step)
        torch.cuda.current_stream(dev).wait_stream(side)
        with _GRAPH_LOCK:
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the daemon's connection threads keep uploading micro-batches meanwhile
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    step.out = self._body(step)
            except BaseException:
                graph = None  # a failed capture's graph goes here, under the lock
                raise
            step.graph = _Graph(graph)
