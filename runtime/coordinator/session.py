"""A coordinator's session with a deployed pipeline: micro-batches in, sampled logits out.

Design note. The session opens one data connection to each daemon of the pipeline. For every
micro-batch it sends the layout to every daemon, then the token ids to the first stage on the
same connection (so the first stage always has the layout first); the activations then go from
daemon to daemon, and the last stage sends the logits of the rows the entries asked for back on
its session connection. The coordinator never relays activations. A reader thread files each
result by micro-batch id; waiting callers poll every daemon's ``Status`` meanwhile, so a dead or
stuck stage surfaces as a :class:`StageFailure` naming it within ``POLL_S`` plus a status
deadline, never as a hang. Sequences that a daemon failed (out of KV blocks, say) come back in
the result's ``failed``: they fail alone.

A session opened with ``resume_from`` (after a failure, :mod:`runtime.coordinator.recovery`) first takes over
the old session's sequences on every daemon (``Resume``) and keeps where each one stands on each
stage in ``resumed``, for the engine to resume them (:mod:`runtime.coordinator.resume`).

A session has a random key besides its id: its data connections introduce themselves with it and
its control calls name it, and a daemon refuses anyone who names the session without it
(:mod:`runtime.daemon.owners`), token or not.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from hpipe.core.cluster import split_address
from hpipe.core.errors import HpipeError
from runtime.wire.logits import top_rows, unpack
from runtime.wire.messages import pb
from runtime.wire.transport import Connection, LinkError, client_context, connect, read_payload

log = logging.getLogger(__name__)

POLL_S = 0.5          # how often a waiting coordinator checks on the daemons
STATUS_TIMEOUT_S = 3.0


class StageFailure(HpipeError):
    """A stage died, became unreachable, or cannot pass its results on. ``lasting``: the daemon
    answered and refused (a bad model path, too little memory): waiting for it will not help."""

    def __init__(self, message: str, lasting: bool = False):
        super().__init__(message)
        self.lasting = lasting


@dataclass
class Result:
    """A micro-batch's outcome: the logits rows its entries asked for (in entry order), and the
    sequences the pipeline failed, by id: (gRPC status name, message)."""

    micro_batch: int
    logits: torch.Tensor
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)


class Session:
    def __init__(self, pipe, result_timeout_s: float = 600.0, resume_from: "Session | None" = None):
        if not pipe.stages:
            raise HpipeError("no model is deployed")
        self.pipe, self.id = pipe, secrets.randbits(63) or 1
        self.key = secrets.token_bytes(16)
        self.result_timeout_s = result_timeout_s
        self.vocab_size = pipe.vocab_size
        tls = client_context(pipe.security.tls_ca)
        self.conns: list[Connection] = []
        self._closed = False  # before anything that may fail: close() reads it
        try:
            for d, port in zip(pipe.daemons, pipe.data_ports):
                host = split_address(d.address, d.name)[0]
                self.conns.append(connect(host, port, pipe.security.token, self.id, tls, self.key))
        except LinkError as e:
            self.close()
            raise StageFailure(str(e)) from None
        self._first, self._last = self.conns[pipe.stage_daemon[0]], self.conns[pipe.stage_daemon[-1]]
        self._next = 0
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._results: dict[int, Result] = {}
        #: micro-batch -> each row of its result: sent as its top logits? (runtime/wire/logits.py)
        self._top: dict[int, list[bool]] = {}
        self.result_bytes = 0  # the logits' bytes the last stage sent back
        self._broken: str | None = None
        self._reader = threading.Thread(target=self._read_results, name=f"results-{self.id}", daemon=True)
        self._reader.start()
        #: sequence -> stage -> (computed, logged): what the daemons kept of ``resume_from``'s sequences
        self.resumed: dict[int, dict[int, tuple[int, int]]] = {}
        if resume_from is not None:
            self._resume(resume_from)

    def _resume(self, old: "Session") -> None:
        request = pb.ResumeRequest(from_session=old.id, from_key=old.key, to_session=self.id, to_key=self.key)
        for d, client in enumerate(self.pipe.clients):
            try:
                reply = client.call("Resume", request, timeout=90.0)
            except grpc.RpcError as e:
                self.close()
                raise StageFailure(f"{self.pipe.describe_daemon(d)} could not resume the session "
                                   f"({e.code().name}: {e.details()})") from None
            for p in reply.progress:
                self.resumed.setdefault(p.sequence_id, {})[p.stage] = (p.computed, p.logged)

    # --- the data path ------------------------------------------------------------------------
    def submit(self, entries: list[pb.Entry], tokens: torch.Tensor | None, replay: pb.Replay | None = None) -> int:
        """Send one micro-batch (its layout to every daemon, ``tokens`` [n] to the first stage); its id.

        A ``replay`` only rebuilds the caches of its stages and has no result; its ``tokens`` are
        sent only when it starts at stage 0 (otherwise the stage before it sends its input)."""
        first = replay is None or replay.first == 0
        if first:
            tokens = tokens.to(torch.int64).reshape(-1).contiguous()
            if tokens.numel() != sum(e.length for e in entries):
                raise HpipeError(f"{tokens.numel()} token ids for entries of {sum(e.length for e in entries)} tokens")
        with self._lock:
            if self._closed:
                raise HpipeError("the session is closed")
            mb = self._next
            self._next += 1
            if replay is None:
                self._top[mb] = top_rows(entries)
            layout = pb.Frame(layout=pb.MicroBatch(id=mb, entries=entries, replay=replay))
            try:
                for conn in self.conns:
                    conn.send(layout)
                if first:
                    self._first.send(pb.Frame(activation=pb.Activation(
                        session=self.id, micro_batch=mb, stage=0, payload_bytes=tokens.numel() * 8)), tokens)
            except LinkError as e:
                self.check()
                raise StageFailure(str(e)) from None
        return mb

    def close_sequences(self, seq_ids: list[int]) -> None:
        """Free these sequences on every daemon (in order after the micro-batches sent before)."""
        if seq_ids:
            self._to_every_daemon(pb.Frame(close=pb.CloseSequences(sequence_ids=seq_ids)))

    def swap_out(self, seq_ids: list[int]) -> None:
        """Every daemon moves these sequences' KV to its host tier (in order after the micro-batches
        sent before; the next entry naming one brings it back: runtime.daemon.kv_tier)."""
        if seq_ids:
            self._to_every_daemon(pb.Frame(swap_out=pb.SwapOut(sequence_ids=seq_ids)))

    def evict(self, blocks: list[int]) -> None:
        """Every daemon forgets these cached blocks (in order after the micro-batches sent before)."""
        if blocks:
            self._to_every_daemon(pb.Frame(evict=pb.Evict(blocks=blocks)))

    def _to_every_daemon(self, frame: pb.Frame) -> None:
        if self._closed:
            return
        with self._lock:
            for conn in self.conns:
                try:
                    conn.send(frame)
                except LinkError:
                    pass  # a daemon that is gone holds nothing

    def _read_results(self) -> None:
        try:
            while True:
                frame = self._last.read_frame()
                if frame.WhichOneof("kind") != "activation":
                    raise LinkError(f"unexpected {frame.WhichOneof('kind')} frame from the last stage")
                act = frame.activation
                buf = read_payload(self._last.sock, act.payload_bytes)
                self.result_bytes += act.payload_bytes
                # not under self._lock: submit holds it while it sends, which may wait on the daemons,
                # which may wait on this reader; the entry was put in before the layout went out
                top = self._top.pop(act.micro_batch, None)
                if top is None:  # not one this session sent: whole rows, as it would be
                    top = [False] * (act.payload_bytes // (4 * self.vocab_size))
                try:
                    logits = unpack(buf.view(torch.float32), top, self.vocab_size)
                except (ValueError, RuntimeError) as e:
                    raise LinkError(f"micro-batch {act.micro_batch}'s logits came malformed: {e}") from None
                result = Result(act.micro_batch, logits, {f.sequence_id: (f.code, f.message) for f in act.failed})
                with self._done:
                    self._results[act.micro_batch] = result
                    self._done.notify_all()
        except LinkError as e:
            with self._done:
                if not self._closed:
                    self._broken = f"the connection to the last stage broke: {e}"
                self._done.notify_all()

    def result(self, mb: int, watch: list[int] = ()) -> Result:
        """The result of micro-batch ``mb``, waiting for it; ``watch``: sequences whose failure on a
        daemon (seen in its status) means the micro-batch will not come."""
        return self.wait_any([mb], watch)

    def wait_any(self, mbs, watch=()) -> Result:
        """The first result among micro-batches ``mbs`` (taken out of the session)."""
        deadline = time.monotonic() + self.result_timeout_s
        while True:
            with self._done:
                for mb in mbs:
                    if mb in self._results:
                        return self._results.pop(mb)
                if self._broken is None:
                    self._done.wait(POLL_S)
                for mb in mbs:
                    if mb in self._results:
                        return self._results.pop(mb)
            self.check(watch)
            if self._broken is not None:
                raise StageFailure(self._broken)
            if time.monotonic() > deadline:
                raise StageFailure(f"no result for micro-batch {min(mbs)} within {self.result_timeout_s:.0f}s")

    def check(self, watch=()) -> None:
        """Raise :class:`StageFailure` if a daemon does not answer, or cannot pass results on.

        Unreachable daemons are blamed first: when a daemon dies, its predecessor's failed send is a
        symptom, the dead daemon the cause. ``watch`` sequences are also marked alive."""
        replies, dead = {}, None
        for d, client in enumerate(self.pipe.clients):
            try:
                request = pb.StatusRequest(sequence_ids=list(watch), session=self.id, key=self.key)
                replies[d] = client.call("Status", request, timeout=STATUS_TIMEOUT_S)
            except grpc.RpcError as e:
                dead = dead or (d, e)
        if dead:
            d, e = dead
            raise StageFailure(f"{self.pipe.describe_daemon(d)} is not responding ({e.code().name}: {e.details()})")
        for d, reply in replies.items():
            stuck = [s for s in reply.sequences if s.error and "could not send" in s.error]
            if stuck:
                raise StageFailure(f"{self.pipe.describe_daemon(d)}: {stuck[0].error}")

    # --- life cycle -------------------------------------------------------------------------
    def close(self) -> list[dict]:
        """End the session: its sequences are freed on every daemon; statistics per stage ({} for a
        daemon that did not answer)."""
        if self._closed:
            return []
        self._closed = True
        per_stage: dict[int, dict] = {}
        for d, client in enumerate(self.pipe.clients):
            try:
                reply = client.call("EndSession", pb.SessionRequest(session=self.id, key=self.key), timeout=10.0)
            except grpc.RpcError:
                continue
            for s in reply.stats:
                per_stage[s.stage] = {
                    "compute_s": s.compute_s, "send_s": s.send_s, "recv_s": s.recv_s,
                    "micro_batches": s.micro_batches, "bytes_sent": s.bytes_sent,
                    "spans": [(x.micro_batch, x.tokens, x.received_s, x.begin_s, x.end_s) for x in s.spans]}
        for conn in self.conns:
            conn.close()
        return [per_stage.get(i, {}) for i in range(len(self.pipe.stages))]

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
