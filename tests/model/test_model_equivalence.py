"""Golden tests: any split into unit ranges, fed any slicing, equals the Hugging Face forward."""

import random

import pytest
import torch

from hpipe.core.units import ranges_from_cuts
from hpipe.model.compute.stage import StageModel
from hpipe.model.generate.local import LocalModel, decode_loop
from hpipe.model.generate.sampling import Sampler
from hpipe.model.weights.sources import resolve_model
from tests.helpers import FAMILIES, hf_model, max_rel_diff, run_split

TOL = 1e-4


def random_cuts(rng, num_units):
    k = rng.randint(1, 4)
    return sorted(rng.sample(range(1, num_units), k))


def random_slices(rng, total):
    cuts = sorted(rng.sample(range(1, total), rng.randint(1, 5)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_splits_and_slices_match_hf(family, tiny_dirs):
    source = resolve_model(str(tiny_dirs[family]))
    cfg = source.config
    ref_model = hf_model(source.path)
    rng = random.Random(family)
    ids = torch.randint(0, cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits
    store = source.weights()
    # Always include a cut between the attention and the MLP of one block (unit 2 | 3 boundary
    # is attn_0 | mlp_0 for cut 2), plus random ones.
    cut_sets = [[2], [1, 4, 5], random_cuts(rng, cfg.num_units), random_cuts(rng, cfg.num_units)]
    for cuts in cut_sets:
        stages = [StageModel.from_checkpoint(store, cfg, r) for r in ranges_from_cuts(cuts, cfg.num_layers)]
        for slices in ([29], [1] * 3 + [26], [13, 16], random_slices(rng, 29)):
            ours = run_split(stages, ids, slices, max_len=40)
            assert max_rel_diff(ours, ref) <= TOL, (family, cuts, slices)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_match_hf_generate(family, tiny_dirs):
    source = resolve_model(str(tiny_dirs[family]))
    ref_model = hf_model(source.path)
    prompt = torch.randint(0, source.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    new = 20
    with torch.no_grad():
        ref = ref_model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)[0, 12:].tolist()
    model = LocalModel(source, cuts=[3, 4])
    ours, *_ = decode_loop(model.open(12 + new), prompt[0].tolist(), max_new_tokens=new, sampler=Sampler(),
                           eos_ids=[], slices=[5, 7])
    assert ours == ref


def test_random_weights_do_not_depend_on_split(tiny_dirs):
    cfg = resolve_model(str(tiny_dirs["llama"])).config
    ids = torch.arange(10)[None]
    whole = [StageModel.random(cfg, r, seed=3) for r in ranges_from_cuts([], cfg.num_layers)]
    split = [StageModel.random(cfg, r, seed=3) for r in ranges_from_cuts([2, 5], cfg.num_layers)]
    assert torch.equal(run_split(whole, ids, [10], 10), run_split(split, ids, [10], 10))
    assert max_rel_diff(run_split(split, ids, [4, 6], 10), run_split(whole, ids, [10], 10)) <= TOL


def test_bfloat16_close_to_float32(tiny_dirs):
    source = resolve_model(str(tiny_dirs["llama"]))
    cfg, store = source.config, source.weights()
    ids = torch.arange(16)[None]
    f32 = [StageModel.from_checkpoint(store, cfg, r) for r in ranges_from_cuts([3], cfg.num_layers)]
    b16 = [StageModel.from_checkpoint(store, cfg, r, dtype=torch.bfloat16) for r in ranges_from_cuts([3], cfg.num_layers)]
    a, b = run_split(f32, ids, [16], 16), run_split(b16, ids, [10, 6], 16)
    assert b.dtype == torch.bfloat16
    rel = float((b.float() - a).norm() / a.norm())
    assert rel < 0.1  # bf16 keeps ~3 significant digits; a wrong mask or cache gives ~1
    assert (b.float().argmax(-1) == a.argmax(-1)).float().mean() >= 0.9
