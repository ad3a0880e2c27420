"""Pictures of a run: its loss curve, and what happened to it (matplotlib, written to a file)."""

from __future__ import annotations

from typing import Any

# A colour for each fault kind of pimhbm.campaign, and for each incident kind otherwise.
_COLOURS = ["#e41a1c", "#ff7f00", "#984ea3", "#4daf4a", "#f781bf", "#a65628", "#999999"]


def plot(stats: Any, path: str, *, reference: Any = None, campaign: Any = None,
         title: str | None = None) -> str:
    """The loss curve of ``stats`` (a RunStats) into ``path`` (PNG, or any format matplotlib
    writes), beside the curve of a ``reference`` run if given. Above the curves, a mark at each
    step where something happened: the faults a ``campaign`` planned (pimhbm.campaign, by kind),
    or else the run's incidents (by kind). Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not stats.losses:
        raise ValueError("the run has no losses to plot (no step committed)")
    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    curves = [(reference, "without faults", 2.5, "#9ecae1")] if reference is not None else []
    curves.append((stats, "under the fault campaign" if campaign is not None else "the run", 1,
                   "#08519c"))
    for run, label, width, colour in curves:
        steps = sorted(run.losses)
        ax.plot(steps, [run.losses[s] for s in steps], lw=width, color=colour, label=label)
    top = max(max(run.losses.values()) for run, *_ in curves) * 1.02
    if campaign is not None:
        marks = [(f.kind, f.step) for f in campaign.plan]
    else:
        marks = [(str(i.kind), i.step) for i in stats.incidents]
    for colour, kind in zip(_COLOURS * 4, sorted({k for k, _ in marks})):
        xs = [s for k, s in marks if k == kind]
        ax.scatter(xs, [top] * len(xs), marker="v", s=18, color=colour, label=f"{kind} ({len(xs)})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
