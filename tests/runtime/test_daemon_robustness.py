"""Bad messages sent straight to a daemon get a clear refusal, and the daemon keeps serving."""

import json
import os
import shutil
import time

import grpc
import pytest
import torch

from runtime.coordinator.pipeline import Pipeline, cut_stages
from runtime.daemon.deployment import check_source
from runtime.wire.messages import pb
from runtime.wire.transport import connect, read_payload
from tests.cluster_helpers import Served, cluster_of


@pytest.fixture
def daemon():
    d = Served(memory_budget=4 * 2**20)  # tiny model: ~0.5 MiB of weights, the rest for its KV pool
    yield d
    d.stop()


def code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def load(client, model, start, end, dtype=pb.FLOAT32, num_units=8, kv_pool_bytes=0):
    """Hold units [start, end) of a pipeline whose other stages (if any) are on an unused address."""
    bounds = sorted({0, start, end, num_units})
    stages = [pb.Stage(unit_start=a, unit_end=b, num_layers=(num_units - 2) // 2, daemon=f"d{i}",
                       address="127.0.0.1:1", data_port=1) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    held = [i for i, st in enumerate(stages) if st.unit_start == start]
    return client.call("Load", pb.LoadRequest(model=str(model), dtype=dtype, stages=stages, held=held,
                                              kv_pool_bytes=kv_pool_bytes))


class Coordinator:
    """A hand-driven session on one daemon's data plane: layouts and activations as we write them.
    The first stage's input goes on the session's connection, a later stage's on a daemon's link
    (session 0) with the session's key, as the stage before it would send it."""

    def __init__(self, d: Served, session: int = 7, token: str | None = None):
        host, port = d.address.split(":")[0], d.stage.data.port
        self.key = os.urandom(16)
        self.conn = connect(host, port, token, session, key=self.key)
        self.link = connect(host, port, token, 0)
        self.session, self.next = session, 0

    def send(self, entries, payload: torch.Tensor, stage: int, nbytes: int | None = None) -> int:
        mb, self.next = self.next, self.next + 1
        self.conn.send(pb.Frame(layout=pb.MicroBatch(id=mb, entries=entries)))
        data = payload.contiguous()
        (self.link if stage else self.conn).send(pb.Frame(activation=pb.Activation(
            session=self.session, micro_batch=mb, stage=stage, session_key=self.key if stage else b"",
            payload_bytes=nbytes if nbytes is not None else data.numel() * data.element_size())), data)
        return mb

    def close(self) -> None:
        self.conn.close()
        self.link.close()

    def result(self, vocab: int):
        frame = self.conn.read_frame()
        act = frame.activation
        logits = read_payload(self.conn.sock, act.payload_bytes).view(torch.float32).view(-1, vocab)
        return act, logits, {f.sequence_id: (f.code, f.message) for f in act.failed}


KEY = bytes(range(16))  # a session key for tests that open sessions by hand


def entry(seq, start, length, max_len=0, logits=pb.LAST_LOGITS):
    return pb.Entry(sequence_id=seq, start=start, length=length, max_len=max_len, logits=logits)


def test_bad_loads_then_a_good_one(daemon, tiny_dirs):
    c = daemon.client()
    model = tiny_dirs["llama"]
    assert code_of(lambda: load(c, "/no-such-model", 0, 8))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: load(c, model.parent / "no-such-model", 0, 8))[0] == grpc.StatusCode.FAILED_PRECONDITION
    code, msg = code_of(lambda: load(c, model, 0, 99))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the model's units [0, 8)" in msg
    code, msg = code_of(lambda: c.call("Load", pb.LoadRequest(model=str(model), dtype=pb.FLOAT32, stages=[
        pb.Stage(unit_start=0, unit_end=4, num_layers=3, address="127.0.0.1:1"),
        pb.Stage(unit_start=3, unit_end=8, num_layers=3, address="127.0.0.1:1")], held=[0, 1])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "do not cover the model's units" in msg
    assert code_of(lambda: c.call("Load", pb.LoadRequest(model=str(model), dtype=pb.FLOAT32)))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT
    code, msg = code_of(lambda: load(c, model, 0, 8, kv_pool_bytes=64 << 20))  # weights + pool past the budget
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in msg
    info = load(c, model, 3, 8)
    assert info.hidden_size == 64 and info.parameters > 0 and info.pools[0].blocks > 0


def test_running_out_of_memory_while_loading_is_a_clear_error_and_loses_nothing(daemon, tiny_dirs, monkeypatch):
    """Memory that was free at the check and is gone at the allocation (another daemon on the same
    GPU loading at once): the load is refused with RESOURCE_EXHAUSTED, naming the way out, and the
    daemon loads the next deployment."""
    from hpipe.model.compute.stage import StageModel

    c, model = daemon.client(), tiny_dirs["llama"]

    def taken(self, blocks):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.24 GiB.")

    with monkeypatch.context() as m:
        m.setattr(StageModel, "new_pool", taken)
        code, msg = code_of(lambda: load(c, model, 0, 8))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory on cpu loading units [0, 8)" in msg and "memory_budget or memory_share" in msg
    assert load(c, model, 0, 8).pools[0].blocks > 0


def test_a_redeployment_lets_the_old_stages_go_before_the_new_ones_load(tiny_dirs):
    """When a daemon loads other units, nothing still holds the stage it ran last (the outbox's
    thread held its last item, and with it the old stage, until the next send: on a GPU the old
    weights and the new were resident together). Checked with weak references, without a
    collection of our own."""
    import weakref

    from runtime.daemon import memory

    model, units = str(tiny_dirs["llama"]), 8
    first, second = Served("g"), Served("h")
    pipe = Pipeline(cluster_of(first, second))
    alive_at_load = []
    try:
        pipe.load(model, cut_stages(pipe.cluster, [5], units), torch.float32)
        with pipe.open(9) as seq:
            seq.submit(torch.tensor([5, 17, 99, 3, 250, 7, 64, 11]))
            seq.result()
        old = [weakref.ref(s.model) for s in first.stage.stages.values()]
        reset_peak = memory.reset_peak

        def spy(device):  # called once the new stages are loaded
            alive_at_load.append(sum(r() is not None for r in old))
            reset_peak(device)

        memory.reset_peak = spy
        pipe.load(model, cut_stages(pipe.cluster, [3], units), torch.float32)
    finally:
        memory.reset_peak = reset_peak
        pipe.close()
        first.stop(), second.stop()
    assert alive_at_load and alive_at_load == [0, 0], alive_at_load


def test_a_memory_share_is_a_budget_of_that_share_of_the_device():
    import psutil

    from runtime.daemon.memory import SHARE_USABLE

    d = Served(memory_share=0.01)
    try:
        budget = d.client().call("Status", pb.StatusRequest()).memory_budget
    finally:
        d.stop()
    assert budget == int(0.01 * psutil.virtual_memory().total * SHARE_USABLE)


def test_load_reads_model_files_only_from_allowed_directories(tiny_dirs, tmp_path):
    allowed = tmp_path / "models"
    shutil.copytree(tiny_dirs["llama"], allowed / "llama")
    d = Served(model_dirs=str(allowed))
    try:
        c = d.client()
        info = load(c, allowed / "llama", 0, 8)  # inside: loads
        outside = [tiny_dirs["llama"],                                  # another directory
                   allowed / ".." / tiny_dirs["llama"].relative_to(tiny_dirs["llama"].anchor),  # '..' out of it
                   f"random:{tiny_dirs['llama'] / 'config.json'}",     # a random-weight shape from any JSON
                   "random:/etc/hostname.json",
                   allowed / "link"]                                   # a link inside, pointing out
        (allowed / "link").symlink_to(tiny_dirs["llama"], target_is_directory=True)
        for model in outside:
            code, msg = code_of(lambda: load(c, model, 0, 8))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "--model-dirs" in msg, model
        assert d.stage.deployment is not None and d.stage.deployment.model == str(allowed / "llama")  # kept
        # a shard index naming files outside its directory is refused without opening them
        crafted = allowed / "crafted"
        shutil.copytree(allowed / "llama", crafted)
        weights = next(crafted.glob("*.safetensors"))
        names = list(json.loads(weights.read_bytes()[8:8 + int.from_bytes(weights.read_bytes()[:8], "little")]))
        for shard in ("/etc/hostname", "../llama/" + weights.name):
            (crafted / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {n: shard for n in names if n != "__metadata__"}}))
            code, msg = code_of(lambda: load(c, crafted, 0, 8))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "is not a file of this directory" in msg
        assert info.parameters > 0
        for builtin in ("smollm2-135m", "random:llama-7b"):  # read no path the caller names
            check_source(builtin, ())
    finally:
        d.stop()


