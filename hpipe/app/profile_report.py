"""Human-readable profile summary (stderr): per-device table and link matrix."""

from __future__ import annotations

from hpipe.core.profile import Profile


def summary(profile: Profile) -> str:
    m = profile.model
    held = f", weights held at {profile.weight_bits:.2f} bits each" if profile.weight_bits else ""
    lines = [f"profile ({profile.source}): {profile.model_name} {profile.dtype}{held}, {m.num_layers} layers, "
             f"hidden {m.hidden_size}"]
    s_ref = max(1, min(512, m.max_position_embeddings))
    lines.append(f"{'daemon':<14} {'device':<6} {'memory GiB':>10}   per-unit ms at {s_ref} tokens, context 0: "
                 "embed / attn / mlp / head(1 token)")
    for d in profile.daemons:
        g = d.compute
        b = g["attn"].batches[0]
        times = [g["embed"].time(s_ref, 0, b), g["attn"].time(s_ref, 0, b), g["mlp"].time(s_ref, 0, b),
                 g["head"].time(1, 0, b)]
        lines.append(f"{d.name:<14} {d.device:<6} {d.memory_bytes / 2**30:>10.2f}   "
                     + " / ".join(f"{t * 1e3:.3f}" for t in times))
    names = [d.name for d in profile.daemons]
    lines.append("links (latency ms / bandwidth MB/s), row = from:")
    lines.append(" " * 14 + "".join(f"{n[:16]:>18}" for n in names))
    for a in names:
        cells = []
        for b in names:
            if a == b:
                cells.append(f"{'-':>18}")
            else:
                link = profile.link(a, b)
                cells.append(f"{link.latency_s * 1e3:>8.3f} / {link.bandwidth_Bps / 1e6:>7.1f}")
        lines.append(f"{a[:14]:<14}" + "".join(cells))
    costs = [l for l in profile.links if l.send_cpu_s_per_byte or l.recv_cpu_s_per_byte]
    if costs:
        tokens = 128
        nbytes = tokens * profile.activation_bytes_per_token()
        lines.append(f"host CPU ms per {tokens}-token slice, outside compute (send / receive): "
                     + ", ".join(f"{l.src}->{l.dst} {l.send_cpu(nbytes) * 1e3:.2f} / {l.recv_cpu(nbytes) * 1e3:.2f}"
                                 for l in costs))
    steal, took = profile.meta.get("steal_s"), profile.meta.get("profiling_s")
    if steal and took:
        lines.append(f"CPU steal while profiling (the hypervisor's, on each daemon's CPUs), s of {took:.0f} s: "
                     + ", ".join(f"{d} {v:.2f}" for d, v in steal.items()))
    return "\n".join(lines)
