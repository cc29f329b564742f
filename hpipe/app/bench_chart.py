"""``hpipe bench --chart``: measured against predicted latency per strategy, and hpipe's pipeline as
it ran (one row per device, one bar per slice and stage) under the one its plan predicted."""

from __future__ import annotations


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["strategies"]
    hp = rows.get("hpipe")
    gantts = []
    if hp and any(st.get("predicted_timeline") for st in hp["stages"]):
        gantts.append(("hpipe as planned", [st.get("predicted_timeline", []) for st in hp["stages"]],
                       hp.get("predicted_s")))
    if hp and any(st.get("timeline") for st in hp["stages"]):
        gantts.append(("hpipe as it ran (median run)", [[x[-2:] for x in st.get("timeline", [])]
                                                         for st in hp["stages"]], hp.get("stages_run_s")))
    gantt_h = 0.5 + 0.35 * len({st["daemon"] for st in hp["stages"]}) if hp else 0  # inches per Gantt panel
    fig, axes = plt.subplots(1 + len(gantts), 1, squeeze=False, figsize=(10, 3.5 + gantt_h * len(gantts)),
                             gridspec_kw={"height_ratios": [3] + [gantt_h] * len(gantts)})
    _bars(axes[0, 0], result)
    horizon = max((t for _, _, t in gantts if t), default=0)
    for ax, (title, stages, total) in zip(axes[1:, 0], gantts):
        _gantt(ax, title, [st["daemon"] for st in hp["stages"]], stages, total, horizon)
    if gantts:
        axes[-1, 0].set_xlabel("seconds from the first slice sent (bars: slice compute)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, result: dict) -> None:
    names = list(result["strategies"])
    meas = [result["strategies"][n]["latency_s"] for n in names]
    pred = [result["strategies"][n]["predicted_s"] or 0 for n in names]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], meas, 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], pred, 0.4, label="predicted")
    if result["ideal_s"]:
        ax.axhline(result["ideal_s"], color="grey", linestyle="--", label="ideal")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("prefill latency (s)")
    ax.set_title(f"{result['seq_len']} tokens x batch {result['batch']}", fontsize=10)
    ax.legend()


def _gantt(ax, title: str, devices: list[str], stages: list[list], total: float | None, horizon: float) -> None:
    """``devices[j]``: the device of stage j; stages of one device (interleaved) share its row."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab20")
    names = list(dict.fromkeys(devices))
    rows = len(names)
    for j, spans in enumerate(stages):
        row = rows - 1 - names.index(devices[j])
        for k, (begin, end) in enumerate(spans):
            ax.barh(row, end - begin, left=begin, height=0.6, color=cmap(k % 20), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(rows))
    ax.set_yticklabels(list(reversed(names)), fontsize=8)
    ax.set_xlim(0, (horizon or 1) * 1.02)
    ax.set_title(title + (f": {total:.3f} s" if total else ""), fontsize=9, loc="left")
