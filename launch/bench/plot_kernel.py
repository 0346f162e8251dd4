"""Plot the GPU kernel benchmark: effective TFLOP/s against N per mask, ours and the peers.

    python -m launch.bench.plot_kernel docs/benchmarks/kernel_h200_cute_causal_docs_dpo.json \
        docs/benchmarks/kernel_h200_cute_sliding_prefix.json docs/benchmarks/kernel_h200_order.json docs/benchmarks/kernel_h200.json

Rows of later files fill in only the (mask, N, D, impl) cases the earlier files lack, so the newest
run comes first. Writes kernel_h200.png next to the first file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"fm_cute": ("C6", "*-"), "fm_triton": ("C0", "o-"), "flex": ("C1", "s--"), "sdpa_flash": ("C2", "^:"), "sdpa_dense_mask": ("C3", "v:"),
         "flex_flash": ("C4", "d--"), "fa4": ("C5", "x-"), "fa4_varlen": ("C5", "x-")}


def load(paths: list[Path]) -> list[dict]:
    seen, rows = set(), []
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            key = (r["mask"], r["n"], r["head_dim"], r["impl"])
            if key not in seen and "error" not in r:
                seen.add(key)
                rows.append(r)
    return rows


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or [Path("docs/benchmarks/kernel_h200.json")]
    rows = [r for r in load(paths) if r["head_dim"] == 128]
    masks = sorted({r["mask"] for r in rows}, key=["causal", "docs", "dpo", "sliding", "prefix", "multi"].index)
    fig, axes = plt.subplots(2, len(masks), figsize=(3.3 * len(masks), 6.5), sharey="row")
    for col, mask in enumerate(masks):
        for row, (key, title) in enumerate((("fwd_tflops", "forward"), ("fwdbwd_tflops", "forward+backward"))):
            ax = axes[row][col]
            for impl in STYLE:
                pts = sorted((r["n"], r[key]) for r in rows if r["mask"] == mask and r["impl"] == impl and key in r)
                if pts:
                    color, style = STYLE[impl]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=impl, ms=4)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mask}: {title}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("effective TFLOP/s")
            if row == 1:
                ax.set_xlabel("N")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("H200, B=1 H=16 D=128 bf16 (visible pairs only)", fontsize=10)
    fig.tight_layout()
    out = paths[0].parent / "kernel_h200.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
