"""The coordinator: deploy unit ranges onto daemons, stream slices into stage 0, read the last
stage's results, and notice a dead or failing stage within a deadline.

Design note. The coordinator never relays activations: it submits token ids to stage 0 and
reads logits from the last stage's ``Results`` stream, one stream per sequence, read by a
background thread into a queue. While it waits it polls every stage's ``Status`` for that
sequence: an unreachable stage, or a stage that recorded an error (a failed send names the
successor it could not reach), fails the sequence at once with a message naming the stage, and
the surviving stages are told to free the sequence's KV cache.

A daemon may hold several stages (an interleaved schedule): it gets one ``Load`` naming all of
them, one ``Open`` per sequence, and reports statistics per stage.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence as Seq

import grpc
import torch

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import HpipeError, InputError
from hpipe.core.plan import PlanError, Stage, stages_from_cuts
from runtime.channels import DaemonClient, Security
from runtime.wire import dtype_to_wire, pb, stage_to_wire, tensor_bytes, tensor_from_proto

log = logging.getLogger(__name__)

POLL_S = 0.5          # how often a waiting coordinator checks on the stages
STATUS_TIMEOUT_S = 3.0


class StageFailure(HpipeError):
    """A stage died, became unreachable, or failed a sequence."""


def cut_stages(cluster: ClusterSpec, cuts: Seq[int], num_units: int, daemons: Seq[str] | None = None) -> list[Stage]:
    """Stages ``[0, c1), [c1, c2), ...`` on the named daemons (default: the cluster's first ones, in
    file order): a pipeline from ``--cuts``, without a plan."""
    n = len(cuts) + 1
    chosen = [cluster.daemon(name) for name in daemons] if daemons else list(cluster.daemons[:n])
    if len(chosen) != n:
        raise InputError(f"{n} stages need {n} daemons; cluster {cluster.name!r} has {len(cluster.daemons)}")
    try:
        return stages_from_cuts([(d.name, d.address) for d in chosen], list(cuts), num_units)
    except PlanError as e:
        raise InputError(str(e)) from None


class Pipeline:
    """Stages deployed on the daemons of a cluster, in pipeline order.

    ``daemons`` are the daemons in use, in order of their first stage, with one client each in
    ``clients``; ``stage_daemon[i]`` is the index of stage i's daemon there."""

    def __init__(self, cluster: ClusterSpec, security: Security | None = None):
        self.cluster = cluster
        self.security = security if security is not None else Security.of(cluster)
        self.stages: list[Stage] = []
        self.daemons: list[DaemonSpec] = []
        self.stage_daemon: list[int] = []
        self.clients: list[DaemonClient] = []
        self.loads: list[pb.LoadReply] = []    # per daemon in use: what its Load reported
        self.vocab_size = 0

    def describe_daemon(self, d: int) -> str:
        spec, stages = self.daemons[d], self.daemon_stages(d)
        return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} ({spec.name} at {spec.address})"

    def daemon_stages(self, d: int) -> list[int]:
        return [i for i, dd in enumerate(self.stage_daemon) if dd == d]

    def deploy(self, model: str, stages: Seq[Stage], dtype: torch.dtype) -> list[Stage]:
        """Load ``stages`` (a plan's, or :func:`stages_from_cuts`) onto their daemons in the cluster.

        A daemon named for several stages holds them all (an interleaved schedule); two stages in a
        row on one daemon would be one stage and are refused. Addresses are the cluster's."""
        if not stages:
            raise InputError("a pipeline needs at least one stage")
        stages = [replace(s, address=self.cluster.daemon(s.daemon).address) for s in stages]
        repeated = [i for i in range(1, len(stages)) if stages[i].daemon == stages[i - 1].daemon]
        if repeated:
            i = repeated[0]
            raise InputError(f"stages {i - 1} and {i} are both on {stages[i].daemon}: merge them into one stage")
        self.close()
        names = list(dict.fromkeys(s.daemon for s in stages))
        daemons = [self.cluster.daemon(n) for n in names]
        stage_daemon = [names.index(s.daemon) for s in stages]
        self.clients = [DaemonClient(d.address, self.security, d.name) for d in daemons]
        wire = [stage_to_wire(s) for s in stages]
        requests = [pb.LoadRequest(model=model, dtype=dtype_to_wire(dtype), stages=wire,
                                   held=[i for i, dd in enumerate(stage_daemon) if dd == d])
                    for d in range(len(daemons))]

        def load(d):
            try:
                return self.clients[d].call("Load", requests[d], timeout=600.0)
            except grpc.RpcError as e:
                ranges = ", ".join(stages[i].units for i in requests[d].held)
                raise StageFailure(f"{daemons[d].name} at {daemons[d].address} could not load units {ranges}: "
                                   f"{e.code().name}: {e.details()}") from None

        with ThreadPoolExecutor(max_workers=len(daemons)) as pool:
            self.loads = list(pool.map(load, range(len(daemons))))
        self.daemons, self.stages, self.stage_daemon = daemons, stages, stage_daemon
        self.vocab_size = self.loads[stage_daemon[-1]].vocab_size
        return self.stages

    def open(self, max_len: int, batch: int = 1, idle_timeout_s: float = 60.0,
             result_timeout_s: float = 600.0) -> "RemoteSequence":
        if not self.stages:
            raise HpipeError("no model is deployed")
        return RemoteSequence(self, max_len, batch, idle_timeout_s, result_timeout_s)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients, self.daemons, self.stages, self.stage_daemon, self.loads = [], [], [], [], []


