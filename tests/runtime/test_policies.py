"""How ``gllm`` (and Seesaw's decode phase) form decode micro-batches, on an engine stand-in (the
policies only read its state)."""

from types import SimpleNamespace

from runtime.coordinator.policies import GLLM
from runtime.coordinator.request import Request
from runtime.coordinator.seesaw import SeesawPhases


class Engine:
    def __init__(self, running: list[Request], lanes: int, depth: int = 9, decode_batches: int = 0):
        self.running, self.waiting, self.lanes, self.depth = running, [], lanes, depth
        self.decode_batches = decode_batches  # micro-batches in flight of decode tokens only

    def kv_free(self) -> float:
        return 1.0


def decoding(n: int, in_flight: int) -> list[Request]:
    """``n`` requests past their prefill, the first ``in_flight`` of them with a token in flight."""
    out = []
    for i in range(n):
        r = Request([1, 2, 3], 8)
        r.laid_out, r.tokens, r.admitted, r.in_flight = 3, [5], i, int(i < in_flight)
        out.append(r)
    return out


def decode_entries(engine: Engine) -> list[Request]:
    return [p.request for p in GLLM().form(engine)]


def test_ready_decode_tokens_wait_for_the_rest_of_their_micro_batch():
    # one decode lane: one micro-batch of every decode token. Requests that finished their
    # prefill at different times would otherwise circulate as separate groups for good, each
    # reading every weight each step: the ready ones wait until the others are back
    running = decoding(16, in_flight=5)
    assert decode_entries(Engine(running, lanes=1)) == []
    for r in running:
        r.in_flight = 0
    assert decode_entries(Engine(running, lanes=1)) == running


def test_decode_tokens_spread_over_decode_lanes():
    running = decoding(16, in_flight=8)  # one micro-batch of 8 in flight, 8 ready: the other's share
    assert decode_entries(Engine(running, lanes=2)) == running[8:]
    # 6 ready, 10 in flight: together more than a share, so the 6 go now (waiting would starve them
    # behind the older requests, who would fill every micro-batch)
    running = decoding(16, in_flight=10)
    assert decode_entries(Engine(running, lanes=2, decode_batches=1)) == running[10:]
    running = decoding(5, in_flight=2)  # one decode lane: the 3 ready and the 2 coming share one
    assert decode_entries(Engine(running, lanes=1)) == []  # micro-batch, so the 3 wait
    # more lanes than stages: the stages bound the spread
    running = decoding(6, in_flight=0)
    assert decode_entries(Engine(running, lanes=4, depth=2)) == running[:3]


def test_a_decode_lane_is_a_memory_system_or_a_pinned_cpu_daemon():
    from hpipe.core.lanes import decode_lane

    # daemons sharing a machine's cores share its memory bandwidth: one lane (local-3)
    assert len({decode_lane(n, "boot-1", "cpu", 2, 2) for n in "abc"}) == 1
    # daemons pinned to cores of their own compute at their own pace: a lane each
    # (emulated-hetero: one on core 0, two on core 1 under separate quotas)
    assert len({decode_lane(n, "boot-1", "cpu", 1, 2) for n in ("fast", "mid", "slow")}) == 3
    # an unknown affinity (an older daemon reports 0) counts as unpinned
    assert decode_lane("a", "boot-1", "cpu", 0, 0) == decode_lane("b", "boot-1", "cpu")
    # GPUs: one lane per GPU, whatever the host's cores
    assert decode_lane("g0", "boot-1", "cuda:0", 1, 16) != decode_lane("g1", "boot-1", "cuda:1", 1, 16)
    assert decode_lane("g0", "boot-1", "cuda:0", 1, 16) == decode_lane("g0b", "boot-1", "cuda:0", 1, 16)
    # other machines: other lanes
    assert decode_lane("a", "boot-1", "cpu") != decode_lane("a", "boot-2", "cpu")


def test_a_machines_unpinned_cpu_daemons_decode_as_many_micro_batches_as_its_cores_hold():
    from hpipe.core.lanes import decode_lane, decode_lanes

    def lanes(names, cpus, host_cpus, threads, host="boot-1", device="cpu"):
        return [(decode_lane(n, host, device, cpus, host_cpus), threads, host_cpus) for n in names]

    assert decode_lanes(lanes("abc", 2, 2, 1)) == 2      # local-3: one thread each on two cores
    assert decode_lanes(lanes("abc", 2, 2, 2)) == 1      # two threads each: one computes at a time
    assert decode_lanes(lanes("abc", 16, 16, 1)) == 3    # never more than one each
    assert decode_lanes(lanes("abc", 16, 16, 4)) == 3
    assert decode_lanes(lanes("abc", 0, 0, 1)) == 1      # an older daemon that does not say: one
    assert decode_lanes(lanes(["fast", "mid", "slow"], 1, 2, 1)) == 3  # pinned: a lane each
    # GPUs: one lane per GPU, whatever the host's cores; other machines add theirs
    assert decode_lanes(lanes(["g0", "g0b"], 1, 16, 1, device="cuda:0")) == 1
    assert decode_lanes(lanes("ab", 2, 2, 1) + lanes("cd", 2, 2, 1, host="boot-2")) == 4


