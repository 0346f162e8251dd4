"""Mask preparation time: the FlashMask builder and the Triton launch plans, range-based against dense-grid.

    python launch/bench/plan_prep.py                      # CUDA if present, else CPU; N = 64k .. 1M
    python launch/bench/plan_prep.py --device cpu --ns 131072 524288

Packed documents (mean length 2048, masks.sample_lengths), plans for the three passes' block shapes
(both orientations each, as the launchers build them), from the bounds: the mask's cached block
summaries are dropped before every run. The dense-grid builder is timed only up to
--dense-max (it is O((N / 64)^2)). Each figure is the median of --repeat runs after one warm-up.
On CUDA the launchers' builder is the Triton one (kernels/triton_plan.py); the PyTorch range-based
builder is timed beside it and both are checked equal at every N (exit 1 if not).
Writes docs/benchmarks/plan_prep_<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.repeats import spread  # noqa: E402


def timed(fn, device, repeat: int) -> dict:
    """``{"min", "median", "max"}`` ms of ``repeat`` runs after a warm-up."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return spread(times)


def _put(row: dict, key: str, spread: dict) -> None:
    """The median under ``key`` (what tables and plots read), the min / max beside it."""
    row[key], row[f"{key}_spread"] = spread["median"], [spread["min"], spread["max"]]


def fresh(mask) -> bool:
    """Forget what the mask cached (block summaries, plans): every timed run starts from the bounds."""
    mask._cache.clear()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[65536, 131072, 262144, 524288, 1048576])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dense-max", type=int, default=262144)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()

    from fm_parallel import masks
    from fm_parallel.kernels.plan import build_plans, build_plans_consecutive
    from fm_parallel.kernels.triton_flashmask import config_for

    device = torch.device(args.device)
    shapes = sorted({(config_for(kind, 128).block_m, config_for(kind, 128).block_n) for kind in ("fwd", "bwd_kv", "bwd_q")})
    rows = []
    for n in args.ns:
        lengths = masks.sample_lengths(n)
        mask = masks.document(lengths).to(device)
        row = {"n": n, "device": str(device), "block_shapes": shapes}
        _put(row, "builder_ms", timed(lambda: masks.document(lengths), device, args.repeat))
        _put(row, "plans_ms", timed(lambda: fresh(mask) and [build_plans_consecutive(mask, 0, n, bm, bn) for bm, bn in shapes],
                                    device, args.repeat))
        if device.type == "cuda":  # "plans_ms" is the Triton builder there; the PyTorch one for comparison
            _put(row, "plans_torch_ms", timed(
                lambda: fresh(mask) and [build_plans_consecutive(mask, 0, n, bm, bn, builder="torch") for bm, bn in shapes],
                device, args.repeat))
            row["builders_equal"] = all(
                torch.equal(getattr(a, f), getattr(b, f))
                for bm, bn in shapes
                for a, b in zip(build_plans_consecutive(mask, 0, n, bm, bn, builder="triton"),
                                build_plans_consecutive(mask, 0, n, bm, bn, builder="torch"))
                for f in ("full_offsets", "full_runs", "part_offsets", "part_runs", "order"))
        if n <= args.dense_max:
            pos = torch.arange(n, device=device)
            _put(row, "plans_dense_ms", timed(lambda: fresh(mask) and [build_plans(mask, pos, bm, bn) for bm, bn in shapes],
                                              device, max(1, args.repeat // 2)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = "python launch/bench/plan_prep.py " + " ".join(sys.argv[1:])
    (args.out / f"plan_prep_{device.type}.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    print("\nEach figure: min / median / max ms of the repeats.\n\n| N | mask builder ms | plans ms (range-based; Triton on CUDA) | "
          "plans ms, PyTorch range-based | plans ms (dense grid) | builders equal |\n|---|---|---|---|---|---|")

    def shown(r, key):
        return " / ".join(f"{x:.2f}" for x in (r[f"{key}_spread"][0], r[key], r[f"{key}_spread"][1])) if key in r else "-"

    for r in rows:
        print(f"| {r['n']} | {shown(r, 'builder_ms')} | {shown(r, 'plans_ms')} | {shown(r, 'plans_torch_ms')} | "
              f"{shown(r, 'plans_dense_ms')} | {r.get('builders_equal', '-')} |")
    if not all(r.get("builders_equal", True) for r in rows):
        sys.exit("FAIL: the Triton and PyTorch plan builders disagree")


if __name__ == "__main__":
    main()
