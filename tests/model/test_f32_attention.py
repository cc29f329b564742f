"""hpipe's own float32 attention for prefill slices (kernels/f32_attention.cpp): the kernel on any
CPU with AVX2 and FMA, and the attention layers' choice of it where AVX2 is the widest vectors."""

import pytest
import torch

from hpipe.core.units import UnitRange
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels import precision
from hpipe.model.kv.pool import Entry
from hpipe.model.weights.sources import model_shape
from tests.helpers import need_cpu_kernels
from tests.model.attention_checks import HEADS, KV_HEADS, assert_bits_depend_only_on_position_and_keys, reference
from tests.model.test_quant import _cpu_has

pytestmark = pytest.mark.skipif(not (_cpu_has("avx2") and _cpu_has("fma")), reason="this CPU has no AVX2 and FMA")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    need_cpu_kernels()


def attention(q, k, v, start, scale=0.125, window=0):
    return torch.ops.hpipe.f32_attention(q, k, v, start, scale, window)


@pytest.mark.parametrize("heads, kv_heads, d", [(6, 2, 64), (4, 1, 256), (8, 8, 128), (9, 3, 16)])
@pytest.mark.parametrize("start,s,window", [(0, 1, 0), (0, 97, 0), (37, 70, 0), (500, 3, 0), (100, 300, 64),
                                            (1000, 200, 512), (31, 33, 1), (63, 66, 0)])
def test_close_to_float64_attention(heads, kv_heads, d, start, s, window):
    """Within float32's rounding of float64 attention, for any slice: unaligned ones, a single
    query, sliding windows down to one key, groups of 1 to 4 queries a key, heads of 16 to 256
    values; keys and values past the slice's end are never read (they are NaN here)."""
    g = torch.Generator().manual_seed(d + start + s)
    n = start + s
    q = torch.randn(s, heads, d, generator=g)
    k, v = torch.randn(kv_heads, n + 40, d, generator=g), torch.randn(kv_heads, n + 40, d, generator=g)
    k[:, n:], v[:, n:] = float("nan"), float("nan")
    out = attention(q, k, v, start, d ** -0.5, window)
    assert out.shape == (s, heads, d) and out.dtype == torch.float32
    assert (out.double() - reference(q, k, v, start, d ** -0.5, window)).abs().max() <= 2e-5


def test_a_querys_bits_depend_on_nothing_but_its_position_and_keys():
    """However the prompt is sliced, however many threads, whatever shares its tile: the same bits
    (a request's tokens do not change with the load that sliced it, and no keys are padded)."""
    assert_bits_depend_only_on_position_and_keys(attention)


def test_bad_shapes_are_clear_errors():
    q, k = torch.randn(4, HEADS, 64), torch.randn(KV_HEADS, 10, 64)
    with pytest.raises(RuntimeError, match="keys and values for every position"):
        attention(q, k, k, 8)  # 12 positions, 10 keys
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attention(torch.randn(4, HEADS, 24), torch.randn(KV_HEADS, 4, 24), torch.randn(KV_HEADS, 4, 24), 0)


def test_a_float32_prefill_takes_it_where_avx2_is_the_widest(monkeypatch):
    """A float32 stage's prefill slices run the kernel where the CPU's widest vectors are AVX2's
    (``HPIPE_CPU_ISA=avx2`` on a wider one, as the tests' AVX2 pass sets) and SDPA elsewhere or
    with ``HPIPE_PREFILL_ATTENTION=sdpa``; sliced or whole, the same results to float32's rounding."""
    import hpipe.model.compute.layers as layers

    cfg = model_shape("random:tiny")[1]
    stage = StageModel.random(cfg, UnitRange(0, cfg.num_units, cfg.num_layers))
    prompt = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(3))
    taken = []
    choose = layers.own_f32_attention
    monkeypatch.setattr(layers, "own_f32_attention", lambda: taken.append(choose()) or taken[-1])

    def run(slices: list[int]) -> torch.Tensor:
        pool = stage.new_pool(16)
        seq = pool.sequence(160)
        at, out = 0, []
        for n in slices:
            seq.grow(at + n)
            out.append(stage.forward_batch(prompt[at:at + n], [Entry(at, n, seq, "all", prefill_end=150)], pool))
            at += n
        return torch.cat(out)

    whole, sliced = run([150]), run([7, 64, 1, 78])
    fits = torch.ops.hpipe.f32_attention_fits()
    assert fits == (not _cpu_has("avx512f"))
    assert taken and all(t == fits for t in taken)
    assert (sliced - whole).abs().max() <= 1e-4 * whole.abs().max()
    monkeypatch.setenv(precision.ATTENTION_ENV, "sdpa")
    taken.clear()
    sdpa = run([150])
    assert taken and not any(taken) and (sdpa - whole).abs().max() <= 1e-4 * whole.abs().max()
