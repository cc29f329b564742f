"""Packed linears compute what nn.Linear does; float32 CPU stages use them and count the same weights."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpipe.core.units import UnitRange
from hpipe.model.compute import packed
from hpipe.model.compute.stage import StageModel
from hpipe.model.weights.sources import model_shape

pytestmark = pytest.mark.skipif(not packed.available(), reason="this PyTorch build has no MKL packed GEMM")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 96), (1, 7, 96), (1, 128, 96), (2, 50, 96), (300, 96)])
def test_packed_linear_computes_what_linear_does(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    weight = lin.weight.detach().clone()
    p = packed.PackedLinear(lin)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got = p(x)
        want = F.linear(x, weight, lin.bias)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_non_contiguous_and_empty_inputs():
    lin = nn.Linear(32, 48)
    weight = lin.weight.detach().clone()
    p = packed.PackedLinear(lin)
    x = torch.randn(2, 5, 32).transpose(0, 1)  # [5, 2, 32], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(p(x), F.linear(x, weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert p(torch.randn(1, 0, 32)).shape == (1, 0, 48)


def test_cpu_float32_stages_pack_their_projections_and_count_the_same_parameters():
    """Packing changes the layout, not what is counted as the stage's weights."""
    cfg = model_shape("random:tiny")[1]
    units = UnitRange.full(cfg.num_layers)
    fp32 = StageModel.random(cfg, units, dtype=torch.float32, pack=True)
    bf16 = StageModel.random(cfg, units, dtype=torch.bfloat16, pack=True)
    kinds = {type(m) for m in fp32.modules()}
    assert packed.PackedLinear in kinds
    assert not any(isinstance(m, packed.PackedLinear) for m in bf16.modules())
    assert fp32.parameter_count() == bf16.parameter_count()
    assert fp32.weight_bytes() == 2 * bf16.weight_bytes()


@pytest.mark.parametrize("vendor, packs", [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)])
def test_stages_pack_only_on_cpus_where_it_pays(monkeypatch, vendor, packs):
    """On an AMD EPYC packing ran no faster and took 1.2-3.5x the memory (hpipe/model/compute/packed.py)."""
    monkeypatch.setattr(packed.cpuinfo, "vendor", lambda: vendor)
    cfg = model_shape("random:tiny")[1]
    stage = StageModel.random(cfg, UnitRange.full(cfg.num_layers), dtype=torch.float32)
    assert any(isinstance(m, packed.PackedLinear) for m in stage.modules()) == packs
    assert packed.applies(torch.device("cpu"), torch.float32) == packs


def test_a_stage_packs_its_lm_head_unless_it_is_also_its_embedding():
    """A last stage's head is packed and gives the plain head's logits; a stage holding the tied
    embedding too keeps the one shared tensor."""
    cfg = model_shape("random:tiny")[1]
    cuts = UnitRange(cfg.num_units - 3, cfg.num_units, cfg.num_layers)
    plain = StageModel.random(cfg, cuts, pack=False)
    last = StageModel.random(cfg, cuts, pack=True)
    assert isinstance(last.blocks[str(cfg.num_units - 1)].lm_head, packed.PackedLinear)
    x = torch.randn(1, 6, cfg.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(last(x, 0, last.new_cache(1, 8)), plain(x, 0, plain.new_cache(1, 8)),
                                   rtol=1e-5, atol=1e-5)
    untied = StageModel.random(cfg, UnitRange.full(cfg.num_layers), pack=True)
    assert isinstance(untied.blocks[str(cfg.num_units - 1)].lm_head, packed.PackedLinear)
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    whole = StageModel.random(tied, UnitRange.full(tied.num_layers), pack=True)
    head = whole.blocks[str(tied.num_units - 1)]
    assert isinstance(head.lm_head, nn.Linear)
    assert head.lm_head.weight is whole.blocks["0"].embed_tokens.weight
