"""What a stage daemon does, without gRPC: hold unit ranges, run sequences, forward results.

Design note. One daemon drives one device, so all model work runs on one worker thread, in the
order slices were accepted. A daemon holds one unit range (a *part*), or several in an
interleaved schedule (``A1 B1 C1 A2 B2 C2``): each part has its own successor and, per sequence,
its own KV cache, and a slice names the part it is for by its first unit. gRPC handler threads
validate and decode incoming payloads while the worker computes (receiving overlaps compute); a
sender thread encodes each output and submits it straight to the successor daemon (sending
overlaps the next compute). The last stage queues results per sequence for the coordinator's
``Results`` stream. A sequence's KV cache lives from ``open`` until ``close``, a failure, or
``idle_timeout_s`` without traffic (a vanished coordinator), whichever comes first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import psutil
import torch

from hpipe.errors import HpipeError, InputError
from hpipe.model import StageCache, StageModel
from hpipe.units import UnitRange
from runtime import memory
from runtime.device_io import DeviceIO, Pending
from runtime.wire import checked_view, tensor_bytes

log = logging.getLogger(__name__)


class StageError(HpipeError):
    """An error with the gRPC status name it maps to (the servicer does the mapping)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Stats:
    compute_s: float = 0.0
    send_s: float = 0.0
    recv_decode_s: float = 0.0
    slices: int = 0
    bytes_sent: int = 0
    #: (start, length, received, begin, end) per computed slice, wall-clock seconds
    spans: list = field(default_factory=list)
    unit_start: int = 0  # the part these are of


@dataclass
class SliceOutput:
    start: int
    length: int
    logits: "torch.Tensor | Pending | None" = None
    error: str = ""


_CLOSED = object()  # sentinel that ends a results stream


class _DeviceCall:
    """A function queued for the worker thread, with its outcome."""

    def __init__(self, fn):
        self.fn, self.result, self.error = fn, None, None
        self.event = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as e:  # noqa: BLE001 - handed back to the caller's thread
            self.error = e
        finally:
            self.event.set()


@dataclass
class SequencePart:
    """A sequence's state on one part: its KV cache, progress and timings."""
    cache: StageCache
    submitted: int = 0  # positions accepted so far (the queue may still hold some)
    stats: Stats = field(default_factory=Stats)
    timers: list = field(default_factory=list)  # (start, length, received, Timer) per slice, read when stats are
    decode: object = None  # DecodeStep (CUDA graph) once the sequence decodes on a GPU
    decode_steps: int = 0


@dataclass
class Sequence:
    id: int
    parts: dict  # first unit of a part -> SequencePart
    idle_timeout_s: float
    last_active: float
    error: str = ""
    closed: bool = False
    results: "queue.Queue" = field(default_factory=queue.Queue)
    anchor: object = None  # device_io.Anchor of a GPU sequence: places its timers on the wall clock

    @property
    def kv_bytes(self) -> int:
        return sum(p.cache.nbytes for p in self.parts.values())


@dataclass(frozen=True)
class PartSpec:
    """One unit range to hold, and where its outputs go (empty ``next_address``: it holds the head)."""
    unit_start: int
    unit_end: int
    next_address: str = ""
    next_name: str = ""
    stage_index: int = 0


@dataclass(frozen=True)
class Deployment:
    model: str
    dtype: torch.dtype
    parts: tuple[PartSpec, ...]


@dataclass
class Part:
    """A loaded part: its units' model and its sender to the successor."""
    spec: PartSpec
    stage: StageModel
    send: "SendFn | None"

    @property
    def units(self) -> UnitRange:
        return self.stage.units

    @property
    def next_name(self) -> str:
        return self.spec.next_name or self.spec.next_address


#: sends one slice to the successor:
#: (sequence_id, unit_start, start, length, payload bytes, all_logits, want_logits) -> None
SendFn = Callable[[int, int, int, int, bytes, bool, bool], None]


