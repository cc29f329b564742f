"""Checks both of hpipe's own prefill attention kernels pass (kernels/bf16_attention.cpp,
kernels/f32_attention.cpp): a float64 reference, and the bits' independence of slicing and threads."""

import torch
import torch.nn.functional as F

HEADS, KV_HEADS = 6, 2


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


def assert_bits_depend_only_on_position_and_keys(attention) -> None:
    """``attention(q, k, v, start, window=...)`` gives a query the same bits however the prompt is
    sliced, on 1-3 threads, whatever shares its tile."""
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
