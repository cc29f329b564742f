"""The coordinator: deploy a plan's stages onto daemons, and run sequences through them.

:class:`Pipeline` loads each daemon's stages (one ``Load`` with the whole pipeline and the stages
it holds, and every daemon's data port, so each can reach the next) and keeps a gRPC client per
daemon for status. Micro-batches go through a :class:`runtime.coordinator.session.Session`. For callers that
think in one sequence at a time, :class:`RemoteSequence` is one sequence (or a batch of rows of
equal length, each a sequence of its own) on a session, and :class:`RemoteRunner` adapts it to the
single-sequence generation loop: prefill sends every slice as a micro-batch of its own, without
waiting, so the slices pipeline through the stages; each decode step waits for its token.
"""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence as Seq

import grpc
import torch

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.core.errors import InputError
from hpipe.core.lanes import decode_lane, decode_lanes
from hpipe.core.plan import PlanError, Stage, stages_from_cuts
from hpipe.model.kernels.precision import asked_prefill_gemm
from hpipe.model.kv.pool import prefill_end
from runtime.coordinator.session import Session, StageFailure
from runtime.coordinator.ship import Shipment, Transfer, is_data_loss
from runtime.wire.channels import DaemonClient, Security
from runtime.wire.messages import dtype_to_wire, pb, stage_to_wire

log = logging.getLogger(__name__)

__all__ = ["Pipeline", "RemoteRunner", "RemoteSequence", "StageFailure", "cut_stages", "generate_on_cluster"]


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


def coordinate_on_one_thread() -> None:
    """Run this process's own tensor work (sampling, the finiteness check of logits) on one CPU
    thread. A coordinator shares its machine with daemons, or at least with its own socket
    threads, and torch's default of one OpenMP thread per core wakes and spins threads on cores
    the daemons compute on: on the 2-core VM with ``local-3`` busy, a finiteness check of 2 logit
    rows took 8.7 ms on 2 threads against 0.7 ms on one, and a 16-document ``hpipe run`` spent 28 s
    of coordinator CPU against 6 s (94.7 s against 85.0 s in all)."""
    torch.set_num_threads(1)


#: the gRPC codes of a daemon that may answer differently in a moment (restarting, overloaded)
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.ABORTED})


