"""Latency against request rate for several configurations on one picture: the Orca and vLLM papers' main figure.

Each configuration is a curve of mean normalized latency (seconds per output
token) over the swept request rates; the latency bound of the sustainable-rate
test is a dashed line, and each curve's max sustainable rate is circled.
"""

from __future__ import annotations

from pathlib import Path


def plot_sweep(
    curves: dict[str, tuple[list[float], list[float]]],
    max_rates: dict[str, float | None],
    latency_bound: float,
    title: str,
    out: str | Path,
) -> None:
    """``curves``: label -> (request rates, mean normalized latencies)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for index, (label, (rates, latencies)) in enumerate(curves.items()):
        colour = f"C{index}"
        best = max_rates.get(label)
        ax.plot(rates, latencies, marker="o", color=colour, label=f"{label} (max sustainable: {_rate(best)})")
        if best is not None:
            ax.plot([best], [latencies[rates.index(best)]], marker="o", markersize=14, fillstyle="none",
                    color=colour)
    ax.axhline(latency_bound, color="grey", linestyle="--", linewidth=1, label=f"bound {latency_bound} s/token")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("mean normalized latency (s/token)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _rate(rate: float | None) -> str:
    return "none" if rate is None else f"{rate:g} req/s"
