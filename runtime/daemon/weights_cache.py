"""A daemon's cache of the weights coordinators ship it: tensors by content hash, bounded, checked.

A daemon that does not hold a model's files receives its units' tensors from the coordinator
(:mod:`runtime.coordinator.ship`) as the file stores them. Each one is a file named by its BLAKE3
hash (:mod:`hpipe.model.weights.manifest`). Bytes arrive in chunks, appended to ``partial/HASH`` and hashed
as they arrive (so a whole entry is not read again: the link does not wait for that); a transfer
cut off part way goes on from the bytes that arrived (:meth:`WeightsCache.claim` says how many; they
are hashed once more then). A complete entry's hash is checked before it is renamed into place
(atomically), and again each time a stage loads it; a wrong one is deleted, so it is fetched again. The cache keeps at most
``budget`` bytes on disk, partial entries counted at their whole size from their first chunk: a
partial entry no chunk has reached for :data:`PARTIAL_IDLE_S` goes first when room is needed, then
the entries used least recently, never those a deployment holds or a live transfer asked for.
Only weights are cached, never activations.

Transfers belong to whoever began them. A coordinator names the tensors it is about to send with a
random transfer key (``CachedTensors``) and sends that key with every chunk (``PutTensors``): a chunk
of a tensor no transfer asked for is refused, and so is one of a tensor another transfer is
sending (its stream is open and a chunk came in the last :data:`CLAIM_IDLE_S`), so a caller cannot
restart or interleave another's transfer. What a transfer asked for is kept from eviction only while the
transfer lives (:data:`PARTIAL_IDLE_S` after its last call); what a ``Load`` holds, until the next
``Load``. Content addressing makes the bytes themselves trustworthy: an entry is its hash.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import blake3

from hpipe.core.errors import StatusError
from hpipe.model.weights.manifest import file_hash

log = logging.getLogger(__name__)

_HASH = re.compile(r"[0-9a-f]{64}")
#: the largest tensor a daemon accepts (a 128k-token vocabulary's bf16 embedding of width 16k is 4 GiB)
MAX_TENSOR_BYTES = 16 << 30
#: a partial entry no chunk has reached for this long is abandoned: removed when room is needed; a
#: transfer's claim on the tensors it asked for lapses as long after its last call
PARTIAL_IDLE_S = 600.0
#: a transfer whose stream sent nothing for this long lets another one that asks take its tensors
#: over (at once once its stream ended: a coordinator that retries goes on from what arrived)
CLAIM_IDLE_S = 30.0
#: the most tensors live transfers may have asked for at once
MAX_CLAIMS = 1 << 16
#: the shortest transfer key (as a session's, runtime.daemon.owners)
MIN_KEY_BYTES = 16


@dataclass
class _Claim:
    key: bytes
    touched: float  # time.monotonic() of the transfer's last call naming it
    sending: bool = False  # a PutTensors stream of the transfer is open


def check_hash(h: str) -> str:
    if not _HASH.fullmatch(h):
        raise StatusError("INVALID_ARGUMENT", f"{h[:80]!r} is not a content hash (64 hex digits)")
    return h


class WeightsCache:
    def __init__(self, root: Path, budget: int | None = None):
        self.root, self.budget = Path(root), budget
        self._partial = self.root / "partial"
        self._partial.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pinned: set[str] = set()  # what the deployment holds: never evicted
        self._claims: dict[str, _Claim] = {}  # what live transfers asked for, by hash
        self._hashing: dict[str, tuple[blake3.blake3, int]] = {}  # a partial entry's hash so far, and its bytes
        self._bytes: int | None = None  # whole entries' bytes (counted when first needed)
        self._expected: dict[str, int] = {}  # a partial entry's whole size, reserved at its first chunk

    # --- what a coordinator asks --------------------------------------------------------------
    def claim(self, hashes: list[str], key: bytes) -> tuple[list[str], dict[str, int]]:
        """Which of ``hashes`` are here whole, and how many bytes of the others arrived. The
        transfer of ``key`` now owns them (kept from eviction while it lives), except those another
        live transfer is sending: their bytes so far are not reported (a chunk of them is refused)."""
        if len(key) < MIN_KEY_BYTES:
            raise StatusError("INVALID_ARGUMENT", f"a transfer needs a key of {MIN_KEY_BYTES} bytes or more")
        whole, partial = [], {}
        now = time.monotonic()
        with self._lock:
            self._lapse(now)
            for h in map(check_hash, hashes):
                claim = self._claims.get(h)
                mine = claim is None or hmac.compare_digest(claim.key, key) or not claim.sending \
                    or now - claim.touched > CLAIM_IDLE_S
                if mine:
                    if len(self._claims) >= MAX_CLAIMS and h not in self._claims:
                        raise StatusError("RESOURCE_EXHAUSTED", f"live transfers have asked for {MAX_CLAIMS} tensors")
                    self._claims[h] = _Claim(key, now)
                if (self.root / h).exists():
                    whole.append(h)
                elif mine and (self._partial / h).exists():
                    partial[h] = (self._partial / h).stat().st_size
        return whole, partial

    def receive(self, h: str, offset: int, total: int, data: bytes, key: bytes) -> bool:
        """Append a chunk of ``h``'s bytes at ``offset`` (of ``total``), sent by the transfer of
        ``key``; True once the entry is whole and its hash checked. A chunk at 0 starts the entry
        over; any other not at the end of what arrived is refused (the sender asks :meth:`claim`
        where to go on), as is one of a tensor this transfer did not ask for."""
        check_hash(h)
        if not 0 < total <= MAX_TENSOR_BYTES or offset < 0 or offset + len(data) > total:
            raise StatusError("INVALID_ARGUMENT", f"a chunk of {len(data)} bytes at {offset} of a {total}-byte tensor")
        with self._lock:
            claim = self._claims.get(h)
            if claim is None or time.monotonic() - claim.touched > PARTIAL_IDLE_S:
                raise StatusError("FAILED_PRECONDITION", f"tensor {h[:12]}: no transfer asked for it (CachedTensors "
                                  "first, with the transfer's key)")
            if not hmac.compare_digest(claim.key, key):
                raise StatusError("ABORTED", f"tensor {h[:12]} is being sent by another transfer")
            claim.touched, claim.sending = time.monotonic(), True
            if (self.root / h).exists():
                return True  # another transfer brought it
            part = self._partial / h
            have = part.stat().st_size if part.exists() else 0
            if offset == 0 and have:  # the sender starts over
                self._drop_partial(h)
                have = 0
            if offset != have:
                raise StatusError("FAILED_PRECONDITION", f"tensor {h[:12]}: {have} bytes have arrived, not {offset}")
            if self._expected.get(h, total) != total:
                raise StatusError("INVALID_ARGUMENT", f"tensor {h[:12]} was {self._expected[h]} bytes, not {total}")
            if h not in self._expected:  # a new entry (or one from before a restart): room for all of it now
                self._make_room(total - have)
                self._expected[h] = total
            hasher, hashed = self._hashing.pop(h, (None, -1))
            if hashed != have:  # new, or bytes from before a restart: hash what is there
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                if have:
                    hasher.update_mmap(part)
            with open(part, "ab") as f:
                f.write(data)
            hasher.update(data)
            if have + len(data) < total:
                self._hashing[h] = (hasher, have + len(data))
                return False
            got = hasher.hexdigest()
            if got != h:
                self._drop_partial(h)
                raise StatusError("DATA_LOSS", f"tensor {h[:12]} arrived with hash {got[:12]}: discarded")
            os.replace(part, self.root / h)
            self._expected.pop(h, None)
            self._bytes += total
            return True

    # --- what a stage loads -------------------------------------------------------------------
    def path(self, h: str) -> Path:
        """The entry ``h``, its hash checked again (``DATA_LOSS`` and deleted when it is wrong or
        gone), marked used now."""
        p = self.root / check_hash(h)
        if not p.exists():
            raise StatusError("DATA_LOSS", f"tensor {h[:12]} is not in the weights cache")
        size = p.stat().st_size
        got = file_hash(p)
        if got != h:
            log.warning("weights cache entry %s is corrupt (its bytes hash to %s): deleted", h[:12], got[:12])
            with self._lock:
                if self._bytes is not None and p.exists():
                    self._bytes -= size
                p.unlink(missing_ok=True)
            raise StatusError("DATA_LOSS", f"tensor {h[:12]} in the weights cache is corrupt: deleted")
        now = time.time()
        os.utime(p, (now, now))
        return p

    def hold_only(self, hashes: set[str]) -> None:
        """The entries the daemon's stages now hold: kept from eviction until the next Load. The
        transfers that brought whole entries are done: their claims go (partial ones stay)."""
        with self._lock:
            self._pinned = set(hashes)
            for h in [h for h in self._claims if (self.root / h).exists()]:
                del self._claims[h]

    def stream_ended(self, key: bytes) -> None:
        """A PutTensors stream of the transfer of ``key`` ended (done, cut or cancelled): what it
        asked for stays kept while its claim lives, but another transfer may now go on with it."""
        with self._lock:
            for c in self._claims.values():
                if c.sending and hmac.compare_digest(c.key, key):
                    c.sending = False

    def _lapse(self, now: float) -> None:
        """Forget the claims of transfers gone quiet for :data:`PARTIAL_IDLE_S`."""
        for h in [h for h, c in self._claims.items() if now - c.touched > PARTIAL_IDLE_S]:
            del self._claims[h]

    def _kept(self) -> set[str]:
        self._lapse(time.monotonic())
        return self._pinned | self._claims.keys()

    def _drop_partial(self, h: str) -> None:
        (self._partial / h).unlink(missing_ok=True)
        self._expected.pop(h, None)
        self._hashing.pop(h, None)

    def _reserved(self) -> int:
        """Bytes the partial entries hold or have reserved (their whole size, where known)."""
        return sum(max(self._expected.get(p.name, 0), p.stat().st_size) for p in self._partial.iterdir())

    def _make_room(self, incoming: int) -> None:
        if self._bytes is None:
            self._bytes = sum(p.stat().st_size for p in self.root.iterdir() if p.is_file())
        if self.budget is None or self._bytes + self._reserved() + incoming <= self.budget:
            return
        stale = time.time() - PARTIAL_IDLE_S
        for p in list(self._partial.iterdir()):  # abandoned transfers first
            if p.stat().st_mtime < stale:
                log.info("weights cache: removed %s, a transfer abandoned part way", p.name[:12])
                self._drop_partial(p.name)
        entries = sorted((p for p in self.root.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime)
        total = self._bytes = sum(p.stat().st_size for p in entries)
        incoming += self._reserved()
        kept = self._kept()
        for p in entries:
            if total + incoming <= self.budget:
                return
            if p.name in kept:
                continue
            total -= p.stat().st_size
            self._bytes = total
            p.unlink(missing_ok=True)
            log.info("weights cache: evicted %s (least recently used) to stay within %.1f GB", p.name[:12],
                     self.budget / 1e9)
        if total + incoming > self.budget:
            raise StatusError("RESOURCE_EXHAUSTED", f"the weights cache's budget ({self.budget / 1e9:.2f} GB) is "
                              f"smaller than the weights this daemon is given; raise --weights-cache-gb")
