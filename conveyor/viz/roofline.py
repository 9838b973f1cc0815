"""The roofline picture: attainable FLOP/s against arithmetic intensity, log-log.

The roof is the machine's bandwidth slope up to the ridge point, then its
compute ceiling. Each batch size is a point on the roof (the bound) and, when
measured, a point below it at the FLOP/s the engine reached.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.benchmarks.machine import MachineFigures
from conveyor.benchmarks.roofline import RooflinePoint


def plot_roofline(points: list[RooflinePoint], machine: MachineFigures, out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured_context = {p.context_len for p in points if p.measured_tokens_per_s is not None}
    shown = [p for p in points if p.context_len in measured_context] or points
    low = min(p.intensity for p in shown) / 2
    high = max(max(p.intensity for p in shown) * 2, machine.ridge_point * 4)
    ridge = machine.ridge_point
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot([low, ridge, high], [machine.memory_bandwidth * low, machine.gemm_flops, machine.gemm_flops],
            color="black", label="roof: bandwidth x intensity, then peak GEMM")
    ax.axvline(ridge, color="grey", linestyle=":", label=f"ridge point {ridge:.1f} FLOP/byte")
    if machine.int8_ops:  # quantized weights' products: int8 dot products, a higher ceiling
        int8_ridge = machine.int8_ops / machine.memory_bandwidth
        high = max(high, int8_ridge * 2)
        ax.plot([ridge, int8_ridge, high], [machine.gemm_flops, machine.int8_ops, machine.int8_ops], color="black",
                linestyle="--", label="roof of quantized weights: peak int8 dot products")
    for p in shown:
        step_seconds = p.batch_size / p.bound_tokens_per_s
        ax.scatter(p.intensity, p.flops / step_seconds, color="C0", marker="o")
        ax.annotate(f"B={p.batch_size}", (p.intensity, p.flops / step_seconds), textcoords="offset points",
                    xytext=(4, 6), fontsize=8)
        if p.measured_tokens_per_s is not None:
            reached = p.flops * p.measured_tokens_per_s / p.batch_size
            ax.scatter(p.intensity, reached, color="C3", marker="x")
    ax.scatter([], [], color="C0", marker="o", label="bound of a decode step")
    ax.scatter([], [], color="C3", marker="x", label="Conveyor, measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("FLOP/s")
    context = ", ".join(str(c) for c in sorted(measured_context)) or "various"
    ax.set_title(f"Decode step roofline, context {context} tokens\n{machine.cpu}, {machine.dtype}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
