"""The throughput-against-length plot of the training benchmarks (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def throughput_vs_length(series: list[tuple[str, list[tuple[int, float]], list[int]]], title: str, path: Path) -> None:
    """One line per ``(label, [(tokens per row, tokens/s) that ran], [tokens per row that did not])``;
    runs that did not fit are x marks on the axis in the line's colour. Log-2 length axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (label, ran, failed) in enumerate(series):
        ran = sorted(ran)
        ax.plot([n for n, _ in ran], [t for _, t in ran], "o-", color=f"C{i}", label=label)
        ax.plot(failed, [0] * len(failed), "x", color=f"C{i}", ms=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("training tokens / s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
