"""A daemon's cache of the weights coordinators ship it: tensors by content hash, bounded, checked.

A daemon that does not hold a model's files receives its units' tensors from the coordinator
(:mod:`runtime.coordinator.ship`) as the file stores them. Each one is a file named by its BLAKE3
hash (:mod:`hpipe.model.weights.manifest`). Bytes arrive in chunks, appended to ``partial/HASH`` and hashed
as they arrive (so a whole entry is not read again: the link does not wait for that); a transfer
cut off part way goes on from the bytes that arrived (:meth:`WeightsCache.held` says how many; they
are hashed once more then). A complete entry's hash is checked before it is renamed into place
(atomically), and again each time a stage loads it; a wrong one is deleted, so it is fetched again. The cache keeps at most
``budget`` bytes on disk, partial entries counted at their whole size from their first chunk: a
partial entry no chunk has reached for :data:`PARTIAL_IDLE_S` goes first when room is needed, then
the entries used least recently, never those a deployment has asked for or holds. Only weights are
cached, never activations.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

import blake3

from hpipe.core.errors import StatusError
from hpipe.model.weights.manifest import file_hash

log = logging.getLogger(__name__)

_HASH = re.compile(r"[0-9a-f]{64}")
#: the largest tensor a daemon accepts (a 128k-token vocabulary's bf16 embedding of width 16k is 4 GiB)
MAX_TENSOR_BYTES = 16 << 30
#: a partial entry no chunk has reached for this long is abandoned: removed when room is needed
PARTIAL_IDLE_S = 600.0


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
        self._pinned: set[str] = set()  # what deployments asked for or hold: never evicted
        self._hashing: dict[str, tuple[blake3.blake3, int]] = {}  # a partial entry's hash so far, and its bytes
        self._bytes: int | None = None  # whole entries' bytes (counted when first needed)
        self._expected: dict[str, int] = {}  # a partial entry's whole size, reserved at its first chunk

    # --- what a coordinator asks --------------------------------------------------------------
    def held(self, hashes: list[str]) -> tuple[list[str], dict[str, int]]:
        """Which of ``hashes`` are here whole, and how many bytes of the others arrived; they are
        kept from eviction from now on (a deployment is about to use them)."""
        whole, partial = [], {}
        with self._lock:
            for h in map(check_hash, hashes):
                self._pinned.add(h)
                if (self.root / h).exists():
                    whole.append(h)
                elif (self._partial / h).exists():
                    partial[h] = (self._partial / h).stat().st_size
        return whole, partial

    def receive(self, h: str, offset: int, total: int, data: bytes) -> bool:
        """Append a chunk of ``h``'s bytes at ``offset`` (of ``total``); True once the entry is whole
        and its hash checked. A chunk at 0 starts the entry over; any other not at the end of what
        arrived is refused (the sender asks :meth:`held` where to go on)."""
        check_hash(h)
        if not 0 < total <= MAX_TENSOR_BYTES or offset < 0 or offset + len(data) > total:
            raise StatusError("INVALID_ARGUMENT", f"a chunk of {len(data)} bytes at {offset} of a {total}-byte tensor")
        with self._lock:
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
        """The entries the daemon's stages now hold: the ones kept from eviction."""
        with self._lock:
            self._pinned = set(hashes)

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
        for p in entries:
            if total + incoming <= self.budget:
                return
            if p.name in self._pinned:
                continue
            total -= p.stat().st_size
            self._bytes = total
            p.unlink(missing_ok=True)
            log.info("weights cache: evicted %s (least recently used) to stay within %.1f GB", p.name[:12],
                     self.budget / 1e9)
        if total + incoming > self.budget:
            raise StatusError("RESOURCE_EXHAUSTED", f"the weights cache's budget ({self.budget / 1e9:.2f} GB) is "
                              f"smaller than the weights this daemon is given; raise --weights-cache-gb")
