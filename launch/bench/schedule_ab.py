"""The launch orders of the CuTe and Triton backends against each other on one mask, one process (H200).

    python launch/bench/schedule_ab.py --n 65536 --masks window_sinks              # impl cute
    python launch/bench/schedule_ab.py --impl triton --n 16384 --masks sliding window_sinks global_window

What the schedule costs and brings, separated: FA4's grid order and its reversed (LPT) forward, both
without any decoding in the kernel; the cost-ordered scheduler (``CostOrderScheduler``) given the
*same* sequences as those two (one bucket, blocks ascending / descending), so the difference to them
is the scheduler's own per-CTA decoding; and the cost order as shipped (buckets of visited tiles,
heaviest first). ``--impl triton``: the Triton kernels' order before the launch order (each head's
blocks busiest first, head after head: one bucket sorted by work) against the shipped launch order,
the same kernels decoding both. Each variant runs on a fresh mask object (orders and plans are cached
on the mask).
Prints one row per variant (forward and forward + backward, median and min / max of the repeats)
and writes schedule_ab.json under --out.
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

from fm_parallel import flashmask_attention  # noqa: E402
from fm_parallel.kernels import plan  # noqa: E402
from fm_parallel.kernels.plan import ORDER_BUCKETS  # noqa: E402
from launch.bench.kernel import MASKS, build, measure, without_structure  # noqa: E402


def one_bucket(descending: bool):
    """A ``cost_order`` stand-in: every block in one bucket, in block order (FA4's grid order for the
    forward and backward alike) or reversed (the LPT forward's order within a head)."""

    def order(lists):
        blocks = lists.full_block_cnt.shape[-1]
        seq = torch.arange(blocks, device=lists.full_block_cnt.device)
        return _with_one_bucket(seq.flip(0) if descending else seq)

    return order


def _with_one_bucket(seq: torch.Tensor) -> torch.Tensor:
    blocks = seq.numel()
    starts = torch.full((ORDER_BUCKETS + 1,), blocks, dtype=torch.long, device=seq.device)
    starts[0] = 0
    return torch.cat([seq.long(), starts]).to(torch.int32)


def busiest_first_per_head(work: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """A ``plan.launch_order`` stand-in: the Triton order before it (one bucket, blocks by work)."""
    return _with_one_bucket(torch.argsort(work, descending=True, stable=True))


VARIANTS = {  # label -> (schedule, cost_order stand-in or None)
    "grid": ("grid", None),
    "reversed (LPT fwd)": ("reversed", None),
    "decoded grid sequence": ("cost", one_bucket(False)),
    "decoded reversed sequence": ("cost", one_bucket(True)),
    "cost order (shipped)": ("cost", None),
}
TRITON_VARIANTS = {  # label -> plan.launch_order stand-in or None
    "head by head, busiest first (before)": busiest_first_per_head,
    "launch order (shipped)": None,
}


def variants_for(impl: str) -> dict:
    """label -> install(), which puts the variant in place and returns the restore()."""
    if impl == "triton":
        shipped = plan.launch_order

        def triton_variant(order):
            def install():  # plan.launch_order is read when the plans are built (forward and backward)
                plan.launch_order = order or shipped
                return lambda: setattr(plan, "launch_order", shipped)
            return install

        return {label: triton_variant(order) for label, order in TRITON_VARIANTS.items()}
    from fm_parallel.kernels import cute_fa4_patches, cute_flashmask

    shipped_order, shipped_options = cute_flashmask.cost_order, cute_flashmask.OPTIONS

    def cute_variant(schedule, order):
        def install():  # for the whole variant: the backward reads them when autograd runs it
            cute_flashmask.OPTIONS = cute_fa4_patches.Options(True, schedule)
            cute_flashmask.cost_order = order or shipped_order

            def restore():
                cute_flashmask.OPTIONS, cute_flashmask.cost_order = shipped_options, shipped_order
            return restore
        return install

    return {label: cute_variant(*spec) for label, spec in VARIANTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--masks", nargs="+", default=["window_sinks"], choices=MASKS)
    parser.add_argument("--impl", choices=["cute", "triton"], default="cute")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    write(args, compare(args, variants_for(args.impl)))


def compare(args, variants) -> list[dict]:
    """Every variant on every mask, same inputs; ``variants``: label -> install() returning restore()."""
    rows, d = [], 128
    for name in args.masks:
        fm = build(name, args.n)[0].to("cuda")
        pairs = int(fm.visible_pairs().sum())
        q, k, v = (torch.randn(1, args.heads, args.n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        for label, install in variants.items():
            mask = without_structure(fm)  # its own caches: this variant's order and plans only
            restore = install()
            try:
                def call(mask=mask, q=q, k=k, v=v):
                    return flashmask_attention(q, k, v, mask=mask, impl=args.impl)
                row = dict(mask=name, n=args.n, variant=label,
                           **measure(label, call, q, k, v, do, pairs, args.heads, d, False))
            finally:
                restore()
            rows.append(row)
            report(row)
    return rows


def report(row: dict) -> None:
    print(f"{row['mask']:14s} {row['n']:7d} {row['variant']:36s} fwd {row.get('fwd_ms', float('nan')):.3f} ms "
          f"({row.get('fwd_ms_min', float('nan')):.3f}-{row.get('fwd_ms_max', float('nan')):.3f})  fwd+bwd "
          f"{row.get('fwdbwd_ms', float('nan')):.3f} ms ({row.get('fwdbwd_ms_min', float('nan')):.3f}-"
          f"{row.get('fwdbwd_ms_max', float('nan')):.3f}) {row.get('error', '')}", flush=True)


def write(args, rows: list[dict]) -> None:
    meta = {"command": "python launch/bench/schedule_ab.py " + " ".join(sys.argv[1:]),
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"schedule_ab_{args.impl}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
