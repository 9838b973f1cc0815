"""The seed's batch picture, from real traces: one row per batch slot, one column per step.

A filled cell is a slot that computed tokens in that step; a pale cell is a
slot held by a request that did nothing (a static batch member waiting for
the longest request); white is an empty slot. Several traces of the same
workload are drawn one above the other, each with its idle fraction.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.observe.trace import Trace

BUSY, HELD_IDLE, EMPTY = 2, 1, 0


def plot_timeline(traces: list[Trace], labels: list[str], out: str | Path) -> list[float]:
    """Draw the traces into ``out`` (PNG); returns each trace's idle fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    colours = ListedColormap(["#ffffff", "#f4c7a1", "#2b6cb0"])
    width = max(len(t.steps) for t in traces)
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 2.6 * len(traces) + 0.6), squeeze=False)
    idle = []
    for ax, trace, label in zip(axes[:, 0], traces, labels):
        grid, idle_fraction = trace.slot_fill()
        idle.append(idle_fraction)
        cells = [[_code(c) for c in row] + [EMPTY] * (width - len(row)) for row in grid]
        ax.imshow(cells, aspect="auto", interpolation="nearest", cmap=colours, vmin=0, vmax=2)
        ax.set_title(f"{label}: {len(trace.steps)} steps, {idle_fraction:.0%} of slot-steps idle", loc="left")
        ax.set_ylabel("batch slot")
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i)) for i in (BUSY, HELD_IDLE)]
    fig.legend(handles, ["computing", "held, idle"], loc="upper right", ncols=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return idle


def _code(cell: bool | None) -> int:
    return EMPTY if cell is None else (BUSY if cell else HELD_IDLE)
