"""hpipe's own bfloat16 attention for prefill slices (kernels/bf16_attention.cpp), on any CPU with
AVX512-BF16 (it runs by default where hpipe's own bfloat16 GEMM does: AMD's Zen 4)."""

import pytest
import torch

from tests.helpers import need_cpu_kernels
from tests.model.attention_checks import HEADS, KV_HEADS, assert_bits_depend_only_on_position_and_keys, reference
from tests.model.test_quant import _cpu_has

pytestmark = pytest.mark.skipif(not _cpu_has("avx512_bf16"), reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    need_cpu_kernels()


def attention(q, k, v, start, scale=0.125, window=0):
    return torch.ops.hpipe.bf16_attention(q, k, v, start, scale, window)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("start,s,window", [(0, 1, 0), (0, 97, 0), (37, 70, 0), (500, 3, 0), (100, 300, 64),
                                            (1000, 200, 512), (31, 33, 1)])
def test_close_to_float64_attention(d, start, s, window):
    """Within what bfloat16 products allow (SDPA's own bfloat16 kernel errs more), for any slice:
    unaligned ones, a single query, sliding windows down to one key, heads of 64 to 256 values;
    keys and values past the slice's end are never read."""
    g = torch.Generator().manual_seed(d + start + s)
    n = start + s
    q = torch.randn(s, HEADS, d, generator=g)
    k, v = torch.randn(KV_HEADS, n + 40, d, generator=g), torch.randn(KV_HEADS, n + 40, d, generator=g)
    k[:, n:], v[:, n:] = float("nan"), float("nan")
    out = attention(q, k, v, start, d ** -0.5, window)
    ref = reference(q, k, v, start, d ** -0.5, window)
    sdpa = reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), start, d ** -0.5, window)
    assert out.shape == (s, HEADS, d) and out.dtype == torch.float32
    err = (out.double() - ref).abs()
    assert err.max() <= 0.02 and err.mean() <= (sdpa - ref).abs().mean() * 1.5 + 1e-6, (err.max(), err.mean())


def test_a_querys_bits_depend_on_nothing_but_its_position_and_keys():
    """However the prompt is sliced, however many threads, whatever shares its tile: the same bits
    (what keeps a request's tokens from changing with the load that sliced it)."""
    assert_bits_depend_only_on_position_and_keys(attention)


def test_bad_shapes_are_clear_errors():
    q, k = torch.randn(4, HEADS, 64), torch.randn(KV_HEADS, 10, 64)
    with pytest.raises(RuntimeError, match="keys and values for every position"):
        attention(q, k, k, 8)  # 12 positions, 10 keys
    with pytest.raises(RuntimeError, match="multiple of 64"):
        attention(torch.randn(4, HEADS, 32), torch.randn(KV_HEADS, 4, 32), torch.randn(KV_HEADS, 4, 32), 0)
