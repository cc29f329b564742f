"""What-if profiles from published specs (``hpipe profile --simulate``): a roofline model.

A device is described by peak FLOP/s, memory bandwidth and memory; a link by Gbit/s and latency.
The time of one unit for a slice of ``s`` tokens x batch ``B`` at context ``c`` is

    max(flops / (peak x efficiency), bytes / bandwidth) + overhead

with flops = 2 x B x s x (unit weights) plus, for attention, 4 x B x heads x head_dim x s x (c + (s+1)/2)
(scores and weighted sum over the cached prefix and the causal half of the slice); bytes = the
unit's weights + activations in and out + (attention) the KV cache read. ``efficiency`` (default
0.5) is the fraction of peak large matrix products reach; ``overhead`` (default 30 us on GPUs,
10 us on CPUs) models per-unit launch costs, which is what makes tiny slices inefficient. The
output is an ordinary profile with ``source: simulated``, on the same grid a measured one uses.
"""

from __future__ import annotations

from hpipe.core.config import ModelConfig
from hpipe.core.profile import DTYPE_BYTES, ComputeGrid, DaemonProfile, LinkProfile, Profile


def unit_cost(cfg: ModelConfig, kind: str, s: int, c: int, b: int, itemsize: int,
              weight_bits: float = 0.0) -> tuple[float, float]:
    """(flops, bytes) of one unit kind for a slice; weights read at ``weight_bits`` per weight
    (quantized; 0: the dtype's ``itemsize``)."""
    h, kv, hd, H = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    wb = weight_bits / 8 if weight_bits else itemsize
    act = 2 * b * s * h * itemsize
    if kind == "embed":
        return 0.0, float(act)
    if kind == "head":
        w = cfg.vocab_size * h
        return 2.0 * b * w, float(w * wb + b * cfg.vocab_size * 4)
    if kind == "mlp":
        w = 3 * h * cfg.intermediate_size
        return 2.0 * b * s * w, float(w * wb + act)
    w = h * hd * (H + 2 * kv) + H * hd * h
    attn = 4.0 * b * H * hd * s * (c + (s + 1) / 2)
    kv_read = b * (c + s) * 2 * kv * hd * itemsize
    return 2.0 * b * s * w + attn, float(w * wb + act + kv_read)


def grid_axes(max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    tokens = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, max_len} & set(
        range(1, max_len + 1)))
    contexts = sorted({0, max_len // 8, max_len // 4, max_len // 2, max_len})
    return tuple(tokens), tuple(contexts)


def simulated_profile(model_name: str, cfg: ModelConfig, daemons, links: dict, dtype: str, max_len: int,
                      batch: int, weight_bits: float = 0.0) -> Profile:
    """``daemons``: objects with ``name, address, device, spec`` (spec: peak_tflops, mem_bw_gbs, memory,
    efficiency?, overhead_us?); ``links``: {(src, dst): (latency_s, bandwidth_Bps)}; ``weight_bits``:
    the matrices held quantized at that many bits per weight (0: in ``dtype``)."""
    it = DTYPE_BYTES[dtype]
    tokens, contexts = grid_axes(max_len)
    batches = tuple(b for b in range(1, batch + 1) if batch % b == 0)  # every micro-batch size
    devices = []
    for d in daemons:
        spec = d.spec
        peak = float(spec["peak_tflops"]) * 1e12 * float(spec.get("efficiency", 0.5))
        bw = float(spec["mem_bw_gbs"]) * 1e9
        overhead = float(spec.get("overhead_us", 10 if d.device == "cpu" else 30)) * 1e-6
        grids = {}
        for kind in ("embed", "attn", "mlp", "head"):
            ctxs = contexts if kind == "attn" else (0,)
            planes = []
            for b in batches:
                plane = []
                for s in tokens:
                    row = []
                    for c in ctxs:
                        flops, nbytes = unit_cost(cfg, kind, s, c, b, it, weight_bits)
                        row.append(max(flops / peak, nbytes / bw) + overhead)
                    plane.append(tuple(row))
                planes.append(tuple(plane))
            grids[kind] = ComputeGrid(batches, tokens, ctxs, tuple(planes))
        devices.append(DaemonProfile(d.name, d.address, d.device, int(spec["memory"]), grids,
                                     fingerprint=f"spec:{spec['peak_tflops']}TF/{spec['mem_bw_gbs']}GBs"))
    link_profiles = tuple(LinkProfile(a, b, lat, bw) for (a, b), (lat, bw) in links.items())
    return Profile(cfg, model_name, dtype, tuple(devices), link_profiles, source="simulated",
                   meta={"max_len": max_len, "batch": batch, "model": "roofline"}, weight_bits=weight_bits)