class Pipeline:
    """Stages deployed on the daemons of a cluster, in pipeline order.

    ``daemons`` are the daemons in use, in order of their first stage, with one client each in
    ``clients``; ``stage_daemon[i]`` is the index of stage i's daemon there."""

    def __init__(self, cluster: ClusterSpec, security: Security | None = None, dequantize: bool = False):
        self.cluster = cluster
        self.dequantize = dequantize  # every load asks for a GGUF model's weights as float32
        self.security = security if security is not None else Security.of(cluster)
        self.stages: list[Stage] = []
        self.daemons: list[DaemonSpec] = []
        self.stage_daemon: list[int] = []
        self.clients: list[DaemonClient] = []
        self.loads: list[pb.LoadReply] = []    # per daemon in use: what its Load reported
        self.data_ports: list[int] = []        # per daemon in use
        self.lanes = 0                         # decode lanes among them (hpipe.core.lanes.decode_lanes)
        self.vocab_size = 0
        self.model, self.dtype = "", None      # what the stages hold, as loaded
        self.transfers: list[Transfer] = []    # per daemon in use: the weights the last load shipped it

    def describe_daemon(self, d: int) -> str:
        spec, stages = self.daemons[d], self.daemon_stages(d)
        return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} ({spec.name} at {spec.address})"

    def daemon_stages(self, d: int) -> list[int]:
        return [i for i, dd in enumerate(self.stage_daemon) if dd == d]

    def load(self, model: str, stages: Seq[Stage], dtype: torch.dtype, kv_pool_bytes: int = 0,
               adjacent: bool = False) -> list[Stage]:
        """Load ``stages`` (a plan's, or :func:`cut_stages`) onto their daemons in the cluster, each
        daemon's KV pools ``kv_pool_bytes`` in all (0: the daemon sizes them).

        A daemon named for several stages holds them all (an interleaved schedule); two stages in a
        row on one daemon would be one stage and are refused, unless ``adjacent`` (a recovery that
        moved a lost daemon's stage to its neighbour keeps both as they are). Addresses are the
        cluster's."""
        if not stages:
            raise InputError("a pipeline needs at least one stage")
        stages = [replace(s, address=self.cluster.daemon(s.daemon).address) for s in stages]
        repeated = [i for i in range(1, len(stages)) if stages[i].daemon == stages[i - 1].daemon]
        if repeated and not adjacent:
            i = repeated[0]
            raise InputError(f"stages {i - 1} and {i} are both on {stages[i].daemon}: merge them into one stage")
        self.close()
        names = list(dict.fromkeys(s.daemon for s in stages))
        daemons = [self.cluster.daemon(n) for n in names]
        stage_daemon = [names.index(s.daemon) for s in stages]
        self.clients = [DaemonClient(d.address, self.security, d.name) for d in daemons]

        def ask(d: int) -> tuple[int, tuple]:  # each daemon's data port and decode lane, all at once
            spec, client = daemons[d], self.clients[d]
            try:
                port = client.call("Status", pb.StatusRequest(), timeout=10.0).data_port
                info = client.call("GetDeviceInfo", pb.DeviceInfoRequest(), timeout=10.0)
            except grpc.RpcError as e:
                raise StageFailure(f"{spec.name} at {spec.address} is not responding: {e.code().name}: "
                                   f"{e.details()}") from None
            return port, (decode_lane(spec.name, info.host_id or spec.host, info.device, info.cpus, info.host_cpus),
                          info.threads, info.host_cpus)

        with ThreadPoolExecutor(max_workers=len(daemons)) as pool:
            ports, lanes = map(list, zip(*pool.map(ask, range(len(daemons)))))
        wire = [stage_to_wire(s, ports[stage_daemon[i]]) for i, s in enumerate(stages)]
        requests = [pb.LoadRequest(model=model, dtype=dtype_to_wire(dtype), stages=wire, kv_pool_bytes=kv_pool_bytes,
                                   dequantize=self.dequantize, prefill_gemm=asked_prefill_gemm(),
                                   held=[i for i, dd in enumerate(stage_daemon) if dd == d])
                    for d in range(len(daemons))]

        shipment = Shipment.of(model)
        self.transfers = [Transfer(d.name, local=shipment is None) for d in daemons]

        def load(d):
            request, client = requests[d], self.clients[d]
            ranges = [stages[i].units for i in request.held]
            try:
                for attempt in range(2):
                    if shipment is not None:  # the tensors it lacks, from the model's file here
                        shipped, self.transfers[d] = shipment.to(client, ranges, daemons[d].name)
                        if shipped is not None:
                            request.shipped.CopyFrom(shipped)
                    try:
                        return client.call("Load", request, timeout=600.0)
                    except grpc.RpcError as e:
                        if attempt or not (request.HasField("shipped") and is_data_loss(e)):
                            raise
                        log.warning("%s: %s; sending them again", daemons[d].name, e.details())
            except grpc.RpcError as e:
                raise StageFailure(f"{daemons[d].name} at {daemons[d].address} could not load units "
                                   f"{', '.join(map(str, ranges))}: {e.code().name}: {e.details()}",
                                   lasting=e.code() not in TRANSIENT) from None

        with ThreadPoolExecutor(max_workers=len(daemons)) as pool:
            self.loads = list(pool.map(load, range(len(daemons))))
        self.daemons, self.stages, self.stage_daemon, self.data_ports = daemons, stages, stage_daemon, ports
        self.model, self.dtype = model, dtype
        self.lanes = decode_lanes(lanes)
        self.vocab_size = self.loads[stage_daemon[-1]].vocab_size
        return self.stages

    def pools(self) -> list[pb.Pool]:
        """Every held stage's KV pool now, in stage order (:class:`StageFailure` if a daemon does not answer)."""
        out = {}
        for client in self.clients:
            try:
                status = client.call("Status", pb.StatusRequest(), timeout=10.0)
            except grpc.RpcError as e:
                raise StageFailure(f"{client.name} at {client.address} is not responding: {e.code().name}") from None
            for p in status.pools:
                out[p.stage] = p
        return [out[i] for i in sorted(out)]

    def session(self, result_timeout_s: float = 600.0, resume_from: Session | None = None) -> Session:
        """A new session; with ``resume_from``, one that takes over that session's sequences."""
        return Session(self, result_timeout_s, resume_from)

    def open(self, max_len: int, batch: int = 1) -> "RemoteSequence":
        """One sequence on a session of its own (closed with it)."""
        return RemoteSequence(self.session(), max_len, batch, owns_session=True)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients, self.daemons, self.stages, self.stage_daemon, self.loads, self.data_ports = \
            [], [], [], [], [], []


