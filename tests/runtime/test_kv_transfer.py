"""A switch's KV between two daemons' pools (runtime.daemon.kv_transfer), without the network:
read from one pool, cut into parts, received, written into another pool's blocks bit for bit; a
stream cut short leaves the stage to the replays."""

from types import SimpleNamespace

import pytest
import torch

from hpipe.model.kv.pool import KVPool
from runtime.daemon import kv_tier, kv_transfer
from runtime.daemon.kv_tier import HostTier
from runtime.daemon.kv_transfer import IncomingKV, parts, read
from runtime.daemon.sequences import Sequence, SequenceTable

SESSION, KEY = 7, b"k" * 16


def stage_with(positions: int, dtype: torch.dtype, blocks: int = 8):
    """A held stage of two attention layers whose one sequence has ``positions`` positions of
    random keys and values, the sequence scattered over the pool's blocks."""
    pool = KVPool([3, 4], blocks, kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
    other = pool.sequence(64)
    other.grow(16)  # a block taken first: the sequence's blocks do not start at 0
    kv = pool.sequence(64)
    kv.grow(positions)
    gen = torch.Generator().manual_seed(positions)
    for layer in pool.layers:
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    seq = Sequence(11, SESSION, 64, {5: kv}, {5: positions}, {5: positions})
    return {5: SimpleNamespace(pool=pool)}, seq


def keys(stages, seq, i=5):
    pool, n = stages[i].pool, seq.computed[i]
    slots = seq.kv[i].slots(0, n, torch.device("cpu"))
    return [(pool.k[x][:, slots], pool.v[x][:, slots]) for x in pool.layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_read_cut_received_and_written_is_the_same_bits(dtype, monkeypatch):
    monkeypatch.setattr(kv_transfer, "PART_BYTES", 200)  # several parts for each layer
    src, seq = stage_with(37, dtype)
    sent = list(parts(seq, read(src, seq, [5]), SESSION, KEY))
    assert len(sent) > 4 * 2 and all(len(p.data) <= 200 for p in sent)
    incoming = IncomingKV()
    got = incoming.receive(iter(sent), lambda s, k: True)  # the session is connected here, with this key
    assert got["sequences"] == 1 and got["bytes"] == 2 * 2 * 37 * 2 * 8 * dtype.itemsize
    dst, _ = stage_with(0, dtype)
    table = SequenceTable()
    assert incoming.install(dst, table, torch.device("cpu")) == 37
    new = table.find(11)
    assert new.session == SESSION and new.computed[5] == new.planned[5] == 37
    for (k0, v0), (k1, v1) in zip(keys(src, seq), keys(dst, new)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert incoming.nbytes == 0 and incoming.owns(SESSION, KEY) and incoming.owns(SESSION, b"x" * 16) is False


def test_kv_cut_short_is_not_written():
    src, seq = stage_with(20, torch.float32)
    sent = list(parts(seq, read(src, seq, [5]), SESSION, KEY))
    incoming = IncomingKV()
    incoming.receive(iter(sent[:-1]), lambda s, k: True)  # the session is connected here, with this key  # the last part never came
    dst, _ = stage_with(0, torch.float32)
    table = SequenceTable()
    assert incoming.install(dst, table, torch.device("cpu")) == 0
    assert table.find(11).computed[5] == 0  # an empty cache: the replays rebuild it


def test_kv_of_a_session_that_ended_is_let_go():
    src, seq = stage_with(20, torch.float32)
    incoming = IncomingKV()
    incoming.receive(parts(seq, read(src, seq, [5]), SESSION, KEY), lambda s, k: True)  # the session is connected here, with this key
    assert incoming.nbytes > 0
    incoming.forget(SESSION)  # the session ended on this daemon before a Load took its KV
    assert incoming.nbytes == 0 and incoming.owns(SESSION, KEY) is None
    dst, _ = stage_with(0, torch.float32)
    table = SequenceTable()
    assert incoming.install(dst, table, torch.device("cpu")) == 0 and table.find(11) is None


def test_the_keys_of_sessions_that_never_came_back_are_let_go(monkeypatch):
    """KV of more sessions than it keeps keys of: the oldest session's key and KV go, the newest's stay."""
    monkeypatch.setattr(kv_transfer, "KEPT_SESSIONS", 3)
    src, seq = stage_with(20, torch.float32)
    incoming = IncomingKV()
    for session in range(1, 6):
        seq.id = 100 + session
        incoming.receive(parts(seq, read(src, seq, [5]), session, KEY), lambda s, k: True)  # the session is connected here, with this key
    assert [incoming.owns(s, KEY) for s in range(1, 6)] == [None, None, True, True, True]
    dst, _ = stage_with(0, torch.float32)
    table = SequenceTable()
    assert incoming.install(dst, table, torch.device("cpu")) == 3 * 20
    assert table.find(101) is None and table.find(105).session == 5


def test_a_sequence_swapped_out_to_the_host_tier_is_not_read():
    """Swapped out, a sequence keeps its positions but not its blocks: nothing of it is sent (the
    coordinator starts such a request again at a switch), and the others still are."""
    src, seq = stage_with(20, torch.float32)
    pool = src[5].pool
    seq.kv[5].release()
    seq.kv[5] = pool.sequence(64)  # as HostTier.swap_out leaves it: computed 20, no blocks
    assert read(src, seq, [5]) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_swapped_sequence_goes_from_one_tier_to_the_other(dtype):
    """Seesaw's parked sequences: swapped out on the old owner, its KV is read from that host tier,
    sent marked as swapped, kept in the new owner's tier (not its pool), and comes back into the
    new owner's pool the same bits; a reshard keeps the copies of the stages a daemon still holds."""
    src, seq = stage_with(37, dtype)
    want = keys(src, seq)
    old_tier = HostTier()
    assert old_tier.swap_out(seq, src) and seq.kv[5].capacity == 0
    sent = list(parts(seq, read(src, seq, [5], old_tier), SESSION, KEY))
    assert sent and all(p.swapped for p in sent)
    incoming, new_tier = IncomingKV(), HostTier()
    incoming.receive(iter(sent), lambda s, k: True)  # the session is connected here, with this key
    dst, _ = stage_with(0, dtype)
    table = SequenceTable()
    assert incoming.install(dst, table, torch.device("cpu"), new_tier) == 37
    new = table.find(11)
    assert new.computed[5] == 37 and new.kv[5].capacity == 0 and new_tier.holds(11)  # still out of the pool
    new_tier.keep(dst)  # the same stage held after a switch: the copy stays
    new_tier.swap_in(new, dst)
    for (k0, v0), (k1, v1) in zip(want, keys(dst, new)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    old_tier.keep({})  # the old owner gave stage 5 up: its copy goes
    assert not old_tier.holds(11)


def test_a_tier_without_room_keeps_nothing_of_a_sent_swapped_sequence(monkeypatch):
    src, seq = stage_with(20, torch.float32)
    old_tier = HostTier()
    assert old_tier.swap_out(seq, src)
    incoming, new_tier = IncomingKV(), HostTier()
    incoming.receive(parts(seq, read(src, seq, [5], old_tier), SESSION, KEY), lambda s, k: True)  # the session is connected here, with this key
    monkeypatch.setattr(kv_tier, "TIER_FACTOR", 0)  # the new owner's tier has no room
    dst, _ = stage_with(0, torch.float32)
    table = SequenceTable()
    assert incoming.install(dst, table, torch.device("cpu"), new_tier) == 0
    assert table.find(11).computed[5] == 0 and not new_tier.holds(11)  # the coordinator starts it again
