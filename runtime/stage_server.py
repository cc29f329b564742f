"""What a stage daemon does, without gRPC: hold stages, run sequences' slices, forward results.

Design note. One daemon drives one device, so all model work runs on one worker thread, in the
order slices were accepted. A daemon holds one stage, or several in an interleaved schedule
(``A1 B1 C1 A2 B2 C2``): each stage has its own successor and, per sequence, its own KV cache,
and a slice names the stage it is for. gRPC handler threads validate and decode incoming
payloads while the worker computes (receiving overlaps compute); a sender thread encodes each
output and submits it straight to the successor daemon (sending overlaps the next compute). The
last stage queues results per sequence for the coordinator's ``Results`` stream. A reaper
thread frees sequences left idle (:mod:`runtime.sequences`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator

import torch

from hpipe.core.errors import HpipeError, InputError, StatusError
from hpipe.model import StageCache
from runtime import deployment, memory
from runtime.deployment import Deployment, LoadedStage, SendFn
from runtime.device_io import DeviceIO, Pending
from runtime.sequences import CLOSED, Sequence, SequenceStage, SequenceTable, SliceOutput, Stats, idle_timeout
from runtime.wire import checked_view, tensor_bytes

log = logging.getLogger(__name__)


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
        self.before_load: list[Callable[[], None]] = []  # e.g. free what profiling built
        self.stages: dict[int, LoadedStage] = {}  # stage index -> held stage, in pipeline order
        self.deployment: Deployment | None = None
        self.weight_bytes = 0
        self._baseline_memory = 0
        self.sequences = SequenceTable()
        self._anchor = None  # device_io.Anchor shared by GPU sequences (see open)
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
    def load(self, dep: Deployment) -> dict:
        """Hold ``dep``'s stages (replacing any other deployment); sizes summed over the held stages."""
        t0 = time.perf_counter()
        with self.sequences.lock:
            if self.deployment != dep:
                for hook in self.before_load:
                    hook()
                for seq_id in self.sequences.ids():
                    self.close(seq_id)
                self.stages, self.deployment, self.weight_bytes = {}, None, 0
                self._baseline_memory = memory.current(self.device)
                loaded = deployment.load(dep, self.device, self._connect,
                                         lambda n, what: self._check_memory(n, what))
                self.weight_bytes = sum(s.model.weight_bytes() for s in loaded.values())
                self.stages, self.deployment = loaded, dep
                memory.reset_peak(self.device)  # peaks reported from now on are this deployment's
                log.info("loaded units %s of %s (%s) in %.1fs", self._held(), dep.model, dep.dtype,
                         time.perf_counter() - t0)
            models = [s.model for s in self.stages.values()]
        cfg = models[0].cfg
        return {
            "parameters": sum(m.parameter_count() for m in models), "weight_bytes": self.weight_bytes,
            "load_s": time.perf_counter() - t0, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "kv_bytes_per_token": sum(StageCache.bytes_per_token(len(m.units.attention_layers()), cfg.num_kv_heads,
                                                                 cfg.head_dim, m.dtype) for m in models),
        }

    def _require_stages(self) -> dict[int, LoadedStage]:
        stages = self.stages
        if not stages:
            raise StatusError("FAILED_PRECONDITION", "no model is loaded on this daemon (deploy a plan first)")
        return stages

    def _held(self) -> str:
        return ", ".join(str(s.units) for s in self.stages.values())

    def _check_memory(self, new_bytes: int, what: str) -> None:
        deployment.check_memory(self.device, self.memory_budget, self.weight_bytes + self.sequences.kv_bytes(),
                                new_bytes, what)

    def kv_bytes(self) -> int:
        return self.sequences.kv_bytes()

    # --- sequences ----------------------------------------------------------------------------
    def open(self, seq_id: int, batch: int, max_len: int, idle_timeout_s: float) -> list[int]:
        """Allocate the sequence's KV cache on every held stage; returns each stage's bytes."""
        stages = self._require_stages()
        cfg = next(iter(stages.values())).model.cfg
        if batch < 1 or max_len < 1:
            raise StatusError("INVALID_ARGUMENT", f"batch and max_len must be >= 1 (got {batch}, {max_len})")
        if max_len > cfg.max_position_embeddings:
            raise StatusError("OUT_OF_RANGE", f"max_len {max_len} exceeds the model's context of "
                              f"{cfg.max_position_embeddings} tokens")
        timeout = idle_timeout(idle_timeout_s)
        per_token = sum(StageCache.bytes_per_token(len(s.units.attention_layers()), cfg.num_kv_heads, cfg.head_dim,
                                                   s.model.dtype, batch) for s in stages.values())
        if self.io.cuda and (self._anchor is None or not len(self.sequences)):
            # waits for the device to reach an event: only when no sequence is open, so that the
            # wait is short and never holds up the open of a sequence beside one in flight
            self._anchor = self.io.anchor()
        with self.sequences.lock:
            if self.sequences.find(seq_id) is not None:
                raise StatusError("ALREADY_EXISTS", f"sequence {seq_id} is already open")
            self._check_memory(per_token * max_len,
                               what=f"the KV cache of sequence {seq_id} ({batch} x {max_len} tokens)")
            caches = {i: SequenceStage(s.model.new_cache(batch, max_len)) for i, s in stages.items()}
            seq = Sequence(seq_id, caches, timeout, time.monotonic(), anchor=self._anchor)
            self.sequences.add(seq)
        log.debug("sequence %d opened: batch %d, max_len %d, %s KV", seq_id, batch, max_len,
                  deployment.mib(seq.kv_bytes))
        return [c.cache.nbytes for c in caches.values()]

    def submit(self, seq_id: int, stage_index: int, start: int, length: int, payload: bytes,
               all_logits: bool = False, want_logits: bool = True) -> None:
        """Validate and decode one slice (in the caller's thread), start its upload, queue it for the worker."""
        stage = self._require_stages().get(stage_index)
        if stage is None:
            raise StatusError("FAILED_PRECONDITION", f"this daemon holds units {self._held()}; the slice is for "
                              f"stage {stage_index}")
        model = stage.model
        with self.sequences.lock:
            seq = self.sequences.get(seq_id)
            ss = seq.stages[stage_index]
            if seq.error:
                raise StatusError("ABORTED", f"sequence {seq_id} failed: {seq.error}")
            if length < 1:
                raise StatusError("INVALID_ARGUMENT", f"slice length must be >= 1, got {length}")
            if start != ss.submitted:
                raise StatusError("FAILED_PRECONDITION", f"slice starts at position {start}; sequence {seq_id} "
                                  f"continues at {ss.submitted}")
            if start + length > ss.cache.max_len:
                raise StatusError("OUT_OF_RANGE", f"positions up to {start + length} exceed sequence {seq_id}'s "
                                  f"declared max length {ss.cache.max_len}")
            t0 = time.perf_counter()
            try:
                if model.units.has_embed:
                    ids = checked_view(payload, (ss.cache.batch, length), torch.int64)
                    if int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab_size:
                        raise InputError(f"token ids must lie in [0, {model.cfg.vocab_size})")
                    x = self.io.upload(payload, (ss.cache.batch, length), torch.int64)
                else:
                    x = self.io.upload(payload, (ss.cache.batch, length, model.cfg.hidden_size), model.dtype)
            except InputError as e:
                raise StatusError("INVALID_ARGUMENT", f"sequence {seq_id}, slice at {start}: {e}") from None
            ss.stats.recv_decode_s += time.perf_counter() - t0
            ss.submitted = start + length
            seq.last_active = time.monotonic()
            self._work.put((seq, stage, x, start, all_logits, want_logits, time.time()))

    def results(self, seq_id: int, is_active: Callable[[], bool] = lambda: True) -> Iterator[SliceOutput]:
        """The last stage's outputs for ``seq_id``, in order, until the sequence is closed."""
        if not any(s.units.has_head for s in self._require_stages().values()):
            raise StatusError("FAILED_PRECONDITION", f"this daemon holds units {self._held()}, not the head")
        seq = self.sequences.get(seq_id)
        while is_active() and not self._stopping.is_set():
            try:
                item = seq.results.get(timeout=0.25)
            except queue.Empty:
                continue
            if item is CLOSED:
                return
            if isinstance(item.logits, Pending):
                item.logits = item.logits.on_host()
            yield item

    def close(self, seq_id: int) -> list[Stats] | None:
        """Free the sequence; its statistics per held stage (each with ``stage``), or None if unknown."""
        seq = self.sequences.pop(seq_id)
        if seq is None:
            return None
        out = []
        for index, ss in seq.stages.items():
            ss.decode = None  # its graph holds the cache
            ss.cache = StageCache(batch=ss.cache.batch, max_len=ss.cache.max_len)  # drop the tensors now
            timers = list(ss.timers)
            ss.stats.compute_s = sum(t.seconds() for *_, t in timers)
            ss.stats.spans = [(start, length, received, *span) for start, length, received, t in timers
                              if (span := t.span()) is not None]
            ss.stats.stage = index
            out.append(ss.stats)
        log.debug("sequence %d closed", seq_id)
        return out

    def status(self, seq_ids: list[int]) -> dict:
        with self.sequences.lock:
            states = []
            for i in seq_ids:
                seq = self.sequences.find(i)
                length = min(s.cache.length for s in seq.stages.values()) if seq else 0
                states.append({"sequence_id": i, "open": seq is not None, "length": length,
                               "error": seq.error if seq else ""})
            dep = self.deployment
            return {
                "loaded": dep is not None, "model": dep.model if dep else "",
                "stages": [(i, dep.stages[i]) for i in dep.held] if dep else [],
                "device": str(self.device), "open_sequences": len(self.sequences), "kv_bytes": self.kv_bytes(),
                "weight_bytes": self.weight_bytes, "memory_budget": self.memory_budget or 0, "sequences": states,
                "peak_memory_bytes": memory.peak(self.device), "baseline_memory_bytes": self._baseline_memory,
            }

    # --- threads ------------------------------------------------------------------------------
    def run_on_device(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run ``fn`` on the worker thread, between slices, and return its result (or raise its error).

        Profiling goes through here, so measurements run on the thread (and under the limits) that
        runs slices, and never overlap a slice's compute.
        """
        done = _DeviceCall(fn)
        self._work.put(done)
        if not done.event.wait(timeout_s):
            raise StatusError("DEADLINE_EXCEEDED", "the device did not get to the request in time")
        if done.error is not None:
            raise done.error
        return done.result

    def _work_loop(self) -> None:
        if self._on_worker_start:
            self._on_worker_start()
        while True:
            item = self._work.get()  # blocks: an idle daemon uses no CPU
            if item is CLOSED:
                return
            if isinstance(item, _DeviceCall):
                item.run()
            else:
                # in a method of its own so that its locals (the stage model, activations) do not
                # outlive the slice: a redeployment must not find the old model still referenced
                self._run_slice(*item)
            del item

    def _run_slice(self, seq: Sequence, stage: LoadedStage, pending: Pending, start: int, all_logits: bool,
                   want_logits: bool, received: float) -> None:
        if seq.closed or seq.error:
            return
        model, ss = stage.model, seq.stages[stage.index]
        try:
            x = pending.on_device()
            timer = self.io.timer(seq.anchor)
            timer.start()
            step = self._decode_step(ss, model, x, start, want_logits)
            out = step(x, start) if step else model(x, start, ss.cache, all_logits=all_logits, logits=want_logits)
            timer.stop()
            ss.timers.append((start, x.shape[1], received, timer))
            ss.stats.slices += 1
        except HpipeError as e:
            seq.fail(f"stage {stage.index}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a bug must fail the sequence, not kill the worker
            log.exception("stage compute failed")
            seq.fail(f"stage {stage.index}: internal error: {e!r}")
            return
        seq.last_active = time.monotonic()
        if model.units.has_head:
            logits = None
            if out is not None:
                logits = self.io.download(out.float() if all_logits else out[:, -1].float())
            seq.results.put(SliceOutput(start, x.shape[1], logits))
        else:
            self._outbox.put((seq, stage, start, x.shape[1], self.io.download(out), all_logits, want_logits))

    def _decode_step(self, ss: SequenceStage, model, x: torch.Tensor, start: int, want_logits: bool):
        """The sequence's CUDA-graph decode step for this slice on this stage, if it is one (None: run eagerly).

        A one-token slice after the prompt is a decode step. The first runs eagerly (it warms up
        the kernels); the second captures the graph that the rest replay.
        """
        if not (self.cuda_graphs and x.shape[1] == 1 and start > 0 and (want_logits or not model.units.has_head)):
            return None
        ss.decode_steps += 1
        if ss.decode is None and ss.decode_steps >= 2:
            from hpipe.model.graphs import DecodeStep

            ss.decode = DecodeStep(model, ss.cache, graph=True)
        if ss.decode is None:
            return None

        def run(x, start):
            try:
                return ss.decode(x, start)
            except RuntimeError as e:  # a capture this device or driver refuses: carry on eagerly
                log.warning("CUDA graph decode failed (%s); decoding eagerly from now on", e)
                self.cuda_graphs, ss.decode = False, None
                return model(x, start, ss.cache)
        return run

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is CLOSED:
                return
            seq, stage, start, length, pending, all_logits, want_logits = item
            if seq.closed or seq.error:
                continue
            stats = seq.stages[stage.index].stats
            t0 = time.perf_counter()
            try:
                payload = tensor_bytes(pending.on_host())
                stage.send(seq.id, stage.index + 1, start, length, payload, all_logits, want_logits)
            except HpipeError as e:
                nxt = stage.successor
                seq.fail(f"stage {stage.index} could not send to stage {stage.index + 1} "
                         f"({nxt.daemon or nxt.address}): {e}")
                continue
            stats.send_s += time.perf_counter() - t0
            stats.bytes_sent += len(payload)
            seq.last_active = time.monotonic()

    def _reap_loop(self) -> None:
        while not self._stopping.wait(0.5):
            for seq_id in self.sequences.idle():
                log.warning("sequence %d idle for too long: freeing its KV cache", seq_id)
                self.close(seq_id)

    def shutdown(self) -> None:
        for seq_id in self.sequences.ids():
            self.close(seq_id)
        self._stopping.set()
        self._work.put(CLOSED)
        self._outbox.put(CLOSED)
