"""What a partial tile costs in ``impl="cute"``, against a fully visible one (H200 diagnostic).

    python launch/bench/cute_tile_costs.py --n 16384 --masks docs sliding causal

For each mask the CuTe forward and forward+backward are timed three ways, with the same kernels:
``real`` (our block lists), ``as_full`` (partial tiles listed as fully visible: no mask evaluated;
the numbers are wrong, only the time matters) and ``as_partial`` (every visited tile listed as partial).
With F full and P partial tiles, ``t = c + a * full_tiles + b * partial_tiles`` for the three runs
gives the time per full tile ``a``, per partial tile ``b`` and the rest ``c`` (launch, prologue,
tail). ``b / a`` is what masking a tile costs; ``P * (b - a)`` is what the partial tiles cost the real
run. B=1, H=16, D=128, bf16. Writes ``--out/<tag>.json``.
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

from launch.bench.kernel import MASKS, bench, build  # noqa: E402


def lists_for(mask, mode: str, heads: int, d: int):
    """FA4's (forward, backward) lists of ``mask`` with the tile classes changed by ``mode``."""
    from fm_parallel.kernels import fa4_sparsity
    from fm_parallel.masks.blocks import TileClass

    classes = fa4_sparsity.tile_classes

    def changed(*args, **kwargs):
        cls = classes(*args, **kwargs).clone()
        if mode == "as_full":
            cls[cls == int(TileClass.PARTIAL)] = int(TileClass.FULL)
        elif mode == "as_partial":
            cls[cls == int(TileClass.FULL)] = int(TileClass.PARTIAL)
        return cls

    fa4_sparsity.tile_classes = changed
    try:
        fwd, bwd = fa4_sparsity.fa4_block_sparsity(mask, *fa4_sparsity.fa4_tile_shape(d), heads)
    finally:
        fa4_sparsity.tile_classes = classes
    full = int(fwd.full_block_cnt.sum()) // fwd.full_block_cnt.shape[1]
    partial = int(fwd.mask_block_cnt.sum()) // fwd.mask_block_cnt.shape[1]
    orders = (fa4_sparsity.cost_order(fwd), fa4_sparsity.cost_order(bwd))
    return (fwd.to_fa4(), bwd.to_fa4(), *orders), full, partial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--masks", nargs="+", default=["docs", "sliding", "causal"], choices=MASKS)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--tag", default="cute_tile_costs_h200")
    args = parser.parse_args()

    from fm_parallel import flashmask_attention
    from fm_parallel.kernels import cute_flashmask

    d, n, heads = 128, args.n, args.heads
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    rows = []
    real_sparsity = cute_flashmask._sparsity
    for name in args.masks:
        fm = build(name, n)[0].to("cuda")
        row = {"mask": name, "n": n}
        for mode in ("real", "as_full", "as_partial"):
            lists, full, partial = lists_for(fm, mode, heads, d)
            cute_flashmask._sparsity = lambda *a, _lists=lists, **kw: _lists  # noqa: E731
            try:
                call = lambda: flashmask_attention(q, k, v, mask=fm, impl="cute")  # noqa: E731

                def fb():
                    for x in (q, k, v):
                        x.grad = None
                    call().backward(do)

                fwd_t, fwdbwd_t = bench(call, False), bench(fb, False)  # min / median / max of the repeats
                row[mode] = {"full_tiles": full, "partial_tiles": partial, "fwd_ms": fwd_t["median"],
                             "fwdbwd_ms": fwdbwd_t["median"], "fwd_spread_ms": fwd_t, "fwdbwd_spread_ms": fwdbwd_t}
            finally:
                cute_flashmask._sparsity = real_sparsity
        for key in ("fwd_ms", "fwdbwd_ms"):  # solve t = c + a F + b P from the three runs
            tiles = row["real"]["full_tiles"] + row["real"]["partial_tiles"]
            a_ = (row["as_full"][key] - row["real"][key]) / max(row["real"]["partial_tiles"], 1)  # = a - b, per tile
            a_b = row["as_full"][key] - row["as_partial"][key]  # = (a - b) * tiles
            per_partial_minus_full = -a_b / tiles
            row[key.replace("_ms", "") + "_partial_minus_full_us_per_tile"] = 1e3 * per_partial_minus_full
            row[key.replace("_ms", "") + "_check_us_per_tile"] = -1e3 * a_  # the same quantity from the real run
            row[key.replace("_ms", "") + "_full_tile_us"] = 1e3 * row["as_full"][key] / tiles  # c included
            row[key.replace("_ms", "") + "_partial_share_of_real"] = (
                row["real"]["partial_tiles"] * per_partial_minus_full / row["real"][key])
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python launch/bench/cute_tile_costs.py " + " ".join(sys.argv[1:]),
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    (args.out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("| mask | tiles full / partial | fwd ms real / as_full / as_partial | partial - full, us per tile | "
          "share of the real fwd | fwd+bwd ms real / as_full / as_partial | share of the real fwd+bwd |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mask']} | {r['real']['full_tiles']} / {r['real']['partial_tiles']} | "
              f"{r['real']['fwd_ms']:.3f} / {r['as_full']['fwd_ms']:.3f} / {r['as_partial']['fwd_ms']:.3f} | "
              f"{r['fwd_partial_minus_full_us_per_tile']:.2f} | {r['fwd_partial_share_of_real']:.0%} | "
              f"{r['real']['fwdbwd_ms']:.3f} / {r['as_full']['fwdbwd_ms']:.3f} / {r['as_partial']['fwdbwd_ms']:.3f} | "
              f"{r['fwdbwd_partial_share_of_real']:.0%} |")


if __name__ == "__main__":
    main()
