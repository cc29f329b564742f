"""The pipeline over real daemon processes gives exactly the tokens of single-process generation."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hpipe.app.cli import main
from hpipe.core.errors import ModelSourceError
from hpipe.model.generate.local import LocalModel, generate
from hpipe.model.generate.sampling import SamplingParams
from hpipe.model.kernels.precision import PREFILL_ENV, set_prefill_gemm
from runtime.coordinator.pipeline import Pipeline, RemoteRunner, cut_stages, generate_on_cluster

PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow."]
MAX_NEW = 12


@pytest.fixture(scope="module")
def reference(smollm2):
    """Single-process greedy tokens for each prompt (the golden answers)."""
    tok, model = smollm2.tokenizer(), LocalModel(smollm2)
    out = {}
    for p in PROMPTS:
        r = generate(model.open, tok, p, context=smollm2.config.max_position_embeddings,
                     eos_ids=smollm2.eos_token_ids(), chat=True, max_new_tokens=MAX_NEW)
        out[p] = (r.token_ids, r.prompt_tokens)
    return out


def run(pipe, smollm2, prompt, slices=None):
    return generate_on_cluster(pipe, smollm2, smollm2.tokenizer(), prompt, chat=True, max_new_tokens=MAX_NEW,
                               sampling=SamplingParams(), slices=slices)


@pytest.mark.parametrize("cuts", [[], [6], [1, 61], [6, 31], [23, 40]])
def test_cuts_and_slices_equal_single_process(cluster3, smollm2, reference, cuts):
    pipe = Pipeline(cluster3.spec)
    try:
        pipe.load("smollm2-135m", cut_stages(pipe.cluster, cuts, smollm2.config.num_units), torch.float32)
        assert len(pipe.stages) == len(cuts) + 1
        prompt = PROMPTS[0]
        want, n = reference[prompt]
        for slices in (None, [5, 1, n - 6], [9] * (n // 9) + ([n % 9] if n % 9 else [])):
            result = run(pipe, smollm2, prompt, slices)
            assert result.token_ids == want, (cuts, slices)
            stages = result.extra["stages"]
            assert [s["units"] for s in stages][0][0] == 0 and stages[-1]["units"][1] == 62
            assert all(s["micro_batches"] >= 1 and s["compute_s"] > 0 for s in stages)
        # every sequence was freed on every stage
        assert _all_freed(pipe)
    finally:
        pipe.close()


def test_interleaved_stages_equal_single_process(cluster3, smollm2, reference):
    """Daemons holding two unit ranges each (s0 s1 s2 s0 s1): the same tokens, statistics per stage."""
    from runtime.wire.messages import pb

    pipe = Pipeline(cluster3.spec)
    try:
        stages = cut_stages(pipe.cluster, [6, 20, 31, 45], smollm2.config.num_units, ["s0", "s1", "s2", "s0", "s1"])
        pipe.load("smollm2-135m", stages, torch.float32)
        assert [d.name for d in pipe.daemons] == ["s0", "s1", "s2"] and pipe.stage_daemon == [0, 1, 2, 0, 1]
        status = pipe.clients[0].call("Status", pb.StatusRequest())
        held = [(status.stages[i].unit_start, status.stages[i].unit_end, i) for i in status.held]
        assert held == [(0, 6, 0), (31, 45, 3)]
        prompt = PROMPTS[1]
        want, n = reference[prompt]
        for slices in (None, [7, 3, n - 10]):
            result = run(pipe, smollm2, prompt, slices)
            assert result.token_ids == want, slices
            stages = result.extra["stages"]
            assert [s["units"] for s in stages] == [[0, 6], [6, 20], [20, 31], [31, 45], [45, 62]]
            assert [s["daemon"] for s in stages] == ["s0", "s1", "s2", "s0", "s1"]
            # every stage computed every slice (the prompt's, then one per generated token but the last)
            assert len({s["micro_batches"] for s in stages}) == 1 and stages[0]["micro_batches"] >= len(slices or [n])
            assert all(s["kv_bytes"] > 0 for s in stages)
        with pytest.raises(Exception, match="both on s0"):
            pipe.load("smollm2-135m", cut_stages(pipe.cluster, [6, 20], smollm2.config.num_units,
                                                   ["s1", "s0", "s0"]), torch.float32)
    finally:
        pipe.close()


def test_a_prompts_one_token_slice_is_computed_as_prompt(cluster3, smollm2, monkeypatch):
    """In bfloat16 prefill (skipped where the CPU has none), a prompt sliced with slices of one
    token gives the logits of the same prompt in one slice in one process, to the bit: the slices
    say they are the prompt's (``prefill_end``), so the daemons compute a one-token slice as a
    prefill row, in bfloat16, not as a decode token in float32 (0.1 apart in the logits)."""
    try:
        before = set_prefill_gemm("bfloat16")
    except ModelSourceError as e:
        pytest.skip(str(e))
    monkeypatch.setenv(PREFILL_ENV, "bfloat16")  # what the coordinator's Load asks of the daemons
    ids = torch.randint(0, smollm2.config.vocab_size, (1, 97), generator=torch.Generator().manual_seed(1))
    n = ids.shape[1]
    pipe = Pipeline(cluster3.spec)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as the daemons compute (a GEMM on more threads may sum otherwise)
        want = LocalModel(smollm2).open(n + 1).prefill(ids, [n])
        torch.set_num_threads(threads)
        pipe.load("smollm2-135m", cut_stages(pipe.cluster, [6, 31], smollm2.config.num_units), torch.float32)
        for slices in ([n - 1, 1], [1, 7, 1, n - 9]):
            with pipe.open(n + 1) as seq:
                assert torch.equal(RemoteRunner(seq).prefill(ids, slices), want), slices
    finally:
        torch.set_num_threads(threads)
        pipe.close()
        set_prefill_gemm(before)


@pytest.mark.parametrize("daemons", [None, ["s0", "s1", "s0", "s2"]])
def test_several_sequences_in_flight(cluster3, smollm2, reference, daemons):
    pipe = Pipeline(cluster3.spec)
    try:
        cuts = [6, 31] if daemons is None else [6, 31, 40]
        pipe.load("smollm2-135m", cut_stages(pipe.cluster, cuts, smollm2.config.num_units, daemons), torch.float32)
        jobs = [(p, s) for p in PROMPTS for s in (None, [4, 4, 4])] * 2
        jobs = [(p, s if s is None else s + [reference[p][1] - 12]) for p, s in jobs]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = list(pool.map(lambda job: run(pipe, smollm2, *job), jobs))
        for (prompt, _), result in zip(jobs, results):
            assert result.token_ids == reference[prompt][0]
    finally:
        pipe.close()


def test_cli_generate_on_cluster(cluster3, reference, capsys):
    code = main(["generate", "--cluster", str(cluster3.path), "--model", "smollm2-135m", "--chat", "--prompt",
                 PROMPTS[0], "--max-new-tokens", str(MAX_NEW), "--cuts", "2,40", "--slices", "20,17", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == reference[PROMPTS[0]][0]
    assert [s["units"] for s in out["stages"]] == [[0, 2], [2, 40], [40, 62]]
    assert all({"compute_s", "send_s", "recv_s"} <= set(s) for s in out["stages"])


def test_cli_slices_must_add_up(cluster3, capsys):
    code = main(["generate", "--cluster", str(cluster3.path), "--chat", "--prompt", PROMPTS[0], "--slices", "3,4"])
    assert code == 1 and "add up to 7" in capsys.readouterr().err


def test_all_position_logits_through_three_daemons_equal_hf(cluster3, smollm2):
    """The strongest check of the wire path: every position's logits, sliced over three processes."""
    from hpipe.model.generate.local import encode_prompt
    from tests.helpers import hf_model, max_rel_diff

    tok = smollm2.tokenizer()
    ids = torch.tensor([encode_prompt(tok, "Pipelines cut a model into stages and feed it slices of tokens", False)])
    n = ids.shape[1]
    with torch.no_grad():
        ref = hf_model(smollm2.path)(ids).logits
    pipe = Pipeline(cluster3.spec)
    try:
        # 6: attn_2 | mlp_2
        pipe.load("smollm2-135m", cut_stages(pipe.cluster, [6, 31], smollm2.config.num_units), torch.float32)
        with pipe.open(n) as seq:
            slices, start = [4, 1, n - 5], 0
            for k in slices:
                seq.submit(ids[:, start:start + k], all_logits=True)
                start += k
            ours = torch.cat([seq.result() for _ in slices], dim=1)
    finally:
        pipe.close()
    assert ours.shape == ref.shape
    assert max_rel_diff(ours, ref) <= 1e-4


