"""KV sent between daemons at a Seesaw layout switch, instead of rebuilt by replays.

Design note (docs/decisions/seesaw.md). A switch moves some stages from one daemon to another.
Without this, the new owner starts with empty caches and the coordinator rebuilds them with
replays (the stage before sends the activations it logged, the new owner computes them again):
Seesaw's "recompute" transition. Here is the other one, "send": before the switch's ``Load``, the
coordinator asks the old owner to send its stages' KV of the session's sequences to the new owner
(``SendKv``; the old owner streams it with ``ReceiveKv`` over gRPC, the cluster's token and TLS as
any daemon-to-daemon call). The new owner keeps what arrives in host memory
(:class:`IncomingKV`) until its next ``Load`` holds those stages, then writes each sequence's
positions into blocks of its own there (creating the sequence, in the old session, if it had no
stage of it), so ``Resume`` reports them computed and nothing is replayed. The planner prices the
two and says which it chose for each run of moved units (:mod:`planner.seesaw`).

Reading a pool and writing one run on the daemon's worker (``run_on_device``), one sequence at a
time, so a sequence's KV is in host memory once on each side at most. A sequence the new owner's
pool has no room for keeps an empty cache there (replays rebuild it). The key of the session
travels with the KV, and the receiver takes it only for a session whose own data connection (its
Hello) gave this daemon that key: KV cannot arrive ahead of a session and claim it, and only the
session's owner adopts what came (``Resume``).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import psutil
import torch

from hpipe.core.errors import StatusError
from hpipe.model.kv.pool import PoolExhausted
from runtime.daemon.kv_tier import HostTier
from runtime.daemon.sequences import Sequence, SequenceTable
from runtime.wire.messages import dtype_from_wire, dtype_to_wire, pb

log = logging.getLogger(__name__)

#: the most bytes of keys or values one KvPart carries (as the weights' chunks, runtime.coordinator.ship)
PART_BYTES = 4 << 20

#: the most sessions whose keys :class:`IncomingKV` keeps (the oldest goes first): a session that
#: never comes back (its coordinator died between a send and its Resume) leaves its key behind
KEPT_SESSIONS = 64


@dataclass
class StageKV:
    """One sequence's KV on one stage: each layer's keys and values, [positions, kv_heads, head_dim]
    (positions outermost, so a part of positions is one contiguous run of bytes)."""
    positions: int
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    filled: int = 0  # positions received, over every layer's keys and values (a stream cut short leaves fewer)
    swapped: bool = False  # the sequence's copy in the host tier (kv_tier), not its blocks in a pool

    def complete(self, layers: list[int]) -> bool:
        return all(x in self.k and x in self.v for x in layers) and self.filled == 2 * len(layers) * self.positions

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k.values()) + sum(t.nbytes for t in self.v.values())


def read(stages: dict, seq: Sequence, wanted: Iterable[int], tier: HostTier | None = None) -> dict[int, StageKV]:
    """``seq``'s computed positions on each held stage of ``wanted``, copied into host memory (run
    it on the worker); a stage without attention has none to copy, only its positions. A sequence
    swapped out to the host ``tier`` is read from its copy there (none without the tier)."""
    out = {}
    for i in wanted:
        held, kv, n = stages.get(i), seq.kv.get(i), seq.computed.get(i, 0)
        if held is None or n <= 0:
            continue
        pool = held.pool
        copy = tier.stage_copy(seq.id, i) if tier is not None else None
        if copy is not None:
            out[i] = StageKV(n, {layer: t.transpose(0, 1).contiguous() for layer, t in copy[0].items()},
                             {layer: t.transpose(0, 1).contiguous() for layer, t in copy[1].items()}, swapped=True)
            continue
        if pool is None or not pool.layers or kv is None:
            out[i] = StageKV(n)
            continue
        if kv.capacity < n:  # swapped out, and its copy is not here
            continue
        slots = kv.slots(0, n, pool.k[pool.layers[0]].device)
        out[i] = StageKV(n, {layer: _positions_first(pool.k[layer], slots) for layer in pool.layers},
                         {layer: _positions_first(pool.v[layer], slots) for layer in pool.layers})
    return out


def parts(seq: Sequence, held: dict[int, StageKV], session: int, key: bytes) -> Iterator[pb.KvPart]:
    """``held`` (one sequence's KV on some stages) cut into parts of at most :data:`PART_BYTES`; a
    stage without KV is one part of no positions (``count`` 0), saying how far it is."""
    for i, st in held.items():
        if not st.k:
            yield pb.KvPart(session=session, key=key, sequence_id=seq.id, max_len=seq.max_len, stage=i,
                            positions=st.positions, layer=-1, swapped=st.swapped)
        for values, layers in ((False, st.k), (True, st.v)):
            for layer, t in layers.items():
                n, heads, dim = t.shape
                step = max(1, PART_BYTES // (heads * dim * t.element_size()))
                for a in range(0, n, step):
                    c = min(step, n - a)
                    data = t[a:a + c].view(torch.uint8).numpy().tobytes()
                    yield pb.KvPart(session=session, key=key, sequence_id=seq.id, max_len=seq.max_len, stage=i,
                                    positions=st.positions, layer=layer, values=values, start=a, count=c,
                                    dtype=dtype_to_wire(t.dtype), kv_heads=heads, head_dim=dim, data=data,
                                    swapped=st.swapped)


def send(sequences: SequenceTable, stages: Callable[[], dict], run_on_device: Callable, session: int,
         key: bytes, wanted: list[int], push: Callable[[Iterator[pb.KvPart]], pb.KvReply],
         only: set[int] | None = None, tier: HostTier | None = None) -> dict:
    """Send ``session``'s KV on held stages ``wanted`` (of its sequences ``only``, or all of them;
    a swapped one's from the host ``tier``) through ``push`` (a ReceiveKv call on the new owner), a
    sequence at a time: what was sent."""
    t0, sent = time.perf_counter(), {"bytes": 0, "sequences": 0}

    def stream() -> Iterator[pb.KvPart]:
        for seq in [s for s in sequences.all() if s.session == session and not s.error
                    and (only is None or s.id in only)]:
            held = run_on_device(lambda seq=seq: read(stages(), seq, wanted, tier), 60.0)
            if held:
                sent["sequences"] += 1
                sent["bytes"] += sum(st.nbytes for st in held.values())
                yield from parts(seq, held, session, key)
    push(stream())
    return {**sent, "seconds": time.perf_counter() - t0}


@dataclass
class _Arriving:
    session: int
    max_len: int
    stages: dict[int, StageKV] = field(default_factory=dict)


class IncomingKV:
    """KV that other daemons sent here for stages this daemon is about to hold, by sequence, until
    the next ``Load`` puts it into the pools (:meth:`install`); at most ``limit`` bytes."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or psutil.virtual_memory().total // 2
        self.nbytes = 0
        self._lock = threading.Lock()
        self._arriving: dict[int, _Arriving] = {}
        self._keys: OrderedDict[int, bytes] = OrderedDict()  # session -> its key (its own, checked at arrival)

    def receive(self, stream: Iterable[pb.KvPart], owns: Callable[[int, bytes], bool]) -> dict:
        """Keep a ReceiveKv stream's parts; ``owns(session, key)``: whether the key is the session's
        here (False too for a session with no data connection here: only a session itself records
        its key on a daemon, by its Hello, so KV sent ahead of it cannot claim it). What arrived."""
        t0, got, seqs = time.perf_counter(), 0, set()
        for part in stream:
            t = _tensor(part) if part.count else None
            self._check_key(part, owns)
            with self._lock:
                a = self._arriving.setdefault(part.sequence_id, _Arriving(part.session, part.max_len))
                if a.session != part.session or part.positions <= 0:
                    raise StatusError("INVALID_ARGUMENT", f"sequence {part.sequence_id}: a KV part of another "
                                      "session, or of no positions")
                st = a.stages.setdefault(part.stage, StageKV(part.positions, swapped=part.swapped))
                if t is None:  # a stage without KV: only how far it is
                    seqs.add(part.sequence_id)
                    continue
                layers = st.v if part.values else st.k
                buf = layers.get(part.layer)
                if buf is None:
                    if self.nbytes + t.nbytes * part.positions // part.count > self.limit:
                        raise StatusError("RESOURCE_EXHAUSTED", f"KV sent here passes {self.limit} bytes")
                    buf = layers[part.layer] = torch.empty(part.positions, part.kv_heads, part.head_dim,
                                                           dtype=t.dtype)
                    self.nbytes += buf.nbytes
                if st.positions != part.positions or buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype \
                        or part.start + part.count > part.positions:
                    raise StatusError("INVALID_ARGUMENT", f"a KV part of sequence {part.sequence_id} does not "
                                      "match the ones before it")
                buf[part.start:part.start + part.count] = t
                st.filled += part.count
            got += len(part.data)
            seqs.add(part.sequence_id)
        return {"bytes": got, "sequences": len(seqs), "seconds": time.perf_counter() - t0}

    def _check_key(self, part: pb.KvPart, owns: Callable[[int, bytes], bool]) -> None:
        with self._lock:
            held = self._keys.get(part.session)
            if held is None:
                if not owns(part.session, part.key):
                    raise StatusError("PERMISSION_DENIED", f"KV of session {part.session} without its key (or for "
                                      "a session with no connection here)")
                self._keys[part.session] = part.key
                while len(self._keys) > KEPT_SESSIONS:  # its KV, if any is still here, goes with it
                    self._drop(next(iter(self._keys)))
            elif not hmac.compare_digest(held, part.key):
                raise StatusError("PERMISSION_DENIED", f"KV of session {part.session} without its key")

    def owns(self, session: int, key: bytes) -> bool | None:
        """Whether ``key`` is the one ``session``'s KV came with (None: no KV of it came)."""
        with self._lock:
            held = self._keys.get(session)
        return None if held is None else hmac.compare_digest(held, key)

    def install(self, stages: dict, sequences: SequenceTable, device: torch.device,
                tier: HostTier | None = None) -> int:
        """Write what arrived into the held stages' pools (run it on the worker, after a Load), a
        swapped sequence's into the host ``tier`` (it stays swapped out); the positions written.
        KV of a stage not held here is dropped; a sequence that was not here is opened in its
        session, with empty caches on the other held stages (replays fill them)."""
        with self._lock:
            arriving, self._arriving, self.nbytes = self._arriving, {}, 0
        written = 0
        for seq_id, a in arriving.items():
            seq = sequences.find(seq_id)
            if seq is None:
                seq = Sequence(seq_id, a.session, a.max_len, {}, {})
                sequences.add(seq)
            elif seq.session != a.session:
                log.warning("KV of sequence %d came for session %d; it is in another here", seq_id, a.session)
                continue
            for i, held in stages.items():
                if i not in seq.kv and held.pool is not None:
                    seq.kv[i] = held.pool.sequence(seq.max_len)
                    seq.planned[i] = seq.computed[i] = 0
                seq.planned.setdefault(i, 0)
                seq.computed.setdefault(i, 0)
            for i, st in a.stages.items():
                if st.swapped:
                    written += _keep_swapped(stages, seq, i, st, tier)
                else:
                    written += _write(stages.get(i), seq, i, st, device)
        return written

    def forget(self, session: int) -> None:
        """``session``'s key, once its sequences were adopted, and what came of it and was not yet
        written (it ended here before a Load: nothing would adopt the sequences)."""
        with self._lock:
            self._drop(session)

    def _drop(self, session: int) -> None:
        self._keys.pop(session, None)
        for seq_id in [i for i, a in self._arriving.items() if a.session == session]:
            self.nbytes -= sum(st.nbytes for st in self._arriving.pop(seq_id).stages.values())


def _write(held, seq: Sequence, i: int, st: StageKV, device: torch.device) -> int:
    if held is None:
        log.warning("KV of sequence %d came for stage %d, which is not held here", seq.id, i)
        return 0
    pool, kv, n = held.pool, seq.kv.get(i), st.positions
    if pool is None or not pool.layers:  # nothing to write: it only goes on from there
        seq.planned[i] = seq.computed[i] = n
        return n
    if not st.complete(pool.layers):
        log.warning("the KV sent for sequence %d on stage %d did not all come; replays rebuild it", seq.id, i)
        return 0
    kv.truncate(0)
    try:
        kv.grow(n)
    except PoolExhausted as e:
        log.warning("sequence %d: no room for the KV sent for stage %d (%s); replays rebuild it", seq.id, i, e)
        kv.truncate(0)
        seq.planned[i] = seq.computed[i] = 0
        return 0
    slots = kv.slots(0, n, device)
    for layer in pool.layers:
        pool.k[layer][:, slots] = st.k[layer].to(device).transpose(0, 1)
        pool.v[layer][:, slots] = st.v[layer].to(device).transpose(0, 1)
    seq.planned[i] = seq.computed[i] = n
    return n


def _keep_swapped(stages: dict, seq: Sequence, i: int, st: StageKV, tier: HostTier | None) -> int:
    """A swapped sequence's KV for stage ``i``, kept in the host tier: it comes back into the pool
    with the sequence's other stages when the coordinator brings it back."""
    held = stages.get(i)
    if held is None or tier is None:
        log.warning("KV of swapped sequence %d came for stage %d, which is not held here", seq.id, i)
        return 0
    if held.pool is None or not held.pool.layers:  # nothing to keep: it only goes on from there
        seq.planned[i] = seq.computed[i] = st.positions
        return st.positions
    if not st.complete(held.pool.layers):
        log.warning("the KV sent for swapped sequence %d on stage %d did not all come", seq.id, i)
        return 0
    if not tier.adopt(seq, i, st.positions, {x: t.transpose(0, 1) for x, t in st.k.items()},
                      {x: t.transpose(0, 1) for x, t in st.v.items()}, stages):
        log.warning("the host tier has no room for swapped sequence %d's KV of stage %d", seq.id, i)
        return 0
    return st.positions


def _positions_first(pool_kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A pool tensor's rows at ``slots`` as one contiguous [positions, kv_heads, head_dim] host tensor."""
    return pool_kv.transpose(0, 1).index_select(0, slots).cpu()


def _tensor(part: pb.KvPart) -> torch.Tensor:
    """A part's positions, [count, kv_heads, head_dim] (a read-only view of its bytes: copy it)."""
    dtype = dtype_from_wire(part.dtype)
    shape = (part.count, part.kv_heads, part.head_dim)
    want = part.kv_heads * part.count * part.head_dim * dtype.itemsize
    if part.count <= 0 or part.positions <= 0 or len(part.data) != want:
        raise StatusError("INVALID_ARGUMENT", f"a KV part of sequence {part.sequence_id} has {len(part.data)} "
                          f"bytes; its shape {shape} needs {want}")
    with warnings.catch_warnings():  # the bytes are only read, into the receiver's buffer
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(part.data, dtype=torch.uint8).view(dtype).view(shape)