def test_bad_micro_batches_fail_alone_and_the_daemon_keeps_serving(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 3, 8)  # no embedding: takes the residual stream [tokens, 64] float32
    co = Coordinator(daemon)
    good = torch.randn(4, 64)
    co.send([entry(1, 0, 4, max_len=16)], good, stage=1)
    act, logits, failed = co.result(384)
    assert act.micro_batch == 0 and logits.shape == (1, 384) and not failed
    cases = {  # (entries, payload, stage, payload bytes) -> (code, message) for sequence 2
        "unknown sequence": ([entry(2, 0, 4)], good, 1, None, "NOT_FOUND", "unknown sequence 2"),
        "beyond max length": ([entry(2, 0, 17, max_len=16)], torch.randn(17, 64), 1, None, "OUT_OF_RANGE",
                              "declared max length 16"),
        "max length past the context": ([entry(2, 0, 4, max_len=97)], good, 1, None, "OUT_OF_RANGE",
                                        "model's context of 96"),
        "wrong byte count": ([entry(2, 0, 4, max_len=16)], good[:3], 1, None, "INVALID_ARGUMENT",
                             "its layout of 4 tokens needs 1024"),
        "wrong dtype": ([entry(2, 0, 4, max_len=16)], good.bfloat16(), 1, None, "INVALID_ARGUMENT", "needs 1024"),
        "twice in one micro-batch": ([entry(2, 0, 2, max_len=16), entry(2, 2, 2)], good, 1, None,
                                     "INVALID_ARGUMENT", "appears twice"),
    }
    for name, (entries, payload, stage, nbytes, code, message) in cases.items():
        co.send(entries, payload, stage, nbytes)
        act, logits, failed = co.result(384)
        assert failed.get(2, ("", ""))[0] == code and message in failed[2][1], (name, failed)
        mine = pb.StatusRequest(sequence_ids=[2], session=co.session, key=co.key)
        assert c.call("Status", mine).sequences[0].error in ("", failed[2][1]), name
        co.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=[2])))
    # sequence 1 was untouched by all of that, and continues where it was: not past it, but an
    # entry may rewind it (how a recovering coordinator resumes)
    co.send([entry(1, 5, 1)], torch.randn(1, 64), stage=1)
    _, _, failed = co.result(384)
    assert failed[1][0] == "FAILED_PRECONDITION" and "continues at 4" in failed[1][1]
    co.send([entry(1, 3, 1)], torch.randn(1, 64), stage=1)
    assert not co.result(384)[2]
    assert c.call("Status", pb.StatusRequest(sequence_ids=[1], session=co.session, key=co.key)).sequences[0].length == 4
    # another session (or no session) reads it as not open here, and does not keep it alive
    assert not c.call("Status", pb.StatusRequest(sequence_ids=[1], session=99, key=co.key)).sequences[0].open
    assert not c.call("Status", pb.StatusRequest(sequence_ids=[1])).sequences[0].open
    co2 = Coordinator(daemon, session=8)
    co2.send([entry(9, 0, 2, max_len=8)], torch.randn(2, 64), stage=1)
    assert not co2.result(384)[2]
    co.close()
    co2.close()
    deadline = time.monotonic() + 5  # a coordinator that disconnects frees its sequences
    while c.call("Status", pb.StatusRequest()).kv_bytes:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_token_ids_out_of_range(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    co = Coordinator(daemon)
    co.send([entry(1, 0, 1, max_len=8)], torch.tensor([5000]), stage=0)
    _, logits, failed = co.result(384)
    assert failed[1][0] == "INVALID_ARGUMENT" and "token ids must lie" in failed[1][1] and logits.shape == (1, 384)
    co.close()


def test_kv_pool_exhausted_fails_only_the_sequences_that_do_not_fit(daemon, tiny_dirs):
    c = daemon.client()
    block = 2 * 3 * 2 * 16 * 16 * 4  # K and V, 3 layers, 2 KV heads of 16, 16 tokens, float32
    info = load(c, tiny_dirs["llama"], 0, 8, kv_pool_bytes=10 * block)
    assert info.pools[0].blocks == 10
    co = Coordinator(daemon)
    # 12 sequences of 16 tokens: 10 fit, 2 do not
    co.send([entry(i, 0, 16, max_len=16) for i in range(12)], torch.randint(0, 384, (12 * 16,)), stage=0)
    _, logits, failed = co.result(384)
    assert logits.shape == (12, 384) and sorted(failed) == [10, 11]
    assert all(code == "RESOURCE_EXHAUSTED" and "KV pool is full" in msg for code, msg in failed.values())
    assert c.call("Status", pb.StatusRequest()).pools[0].used_blocks == 10
    co.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=list(range(12)))))
    deadline = time.monotonic() + 5
    while c.call("Status", pb.StatusRequest()).pools[0].used_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    co.close()


