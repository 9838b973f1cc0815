"""KV memory over time: slots reserved vs slots holding real K/V, and how many requests that bought.

Drawn for several traces of the same workload (contiguous vs paged, prefix
caching on or off), so the gap between the reserved and used curves
(internal waste) and the running request counts can be compared directly.
With prefix caching, two more curves: the slots shared blocks save (a block
held by several requests counts once in "reserved") and the free slots that
still hold a cached prefix, waiting to be found again or evicted.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.observe.trace import Trace


def plot_memory(traces: list[Trace], labels: list[str], out: str | Path) -> list[dict[str, float]]:
    """Draw into ``out`` (PNG); returns per trace: mean waste share and peak running requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=(3, 2))
    summaries = []
    for index, (trace, label) in enumerate(zip(traces, labels)):
        colour = f"C{index}"
        steps = [s.step for s in trace.steps]
        top.plot(steps, [s.kv_reserved_slots for s in trace.steps], color=colour, label=f"{label}: reserved")
        top.plot(steps, [s.kv_used_slots for s in trace.steps], color=colour, linestyle="--",
                 label=f"{label}: holding K/V")
        if any(s.kv_shared_slots or s.kv_cached_free_slots for s in trace.steps):
            top.plot(steps, [s.kv_shared_slots for s in trace.steps], color=colour, linestyle=":",
                     label=f"{label}: saved by shared blocks")
            top.plot(steps, [s.kv_cached_free_slots for s in trace.steps], color=colour, linestyle="-.",
                     label=f"{label}: free, still cached")
        bottom.plot(steps, [s.num_running for s in trace.steps], color=colour, label=label)
        summaries.append({"mean_waste": trace.mean_kv_waste(), "peak_running": trace.peak_running()})
    top.set_ylabel("KV token slots")
    top.set_title("KV cache: reserved vs holding real K/V")
    top.legend(fontsize=8)
    bottom.set_ylabel("running requests")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summaries
