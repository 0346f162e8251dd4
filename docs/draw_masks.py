"""Draw every mask family with its tile classes: docs/img/masks.png.

    python docs/draw_masks.py

Each panel shows a 96-token mask (rows = queries, columns = keys) cut into 16 x 16 tiles, coloured
by the tile rule: white = skipped (no loads, no math), green = fully visible (no mask math),
blue / pale orange = visible / masked entries of a partial tile (masked in registers).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fm_parallel import masks  # noqa: E402

N, TILE = 96, 16


def families():
    return {
        "causal": masks.causal(N),
        "packed documents (causal)": masks.document([30, 18, 40], n=N),
        "packed documents (bidirectional)": masks.document([30, 18, 40], causal=False, n=N),
        "prefix-LM per document": masks.prefix_lm(prefix_len=[12, 20], lengths=[50, 46]),
        "DPO: prompt, chosen, rejected": masks.dpo(40, 28, 28),
        "reward model, 3 answers x 2 samples": masks.preference([16, 12], [[10, 8, 12], [14, 10, 14]]),
        "sliding window 16 + 4 sinks": masks.sliding_window(N, 16, sinks=4),
        "window 8 OR last 16 rows see all (2 intervals)": masks.union(
            masks.sliding_window(N, 8), masks.FlashMask(torch.full((N,), N - 16), torch.full((N,), N - 1))
        ),
        "window 24 AND packed docs": masks.intersect(masks.sliding_window(N, 24), masks.document([40, 56])),
    }


def main(path: Path = Path(__file__).parent / "img" / "masks.png") -> None:
    fams = families()
    cols = 3
    rows = -(-len(fams) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4.2 * rows))
    visible_colors = {1: (0.1, 0.2, 0.55), 2: (0.15, 0.55, 0.25)}  # partial, full
    hidden_colors = {0: (1, 1, 1), 1: (1.0, 0.85, 0.6)}  # skipped, partial
    for ax, (name, m) in zip(axes.flat, fams.items()):
        dense = m.to_dense()[0, 0].numpy()
        lo, hi = masks.row_block_bounds(torch.arange(N), TILE)
        cls = masks.classify_tiles(m.block_summary(TILE), lo, hi)[0, 0].numpy()
        tile = np.kron(cls, np.ones((TILE, TILE), dtype=cls.dtype))[:N, :N]
        img = np.ones((N, N, 3))
        for c, color in hidden_colors.items():
            img[(tile == c) & ~dense] = color
        for c, color in visible_colors.items():
            img[(tile == c) & dense] = color
        ax.imshow(img, interpolation="nearest")
        for t in range(0, N + 1, TILE):
            ax.axhline(t - 0.5, color="0.7", lw=0.4)
            ax.axvline(t - 0.5, color="0.7", lw=0.4)
        s = m.stats(block=TILE)
        ax.set_title(f"{name}\nM={m.max_intervals}, skipped {s.skip_ratio:.0%}, density {s.density:.2f}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