def test_idle_sequence_is_freed(daemon, tiny_dirs):
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    daemon.stage.sequences.idle_timeout_s = 0.5
    co = Coordinator(daemon)
    co.send([entry(3, 0, 2, max_len=32)], torch.tensor([1, 2]), stage=0)
    co.result(384)
    assert c.call("Status", pb.StatusRequest()).open_sequences == 1
    deadline = time.monotonic() + 5
    while c.call("Status", pb.StatusRequest()).open_sequences:  # (naming it in a status would keep it alive)
        assert time.monotonic() < deadline, "idle sequence was not freed"
        time.sleep(0.1)
    co.close()
    assert c.call("Status", pb.StatusRequest()).kv_bytes == 0


def test_a_sequence_closed_before_its_micro_batch_is_computed_fails_it_rather_than_sending_its_row(daemon, tiny_dirs):
    """Its layout found the sequence, then a close freed it: the micro-batch computes its row dead
    and names it failed, so no later stage writes its cache from that row and nobody samples it
    (a daemon shutting down frees its sequences under micro-batches still queued alike)."""
    c = daemon.client()
    load(c, tiny_dirs["llama"], 0, 8)
    co = Coordinator(daemon)
    co.send([entry(3, 0, 2, max_len=32), entry(4, 0, 2, max_len=32)], torch.tensor([1, 2, 5, 6]), stage=0)
    _, _, failed = co.result(384)
    assert not failed
    co.conn.send(pb.Frame(layout=pb.MicroBatch(id=co.next, entries=[entry(3, 2, 1), entry(4, 2, 1)])))
    co.conn.send(pb.Frame(close=pb.CloseSequences(sequence_ids=[3])))  # in order: after the layout, before the data
    data = torch.tensor([7, 8])
    co.conn.send(pb.Frame(activation=pb.Activation(session=co.session, micro_batch=co.next, stage=0,
                                                   payload_bytes=data.numel() * data.element_size())), data)
    _, logits, failed = co.result(384)
    assert set(failed) == {3} and failed[3][0] == "NOT_FOUND", failed
    assert logits.shape[0] == 2 and torch.isfinite(logits[1]).all()  # the other sequence is computed
    co.close()
