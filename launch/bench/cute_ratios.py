"""``impl="cute"`` against the strongest peer of each mask family, from kernel.py runs (no GPU needed).

    python launch/bench/cute_ratios.py docs/benchmarks/kernel_h200_cute_final_8k_32k_128k.json \\
        docs/benchmarks/kernel_h200_cute_final_16k_64k.json

The strongest peer (issue 5): FA4 on causal, FA4 varlen on packed docs, Flex's FLASH backend (FA4's
kernels under Flex) on DPO, sliding window + sinks and prefix-LM. Ratios are effective TFLOP/s of the
same run (peers in the same process), forward and forward+backward; ``cute_sparse`` is the block-sparse
path on masks that would take FA4's causal / varlen kernel. Also the ratio to Flex-FLASH everywhere.
Writes ``cute_vs_peers_h200.md`` and a heat map ``cute_vs_peers_h200.png`` next to the first file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAMILIES = ("causal", "docs", "dpo", "sliding", "prefix")
STRONGEST = {"causal": "fa4", "docs": "fa4_varlen", "dpo": "flex_flash", "sliding": "flex_flash", "prefix": "flex_flash"}


def ratios(paths: list[Path]) -> list[dict]:
    rows = [r for p in paths for r in json.loads(p.read_text())["rows"] if "error" not in r and r["head_dim"] == 128]
    by = {(r["mask"], r["n"], r["impl"]): r for r in rows}
    out = []
    for mask, n in sorted({(r["mask"], r["n"]) for r in rows}, key=lambda x: (FAMILIES.index(x[0]), x[1])):
        for impl in ("fm_cute", "fm_cute_sparse"):
            ours = by.get((mask, n, impl))
            if ours is None:
                continue
            row = {"mask": mask, "n": n, "impl": impl}
            for label, peer in (("strongest", STRONGEST[mask]), ("flex_flash", "flex_flash")):
                theirs = by.get((mask, n, peer))
                if theirs is None:
                    continue
                row[f"vs_{label}"] = peer
                for pass_ in ("fwd", "fwdbwd"):
                    row[f"{pass_}_vs_{label}"] = ours[f"{pass_}_tflops"] / theirs[f"{pass_}_tflops"]
            out.append(row)
    return out


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        sys.exit(__doc__)
    rows = ratios(paths)
    lines = ["| mask | N | ours | strongest peer | fwd | fwd+bwd | fwd vs Flex-FLASH | fwd+bwd vs Flex-FLASH |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.get(f"{p}_vs_{peer}", float("nan")) for peer in ("strongest", "flex_flash") for p in ("fwd", "fwdbwd")]
        lines.append(f"| {r['mask']} | {r['n'] // 1024}k | {r['impl']} | {r.get('vs_strongest', '')} | "
                     + " | ".join(f"{c:.2f}" for c in cells) + " |")
    table = "\n".join(lines)
    print(table)
    sources = ", ".join(p.name for p in paths)
    (paths[0].parent / "cute_vs_peers_h200.md").write_text(
        f"`python launch/bench/cute_ratios.py {' '.join(str(p) for p in paths)}` (from {sources})\n\n{table}\n")

    main_rows = [r for r in rows if r["impl"] == "fm_cute"]
    ns = sorted({r["n"] for r in main_rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), constrained_layout=True)
    for ax, pass_ in zip(axes, ("fwd", "fwdbwd")):
        grid = [[next((r[f"{pass_}_vs_strongest"] for r in main_rows if r["mask"] == m and r["n"] == n), float("nan"))
                 for n in ns] for m in FAMILIES]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.2)
        ax.set_xticks(range(len(ns)), [f"{n // 1024}k" for n in ns])
        ax.set_yticks(range(len(FAMILIES)), [f"{m} (vs {STRONGEST[m]})" for m in FAMILIES])
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=9)
        ax.set_title(f"impl='cute' / strongest peer, {'forward' if pass_ == 'fwd' else 'forward+backward'}")
    fig.colorbar(im, ax=axes, shrink=0.8, label="ratio of effective TFLOP/s")
    fig.suptitle("H200, B=1, H=16, D=128, bf16; peers in the same process", fontsize=9)
    fig.savefig(paths[0].parent / "cute_vs_peers_h200.png", dpi=120)


if __name__ == "__main__":
    main()
