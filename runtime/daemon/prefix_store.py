"""The prefix cache's blocks on a daemon: full KV blocks kept, by name, for later sequences.

A coordinator decides everything about its prefix cache (:mod:`runtime.coordinator.prefix_cache`):
which blocks to keep, which a new sequence begins with, which to forget. A daemon only does as it
is told, for each stage it holds: an entry's ``keep`` names the blocks it fills, and the store
holds them (one holder more in the pool, so they outlive their sequence); a sequence's first entry
lists in ``cached`` the names it begins with, and the store gives it those blocks; an ``Evict``
frame, or the end of the session, lets go of them. Names are the session's own: one session never
sees another's blocks.
"""

from __future__ import annotations

import threading
from collections import Counter

from hpipe.model.kv.pool import SeqKV


class PrefixStore:
    def __init__(self):
        self._lock = threading.Lock()
        #: session -> held stage -> block name -> (the stage's pool, the block)
        self._kept: dict[int, dict[int, dict[int, tuple]]] = {}
        #: held stage -> hits, cached_tokens, evictions (over every session)
        self._counts: dict[int, Counter] = {}

    def begin(self, session: int, kv: dict[int, SeqKV], names: list[int]) -> str:
        """Start each stage's new, empty sequence ``kv`` with the blocks ``names`` (in order);
        an error ("" if none) when a stage lacks one of them (then nothing is shared)."""
        with self._lock:
            kept = self._kept.get(session, {})
            found = {}
            for stage in kv:
                have = kept.get(stage, {})
                missing = [n for n in names if n not in have]
                if missing:
                    return f"stage {stage} keeps no cached block {missing[0]:#x} for this session"
                found[stage] = [have[n][1] for n in names]
            for stage, seq in kv.items():
                seq.share(found[stage])
                counts = self._counts.setdefault(stage, Counter())
                counts["hits"] += 1
                counts["cached_tokens"] += len(names) * seq.pool.block_size
        return ""

    def keep(self, session: int, stage: int, seq: SeqKV, first: int, names: list[int]) -> None:
        """Keep ``seq``'s blocks ``first, first + 1, ...`` under ``names`` (a name kept already
        keeps its block)."""
        with self._lock:
            kept = self._kept.setdefault(session, {}).setdefault(stage, {})
            for j, name in enumerate(names):
                if name not in kept:
                    block = seq.blocks[first + j]
                    seq.pool.hold([block])
                    kept[name] = (seq.pool, block)

    def evict(self, session: int, names: list[int]) -> None:
        """Let go of these blocks on every held stage (names not kept are skipped)."""
        with self._lock:
            for stage, kept in self._kept.get(session, {}).items():
                gone = [kept.pop(n) for n in names if n in kept]
                for pool, block in gone:
                    pool.drop([block])
                if gone:
                    self._counts.setdefault(stage, Counter())["evictions"] += len(gone)

    def end(self, session: int) -> None:
        """Let go of every block of a session (it ended)."""
        with self._lock:
            for kept in self._kept.pop(session, {}).values():
                for pool, block in kept.values():
                    pool.drop([block])

    def clear(self) -> None:
        """Let go of everything (the stages are being replaced)."""
        for session in list(self._kept):
            self.end(session)

    def stats(self, stage: int) -> dict:
        """The held stage's cached blocks (over every session), hits, cached tokens and evictions."""
        with self._lock:
            counts = self._counts.get(stage, Counter())
            return {"cached_blocks": sum(len(k.get(stage, {})) for k in self._kept.values()),
                    "prefix_hits": counts["hits"], "cached_tokens": counts["cached_tokens"],
                    "evictions": counts["evictions"]}
