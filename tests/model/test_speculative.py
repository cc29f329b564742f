"""Speculative decoding in one process (hpipe.model.generate.speculate): guesses verified as one
entry of decode rows give each position the logits decoding one token at a time gives it, bit for
bit, on the built-in models' block types and on the integer K-quant rows; greedy answers are the
same with speculation on; sampled ones keep their distribution."""

import pytest
import torch

from hpipe.model.generate import speculate
from hpipe.model.generate.local import LocalModel, encode_prompt, generate_ids
from hpipe.model.generate.sampling import Sampler, SamplingParams
from hpipe.model.generate.speculate import PromptLookup, verify

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DOCUMENT = ("The harbour office opens at seven. Boats pay a fee of four crowns a night. The clerk, Anna Berg, "
            "keeps the ledger of every boat that stays. ") * 3


def _rows_both_ways(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    one = model.open(len(prompt) + len(tokens) + 1)
    one.prefill(torch.tensor([prompt]), [len(prompt)])
    alone = torch.stack([one.step(t) for t in tokens])
    many = model.open(len(prompt) + len(tokens) + 1)
    many.prefill(torch.tensor([prompt]), [len(prompt)])
    return alone, many.verify(tokens)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_verification_entry_gives_every_position_its_one_at_a_time_logits(request, name):
    """SmolLM2's Q4_1 blocks (float decode rows) and Gemma 3's Q4_K_M file (integer K-quant rows
    beside Q5_0 and Q8_0 ones): 1, 2, 3, 5 and 9 rows of one entry, each row's bits those of a lone
    decode step at its position."""
    source = request.getfixturevalue(name)
    model, tok = LocalModel(source), source.tokenizer()
    prompt = encode_prompt(tok, DOCUMENT, False)
    tokens = encode_prompt(tok, " The clerk, Anna Berg, keeps the ledger of every", False)[-9:]
    for k in (1, 2, 3, 5, 9):
        alone, many = _rows_both_ways(model, prompt, tokens[:k])
        assert torch.equal(alone, many), (name, k, float((alone - many).abs().max()))


def test_a_rewound_sequence_continues_as_if_the_guesses_had_never_been_fed(smollm2):
    model, tok = LocalModel(smollm2), smollm2.tokenizer()
    prompt = encode_prompt(tok, DOCUMENT, False)
    ref = model.open(len(prompt) + 8)
    ref.prefill(torch.tensor([prompt]), [len(prompt)])
    expected = ref.step(11)
    run = model.open(len(prompt) + 8)
    run.prefill(torch.tensor([prompt]), [len(prompt)])
    run.verify([11, 22, 33, 44])
    run.rewind(len(prompt))
    assert torch.equal(run.step(11), expected)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_answers_are_the_same_with_speculation_and_guesses_are_kept(request, name, monkeypatch):
    monkeypatch.setattr(speculate, "WEIGH_COSTS", False)  # guess whether it pays or not: count what is kept
    source = request.getfixturevalue(name)
    model, tok = LocalModel(source), source.tokenizer()
    chat = bool(getattr(tok, "chat_template", None))  # Gemma 3 270M's file has none
    prompt = encode_prompt(tok, DOCUMENT + "\nRepeat the last sentence above word for word.", chat)
    kw = dict(context=source.config.max_position_embeddings, eos_ids=source.eos_token_ids(), max_new_tokens=40)
    plain = generate_ids(model.open, tok, prompt, **kw)
    fast = generate_ids(model.open, tok, prompt, speculate="ngram", **kw)
    assert fast.token_ids == plain.token_ids
    stats = fast.extra["speculation"]
    assert stats["accepted"] > 0 and stats["verifications"] > 0, stats


def test_prompt_lookup_guesses_what_followed_the_last_tokens_and_adapts():
    d = PromptLookup(weigh=False)
    assert d.propose([5, 6, 7, 8, 9, 5, 6, 7], room=10) == [8, 9, 5, 6]  # after (5, 6, 7): 8, 9, ...
    assert d.propose([1, 2, 3], room=10) == []  # nothing repeats
    d.record(4, 4)
    assert d.length == 5
    for _ in range(3):
        d.record(5, 0)
    assert d.paused > 0 and d.propose([5, 6, 7, 8, 9, 5, 6, 7], room=10) == []
    assert d.propose([5, 6, 7, 8, 9, 5, 6, 7], room=2) == [] and d.stats()["proposed"] == 19


def test_greedy_verification_keeps_guesses_while_they_are_the_arg_max():
    rows = torch.full((4, 10), -5.0)
    for i, best in enumerate([3, 4, 9, 1]):
        rows[i, best] = 5.0
    assert verify(Sampler(), rows, [3, 4, 5]) == [3, 4, 9]  # the third guess is wrong: 9 instead
    assert verify(Sampler(), rows[:3], [3, 4]) == [3, 4, 9]  # all kept, and one more


def test_rejection_sampling_keeps_the_distribution():
    """One position, a guess that is wrong half the time: the token drawn is distributed as the
    sampler's own distribution, whatever the guess."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    draws = torch.zeros(3)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    n = 6000
    for _ in range(n):
        first = verify(sampler, torch.stack([logits, logits]), [1])[0]
        draws[first] += 1
    assert torch.allclose(draws / n, torch.tensor([0.5, 0.3, 0.2]), atol=0.025), draws / n


def test_guesses_are_made_only_where_they_pay():
    """Timed passes: where a verification of k rows costs k + 1 steps (compute-bound rows), no
    number of guesses pays and guessing pauses; where it costs about one step (rows bound by
    reading the weights, or by a link's latency), it guesses as many as it may."""
    d = PromptLookup()
    d.record(4, 2)  # kept half
    d.timed(0, 0.010)
    for k in range(1, 9):
        d.timed(k, 0.010 * (k + 1))
    assert d.worth(8) == 0
    assert d.propose([5, 6, 7, 8, 9, 5, 6, 7], room=10) == [] and d.paused > 0
    cheap = PromptLookup()
    cheap.record(4, 3)
    cheap.timed(0, 0.010)
    cheap.timed(4, 0.011)
    assert cheap.worth(4) == 4 and cheap.propose([5, 6, 7, 8, 9, 5, 6, 7], room=10)[:3] == [8, 9, 5]
