"""What a stage daemon does, without gRPC: hold stages, compute micro-batches, forward results.

Design note. One daemon drives one device, so all model work runs on one worker thread, in the
order micro-batches arrive. A coordinator opens one data connection to every daemon of its
pipeline (a *session*) and sends each micro-batch's layout on it, in order; the daemon lays the
micro-batch out at once (:mod:`runtime.daemon.layout`): it opens the sequences it names and grows their
KV blocks, refusing (and failing) only the sequences it cannot hold. Activations arrive on
connections from the previous stage's daemon (the coordinator's, for the first stage); a
connection's thread reads each payload straight into the tensor the worker will compute on, and
waits for the layout if the data came first. The worker computes the micro-batch: projections
and MLPs once over all its tokens, attention per entry against its sequence's blocks
(:mod:`runtime.daemon.micro_batch`). The outbox's thread (:mod:`runtime.daemon.outbox`) forwards
the output to the next stage's daemon over one persistent connection, or, from the last stage, the
sampled rows' logits to the coordinator's session. Failures travel with the data: each stage adds
the sequences it failed to the activation's list.

The server is composed of those parts, each given the collaborators it uses (the sequence
table, the replay log, the outbox, the layouts); none holds the server.

Recovery. The outbox keeps what each held stage sent downstream in a replay log per sequence
(:mod:`runtime.daemon.replay_log`, within ``replay_budget`` bytes). When a daemon of the pipeline is
restarted, the coordinator's new session adopts the sequences here (:meth:`StageServer.resume`)
and sends replays: this daemon sends the logged rows again to the restarted stage after one of
its own, which rebuilds its KV cache from them (:mod:`runtime.coordinator.resume`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from hpipe.core.errors import StatusError
from hpipe.core.paths import cache_root
from hpipe.model.kv.pool import BLOCK_SIZE
from runtime.daemon import deployment, hoststat, memory
from runtime.daemon.deployment import Deployment, LoadedStage
from runtime.daemon.device_io import DeviceIO
from runtime.daemon.kv_tier import HostTier
from runtime.daemon.kv_transfer import IncomingKV
from runtime.daemon.layout import LAYOUT_WAIT_S, Layouts
from runtime.daemon.micro_batch import MicroBatches, queued_shape
from runtime.daemon.outbox import Outbox
from runtime.daemon.owners import SessionOwners
from runtime.daemon.parking import ParkedStages
from runtime.daemon.prefix_store import PrefixStore
from runtime.daemon.replay_log import DEFAULT_BUDGET, ReplayLog
from runtime.daemon.sequences import SequenceTable
from runtime.daemon.session_stats import SessionStats
from runtime.daemon.shipped import reads_locally
from runtime.daemon.weights_cache import WeightsCache
from runtime.daemon.worker import Worker
from runtime.wire.data_server import DataServer
from runtime.wire.messages import pb
from runtime.wire.transport import Connection, LinkError, read_payload, skip_payload

log = logging.getLogger(__name__)


class StageServer:
    def __init__(self, device: str = "cpu", memory_budget: int | None = None, host: str = "127.0.0.1",
                 token: str | None = None, tls_server=None, tls_client=None,
                 on_worker_start: Callable[[], None] | None = None, cuda_graphs: bool = True,
                 model_dirs: tuple[str, ...] = (), replay_budget: int = DEFAULT_BUDGET, data_port: int = 0,
                 weights_cache: WeightsCache | None = None):
        self.device = torch.device(device)
        self.model_dirs = model_dirs  # where Load may read model files (deployment.check_source)
        #: the weights coordinators ship (runtime.daemon.weights_cache)
        self.weights_cache = weights_cache or WeightsCache(cache_root() / "weights")
        #: how all-decode micro-batches run (hpipe.model.compute.graphs): "graphs" (CUDA graphs), "eager"
        #: (the same static step without capture; tests use it on the CPU) or "off" (forward_batch)
        self.decode_steps = "graphs" if self.device.type == "cuda" and cuda_graphs else "off"
        self.io = DeviceIO(self.device)
        self.memory_budget = memory_budget
        self.before_load: list[Callable[[], None]] = []  # e.g. free what profiling built
        self.stages: dict[int, LoadedStage] = {}  # stage index -> held stage, in pipeline order
        self.deployment: Deployment | None = None
        self.weight_bytes = 0
        self.parked = ParkedStages()  # the weights of stages a layout switch took away
        self._baseline_memory = 0
        self.sequences = SequenceTable()
        self.replay_log = ReplayLog(replay_budget)
        self.stats = SessionStats()
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self.outbox = Outbox(self.sequences, self.replay_log, self.stats, token, tls_client)
        self.prefixes = PrefixStore()
        self.tier = HostTier()
        self.kv_in = IncomingKV()  # KV other daemons sent at a layout switch, for the next Load
        self.owners = SessionOwners()
        self.layouts = Layouts(lambda: self.stages, self.sequences, self.replay_log, self.outbox, self._stopping,
                               self.prefixes, swap_in=self._swap_in)
        self.worker = Worker(MicroBatches(self.sequences, self.io, self.outbox, self.stats, self.layouts),
                             on_worker_start, shape=queued_shape)
        self.data = DataServer(host, token, self._serve_connection, tls_server, port=data_port,
                               admit=self.owners.claim)
        self._reaper = threading.Thread(target=self._reap_loop, name="stage-reaper", daemon=True)
        self._reaper.start()

    def host_cpu_seconds(self) -> float:
        """CPU seconds outside the device worker since the start (:func:`hoststat.host_cpu_seconds`)."""
        return hoststat.host_cpu_seconds(self.worker.clock)

    # --- deployment -------------------------------------------------------------------------
    def load(self, dep: Deployment) -> dict:
        """Hold ``dep``'s stages (replacing any other deployment); sizes summed over the held stages."""
        t0 = time.perf_counter()
        if dep.shipped is None:
            deployment.check_source(dep.model, self.model_dirs)  # before anything held is dropped
        deployment.set_prefill_gemm(dep.prefill_gemm)
        with self._lock:
            if deployment.relinks(self.deployment, dep) and self.deployment != dep:
                # a daemon of the pipeline came back on a new data port, or a stage moved to
                # another: keep the weights, pools and sequences, re-point the successors
                def relink():
                    deployment.relink(self.stages, dep)
                    self.deployment = dep
                self.run_on_device(relink)
                log.info("kept units %s of %s; successors re-pointed", self._held(), dep.model)
            elif deployment.extends(self.deployment, dep):
                self._extend(dep)
                log.info("took over units %s of %s; kept the others", self._held(), dep.model)
            elif deployment.reshards(self.deployment, dep):
                self._reshard(dep)
                log.info("now holds units %s of %s (a layout switch)", self._held(), dep.model)
            elif self.deployment != dep:
                for hook in self.before_load:
                    hook()
                self.run_on_device(self._drop_everything)
                self._baseline_memory = memory.current(self.device)
                loaded = deployment.load(dep, self.device, self.memory_budget,
                                         lambda n, what: deployment.check_memory(self.device, self.memory_budget, 0,
                                                                                 n, what), self.decode_steps,
                                         weights_cache=self.weights_cache)
                self.weight_bytes = sum(s.model.weight_bytes() for s in loaded.values())
                self.stages, self.deployment = loaded, dep
                memory.reset_peak(self.device)  # peaks reported from now on are this deployment's
                log.info("loaded units %s of %s (%s) in %.1fs", self._held(), dep.model, dep.dtype,
                         time.perf_counter() - t0)
            self.run_on_device(lambda: self.kv_in.install(self.stages, self.sequences, self.device, self.tier))
            models = [s.model for s in self.stages.values()]
            self.weights_cache.hold_only(dep.shipped.hashes() if dep.shipped else set())
        cfg = models[0].cfg
        return {
            "parameters": sum(m.parameter_count() for m in models), "weight_bytes": self.weight_bytes,
            "load_s": time.perf_counter() - t0, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "pools": self.pools(),
            "kv_bytes_per_token": sum(m.block_bytes() for m in models) // BLOCK_SIZE,
        }

    def reads_locally(self, model: str, key: str) -> bool:
        """Whether this daemon reads ``model`` from its own files (nothing to ship it)."""
        return reads_locally(model, key, lambda m: deployment.check_source(m, self.model_dirs))

    def _extend(self, dep: Deployment) -> None:
        """Load the stages ``dep`` adds (a lost daemon's, moved here) beside the held ones, with
        pools of as many blocks; every open sequence gets an empty cache on them, which replays
        fill (:mod:`runtime.coordinator.resume`). Nothing held is dropped or reloaded."""
        new = tuple(i for i in dep.held if i not in self.stages)
        blocks = min((s.pool.num_blocks for s in self.stages.values() if s.pool is not None), default=None)
        in_use = self.weight_bytes + sum(s.pool.nbytes for s in self.stages.values() if s.pool is not None)
        added = self.parked.load_beside(new, lambda parked, kept: deployment.load(
            dep, self.device, self.memory_budget,
            lambda n, what: deployment.check_memory(self.device, self.memory_budget, in_use + kept, n, what),
            self.decode_steps, only=new, blocks=blocks, weights_cache=self.weights_cache, parked=parked))

        def extend():
            self.stages = deployment.take_over(self.stages, added, dep, self.sequences.all())
            self.weight_bytes += sum(s.model.weight_bytes() for s in added.values())
            self.deployment = dep
        self.run_on_device(extend)

    def _reshard(self, dep: Deployment) -> None:
        """Hold ``dep``'s stages of the same pipeline (a Seesaw layout switch): those held before and
        now keep their sequences' KV, the others are dropped, the new ones loaded (empty caches)."""
        gone = [i for i in self.stages if i not in dep.held]

        def drop():
            models = {i: self.stages[i].model for i in gone}
            self.stages = deployment.give_up(self.stages, gone, self.sequences.all(), self.replay_log)
            self.weight_bytes = sum(s.model.weight_bytes() for s in self.stages.values())
            held = self.weight_bytes + sum(s.pool.nbytes for s in self.stages.values() if s.pool is not None)
            self.parked.park(models, self.memory_budget, held, self.device)
            self.tier.keep(self.stages)  # the copies of the stages it keeps (those it gives up were sent)
        self.run_on_device(drop)
        if any(i not in self.stages for i in dep.held):
            self._extend(dep)
        else:
            self.run_on_device(lambda: (deployment.relink(self.stages, dep), setattr(self, "deployment", dep)))

    def _drop_everything(self) -> None:
        """On the worker: forget every sequence and the old stages, before a new deployment loads."""
        for seq_id in self.sequences.ids():
            self._free(seq_id)
        self.prefixes.clear()
        self.tier.reset()
        self.parked.clear()
        self.stages, self.deployment, self.weight_bytes = {}, None, 0

    def _held(self) -> str:
        return ", ".join(str(s.units) for s in self.stages.values())

    def pools(self) -> list[dict]:
        tier = self.tier.stats(self.stages)
        return [{"stage": i, "block_size": s.pool.block_size, "blocks": s.pool.num_blocks,
                 "used_blocks": s.pool.used_blocks, "block_bytes": s.model.block_bytes(), **self.prefixes.stats(i),
                 **tier} for i, s in self.stages.items() if s.pool is not None]

    def kv_bytes(self) -> int:
        return sum(s.pool.used_blocks * s.model.block_bytes() for s in self.stages.values() if s.pool is not None)

    # --- the data plane -----------------------------------------------------------------------
    def _serve_connection(self, conn: Connection, session: int, key: bytes) -> None:
        """One data connection's frames, in order, until it closes. A coordinator's connection
        (session != 0, its key checked by :class:`SessionOwners`) carries layouts, closes and
        first-stage inputs, and results go back on it; when it closes, the session's sequences are
        freed. A daemon's link (session 0) carries activations for the stages after the first, each
        with its session's key."""
        if session:
            self.outbox.attach(session, conn)
        try:
            while not self._stopping.is_set():
                frame = conn.read_frame()
                kind = frame.WhichOneof("kind")
                if kind == "layout" and session:
                    self.layouts.add(session, frame.layout, key)
                elif kind == "activation":
                    if self._admits(conn, session, frame.activation):  # a coordinator's layouts come before its data
                        self._receive(conn, frame.activation, wait_s=0.0 if session else LAYOUT_WAIT_S)
                    else:
                        skip_payload(conn.sock, frame.activation.payload_bytes)
                elif kind == "close" and session:
                    for seq_id in frame.close.sequence_ids:
                        self.close(seq_id, session, conn.peer)
                elif kind == "swap_out" and session:
                    self.swap_out(list(frame.swap_out.sequence_ids), session)
                elif kind == "evict" and session:
                    self.prefixes.evict(session, list(frame.evict.blocks))
                elif kind == "probe" and not session:  # the profiler times this link (MeasureLink)
                    skip_payload(conn.sock, frame.probe.payload_bytes)
                    conn.send(pb.Frame(probe=pb.Probe()))
                else:
                    raise LinkError(f"unexpected {kind} frame")
        except LinkError as e:
            if not conn.closed:
                log.debug("data connection %s ended: %s", conn.peer, e)
        finally:
            if session:
                self.outbox.detach(session, conn)
                self.end_session(session)
                self.owners.release(session)

    def _admits(self, conn: Connection, session: int, act: pb.Activation) -> bool:
        """Whether ``act`` may be computed: a coordinator sends only its own session's first-stage
        input; a daemon's link, only later stages' inputs of sessions whose key it names. Late data
        of a session that has ended here is skipped quietly; every other refusal is logged."""
        if session:
            why = "" if act.session == session and act.stage == 0 else \
                f"a coordinator's connection sent stage {act.stage}'s input of session {act.session}"
        elif act.stage == 0:
            why = "a daemon's link sent a first stage's input"
        elif self.owners.owns(act.session, act.session_key):
            why = ""
        elif self.layouts.ended(act.session) and not self.owners.known(act.session):
            return False  # computed for a session that has ended here: nobody needs it
        else:
            why = f"an activation for session {act.session} without its key"
        if why:
            log.warning("refused an activation from %s: %s", conn.peer, why)
        return not why

    def _receive(self, conn: Connection, act: pb.Activation, wait_s: float) -> None:
        """Read one activation's payload into its tensor and queue it for the worker."""
        stage = self.stages.get(act.stage)
        t0 = time.perf_counter()
        received = time.time()
        layout = self.layouts.wait(act.session, act.micro_batch, wait_s) if stage is not None else None
        if stage is None or layout is None:
            skip_payload(conn.sock, act.payload_bytes)
            if layout is None and self.layouts.ended(act.session):
                return  # computed for a session that has ended (or was taken over): nobody needs it
            log.error("dropped micro-batch %d of session %d for stage %d: %s", act.micro_batch, act.session,
                      act.stage, "no such stage here" if stage is None else "its layout never came")
            return
        expected = layout.tokens * (8 if stage.units.has_embed else stage.model.cfg.hidden_size
                                    * stage.model.dtype.itemsize)
        if act.payload_bytes != expected:
            skip_payload(conn.sock, act.payload_bytes)
            x = None
            layout.fail_all(act.stage, "INVALID_ARGUMENT", f"stage {act.stage}: micro-batch {act.micro_batch} has "
                            f"{act.payload_bytes} bytes; its layout of {layout.tokens} tokens needs {expected}")
        else:
            buf = read_payload(conn.sock, expected, pin=self.io.cuda)
            dtype = torch.int64 if stage.units.has_embed else stage.model.dtype
            shape = (layout.tokens,) if stage.units.has_embed else (layout.tokens, stage.model.cfg.hidden_size)
            x = self.io.upload_tensor(buf.view(dtype).view(shape))
        self.stats.add_recv(act.session, act.stage, time.perf_counter() - t0)
        self.worker.put((stage, layout, x, list(act.failed), received))

    # --- sequences ----------------------------------------------------------------------------
    def resume(self, old: int, new: int) -> list[tuple[int, int, int, int]]:
        """Session ``new`` takes over ``old``'s sequences (their errors cleared: the coordinator
        resumes each from where every stage stands); (sequence, stage, computed, logged) of each.
        Runs on the worker, so nothing of the old session is being computed meanwhile; what is still
        queued of it computes dead rows (its sequences belong to another session now)."""
        def adopt():
            return [(seq.id, i, seq.computed.get(i, 0), self.replay_log.logged(seq, i))
                    for seq in self.sequences.adopt(old, new) for i in self.stages]
        progress = self.run_on_device(adopt, timeout_s=60.0)
        self.layouts.forget(old)
        return progress

    def close(self, seq_id: int, session: int, peer: str = "") -> bool:
        """Free ``session``'s sequence and its blocks now: a micro-batch computed later finds it gone
        and treats its entries as dead rows (see :mod:`hpipe.model.kv.pool` for one already being
        computed). Another session's sequence is left alone (the refusal is logged)."""
        seq = self.sequences.pop(seq_id, session)
        if seq is None:
            if self.sequences.find(seq_id) is not None:
                log.warning("refused %s: closing sequence %d of another session", peer or "a caller", seq_id)
            return False
        self._release(seq)
        return True

    def swap_out(self, seq_ids: list[int], session: int) -> None:
        """Move ``session``'s sequences to the host tier (:meth:`HostTier.swap_out_all`)."""
        mine = [seq for seq in map(self.sequences.find, seq_ids) if seq is not None and seq.session == session]
        try:
            self.run_on_device(lambda: self.tier.swap_out_all(mine, self.stages), timeout_s=60.0)
        except StatusError as e:  # the worker did not get to it: their next entries fail, and are recomputed
            for seq in mine:
                seq.fail("DATA_LOSS", f"sequence {seq.id}: swapping it out: {e}")

    def _swap_in(self, seq) -> None:
        """Before a layout extends ``seq``: its KV back from the host tier, if it is there."""
        if self.tier.holds(seq.id):
            self.run_on_device(lambda: self.tier.swap_in(seq, self.stages), timeout_s=60.0)

    def _free(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id)
        if seq is not None:
            self._release(seq)

    def _release(self, seq) -> None:
        for kv in seq.kv.values():
            kv.release()
        self.tier.drop(seq.id)
        self.replay_log.drop(seq)

    def end_session(self, session: int) -> list:
        """Free a session's sequences and forget its layouts; its statistics per stage."""
        for seq_id in self.sequences.ids(session):
            self.close(seq_id, session)
        self.prefixes.end(session)
        self.layouts.forget(session)
        self.kv_in.forget(session)  # KV sent here for it that no Load took
        return self.stats.pop(session)

    def status(self, seq_ids: list[int], session: int | None = None) -> dict:
        """What Status reports: ``seq_ids`` only where ``session``'s (None: none open, none kept alive)."""
        mine = [i for i in seq_ids if session is not None and (s := self.sequences.find(i)) and s.session == session]
        self.sequences.touch(mine)
        states = []
        for i in seq_ids:
            seq = self.sequences.find(i) if i in mine else None
            states.append({"sequence_id": i, "open": seq is not None,
                           "length": min(seq.planned.values(), default=0) if seq else 0,
                           "error": seq.error if seq else ""})
        dep = self.deployment
        return {
            "loaded": dep is not None, "model": dep.model if dep else "", "device": str(self.device),
            "open_sequences": len(self.sequences), "kv_bytes": self.kv_bytes(), "weight_bytes": self.weight_bytes,
            "memory_budget": self.memory_budget or 0, "sequences": states, "pools": self.pools(),
            "peak_memory_bytes": memory.peak(self.device), "baseline_memory_bytes": self._baseline_memory,
            "data_port": self.data.port, "replay_bytes": self.replay_log.nbytes,
            "replay_budget": self.replay_log.budget,
        }

    # --- threads ------------------------------------------------------------------------------
    def run_on_device(self, fn: Callable[[], object], timeout_s: float | None = None):
        """Run ``fn`` on the worker thread, between micro-batches (:meth:`Worker.call`). Profiling goes
        through here, so measurements run on the thread (and under the limits) that runs micro-batches."""
        return self.worker.call(fn, timeout_s)

    def _reap_loop(self) -> None:
        while not self._stopping.wait(1.0):
            for seq_id in self.sequences.idle():
                log.warning("sequence %d idle for too long: freeing its KV cache", seq_id)
                self._free(seq_id)

    def shutdown(self) -> None:
        self._stopping.set()
        self.data.stop()
        self.outbox.close()  # first: rows computed after the sequences are freed below must not leave
        self.worker.stop()
        self._drop_everything()  # stopped, it holds nothing: an in-process daemon's memory goes back
        memory.release_free(self.device)
