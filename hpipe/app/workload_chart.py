"""``hpipe bench --workload --chart``: each stage's occupancy over time, one panel per policy, so
that bubbles can be seen; under it, each micro-batch's prefill and decode tokens as it was sent."""

from __future__ import annotations


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {p: rs[0] for p, rs in result["runs"].items()}
    stages = result["stages"]
    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(12, sum(0.9 + 0.3 * len(stages) + 1.6 for _ in runs)),
                             squeeze=False,
                             gridspec_kw={"height_ratios": [h for _ in runs for h in (0.6 + 0.3 * len(stages), 1.4)]})
    horizon = max(run["span_s"] for run in runs.values())
    for k, (policy, run) in enumerate(runs.items()):
        ax, mb = axes[2 * k, 0], axes[2 * k + 1, 0]
        for j, st in enumerate(run["stages"]):
            row = len(stages) - 1 - j
            ax.broken_barh([(b, e - b) for b, e in st["spans"]], (row - 0.35, 0.7), color="tab:blue")
        ax.set_yticks(range(len(stages)), list(reversed(stages)), fontsize=7)
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(f"{policy}: {run['total_tokens_per_s']:.0f} tokens/s, busy "
                     + ", ".join(f"{d} {v:.2f}" for d, v in run["daemon_busy"].items()), fontsize=9, loc="left")
        sent = [m[0] for m in run["log"]]
        mb.bar(sent, [m[2] for m in run["log"]], width=horizon / 400, color="tab:orange", label="prefill tokens")
        mb.bar(sent, [m[3] for m in run["log"]], bottom=[m[2] for m in run["log"]], width=horizon / 400,
               color="tab:green", label="decode tokens")
        mb.set_xlim(0, horizon * 1.01)
        mb.set_ylabel("tokens", fontsize=8)
        mb.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from the first arrival (bars above: micro-batches computing on each stage)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