class Admitting(Engine):
    """A stand-in that admits as the engine does, with a prefix cache."""

    def __init__(self, cache):
        super().__init__([], lanes=1)
        self.cache = cache

    def admit(self, r: Request) -> bool:
        admitted, _ = self.cache.admit(r)
        if admitted:
            self.waiting.remove(r)
            self.running.append(r)
        return admitted


def test_a_question_about_a_cached_document_goes_first_in_a_micro_batch_of_its_own():
    """Waiting: a long document, a medium one, and a question whose 640-token document is cached.
    The question has the fewest tokens left to prefill (20, not its 660), so it goes first, and its
    micro-batch takes no long chunk (the daemons run small micro-batches first); the documents
    go in the next."""
    from runtime.coordinator.prefix_cache import PrefixCache

    cache = PrefixCache(16, budget=100)
    doc = list(range(1, 641))
    names = cache.names(doc)
    cache.claim(names, 0)
    cache.filled(names)
    cache.release(names)  # cached, held by nobody
    engine = Admitting(cache)
    long_doc, medium = Request(list(range(1000, 3000)), 4), Request(list(range(5000, 5300)), 4)
    question = Request(doc + [7] * 20, 4)
    engine.waiting = [long_doc, medium, question]
    first = GLLM().form(engine)
    assert [(p.request, p.length) for p in first] == [(question, 20)]
    assert question.begins_at == 640 and question.cached_tokens == 640
    question.laid_out, question.in_flight = len(question.prefix), 1
    assert [p.request for p in GLLM().form(engine)] == [medium, long_doc]


def test_a_stream_of_short_prompts_does_not_keep_a_long_document_from_its_chunks():
    """Short prompts keep a micro-batch small, but at most SMALL_IN_A_ROW in a row: with two new
    short prompts arriving before every micro-batch, the one after those takes a chunk of the long
    document."""
    from runtime.coordinator.policies import SMALL_IN_A_ROW
    from runtime.coordinator.prefix_cache import PrefixCache

    engine = Admitting(PrefixCache(16, budget=100))
    long_doc = Request(list(range(1000, 3000)), 4, slicer=lambda n: [256] * (n // 256) + [n % 256] * (n % 256 > 0))
    engine.waiting = [long_doc]
    policy = GLLM()
    with_long = []
    for k in range(8):
        engine.waiting += [Request(list(range(5000 + 40 * (2 * k + j), 5000 + 40 * (2 * k + j) + 20)), 4)
                           for j in range(2)]
        planned = policy.form(engine)
        with_long.append(any(p.request is long_doc for p in planned))
        for p in planned:  # as the engine lays them out
            p.request.laid_out += p.length
            p.request.in_flight += 1
    assert with_long == ([False] * SMALL_IN_A_ROW + [True]) * (8 // (SMALL_IN_A_ROW + 1))


def test_ready_decode_tokens_wait_while_every_decode_lane_has_a_micro_batch():
    # 12 decoding on two lanes, 11 in flight in two micro-batches: the one ready token would be a
    # third group reading every weight for one token, step after step; it joins the next instead
    running = decoding(12, in_flight=11)
    assert decode_entries(Engine(running, lanes=2, decode_batches=2)) == []
    assert decode_entries(Engine(running, lanes=2, decode_batches=1)) == running[11:]  # a lane free
    # more lanes than stages: the stages bound the lanes
    assert decode_entries(Engine(running, lanes=4, depth=2, decode_batches=2)) == []


def test_seesaws_decode_phase_keeps_one_decode_micro_batch_a_lane():
    # the decode layout's phase forms its micro-batches with gllm's wait: 12 decoding on two lanes,
    # 11 in flight in two micro-batches, the one ready token joins the next rather than going alone
    def entries(engine: Engine) -> list[Request]:
        engine.room, engine.tier = SimpleNamespace(blocks=0), 0
        return [p.request for p in SeesawPhases(lambda phase, session: session, phase="decode").form(engine)]

    running = decoding(12, in_flight=11)
    assert entries(Engine(running, lanes=2, decode_batches=2)) == []
    assert entries(Engine(running, lanes=2, decode_batches=1)) == running[11:]  # a lane free
    running = decoding(16, in_flight=5)  # one lane: the ready ones wait for the rest of their group
    assert entries(Engine(running, lanes=1, decode_batches=1)) == []
    for r in running:
        r.in_flight = 0
    assert entries(Engine(running, lanes=1)) == running