class RemoteSequence:
    """One sequence of ``batch`` rows of equal length (each row a sequence of its own), fed one
    slice at a time, each slice a micro-batch of one entry per row."""

    def __init__(self, session: Session, max_len: int, batch: int = 1, owns_session: bool = False):
        self.session, self.batch, self.max_len, self._owns = session, batch, max_len, owns_session
        self.ids = [secrets.randbits(63) for _ in range(batch)]
        self.position = 0
        self._pending: list[int] = []

    def submit(self, ids: torch.Tensor, *, want_logits: bool = True, all_logits: bool = False,
               prefill: bool | None = None) -> int:
        """Send one slice of token ids ``[batch, tokens]`` into the pipeline (returns without waiting).
        ``prefill``: the slice is the prompt's (True) or decode tokens (False); None: the stages
        decide by its length (see :class:`hpipe.model.kv.pool.Entry`)."""
        ids = ids.to(torch.int64).reshape(self.batch, -1)
        n = ids.shape[1]
        if self.position + n > self.max_len:
            raise InputError(f"positions up to {self.position + n} exceed the sequence's max length {self.max_len}")
        logits = pb.ALL_LOGITS if all_logits else pb.LAST_LOGITS if want_logits else pb.NO_LOGITS
        end = prefill_end(self.position, n, prefill)
        entries = [pb.Entry(sequence_id=i, start=self.position, length=n, logits=logits,
                            max_len=self.max_len if self.position == 0 else 0, prefill_end=end) for i in self.ids]
        mb = self.session.submit(entries, ids)
        self.position += n
        self._pending.append((mb, n if all_logits else 0))
        return mb

    def result(self) -> torch.Tensor:
        """The logits of the oldest slice not yet read: ``[batch, vocab]`` (``[batch, tokens, vocab]``
        for ``all_logits``; no rows for a slice that wanted none). A failed row is a :class:`StageFailure`."""
        mb, positions = self._pending.pop(0)
        try:
            result = self.session.result(mb, self.ids)
        except StageFailure:
            self.session.close_sequences(self.ids)  # the daemons that still answer free it
            raise
        failed = [result.failed[i] for i in self.ids if i in result.failed]
        if failed:
            self.session.close_sequences(self.ids)
            raise StageFailure(f"{failed[0][0]}: {failed[0][1]}")
        return result.logits.view(self.batch, positions, -1) if positions else result.logits

    def close(self) -> list[dict]:
        """Free the sequence (and its own session, with that session's statistics per stage)."""
        self.session.close_sequences(self.ids)
        return self.session.close() if self._owns else []

    def __enter__(self) -> "RemoteSequence":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteRunner:
    """Adapts a :class:`RemoteSequence` to the generation loop: prefill pipelines all slices."""

    def __init__(self, seq: RemoteSequence):
        self.seq = seq

    def prefill(self, ids: torch.Tensor, slices: Seq[int]) -> torch.Tensor:
        start = 0
        for k, n in enumerate(slices):
            self.seq.submit(ids[:, start:start + n], want_logits=k == len(slices) - 1, prefill=True)
            start += n
        logits = None
        for _ in slices:  # results arrive in order; only the last carries logits
            logits = self.seq.result()
        return logits[0]

    def step(self, token: int) -> torch.Tensor:
        self.seq.submit(torch.tensor([[token]]), prefill=False)
        return self.seq.result()[0]

    @property
    def position(self) -> int:
        return self.seq.position

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """``tokens`` at the next positions as one entry of decode rows; every row's logits
        (hpipe.model.generate.speculate)."""
        self.seq.submit(torch.tensor([tokens]), all_logits=True, prefill=False)
        return self.seq.result()[0]

    def rewind(self, position: int) -> None:
        """The next entry starts at ``position``: each stage drops what it holds past it then."""
        if not 0 < position <= self.seq.position:
            raise InputError(f"cannot rewind a sequence of {self.seq.position} positions to {position}")
        self.seq.position = position


def generate_on_cluster(pipe: Pipeline, source, tokenizer, prompt: str, *, chat: bool, max_new_tokens: int,
                        sampling, slices, speculate: str = "off"):
    """:func:`hpipe.model.generate.local.generate` through a deployed pipeline, with per-stage timings."""
    from hpipe.model.generate.local import generate

    session = pipe.session()
    opened: list[RemoteSequence] = []
    block_bytes = {p.stage: (p.block_size, p.block_bytes) for p in pipe.pools()}

    def open_runner(max_len: int) -> RemoteRunner:
        seq = RemoteSequence(session, max_len)
        opened.append(seq)
        return RemoteRunner(seq)

    try:
        result = generate(open_runner, tokenizer, prompt, context=source.config.max_position_embeddings,
                          eos_ids=source.eos_token_ids(), chat=chat, max_new_tokens=max_new_tokens,
                          sampling=sampling, slices=slices, speculate=speculate)
    finally:
        for seq in opened:
            seq.close()
        stats = session.close()
    positions = opened[0].position

    def kv_bytes(i: int) -> int:  # the blocks the sequence held on stage i at its end
        size, per_block = block_bytes.get(i, (1, 0))
        return -(-positions // size) * per_block

    result.extra["stages"] = [
        {"stage": i, "daemon": s.daemon, "address": s.address, "units": [s.units.start, s.units.end],
         "kv_bytes": kv_bytes(i), **{k: v for k, v in st.items() if k != "spans"}}
        for i, (s, st) in enumerate(zip(pipe.stages, stats))
    ]
    return result