class StageServer:
    def __init__(self, device: str = "cpu", memory_budget: int | None = None,
                 connect: Callable[[str], SendFn] | None = None,
                 on_worker_start: Callable[[], None] | None = None, cuda_graphs: bool = True):
        self.device = torch.device(device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.io = DeviceIO(self.device)
        self._on_worker_start = on_worker_start  # e.g. name the thread an emulated device's CPU quota finds
        self.memory_budget = memory_budget
        self._connect = connect  # opens a sender to the successor's address (gRPC in production)
        self.parts: dict[int, Part] = {}  # first unit -> part, in pipeline order
        self.deployment: Deployment | None = None
        self.weight_bytes = 0
        self._baseline_memory = 0
        self._sequences: dict[int, Sequence] = {}
        self._anchor = None  # device_io.Anchor shared by GPU sequences (see open)
        self._lock = threading.RLock()
        self._work: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=f, name=n, daemon=True)
                         for f, n in ((self._work_loop, "stage-worker"), (self._send_loop, "stage-sender"),
                                      (self._reap_loop, "stage-reaper"))]
        for t in self._threads:
            t.start()

    def host_cpu_seconds(self) -> float:
        """CPU seconds this process has used outside the device worker (RPC handlers, transport,
        sender) since it started: what moving activations costs the host, apart from compute."""
        total = time.process_time()
        try:
            worker = time.clock_gettime(time.pthread_getcpuclockid(self._threads[0].ident))
        except (AttributeError, OSError):  # no per-thread clocks on this platform
            return total
        return max(total - worker, 0.0)

    # --- deployment -------------------------------------------------------------------------
    def load(self, model: str, dtype: torch.dtype, parts: list[PartSpec]) -> dict:
        """Hold ``parts`` of ``model`` (replacing any other deployment); sizes summed over the parts."""
        from hpipe.shapes import is_random, model_shape
        from hpipe.sources import resolve_model

        t0 = time.perf_counter()
        if not parts:
            raise StageError("INVALID_ARGUMENT", "a deployment needs at least one unit range")
        source = None if is_random(model) else resolve_model(model)
        cfg = model_shape(model)[1] if source is None else source.config
        ranges = []
        for p in parts:
            units = UnitRange(p.unit_start, p.unit_end, cfg.num_layers)
            if units.has_head == bool(p.next_address):
                raise StageError("INVALID_ARGUMENT", f"stage {units}: a successor is required unless the stage "
                                 "holds the head, and the stage holding the head has none")
            ranges.append(units)
        ordered = sorted(ranges, key=lambda u: u.start)
        if any(a.end > b.start for a, b in zip(ordered, ordered[1:])):
            raise StageError("INVALID_ARGUMENT", f"unit ranges {', '.join(map(str, ranges))} overlap")
        dep = Deployment(model, dtype, tuple(parts))
        with self._lock:
            if self.deployment != dep:
                for seq_id in list(self._sequences):
                    self.close(seq_id)
                self.parts, self.deployment, self.weight_bytes = {}, None, 0
                self._baseline_memory = memory.current(self.device)
                weights = sum(p.numel() for u in ranges for p in _unit_params(cfg, u)) * dtype.itemsize
                self._check_memory(weights, what=f"the weights of units {', '.join(map(str, ranges))}")
                loaded = {}
                for spec, units in zip(parts, ranges):
                    if source is None:  # random:NAME: this daemon creates its own units' weights
                        stage = StageModel.random(cfg, units, dtype=dtype, device=self.device)
                    else:
                        stage = StageModel.from_checkpoint(source.weights(), cfg, units, dtype=dtype,
                                                           device=self.device)
                    send = self._connect(spec.next_address) if spec.next_address and self._connect else None
                    loaded[units.start] = Part(spec, stage, send)
                self.weight_bytes = sum(p.stage.weight_bytes() for p in loaded.values())
                self.parts, self.deployment = loaded, dep
                memory.reset_peak(self.device)  # peaks reported from now on are this deployment's
                log.info("loaded units %s of %s (%s) in %.1fs", ", ".join(map(str, ranges)), model, dtype,
                         time.perf_counter() - t0)
            stages = [p.stage for p in self.parts.values()]
        return {
            "parameters": sum(s.parameter_count() for s in stages), "weight_bytes": self.weight_bytes,
            "load_s": time.perf_counter() - t0, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "kv_bytes_per_token": sum(StageCache.bytes_per_token(len(s.units.attention_layers()), cfg.num_kv_heads,
                                                                 cfg.head_dim, dtype) for s in stages),
        }

    def _require_parts(self) -> dict[int, Part]:
        parts = self.parts
        if not parts:
            raise StageError("FAILED_PRECONDITION", "no model is loaded on this daemon (deploy a plan first)")
        return parts

    def _held(self) -> str:
        return ", ".join(str(p.units) for p in self.parts.values())

    def _available_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return psutil.virtual_memory().available

    def _check_memory(self, new_bytes: int, what: str) -> None:
        if self.memory_budget is not None:
            used = self.weight_bytes + self.kv_bytes()
            if used + new_bytes > self.memory_budget:
                raise StageError("RESOURCE_EXHAUSTED",
                                 f"{what} need {_mib(new_bytes)}; {_mib(used)} of the {_mib(self.memory_budget)} "
                                 "memory budget are in use")
        available = self._available_memory()
        if new_bytes > 0.9 * available:
            raise StageError("RESOURCE_EXHAUSTED", f"{what} need {_mib(new_bytes)}; the device has {_mib(available)} free")

    def kv_bytes(self) -> int:
        with self._lock:
            return sum(s.kv_bytes for s in self._sequences.values())

    # --- sequences ----------------------------------------------------------------------------
    def open(self, seq_id: int, batch: int, max_len: int, idle_timeout_s: float) -> list[int]:
        """Allocate the sequence's KV cache on every part; returns each part's bytes."""
        parts = self._require_parts()
        cfg = next(iter(parts.values())).stage.cfg
        if batch < 1 or max_len < 1:
            raise StageError("INVALID_ARGUMENT", f"batch and max_len must be >= 1 (got {batch}, {max_len})")
        if max_len > cfg.max_position_embeddings:
            raise StageError("OUT_OF_RANGE", f"max_len {max_len} exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        per_token = sum(StageCache.bytes_per_token(len(p.units.attention_layers()), cfg.num_kv_heads, cfg.head_dim,
                                                   p.stage.dtype, batch) for p in parts.values())
        if self.io.cuda and (self._anchor is None or not self._sequences):
            # waits for the device to reach an event: only when no sequence is open, so that the
            # wait is short and never holds up the open of a sequence beside one in flight
            self._anchor = self.io.anchor()
        with self._lock:
            if seq_id in self._sequences:
                raise StageError("ALREADY_EXISTS", f"sequence {seq_id} is already open")
            self._check_memory(per_token * max_len, what=f"the KV cache of sequence {seq_id} ({batch} x {max_len} tokens)")
            caches = {u: SequencePart(p.stage.new_cache(batch, max_len)) for u, p in parts.items()}
            timeout = idle_timeout_s if idle_timeout_s > 0 else 60.0
            seq = self._sequences[seq_id] = Sequence(seq_id, caches, timeout, time.monotonic(), anchor=self._anchor)
        log.debug("sequence %d opened: batch %d, max_len %d, %s KV", seq_id, batch, max_len, _mib(seq.kv_bytes))
        return [c.cache.nbytes for c in caches.values()]

    def _get(self, seq_id: int) -> Sequence:
        seq = self._sequences.get(seq_id)
        if seq is None or seq.closed:
            raise StageError("NOT_FOUND", f"unknown sequence {seq_id} (never opened, closed, or timed out)")
        return seq

    def submit(self, seq_id: int, unit_start: int, start: int, length: int, payload: bytes,
               all_logits: bool = False, want_logits: bool = True) -> None:
        """Validate and decode one slice (in the caller's thread), start its upload, queue it for the worker."""
        part = self._require_parts().get(unit_start)
        if part is None:
            raise StageError("FAILED_PRECONDITION", f"this daemon holds units {self._held()}; the slice is for "
                             f"unit {unit_start}")
        stage = part.stage
        with self._lock:
            seq = self._get(seq_id)
            sp = seq.parts[unit_start]
            if seq.error:
                raise StageError("ABORTED", f"sequence {seq_id} failed: {seq.error}")
            if length < 1:
                raise StageError("INVALID_ARGUMENT", f"slice length must be >= 1, got {length}")
            if start != sp.submitted:
                raise StageError("FAILED_PRECONDITION", f"slice starts at position {start}; sequence {seq_id} "
                                 f"continues at {sp.submitted}")
            if start + length > sp.cache.max_len:
                raise StageError("OUT_OF_RANGE", f"positions up to {start + length} exceed sequence {seq_id}'s "
                                 f"declared max length {sp.cache.max_len}")
            t0 = time.perf_counter()
            try:
                if stage.units.has_embed:
                    ids = checked_view(payload, (sp.cache.batch, length), torch.int64)
                    if int(ids.min()) < 0 or int(ids.max()) >= stage.cfg.vocab_size:
                        raise InputError(f"token ids must lie in [0, {stage.cfg.vocab_size})")
                    x = self.io.upload(payload, (sp.cache.batch, length), torch.int64)
                else:
                    x = self.io.upload(payload, (sp.cache.batch, length, stage.cfg.hidden_size), stage.dtype)
            except InputError as e:
                raise StageError("INVALID_ARGUMENT", f"sequence {seq_id}, slice at {start}: {e}") from None
            sp.stats.recv_decode_s += time.perf_counter() - t0
            sp.submitted = start + length
            seq.last_active = time.monotonic()
            self._work.put((seq, part, x, start, all_logits, want_logits, time.time()))

    def results(self, seq_id: int, is_active: Callable[[], bool] = lambda: True) -> Iterator[SliceOutput]:
        """The last stage's outputs for ``seq_id``, in order, until the sequence is closed."""
        if not any(p.units.has_head for p in self._require_parts().values()):
            raise StageError("FAILED_PRECONDITION", f"this daemon holds units {self._held()}, not the head")
        with self._lock:
            seq = self._get(seq_id)
        while is_active() and not self._stopping.is_set():
            try:
                item = seq.results.get(timeout=0.25)
            except queue.Empty:
                continue
            if item is _CLOSED:
                return
            if isinstance(item.logits, Pending):
                item.logits = item.logits.on_host()
            yield item

    def close(self, seq_id: int) -> list[Stats] | None:
        """Free the sequence; its statistics per part (each with ``unit_start``), or None if unknown."""
        with self._lock:
            seq = self._sequences.pop(seq_id, None)
        if seq is None:
            return None
        seq.closed = True
        seq.results.put(_CLOSED)
        out = []
        for unit_start, sp in seq.parts.items():
            sp.decode = None  # its graph holds the cache
            sp.cache = StageCache(batch=sp.cache.batch, max_len=sp.cache.max_len)  # drop the tensors now
            timers = list(sp.timers)
            sp.stats.compute_s = sum(t.seconds() for *_, t in timers)
            sp.stats.spans = [(start, length, received, *span) for start, length, received, t in timers
                              if (span := t.span()) is not None]
            sp.stats.unit_start = unit_start
            out.append(sp.stats)
        log.debug("sequence %d closed", seq_id)
        return out

    def status(self, seq_ids: list[int]) -> dict:
        with self._lock:
            states = []
            for i in seq_ids:
                seq = self._sequences.get(i)
                length = min(p.cache.length for p in seq.parts.values()) if seq else 0
                states.append({"sequence_id": i, "open": seq is not None, "length": length,
                               "error": seq.error if seq else ""})
            dep = self.deployment
            return {
                "loaded": dep is not None, "model": dep.model if dep else "", "parts": dep.parts if dep else (),
                "device": str(self.device), "open_sequences": len(self._sequences), "kv_bytes": self.kv_bytes(),
                "weight_bytes": self.weight_bytes, "memory_budget": self.memory_budget or 0, "sequences": states,
                "peak_memory_bytes": memory.peak(self.device), "baseline_memory_bytes": self._baseline_memory,
            }

    def _fail(self, seq: Sequence, message: str) -> None:
        if not seq.error:
            seq.error = message
            log.error("sequence %d failed: %s", seq.id, message)
            seq.results.put(SliceOutput(0, 0, error=message))

    # --- threads ------------------------------------------------------------------------------
    def run_on_device(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run ``fn`` on the worker thread, between slices, and return its result (or raise its error).

        Profiling goes through here, so measurements run on the thread (and under the limits) that
        runs slices, and never overlap a slice's compute.
        """
        done = _DeviceCall(fn)
        self._work.put(done)
        if not done.event.wait(timeout_s):
            raise StageError("DEADLINE_EXCEEDED", "the device did not get to the request in time")
        if done.error is not None:
            raise done.error
        return done.result

    def _work_loop(self) -> None:
        if self._on_worker_start:
            self._on_worker_start()
        while True:
            item = self._work.get()  # blocks: an idle daemon uses no CPU
            if item is _CLOSED:
                return
            if isinstance(item, _DeviceCall):
                item.run()
            else:
                # in a method of its own so that its locals (the stage model, activations) do not
                # outlive the slice: a redeployment must not find the old model still referenced
                self._run_slice(*item)
            del item

    def _run_slice(self, seq: Sequence, part: Part, pending: Pending, start: int, all_logits: bool,
                   want_logits: bool, received: float) -> None:
        if seq.closed or seq.error:
            return
        stage, sp = part.stage, seq.parts[part.units.start]
        try:
            x = pending.on_device()
            timer = self.io.timer(seq.anchor)
            timer.start()
            step = self._decode_step(sp, stage, x, start, want_logits)
            out = step(x, start) if step else stage(x, start, sp.cache, all_logits=all_logits,
                                                    logits=want_logits)
            timer.stop()
            sp.timers.append((start, x.shape[1], received, timer))
            sp.stats.slices += 1
        except HpipeError as e:
            self._fail(seq, f"stage {part.spec.stage_index}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a bug must fail the sequence, not kill the worker
            log.exception("stage compute failed")
            self._fail(seq, f"stage {part.spec.stage_index}: internal error: {e!r}")
            return
        seq.last_active = time.monotonic()
        if stage.units.has_head:
            logits = None
            if out is not None:
                logits = self.io.download(out.float() if all_logits else out[:, -1].float())
            seq.results.put(SliceOutput(start, x.shape[1], logits))
        else:
            self._outbox.put((seq, part, start, x.shape[1], self.io.download(out), all_logits, want_logits))

    def _decode_step(self, sp: SequencePart, stage: StageModel, x: torch.Tensor, start: int, want_logits: bool):
        """The sequence's CUDA-graph decode step for this slice on this part, if it is one (None: run eagerly).

        A one-token slice after the prompt is a decode step. The first runs eagerly (it warms up
        the kernels); the second captures the graph that the rest replay.
        """
        if not (self.cuda_graphs and x.shape[1] == 1 and start > 0 and (want_logits or not stage.units.has_head)):
            return None
        sp.decode_steps += 1
        if sp.decode is None and sp.decode_steps >= 2:
            from hpipe.model.graphs import DecodeStep

            sp.decode = DecodeStep(stage, sp.cache, graph=True)
        if sp.decode is None:
            return None

        def run(x, start):
            try:
                return sp.decode(x, start)
            except RuntimeError as e:  # a capture this device or driver refuses: carry on eagerly
                log.warning("CUDA graph decode failed (%s); decoding eagerly from now on", e)
                self.cuda_graphs, sp.decode = False, None
                return stage(x, start, sp.cache)
        return run

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is _CLOSED:
                return
            seq, part, start, length, pending, all_logits, want_logits = item
            if seq.closed or seq.error:
                continue
            index, stats = part.spec.stage_index, seq.parts[part.units.start].stats
            t0 = time.perf_counter()
            try:
                payload = tensor_bytes(pending.on_host())
                part.send(seq.id, part.units.end, start, length, payload, all_logits, want_logits)
            except HpipeError as e:
                self._fail(seq, f"stage {index} could not send to stage {index + 1} ({part.next_name}): {e}")
                continue
            stats.send_s += time.perf_counter() - t0
            stats.bytes_sent += len(payload)
            seq.last_active = time.monotonic()

    def _reap_loop(self) -> None:
        while not self._stopping.wait(0.5):
            now = time.monotonic()
            with self._lock:
                idle = [s.id for s in self._sequences.values() if now - s.last_active > s.idle_timeout_s]
            for seq_id in idle:
                log.warning("sequence %d idle for too long: freeing its KV cache", seq_id)
                self.close(seq_id)

    def shutdown(self) -> None:
        for seq_id in list(self._sequences):
            self.close(seq_id)
        self._stopping.set()
        self._work.put(_CLOSED)
        self._outbox.put(_CLOSED)


def _unit_params(cfg, units: UnitRange):
    """Parameter shapes of ``units`` without allocating them (meta tensors)."""
    from hpipe.model.layers import build_unit

    with torch.device("meta"):
        seen = []
        for u in units:
            seen.extend(build_unit(cfg, u).parameters())
        if cfg.tie_word_embeddings and units.has_embed and units.has_head:
            seen.pop()  # the LM head shares the embedding's tensor
    return seen


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