class RemoteSequence:
    """One sequence (batch of equal-length rows) open on every stage of a pipeline."""

    def __init__(self, pipe: Pipeline, max_len: int, batch: int, idle_timeout_s: float, result_timeout_s: float):
        self.pipe, self.batch, self.max_len = pipe, batch, max_len
        self.id = random.getrandbits(63)
        self.result_timeout_s = result_timeout_s
        self.position = 0
        self.kv_bytes: list[int] = [0] * len(pipe.stages)  # per stage
        self.stats: list[dict] = []                        # per stage, once closed
        self._results: queue.Queue = queue.Queue()
        self._closed = False
        opened = []
        try:
            for d in range(len(pipe.clients)):
                reply = self._rpc(d, "Open", pb.OpenRequest(sequence_id=self.id, batch=batch, max_len=max_len,
                                                           idle_timeout_s=idle_timeout_s))
                opened.append(d)
                for i, kv in zip(pipe.daemon_stages(d), reply.stages_kv_bytes):
                    self.kv_bytes[i] = kv
        except HpipeError:
            for d in opened:
                self._close_daemon(d)
            raise
        self._last = pipe.stage_daemon[-1]
        self._stream = pipe.clients[self._last].results(self.id)
        self._reader = threading.Thread(target=self._read_results, daemon=True, name=f"results-{self.id}")
        self._reader.start()

    def _rpc(self, d: int, method: str, request, timeout: float = 30.0):
        """``method`` on daemon ``d``, its failure as a :class:`StageFailure` naming the daemon's stages."""
        try:
            return self.pipe.clients[d].call(method, request, timeout=timeout)
        except grpc.RpcError as e:
            code, who = e.code(), self.pipe.describe_daemon(d)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StageFailure(f"{who} is not responding ({code.name}: {e.details()})") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise StageFailure(f"{who} is out of memory: {e.details()}") from None
            raise StageFailure(f"{who}: {method} failed: {code.name}: {e.details()}") from None

    def _read_results(self) -> None:
        try:
            for msg in self._stream:
                self._results.put(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self._results.put(e)

    # --- data path ------------------------------------------------------------------------
    def submit(self, ids: torch.Tensor, *, want_logits: bool = True, all_logits: bool = False) -> None:
        """Send one slice of token ids ``[batch, tokens]`` into stage 0 (returns without waiting)."""
        if self._closed:
            raise HpipeError(f"sequence {self.id} is closed")
        ids = ids.to(torch.int64).reshape(self.batch, -1)
        n = ids.shape[1]
        if self.position + n > self.max_len:
            raise InputError(f"positions up to {self.position + n} exceed the sequence's max length {self.max_len}")
        self._rpc(self.pipe.stage_daemon[0], "Submit", pb.Slice(sequence_id=self.id, stage=0, start=self.position,
                                                                length=n, payload=tensor_bytes(ids),
                                                                want_logits=want_logits, all_logits=all_logits))
        self.position += n

    def result(self) -> pb.SliceResult:
        """The next slice result from the last stage, or a :class:`StageFailure` naming the culprit."""
        deadline = time.monotonic() + self.result_timeout_s
        while True:
            try:
                item = self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_stages()
                if time.monotonic() > deadline:
                    self._abort()
                    raise StageFailure(f"no result for sequence {self.id} within {self.result_timeout_s:.0f}s")
                continue
            if isinstance(item, grpc.RpcError):
                self._abort()
                raise StageFailure(f"{self.pipe.describe_daemon(self._last)}: results stream broke "
                                   f"({item.code().name}: {item.details()})")
            if item.error:
                self._check_stages()  # name the stage that failed, if it can be found
                self._abort()
                raise StageFailure(item.error)
            return item

    def _check_stages(self) -> None:
        """Raise :class:`StageFailure` if any stage is unreachable or failed this sequence.

        Unreachable stages are blamed first: when a daemon dies, its predecessor's failed send is
        a symptom, the dead daemon the cause.
        """
        replies, dead = {}, None
        for d in range(len(self.pipe.clients)):
            try:
                replies[d] = self.pipe.clients[d].call("Status", pb.StatusRequest(sequence_ids=[self.id]),
                                                       timeout=STATUS_TIMEOUT_S)
            except grpc.RpcError as e:
                dead = dead or (d, e)
        if dead:
            d, e = dead
            self._abort(skip=d)
            raise StageFailure(f"{self.pipe.describe_daemon(d)} is not responding ({e.code().name}: {e.details()})")
        for d, reply in replies.items():
            state = reply.sequences[0]
            if state.error:
                self._abort()
                raise StageFailure(f"{self.pipe.describe_daemon(d)}: {state.error}")
            if not state.open:
                self._abort()
                raise StageFailure(f"{self.pipe.describe_daemon(d)} no longer holds sequence {self.id} (idle timeout?)")

    def logits(self, msg: pb.SliceResult) -> torch.Tensor:
        return tensor_from_proto(msg.logits)

    # --- life cycle -------------------------------------------------------------------------
    def _close_daemon(self, d: int) -> dict[int, dict]:
        """Free the sequence on daemon ``d``; its statistics per stage index ({} if it did not answer)."""
        try:
            reply = self.pipe.clients[d].call("Close", pb.SequenceRequest(sequence_id=self.id), timeout=5.0)
        except grpc.RpcError:
            return {}
        mine = set(self.pipe.daemon_stages(d))
        return {s.stage: {
            "compute_s": s.compute_s, "send_s": s.send_s, "recv_decode_s": s.recv_decode_s,
            "slices": s.slices, "bytes_sent": s.bytes_sent,
            "spans": [(x.start, x.length, x.received_s, x.begin_s, x.end_s) for x in s.spans]}
            for s in reply.stats if s.stage in mine}

    def _abort(self, skip: int | None = None) -> None:
        """Free the sequence on every daemon that still answers."""
        if self._closed:
            return
        self._closed = True
        for d in range(len(self.pipe.clients)):
            if d != skip:
                self._close_daemon(d)
        self._stream.cancel()

    def close(self) -> list[dict]:
        """Free the sequence everywhere; statistics per stage ({} for a stage that did not answer)."""
        if not self._closed:
            self._closed = True
            per_stage: dict[int, dict] = {}
            for d in range(len(self.pipe.clients)):
                per_stage.update(self._close_daemon(d))
            self.stats = [per_stage.get(i, {}) for i in range(len(self.pipe.stages))]
            self._stream.cancel()
        return self.stats

    def __enter__(self) -> "RemoteSequence":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteRunner:
    """Adapts a :class:`RemoteSequence` to the generation loop: prefill pipelines all slices."""

    def __init__(self, seq: RemoteSequence):
        self.seq = seq
        self.slice_times: list[float] = []

    def prefill(self, ids: torch.Tensor, slices: Seq[int]) -> torch.Tensor:
        start = 0
        for k, n in enumerate(slices):
            self.seq.submit(ids[:, start:start + n], want_logits=k == len(slices) - 1)
            start += n
        msg = None
        for _ in slices:  # results arrive in order; only the last carries logits
            msg = self.seq.result()
        return self.seq.logits(msg)[0]

    def step(self, token: int) -> torch.Tensor:
        self.seq.submit(torch.tensor([[token]]))
        return self.seq.logits(self.seq.result())[0]


def generate_on_cluster(pipe: Pipeline, source, tokenizer, prompt: str, *, chat: bool, max_new_tokens: int,
                        sampling, slices, idle_timeout_s: float = 60.0):
    """:func:`hpipe.model.generate.generate` through a deployed pipeline, with per-stage timings."""
    from hpipe.model.generate import generate

    opened: list[RemoteSequence] = []

    def open_runner(max_len: int) -> RemoteRunner:
        seq = pipe.open(max_len, idle_timeout_s=idle_timeout_s)
        opened.append(seq)
        return RemoteRunner(seq)

    try:
        result = generate(open_runner, tokenizer, prompt, context=source.config.max_position_embeddings,
                          eos_ids=source.eos_token_ids(), chat=chat, max_new_tokens=max_new_tokens,
                          sampling=sampling, slices=slices)
    finally:
        for seq in opened:
            seq.close()
    seq = opened[0]
    result.extra["stages"] = [
        {"stage": i, "daemon": s.daemon, "address": s.address, "units": [s.unit_start, s.unit_end],
         "kv_bytes": kv, **{k: v for k, v in stats.items() if k != "spans"}}
        for i, (s, kv, stats) in enumerate(zip(pipe.stages, seq.kv_bytes, seq.stats))
    ]
    return result
