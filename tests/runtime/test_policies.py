"""How ``gllm`` forms decode micro-batches, on an engine stand-in (the policies only read its state)."""

from runtime.policies import GLLM
from runtime.request import Request


class Engine:
    def __init__(self, running: list[Request], memories: int, depth: int = 9):
        self.running, self.waiting, self.memories, self.depth = running, [], memories, depth

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
    # one memory system: one micro-batch of every decode token. Requests that finished their
    # prefill at different times would otherwise circulate as separate groups for good, each
    # reading every weight each step: the ready ones wait until the others are back
    running = decoding(16, in_flight=5)
    assert decode_entries(Engine(running, memories=1)) == []
    for r in running:
        r.in_flight = 0
    assert decode_entries(Engine(running, memories=1)) == running


def test_decode_tokens_spread_over_memory_systems():
    running = decoding(16, in_flight=8)  # one micro-batch of 8 in flight, 8 ready: the other's share
    assert decode_entries(Engine(running, memories=2)) == running[8:]
    # 6 ready, 10 in flight: together more than a share, so the 6 go now (waiting would starve them
    # behind the older requests, who would fill every micro-batch)
    running = decoding(16, in_flight=10)
    assert decode_entries(Engine(running, memories=2)) == running[10:]
    running = decoding(5, in_flight=2)  # one memory system: the 3 ready and the 2 coming share one
    assert decode_entries(Engine(running, memories=1)) == []  # micro-batch, so the 3 wait
    # more memory systems than stages: the stages bound the spread
    running = decoding(6, in_flight=0)
    assert decode_entries(Engine(running, memories=4, depth=2)) == running[:3]
