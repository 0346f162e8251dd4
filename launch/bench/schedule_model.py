"""How long the slowest CTA keeps the GPU busy under each CTA order, from the tile counts alone.

    python launch/bench/schedule_model.py                 # 16k and 64k, the kernel benchmark's masks
    python launch/bench/schedule_model.py --ns 16384 --masks global_window

Two backends: FA4's kernels (``impl="cute"``: 128 x 128 tiles, one CTA per SM) and our Triton
kernels (64 x 64 tiles at D = 128, taken here as two programs per SM; before the launch order their
grid ran each head's blocks busiest first, head after head).

FA4's SM90 kernels run one CTA per (block, head) work item, one CTA per SM at a time (D = 128), and an
SM takes the next CTA in launch order when it is free: list scheduling. A block that visits far more
tiles than the others (global rows, attention sinks, the last rows of causal masks) decides the
kernel's time if it starts late. This model runs the work items of each order through 132 SMs with a
cost of (visited tiles + 1) per item (the 1: a CTA's prologue / epilogue, about one tile) and reports
the makespan over the perfect-balance bound (total cost / SMs): 1.0 is ideal. Orders: FA4's grid order
(block fastest), FA4's LPT order (blocks reversed within L2 sections of heads, the forward's
``reversed`` schedule) and the bucketed cost order of ``fa4_sparsity.cost_order`` (``cute`` as
shipped), decoded by ``fa4_sparsity.launch_items`` as the kernel decodes it.
It predicts where the cost order can help; the H200 measures whether it does (kernel.py, cute vs
cute_lpt), since the model ignores memory traffic and partial-tile masking cost.

Writes schedule_model.json and .md under --out.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fm_parallel.kernels.fa4_sparsity import cost_order, fa4_block_sparsity  # noqa: E402
from fm_parallel.kernels.plan import launch_items  # noqa: E402
from launch.bench.kernel import MASKS, build  # noqa: E402

SMS = 132
L2_BYTES = 50 * 2**20  # FA4's LPT scheduler's L2 budget for K and V


def makespan(costs: list[float], sms: int = SMS) -> float:
    """Greedy list scheduling in the given order: each item goes to the SM that is free first."""
    free = [0.0] * sms
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return max(free)


def orders(cost: torch.Tensor, heads: int, n: int, d: int, lists, backend: str) -> dict[str, list[float]]:
    """Item costs in launch order for each schedule; ``cost`` [T] per block (one mask for all heads)."""
    blocks = cost.numel()
    per = cost.tolist()
    ranked = [per[b] for b, _ in launch_items(cost_order(lists), heads, blocks)]  # as the kernels decode it
    if backend == "triton":
        before = [per[b] for _ in range(heads) for b in torch.argsort(cost, descending=True, stable=True).tolist()]
        return {"before": before, "cost": ranked}
    grid = [per[b] for _ in range(heads) for b in range(blocks)]
    section = 1
    while section * 2 * n * 2 * d * 2 <= L2_BYTES:  # heads whose K and V fit, a power of 2 (FA4's rule)
        section *= 2
    lpt = [per[b] for s in range(0, heads, section) for b in reversed(range(blocks))
           for _ in range(s, min(heads, s + section))]
    ranked = [per[b] for b, _ in launch_items(cost_order(lists), heads, blocks)]  # as the kernel decodes it
    return {"grid": grid, "lpt": lpt, "cost": ranked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--masks", nargs="+", default=["global_window", "window_sinks", "sliding", "dpo", "prefix", "multi"],
                        choices=MASKS)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()

    rows = []
    for backend, tile, slots in (("cute", 128, SMS), ("triton", 64, 2 * SMS)):
        for name in args.masks:
            for n in args.ns:
                mask = build(name, n)[0]
                fwd, bwd = fa4_block_sparsity(mask, tile, tile)
                for direction, lists in (("fwd", fwd), ("bwd", bwd)):
                    visited = (lists.full_block_cnt + lists.mask_block_cnt)[0, 0].float()
                    cost = visited + 1.0
                    ideal = float(cost.sum()) * args.heads / slots
                    row = {"backend": backend, "mask": name, "n": n, "pass": direction,
                           "heaviest_block": float(cost.max()), "mean_block": float(cost.mean())}
                    for label, items in orders(cost, args.heads, n, args.head_dim, lists, backend).items():
                        row[label] = makespan(items, slots) / ideal
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    lines = ["| mask | N | pass | heaviest / mean block (tiles) | grid order | FA4 LPT (reversed) | launch order (shipped) |",
             "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["backend"] == "cute"):
        lines.append(f"| {r['mask']} | {r['n']} | {r['pass']} | {r['heaviest_block']:.0f} / {r['mean_block']:.1f} | "
                     f"{r['grid']:.3f} | {r['lpt']:.3f} | {r['cost']:.3f} |")
    lines += ["", "Triton (64 x 64 tiles, two programs per SM):", "",
              "| mask | N | pass | heaviest / mean block (tiles) | head by head, busiest first (before) | launch order (shipped) |",
              "|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["backend"] == "triton"):
        lines.append(f"| {r['mask']} | {r['n']} | {r['pass']} | {r['heaviest_block']:.0f} / {r['mean_block']:.1f} | "
                     f"{r['before']:.3f} | {r['cost']:.3f} |")
    command = "python launch/bench/schedule_model.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schedule_model.json").write_text(json.dumps({"command": command, "sms": SMS, "rows": rows}, indent=1))
    md = (f"`{command}`: makespan / perfect balance ({SMS} SMs, H = {args.heads}, D = {args.head_dim}, cost = visited "
          f"tiles + 1 per CTA; 1.000 is ideal). Pass fwd: programs per query block (FA4's forward; Triton's "
          f"forward and dQ); bwd: per key block (FA4's backward; Triton's dK / dV). FA4 (128 x 128 tiles, one CTA per SM):\n\n" + "\n".join(lines) + "\n")
    (args.out / "schedule_model.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
