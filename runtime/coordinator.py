"""The coordinator: deploy unit ranges onto daemons, stream slices into stage 0, read the last
stage's results, and notice a dead or failing stage within a deadline.

Design note. The coordinator never relays activations: it submits token ids to stage 0 and
reads logits from the last stage's ``Results`` stream, one stream per sequence, read by a
background thread into a queue. While it waits it polls every stage's ``Status`` for that
sequence: an unreachable stage, or a stage that recorded an error (a failed send names the
successor it could not reach), fails the sequence at once with a message naming the stage, and
the surviving stages are told to free the sequence's KV cache.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence as Seq

import grpc
import torch

from hpipe.errors import HpipeError, InputError
from runtime.channels import Security, StageClient
from runtime.cluster import ClusterSpec, DaemonSpec
from runtime.wire import dtype_to_wire, pb, tensor_bytes, tensor_from_proto

log = logging.getLogger(__name__)

POLL_S = 0.5          # how often a waiting coordinator checks on the stages
STATUS_TIMEOUT_S = 3.0


class StageFailure(HpipeError):
    """A stage died, became unreachable, or failed a sequence."""


@dataclass(frozen=True)
class StageInfo:
    index: int
    daemon: DaemonSpec
    unit_start: int
    unit_end: int
    parameters: int
    weight_bytes: int
    load_s: float


class Pipeline:
    """Stages deployed on the daemons of a cluster, in pipeline order."""

    def __init__(self, cluster: ClusterSpec, security: Security | None = None):
        self.cluster = cluster
        self.security = security if security is not None else cluster.security()
        self.stages: list[StageInfo] = []
        self.clients: list[StageClient] = []
        self.vocab_size = 0
        self._stage_name = {}

    def describe(self, i: int) -> str:
        d = self.stages[i].daemon
        return f"stage {i} ({d.name} at {d.address})"

    def deploy(self, model: str, cuts: Seq[int], num_units: int, dtype: torch.dtype,
               daemons: Seq[str] | None = None) -> list[StageInfo]:
        """Load ``[0,c1), [c1,c2), ...`` onto the named daemons (default: the first ones, in file order)."""
        bounds = [0, *cuts, num_units]
        n = len(bounds) - 1
        chosen = [self.cluster.daemon(name) for name in daemons] if daemons else list(self.cluster.daemons[:n])
        if len(chosen) != n:
            raise InputError(f"{n} stages need {n} daemons; cluster {self.cluster.name!r} has "
                             f"{len(self.cluster.daemons)}")
        self.close()
        self.clients = [StageClient(d.address, self.security, d.name) for d in chosen]
        requests = [pb.LoadRequest(model=model, unit_start=a, unit_end=b, dtype=dtype_to_wire(dtype),
                                   next_address=chosen[i + 1].address if i + 1 < n else "",
                                   next_name=chosen[i + 1].name if i + 1 < n else "", stage_index=i)
                    for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]

        def load(i):
            try:
                return self.clients[i].call("Load", requests[i], timeout=600.0)
            except grpc.RpcError as e:
                raise StageFailure(f"stage {i} ({chosen[i].name} at {chosen[i].address}) could not load units "
                                   f"[{bounds[i]}, {bounds[i + 1]}): {e.code().name}: {e.details()}") from None

        with ThreadPoolExecutor(max_workers=n) as pool:
            replies = list(pool.map(load, range(n)))
        self.stages = [StageInfo(i, chosen[i], bounds[i], bounds[i + 1], r.parameters, r.weight_bytes, r.load_s)
                       for i, r in enumerate(replies)]
        self.vocab_size = replies[-1].vocab_size
        return self.stages

    def open(self, max_len: int, batch: int = 1, idle_timeout_s: float = 60.0,
             result_timeout_s: float = 600.0) -> "RemoteSequence":
        if not self.stages:
            raise HpipeError("no model is deployed")
        return RemoteSequence(self, max_len, batch, idle_timeout_s, result_timeout_s)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []


class RemoteSequence:
    """One sequence (batch of equal-length rows) open on every stage of a pipeline."""

    def __init__(self, pipe: Pipeline, max_len: int, batch: int, idle_timeout_s: float, result_timeout_s: float):
        self.pipe, self.batch, self.max_len = pipe, batch, max_len
        self.id = random.getrandbits(63)
        self.result_timeout_s = result_timeout_s
        self.position = 0
        self.kv_bytes: list[int] = []
        self.stats: list[dict] = []
        self._results: queue.Queue = queue.Queue()
        self._closed = False
        opened = []
        try:
            for i, client in enumerate(pipe.clients):
                reply = self._rpc(i, "Open", pb.OpenRequest(sequence_id=self.id, batch=batch, max_len=max_len,
                                                           idle_timeout_s=idle_timeout_s))
                opened.append(i)
                self.kv_bytes.append(reply.kv_bytes)
        except HpipeError:
            for i in opened:
                self._close_stage(i)
            raise
        self._stream = pipe.clients[-1].results(self.id)
        self._reader = threading.Thread(target=self._read_results, daemon=True, name=f"results-{self.id}")
        self._reader.start()

    def _rpc(self, i: int, method: str, request, timeout: float = 30.0):
        try:
            return self.pipe.clients[i].call(method, request, timeout=timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StageFailure(f"{self.pipe.describe(i)} is not responding ({code.name}: {e.details()})") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise StageFailure(f"{self.pipe.describe(i)} is out of memory: {e.details()}") from None
            raise StageFailure(f"{self.pipe.describe(i)}: {method} failed: {code.name}: {e.details()}") from None

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
        self._rpc(0, "Submit", pb.Slice(sequence_id=self.id, unit_start=self.pipe.stages[0].unit_start,
                                        start=self.position, length=n, payload=tensor_bytes(ids),
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
                raise StageFailure(f"{self.pipe.describe(len(self.pipe.stages) - 1)}: results stream broke "
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
        for i in range(len(self.pipe.clients)):
            try:
                replies[i] = self.pipe.clients[i].call("Status", pb.StatusRequest(sequence_ids=[self.id]),
                                                       timeout=STATUS_TIMEOUT_S)
            except grpc.RpcError as e:
                dead = dead or (i, e)
        if dead:
            i, e = dead
            self._abort(skip=i)
            raise StageFailure(f"{self.pipe.describe(i)} is not responding ({e.code().name}: {e.details()})")
        for i, reply in replies.items():
            state = reply.sequences[0]
            if state.error:
                self._abort()
                raise StageFailure(f"{self.pipe.describe(i)}: {state.error}")
            if not state.open:
                self._abort()
                raise StageFailure(f"{self.pipe.describe(i)} no longer holds sequence {self.id} (idle timeout?)")

    def logits(self, msg: pb.SliceResult) -> torch.Tensor:
        return tensor_from_proto(msg.logits)

    # --- life cycle -------------------------------------------------------------------------
    def _close_stage(self, i: int) -> dict | None:
        try:
            reply = self.pipe.clients[i].call("Close", pb.SequenceRequest(sequence_id=self.id), timeout=5.0)
        except grpc.RpcError:
            return None
        s = reply.stats
        return {"compute_s": s.compute_s, "send_s": s.send_s, "recv_decode_s": s.recv_decode_s,
                "slices": s.slices, "bytes_sent": s.bytes_sent,
                "spans": [(x.start, x.length, x.received_s, x.begin_s, x.end_s) for x in s.spans]}

    def _abort(self, skip: int | None = None) -> None:
        """Free the sequence on every stage that still answers."""
        if self._closed:
            return
        self._closed = True
        for i in range(len(self.pipe.clients)):
            if i != skip:
                self._close_stage(i)
        self._stream.cancel()

    def close(self) -> list[dict]:
        if not self._closed:
            self._closed = True
            self.stats = [self._close_stage(i) or {} for i in range(len(self.pipe.clients))]
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
    """:func:`hpipe.generate.generate` through a deployed pipeline, with per-stage timings."""
    from hpipe.generate import generate

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
        {"stage": s.index, "daemon": s.daemon.name, "address": s.daemon.address, "units": [s.unit_start, s.unit_end],
         "kv_bytes": kv, **{k: v for k, v in stats.items() if k != "spans"}}
        for s, kv, stats in zip(pipe.stages, seq.kv_bytes, seq.stats)
    ]
    return result
