"""hpipe's own bfloat16 attention for prefill slices (kernels/bf16_attention.cpp), on any CPU with
AVX512-BF16 (it runs by default where hpipe's own bfloat16 GEMM does: AMD's Zen 4)."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import need_cpu_kernels
from tests.model.test_quant import _cpu_has

pytestmark = pytest.mark.skipif(not _cpu_has("avx512_bf16"), reason="this CPU has no AVX512-BF16")

HEADS, KV_HEADS = 6, 2


@pytest.fixture(scope="module", autouse=True)
def kernels():
    need_cpu_kernels()


def reference(q, k, v, start, scale, window):
    """Float64 attention of the queries at positions ``start ..`` over keys ``0 .. start + s``."""
    s, n = q.shape[0], start + q.shape[0]
    q_pos, k_pos = torch.arange(start, n)[:, None], torch.arange(n)[None]
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    mask = torch.zeros(s, n, dtype=torch.float64).masked_fill_(~seen, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), k[None, :, :n].double(),
                                         v[None, :, :n].double(), attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


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
    g = torch.Generator().manual_seed(0)
    n, d = 1500, 64
    q = torch.randn(n, HEADS, d, generator=g)
    k, v = torch.randn(KV_HEADS, n, d, generator=g), torch.randn(KV_HEADS, n, d, generator=g)
    for window in (0, 300):
        whole = attention(q, k, v, 0, window=window)
        for cuts in ([0, 2, 333, 700, 701, 1200, 1500], [0, 1, 1499, 1500], [0, 512, 1024, 1500]):
            parts = [attention(q[a:b], k, v, a, window=window) for a, b in zip(cuts, cuts[1:])]
            assert torch.equal(torch.cat(parts), whole), (window, cuts)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(attention(q, k, v, 0))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_bad_shapes_are_clear_errors():
    q, k = torch.randn(4, HEADS, 64), torch.randn(KV_HEADS, 10, 64)
    with pytest.raises(RuntimeError, match="keys and values for every position"):
        attention(q, k, k, 8)  # 12 positions, 10 keys
    with pytest.raises(RuntimeError, match="multiple of 64"):
        attention(torch.randn(4, HEADS, 32), torch.randn(KV_HEADS, 4, 32), torch.randn(KV_HEADS, 4, 32), 0)