def _all_freed(pipe, within_s=5.0) -> bool:
    """Every daemon holds no sequence and no KV block (freed on its worker, once it gets there)."""
    import time

    from runtime.wire.messages import pb

    deadline = time.monotonic() + within_s
    while True:
        status = [c.call("Status", pb.StatusRequest()) for c in pipe.clients]
        if all(s.open_sequences == 0 and s.kv_bytes == 0 for s in status):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_daemons_hold_the_gguf_blocks(cluster3, smollm2, reference):
    """Daemons read their units' blocks from the GGUF and report those bytes; the float32 import
    (dequantize) over the same cuts gives the same tokens with about five times the bytes."""
    # the file's bytes, and the tied embedding once more: the last stage's LM head reads it too
    stored = smollm2.gguf.stat().st_size + smollm2.weights().nbytes("model.embed_tokens.weight")
    held = {}
    for dequantize in (False, True):
        pipe = Pipeline(cluster3.spec, dequantize=dequantize)
        try:
            pipe.load("smollm2-135m", cut_stages(pipe.cluster, [9, 40], smollm2.config.num_units), torch.float32)
            prompt = PROMPTS[1]
            assert run(pipe, smollm2, prompt).token_ids == reference[prompt][0], dequantize
            held[dequantize] = sum(load.weight_bytes for load in pipe.loads)
        finally:
            pipe.close()
    assert abs(held[False] - stored) <= 0.1 * stored
    assert held[True] > 4 * held[False]


def test_a_deployment_that_says_nothing_of_the_prefill_gemm_gets_the_daemons_default():
    """A coordinator that asked for one precision does not leave it to the next deployment: a
    Load without a word (no HPIPE_PREFILL_GEMM where the coordinator runs) gets the daemon's own
    default again (here float32, from the test suite's environment), not what the last one asked."""
    from hpipe.core.errors import ModelSourceError
    from hpipe.model.kernels.precision import prefill_in_bfloat16, set_prefill_gemm
    from runtime.daemon import deployment

    try:
        before = set_prefill_gemm("bfloat16")
    except ModelSourceError as e:
        pytest.skip(str(e))
    try:
        deployment.set_prefill_gemm("bfloat16")
        assert prefill_in_bfloat16()
        deployment.set_prefill_gemm("")
        assert not prefill_in_bfloat16()  # the daemon's environment says float32
        deployment.set_prefill_gemm("bfloat16")
        deployment.set_prefill_gemm("float32")
        assert not prefill_in_bfloat16()
    finally:
        set_prefill_gemm(before)
