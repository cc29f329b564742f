"""Activations between the wire and a stage's device, and compute timing that does not stall it.

Design note. On a CUDA device a received micro-batch is read straight off the socket into pinned
host memory and copied to the GPU on an upload stream, in the connection thread that received
it, while the worker computes the micro-batch before it; the worker makes the compute stream wait
for that copy only when it reaches it. An output is copied back on a download stream, into pinned
memory, once the compute stream has produced it, and only the sender thread waits for that copy.
Compute time is taken with CUDA events, so the worker never synchronises the device: it queues the
next micro-batch's kernels while the GPU still runs this one. On the CPU all of this reduces to
handing the tensor over.
Tensors that cross streams are handed to the caching allocator with ``record_stream`` so their
memory is not reused before the other stream is done with them.
"""

from __future__ import annotations

import time

import torch


class Pending:
    """A tensor whose copy may still be in flight."""

    def __init__(self, tensor: torch.Tensor, event: "torch.cuda.Event | None" = None):
        self.tensor, self.event = tensor, event

    def on_device(self) -> torch.Tensor:
        """The tensor, usable by work queued on the current stream from now on."""
        if self.event is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            stream.wait_event(self.event)
            self.tensor.record_stream(stream)
        return self.tensor

    def on_host(self) -> torch.Tensor:
        """The host tensor, once its copy from the device has finished (blocks this thread only)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


class Anchor:
    """A moment known on both clocks: a CUDA event and the wall-clock time it completed at."""

    def __init__(self, device: torch.device):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(torch.cuda.current_stream(device))
        self.event.synchronize()  # returns as the device reaches it: the wall clock read next is its time
        self.wall = time.time()


class Timer:
    """One slice's compute: its seconds, and when it ran on the wall clock.

    On a GPU both come from CUDA events (read later, never stalling the worker), placed on the wall
    clock through the sequence's :class:`Anchor`; on the CPU from the clocks directly.
    """

    def __init__(self, device: torch.device, anchor: Anchor | None = None):
        self.cuda = device.type == "cuda"
        self._anchor: Anchor | None = None
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._anchor = anchor
        self._t0 = self._s = self._wall0 = 0.0
        self._stopped = False

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._wall0 = time.time()
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._s = time.perf_counter() - self._t0
        self._stopped = True

    def seconds(self) -> float:
        """The slice's compute seconds; 0 for a slice still being queued (a sequence closed mid-slice)."""
        if not self._stopped:
            return 0.0
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._s

    def span(self) -> tuple[float, float] | None:
        """Wall-clock (begin, end) of the compute; None if it never ran, or on a GPU without an anchor."""
        if not self._stopped:
            return None
        if not self.cuda:
            return self._wall0, self._wall0 + self._s
        if self._anchor is None:
            return None
        seconds = self.seconds()
        begin = self._anchor.wall + self._anchor.event.elapsed_time(self._start) / 1e3
        return begin, begin + seconds


class DeviceIO:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._anchor: Anchor | None = None
        if self.cuda:
            self._up = torch.cuda.Stream(device)
            self._down = torch.cuda.Stream(device)

    def upload_tensor(self, host: torch.Tensor) -> Pending:
        """Start moving ``host`` (pinned, on a GPU daemon: see :func:`runtime.wire.transport.read_payload`)
        to the device."""
        if not self.cuda:
            return Pending(host)
        with torch.cuda.stream(self._up):
            dev = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._up)
        return Pending(dev, event)

    def download(self, t: torch.Tensor) -> Pending:
        """Start copying ``t`` (just produced on the current stream) to pinned host memory."""
        if not self.cuda:
            return Pending(t)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._down):
            self._down.wait_event(produced)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(self._down)
            event = torch.cuda.Event()
            event.record(self._down)
        return Pending(host, event)

    def timer(self) -> Timer:
        """A timer for one micro-batch's compute. On a GPU its span is placed on the wall clock through
        an anchor recorded at the first timer (the only time the worker waits for the device)."""
        if self.cuda and self._anchor is None:
            self._anchor = Anchor(self.device)
        return Timer(self.device, self._anchor)
