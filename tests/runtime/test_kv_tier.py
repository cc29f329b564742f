"""The host KV tier on its own: a sequence's keys and values go out of the pool and come back
bit for bit into other blocks; a tier without room refuses, a pool without room keeps it out."""

from types import SimpleNamespace

import pytest
import torch

from hpipe.model.kv.pool import KVPool, PoolExhausted
from runtime.daemon.kv_tier import TIER_FACTOR, HostTier
from runtime.daemon.sequences import Sequence


def pool_and_sequence(blocks: int, positions: int, seq_id: int = 1):
    pool = KVPool([0, 1], blocks, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    kv = pool.sequence(64)
    kv.grow(positions)
    seq = Sequence(seq_id, 7, 64, {0: kv}, {0: positions}, {0: positions})
    return pool, seq


def write(pool, seq, positions, seed):
    values = {}
    slots = seq.kv[0].slots(0, positions, torch.device("cpu"))
    for layer in pool.layers:
        k = torch.randn(2, positions, 4, generator=torch.Generator().manual_seed(seed + layer))
        pool.k[layer][:, slots], pool.v[layer][:, slots] = k, -k
        values[layer] = k
    return values


def test_a_sequence_goes_out_and_comes_back_into_other_blocks():
    pool, seq = pool_and_sequence(blocks=4, positions=20)
    stages = {0: SimpleNamespace(pool=pool)}
    values = write(pool, seq, 20, seed=0)
    tier = HostTier()
    assert tier.capacity(stages) == TIER_FACTOR * 4
    assert tier.swap_out(seq, stages) and tier.holds(seq.id)
    assert pool.used_blocks == 0 and tier.used_blocks(pool.block_size) == 2 and not seq.kv[0].blocks
    # another sequence takes the blocks and writes over them
    _, other = pool_and_sequence(blocks=4, positions=0, seq_id=2)
    other.kv[0] = pool.sequence(64)
    other.kv[0].grow(16)
    write(pool, other, 16, seed=9)
    tier.swap_in(seq, stages)
    assert not tier.holds(seq.id) and tier.swapped_out == tier.swapped_in == 1
    assert seq.kv[0].blocks and not set(seq.kv[0].blocks) & set(other.kv[0].blocks)
    slots = seq.kv[0].slots(0, 20, torch.device("cpu"))
    for layer, k in values.items():
        assert torch.equal(pool.k[layer][:, slots], k) and torch.equal(pool.v[layer][:, slots], -k)


def test_no_room_in_the_tier_or_the_pool():
    pool, seq = pool_and_sequence(blocks=1, positions=16)
    stages = {0: SimpleNamespace(pool=pool)}
    tier = HostTier()
    big = [pool_and_sequence(blocks=1, positions=16, seq_id=10 + i) for i in range(TIER_FACTOR)]
    for p, s in big:  # fill the tier (each from a pool of its own, priced against this one's)
        assert tier.swap_out(s, {0: SimpleNamespace(pool=p)})
    assert not tier.swap_out(seq, stages)  # full: nothing changed
    assert seq.kv[0].blocks and not tier.holds(seq.id)
    tier.drop(10)
    assert tier.swap_out(seq, stages)
    _, blocker = pool_and_sequence(blocks=1, positions=0, seq_id=3)
    blocker.kv[0] = pool.sequence(16)
    blocker.kv[0].grow(16)  # the pool's only block
    with pytest.raises(PoolExhausted):
        tier.swap_in(seq, stages)
    assert tier.holds(seq.id) and not seq.kv[0].blocks  # it stays out, whole
    blocker.kv[0].release()
    tier.swap_in(seq, stages)
    assert not tier.holds(seq.id)


def test_a_sequence_the_tier_cannot_take_fails_with_data_loss():
    """What the daemon does when the coordinator's mirror of the tier is wrong: the sequence fails
    (its next entry says DATA_LOSS, and the coordinator recomputes it) and gives its blocks back."""
    pool, seq = pool_and_sequence(blocks=1, positions=16)
    tier = HostTier()
    for i in range(TIER_FACTOR):
        p, s = pool_and_sequence(blocks=1, positions=16, seq_id=10 + i)
        tier.swap_out(s, {0: SimpleNamespace(pool=p)})
    tier.swap_out_all([seq], {0: SimpleNamespace(pool=pool)})
    assert seq.code == "DATA_LOSS" and pool.used_blocks == 0 and not tier.holds(seq.id)
