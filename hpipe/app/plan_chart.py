"""Draw a plan's predicted pipeline as a Gantt chart (PNG): one row per stage, one bar per slice."""

from __future__ import annotations

from hpipe.core.plan import Plan, StrategyPlan
from planner.simulator import Timeline


def gantt(plan: Plan, timelines: dict[str, Timeline], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(timelines)
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.2 + 0.5 * sum(len(plan.strategies[n].stages)
                                                                          for n in names)), squeeze=False)
    horizon = max(t.makespan for t in timelines.values())
    cmap = plt.get_cmap("tab20")
    for ax, name in zip(axes[:, 0], names):
        sp: StrategyPlan = plan.strategies[name]
        tl = timelines[name]
        rows = len(sp.stages)
        for j, k, start, end in tl.compute:
            ax.barh(rows - 1 - j, end - start, left=start, height=0.6, color=cmap(k % 20), edgecolor="black",
                    linewidth=0.3)
        for j, k, start, end in tl.transfers:
            ax.barh(rows - 1 - j - 0.45, end - start, left=start, height=0.12, color="grey")
        ax.set_yticks(range(rows))
        ax.set_yticklabels([f"{s.daemon} [{s.units.start},{s.units.end})" for s in reversed(sp.stages)], fontsize=7)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{name}: {tl.makespan:.3f} s predicted, {len(sp.slices)} slice(s) x {sp.micro_batches} "
                     "micro-batch(es)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds (bars: slice compute; grey: transfer to the next stage)")
    fig.suptitle(f"{plan.model_name}, {plan.seq_len} tokens x batch {plan.batch}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
