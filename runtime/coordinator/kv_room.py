"""The room in the pipeline's KV pools, as the engine lays sequences out, and the prefix cache in it.

The engine mirrors every stage's pool instead of asking: a sequence holds ``ceil(positions /
block)`` blocks on each stage, so the tightest stage's free blocks follow from what has been laid
out. With a prefix cache (:mod:`runtime.coordinator.prefix_cache`) a block is counted once however
many sequences share it: every filled cached block, plus each running request's blocks beyond the
cached ones it began with or filled. Cached blocks nobody holds count as free room, since they are
evicted the moment a micro-batch needs them.
"""

from __future__ import annotations

import math

from runtime.coordinator.prefix_cache import PrefixCache
from runtime.coordinator.request import Request


class KVRoom:
    """The tightest stage's ``blocks`` of ``block_size`` tokens (0: no pools), and the cache kept
    in them; ``cache_share``: the cache's budget of blocks nobody holds, a share of the pool
    (None: no cache)."""

    def __init__(self, blocks: int, block_size: int, cache_share: float | None, salt: str):
        self.blocks, self.block_size, self.cache_share = blocks, block_size, cache_share
        self.cache = None if cache_share is None else PrefixCache(block_size, int(cache_share * blocks), salt)

    def resize(self, blocks: int) -> None:
        """A new pipeline's pools (after a recovery)."""
        self.blocks = blocks
        if self.cache is not None:
            self.cache.budget = int(self.cache_share * blocks)

    def of(self, positions: int) -> int:
        """Blocks that ``positions`` take."""
        return math.ceil(positions / self.block_size)

    def used(self, running: list[Request]) -> int:
        """Blocks in use: every cached block that is filled (held or not), and each running
        request's blocks beyond those."""
        own = sum(max(0, self.of(r.laid_out) - len(r.hit) - r.filled) for r in running)
        return own + (self.cache.ready if self.cache is not None else 0)

    def free_share(self, running: list[Request]) -> float:
        """The free share of the pool (1 without pools), cached blocks nobody holds counted free."""
        if not self.blocks:
            return 1.0
        idle = self.cache.idle if self.cache is not None else 0
        return 1.0 - (self.used(running) - idle) / self.blocks

    def short(self, running: list[Request], extents: list[tuple[Request, int]]) -> int:
        """How many blocks are missing for ``extents`` (requests, each growing by that many
        positions) beyond the free ones (0 or less: they fit; always 0 without pools)."""
        if not self.blocks:
            return 0
        needed = sum(self.of(r.laid_out + n) - self.of(r.laid_out) for r, n in extents)
        return needed - (self.blocks - self.used(running))
