"""The coordinator: deploy unit ranges onto daemons, stream slices into stage 0, read the last
stage's results, and notice a dead or failing stage within a deadline.

Design note. The coordinator never relays activations: it submits token ids to stage 0 and
reads logits from the last stage's ``Results`` stream, one stream per sequence, read by a
background thread into a queue. While it waits it polls every stage's ``Status`` for that
sequence: an unreachable stage, or a stage that recorded an error (a failed send names the
successor it could not reach), fails the sequence at once with a message naming the stage, and
the surviving stages are told to free the sequence's KV cache.

A daemon may hold several stages (an interleaved schedule): it gets one ``Load`` with all of its
unit ranges, one ``Open`` per sequence, and reports statistics per range, which are put back in
stage order. ``Pipeline.clients`` has one client per daemon (a *host*); ``StageInfo.host`` maps
each stage to its host.
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
    host: int             # index of its daemon in Pipeline.hosts / clients
    parameters: int       # of the daemon's whole deployment (all its stages)
    weight_bytes: int
    load_s: float


class Pipeline:
    """Stages deployed on the daemons of a cluster, in pipeline order."""

    def __init__(self, cluster: ClusterSpec, security: Security | None = None):
        self.cluster = cluster
        self.security = security if security is not None else cluster.security()
        self.stages: list[StageInfo] = []
        self.hosts: list[DaemonSpec] = []      # the daemons in use, in order of their first stage
        self.clients: list[StageClient] = []   # one per host
        self.vocab_size = 0

    def describe_host(self, h: int) -> str:
        d, stages = self.hosts[h], self.host_stages(h)
        return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} ({d.name} at {d.address})"

    def host_stages(self, h: int) -> list[int]:
        return [s.index for s in self.stages if s.host == h]

    def deploy(self, model: str, cuts: Seq[int], num_units: int, dtype: torch.dtype,
               daemons: Seq[str] | None = None) -> list[StageInfo]:
        """Load ``[0,c1), [c1,c2), ...`` onto the named daemons (default: the first ones, in file order).

        A daemon named for several stages holds them all (an interleaved schedule); two stages in a
        row on one daemon would be one stage and are refused."""
        bounds = [0, *cuts, num_units]
        n = len(bounds) - 1
        chosen = [self.cluster.daemon(name) for name in daemons] if daemons else list(self.cluster.daemons[:n])
        if len(chosen) != n:
            raise InputError(f"{n} stages need {n} daemons; cluster {self.cluster.name!r} has "
                             f"{len(self.cluster.daemons)}")
        repeated = [i for i in range(1, n) if chosen[i].name == chosen[i - 1].name]
        if repeated:
            raise InputError(f"stages {repeated[0] - 1} and {repeated[0]} are both on {chosen[repeated[0]].name}: "
                             "merge them into one stage")
        self.close()
        by_name: dict[str, DaemonSpec] = {}
        for d in chosen:
            by_name.setdefault(d.name, d)
        hosts = list(by_name.values())
        host_index = {name: h for h, name in enumerate(by_name)}
        host_of = [host_index[d.name] for d in chosen]
        self.clients = [StageClient(d.address, self.security, d.name) for d in hosts]
        requests = [pb.LoadRequest(model=model, dtype=dtype_to_wire(dtype), parts=[
            pb.StagePart(unit_start=bounds[i], unit_end=bounds[i + 1], stage_index=i,
                         next_address=chosen[i + 1].address if i + 1 < n else "",
                         next_name=chosen[i + 1].name if i + 1 < n else "")
            for i in range(n) if host_of[i] == h]) for h in range(len(hosts))]

        def load(h):
            try:
                return self.clients[h].call("Load", requests[h], timeout=600.0)
            except grpc.RpcError as e:
                ranges = ", ".join(f"[{p.unit_start}, {p.unit_end})" for p in requests[h].parts)
                raise StageFailure(f"{hosts[h].name} at {hosts[h].address} could not load units {ranges}: "
                                   f"{e.code().name}: {e.details()}") from None

        with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
            replies = list(pool.map(load, range(len(hosts))))
        self.hosts = hosts
        self.stages = [StageInfo(i, chosen[i], bounds[i], bounds[i + 1], host_of[i], replies[host_of[i]].parameters,
                                 replies[host_of[i]].weight_bytes, replies[host_of[i]].load_s) for i in range(n)]
        self.vocab_size = replies[host_of[-1]].vocab_size
        return self.stages

    def open(self, max_len: int, batch: int = 1, idle_timeout_s: float = 60.0,
             result_timeout_s: float = 600.0) -> "RemoteSequence":
        if not self.stages:
            raise HpipeError("no model is deployed")
        return RemoteSequence(self, max_len, batch, idle_timeout_s, result_timeout_s)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients, self.hosts, self.stages = [], [], []


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
            for h in range(len(pipe.clients)):
                reply = self._rpc(h, "Open", pb.OpenRequest(sequence_id=self.id, batch=batch, max_len=max_len,
                                                           idle_timeout_s=idle_timeout_s))
                opened.append(h)
                for i, kv in zip(pipe.host_stages(h), reply.parts_kv_bytes):
                    self.kv_bytes[i] = kv
        except HpipeError:
            for h in opened:
                self._close_host(h)
            raise
        self._last = pipe.stages[-1].host
        self._stream = pipe.clients[self._last].results(self.id)
        self._reader = threading.Thread(target=self._read_results, daemon=True, name=f"results-{self.id}")
        self._reader.start()

    def _rpc(self, h: int, method: str, request, timeout: float = 30.0):
        """``method`` on host ``h``, its failure as a :class:`StageFailure` naming the host's stages."""
        try:
            return self.pipe.clients[h].call(method, request, timeout=timeout)
        except grpc.RpcError as e:
            code, who = e.code(), self.pipe.describe_host(h)
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
        first = self.pipe.stages[0]
        self._rpc(first.host, "Submit", pb.Slice(sequence_id=self.id, unit_start=first.unit_start,
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
                raise StageFailure(f"{self.pipe.describe_host(self._last)}: results stream broke "
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
        for h in range(len(self.pipe.clients)):
            try:
                replies[h] = self.pipe.clients[h].call("Status", pb.StatusRequest(sequence_ids=[self.id]),
                                                       timeout=STATUS_TIMEOUT_S)
            except grpc.RpcError as e:
                dead = dead or (h, e)
        if dead:
            h, e = dead
            self._abort(skip=h)
            raise StageFailure(f"{self.pipe.describe_host(h)} is not responding ({e.code().name}: {e.details()})")
        for h, reply in replies.items():
            state = reply.sequences[0]
            if state.error:
                self._abort()
                raise StageFailure(f"{self.pipe.describe_host(h)}: {state.error}")
            if not state.open:
                self._abort()
                raise StageFailure(f"{self.pipe.describe_host(h)} no longer holds sequence {self.id} (idle timeout?)")

    def logits(self, msg: pb.SliceResult) -> torch.Tensor:
        return tensor_from_proto(msg.logits)

    # --- life cycle -------------------------------------------------------------------------
    def _close_host(self, h: int) -> dict[int, dict]:
        """Free the sequence on host ``h``; its statistics per stage index ({} if it did not answer)."""
        try:
            reply = self.pipe.clients[h].call("Close", pb.SequenceRequest(sequence_id=self.id), timeout=5.0)
        except grpc.RpcError:
            return {}
        index = {self.pipe.stages[i].unit_start: i for i in self.pipe.host_stages(h)}
        return {index[s.unit_start]: {
            "compute_s": s.compute_s, "send_s": s.send_s, "recv_decode_s": s.recv_decode_s,
            "slices": s.slices, "bytes_sent": s.bytes_sent,
            "spans": [(x.start, x.length, x.received_s, x.begin_s, x.end_s) for x in s.spans]}
            for s in reply.stats if s.unit_start in index}

    def _abort(self, skip: int | None = None) -> None:
        """Free the sequence on every host that still answers."""
        if self._closed:
            return
        self._closed = True
        for h in range(len(self.pipe.clients)):
            if h != skip:
                self._close_host(h)
        self._stream.cancel()

    def close(self) -> list[dict]:
        """Free the sequence everywhere; statistics per stage ({} for a stage that did not answer)."""
        if not self._closed:
            self._closed = True
            per_stage: dict[int, dict] = {}
            for h in range(len(self.pipe.clients)):
                per_stage.update(self._close_host(h))
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
