"""The prefix cache's index: which full KV blocks the pipeline keeps, by name, and who holds them.

Design note. Many requests begin alike: eight questions about one document, a server's system
prompt. A prompt's full KV blocks are named by a chained hash (vLLM's automatic prefix caching):
block ``i``'s name hashes block ``i - 1``'s name and block ``i``'s tokens, under a salt naming the
model and dtype, so one name stands for the whole prefix up to that block. The engine
(:mod:`runtime.coordinator.engine`) decides a hit once, when it admits a request: the leading
blocks whose names are *ready* (computed on every stage) are the request's, and on every stage the
daemon gives its sequence those blocks (:mod:`runtime.daemon.prefix_store`); only the rest of the
prompt is prefilled, sliced by the plan. The request *claims* the names of its blocks not cached
yet (pending), tells the daemons to keep them as it fills them, and they turn ready when the
micro-batch that filled them comes back. A request whose next block another request is filling
waits for it rather than computing it twice.

Every block has holders: the requests that began with it or are filling it. A block nobody holds
stays cached, in least-recently-released order, until the pool needs its room or there are more
of them than the budget allows; the oldest are evicted first (among blocks released together, the
deepest first, so that a kept block's prefix is kept too). A pipeline that is re-deployed or
recovered starts with an empty cache: its stages are not the ones that kept the blocks.

This module is pure bookkeeping: it keeps a request's blocks on the request (``hit``, ``claimed``,
``filled``), and the engine sends the names it returns to the daemons.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

from runtime.coordinator.request import Request


@dataclass
class _Block:
    depth: int
    holders: int = 0
    ready: bool = False
    lost: bool = False  # a stage was found without it: no request begins with it any more
    released: int = 0  # when its last holder let go (a tick of the cache's clock)


class PrefixCache:
    """The index of one engine's cached blocks; ``budget``: how many blocks nobody holds it keeps."""

    def __init__(self, block_size: int, budget: int, salt: str = ""):
        if block_size < 1 or budget < 0:
            raise ValueError(f"a prefix cache needs blocks of a token or more and a budget of 0 or more "
                             f"(got {block_size}, {budget})")
        self.block_size, self.budget = block_size, budget
        self._salt = hashlib.blake2b(salt.encode(), digest_size=8).digest()
        self._blocks: dict[int, _Block] = {}
        self.ready = 0  # blocks filled on every stage (held or not)
        self.idle = 0   # of those, the ones nobody holds: room that can be taken back
        self._clock = itertools.count(1)
        self.hits = 0            # requests admitted with cached blocks
        self.cached_tokens = 0   # positions they did not prefill
        self.lookups = 0
        self.evictions = 0

    # --- names ------------------------------------------------------------------------------
    def names(self, tokens: list[int]) -> list[int]:
        """The names of ``tokens``' full blocks, in order."""
        out, parent = [], self._salt
        bs = self.block_size
        for i in range(len(tokens) // bs):
            h = hashlib.blake2b(parent, digest_size=8)
            h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * bs:(i + 1) * bs]))
            parent = h.digest()
            out.append(int.from_bytes(parent, "little") or 1)
        return out

    # --- a request's blocks -----------------------------------------------------------------
    def lookup(self, names: list[int]) -> tuple[int, bool]:
        """How many of ``names``' leading blocks are ready; and whether the next one is being
        filled (a request that waits for it gets it)."""
        hit = 0
        for name in names:
            block = self._blocks.get(name)
            if block is None or block.lost:
                return hit, False
            if not block.ready:
                return hit, True
            hit += 1
        return hit, False

    def claim(self, names: list[int], hit: int) -> tuple[list[int], list[int]]:
        """A request begins with ``names[:hit]`` (ready) and will fill the rest: it holds them all.
        Returns the names it claimed (pending now) and the names evicted to make them: a block
        kept after its prefix was evicted (unreachable, held by nobody) is dropped and filled again."""
        self.lookups += 1
        if hit:
            self.hits += 1
            self.cached_tokens += hit * self.block_size
        for name in names[:hit]:
            block = self._blocks[name]
            self.idle -= not block.holders
            block.holders += 1
        claimed, dropped = [], []
        for depth, name in enumerate(names[hit:], start=hit):
            old = self._blocks.get(name)
            if old is not None:
                if old.holders or not old.ready:
                    break  # another request fills it: this one computes its own copy, unnamed
                del self._blocks[name]
                self.ready, self.idle = self.ready - 1, self.idle - 1
                dropped.append(name)
                self.evictions += 1
            self._blocks[name] = _Block(depth, holders=1)
            claimed.append(name)
        return claimed, dropped

    def filled(self, names: list[int]) -> None:
        """These claimed blocks are computed on every stage: later requests may begin with them."""
        for name in names:
            block = self._blocks.get(name)
            if block is not None and not block.ready:
                block.ready = True  # held by its filler: not idle
                self.ready += 1

    def release(self, names: list[int]) -> list[int]:
        """A request lets go of its blocks (it ended or starts again). Blocks it claimed but never
        filled are forgotten: their names are returned, for the daemons to forget too."""
        now, forgotten = next(self._clock), []
        for name in names:
            block = self._blocks.get(name)
            if block is None:
                continue
            block.holders -= 1
            if block.holders:
                continue
            if block.lost or not block.ready:  # of no use to anyone now
                del self._blocks[name]
                forgotten.append(name)
                self.ready -= block.ready
                self.evictions += block.lost
            else:
                block.released = now
                self.idle += 1
        return forgotten

    # --- room -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Blocks it names (each takes a block of every stage's pool, or will)."""
        return len(self._blocks)

    def evict(self, n: int) -> list[int]:
        """Forget up to ``n`` blocks nobody holds, the least recently released first (the deepest
        first among those released together); their names."""
        if n <= 0:
            return []
        idle = sorted(((b.released, -b.depth, name) for name, b in self._blocks.items()
                       if b.ready and not b.holders))
        gone = [name for _, _, name in idle[:n]]
        for name in gone:
            del self._blocks[name]
        self.ready, self.idle = self.ready - len(gone), self.idle - len(gone)
        self.evictions += len(gone)
        return gone

    def drop(self, names: list[int]) -> None:
        """A stage was found without these blocks (their holders hold them): no later request
        begins with them, and each is forgotten, by the daemons too, when its last holder lets go."""
        for name in names:
            block = self._blocks.get(name)
            if block is not None:
                block.lost = True

    def trim(self) -> list[int]:
        """Evict down to the budget of blocks nobody holds; the names evicted."""
        return self.evict(self.idle - self.budget)

    def clear(self, requests: list[Request] = ()) -> None:
        """Forget everything (the pipeline's stages changed: the daemons dropped their blocks), and
        what ``requests`` held."""
        self._blocks.clear()
        self.ready = self.idle = 0
        for r in requests:
            r.hit, r.claimed, r.filled = [], [], 0

    # --- a request's life -------------------------------------------------------------------
    def _names(self, r: Request) -> list[int]:
        if r.block_names is None or r.block_names[0] is not r.prefix:  # named once per prefix
            # at least one token is computed: its logits give the next
            r.block_names = (r.prefix, self.names(r.prefix[:-1]))
        return r.block_names[1]

    def uncached(self, r: Request) -> int:
        """The tokens ``r`` (waiting) would prefill if it were admitted now."""
        return len(r.prefix) - self.lookup(self._names(r))[0] * self.block_size

    def admit(self, r: Request) -> tuple[bool, list[int]]:
        """Decide ``r``'s hit as it is admitted: it begins with the cached blocks of its prefix
        (its prefill starts after them) and claims the rest of its full blocks, which every stage
        keeps as they are filled. (False, []) when another request is filling its next block: it
        waits for that (``r.deferred``). Else (True, the names evicted to make its claims)."""
        names = self._names(r)
        hit, pending = self.lookup(names)
        r.deferred = pending
        if pending:
            return False, []
        claimed, evicted = self.claim(names, hit)
        r.hit, r.claimed, r.filled, r.cached_tokens = names[:hit], claimed, 0, hit * self.block_size
        if hit:
            r.restart(r.prefix, begins_at=hit * self.block_size)
        return True, evicted

    def keep(self, r: Request, start: int, end: int) -> list[int]:
        """The names of ``r``'s claimed blocks that its positions ``[start, end)`` fill, from block
        ``start // block size`` on (as the daemons read them)."""
        first, own = start // self.block_size, len(r.hit)
        return r.claimed[max(0, first - own):max(0, end // self.block_size - own)] if first >= own else []

    def let_go(self, r: Request) -> list[int]:
        """``r`` no longer holds its blocks (it ended, or starts again in a new sequence); the names
        the daemons are to forget (its blocks never filled, and any evicted to keep the budget)."""
        forgotten = self.release(r.hit + r.claimed) + self.trim() if r.hit or r.claimed else []
        r.hit, r.claimed, r.filled = [], [], 0
        return forgotten

    def stats(self) -> dict:
        return {"cached_blocks": self.size, "idle_blocks": self.idle, "hits": self.hits, "lookups": self.lookups,
                "cached_tokens": self.cached_tokens, "evictions": self.evictions}
