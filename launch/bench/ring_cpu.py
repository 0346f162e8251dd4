"""Ring context parallelism: the planner's report, and a real gloo run on CPU ranks.

    python -m launch.bench.ring_cpu                 # planner report (P = 4, 8, 16, 64) + 4 gloo ranks
    python -m launch.bench.ring_cpu --skip-run      # planner report only (pure computation)

Planner report (no ranks needed): for each mask family at N = 131072 (packed documents of mean
length 2048) and each balance mode, the exact pair table gives the chunk transfers a plain ring
makes (each rank sends its K/V to every other rank, P (P - 1) transfers) against the ones ours posts
(only to ranks whose queries see the chunk), the bytes moved against the plain ring's when whole
chunks travel and when only each receiver's key window does (what the ring sends), and the load
imbalance (max / mean visible pairs per rank).

Gloo run: 4 CPU ranks, N = 4096, H = 4 (H_kv = 2), D = 64, float32, PyTorch local path; time of one
forward+backward per rank (min / median / max of --reps) against one process doing the whole sequence, and the bytes
each rank sent as counted by RingStats.

Writes docs/benchmarks/ring_cpu.json and ring_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.ring_cpu")

from launch.bench.harness import spread

from fm_parallel import masks
from fm_parallel.distributed import BALANCE_MODES, pair_table_and_key_windows, row_work, shard


def families(n: int) -> dict:
    lens = masks.sample_lengths(n, mean=2048, seed=1)
    return {
        "causal": masks.causal(n),
        "docs": masks.document(lens),
        "dpo": masks.dpo(n // 2, n // 4, n - n // 2 - n // 4),
        "sliding_sinks": masks.sliding_window(n, 1024, sinks=4),
        "prefix_lm": masks.prefix_lm(n, n // 4),
        "multi_interval": masks.union(masks.document(lens), masks.intersect(
            masks.causal(n), masks.FlashMask(torch.full((n,), n - 256), torch.full((n,), n - 1)))),
    }


def planner_rows(n: int, worlds: list[int]) -> list[dict]:
    from tqdm import tqdm

    rows = []
    fams = families(n)
    for name, mask in tqdm(list(fams.items()), desc="planner", unit="mask"):
        work = row_work(mask)
        for world in worlds:
            for balance in BALANCE_MODES:
                plan = shard(mask, world, balance)
                table, windows = pair_table_and_key_windows(mask, plan.positions)
                needed = (table > 0)
                posted = int(needed.sum() - needed.diagonal().sum())
                keys = (windows[..., 1] - windows[..., 0]).fill_diagonal_(0)  # keys each rank receives per source
                plain_keys = world * (world - 1) * plan.local_tokens
                per_rank = torch.stack([work[p].sum() for p in plan.positions]).double()
                rows.append(dict(
                    mask=name, n=n, world=world, balance=balance,
                    plain_transfers=world * (world - 1), transfers=posted,
                    bytes_ratio=posted / max(world * (world - 1), 1),
                    window_bytes_ratio=int(keys.sum()) / max(plain_keys, 1),
                    imbalance=(per_rank.max() / per_rank.mean()).item(),
                ))
    return rows


def gloo_case(rank, world, n, reps, out_dir):
    import torch.distributed as dist

    from fm_parallel import flashmask_attention
    from fm_parallel.distributed import RingStats, ring_attention

    torch.set_num_threads(1)
    results = []
    for name, mask in families(n).items():
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 4, n, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)
        for balance in BALANCE_MODES:
            plan = shard(mask, world, balance)
            ql, kl, vl = (plan.shard(t, rank, 2).requires_grad_() for t in (q, k, v))
            times, stats = [], None
            for _ in range(reps):
                stats = RingStats()
                dist.barrier()
                t0 = time.perf_counter()
                ring_attention(ql, kl, vl, mask, plan, stats=stats).sum().backward()
                dist.barrier()
                times.append(time.perf_counter() - t0)
            ms = spread(1e3 * t for t in times)
            results.append(dict(mask=name, balance=balance, rank=rank, ms=ms["median"], ms_min=ms["min"], ms_max=ms["max"],
                                bytes_sent=stats.bytes_sent, posted=stats.transfers_posted,
                                skipped=stats.transfers_skipped, pairs=stats.visible_pairs))
        if rank == 0:  # the single-process baseline, one thread like each rank
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                flashmask_attention(qs, ks, vs, mask=mask).sum().backward()
                times.append(time.perf_counter() - t0)
            ms = spread(1e3 * t for t in times)
            results.append(dict(mask=name, balance="single process", rank=0, ms=ms["median"], ms_min=ms["min"], ms_max=ms["max"]))
    with open(os.path.join(out_dir, f"gloo_rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _entry(rank, world, init_file, n, reps, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gloo_case(rank, world, n, reps, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_rows(world: int, n: int, reps: int) -> list[dict]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "init"), n, reps, tmp), nprocs=world, start_method="spawn")
        rows = []
        for r in range(world):
            rows += json.load(open(os.path.join(tmp, f"gloo_rank{r}.json")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=131072, help="sequence length of the planner report")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 64])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--run-n", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-run", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    planner = planner_rows(args.n, args.worlds)
    lines = ["## Planner (exact pair table, no ranks)", "",
             f"N = {args.n}. Transfers: chunk sends a plain ring makes, P (P - 1), and the ones ours posts.", "",
             "Bytes: what moves against a plain ring's whole chunks, when whole chunks travel to the ranks that need them and when only each receiver's key window does (the ring since 2026-12-03).", "",
             "| mask | P | balance | transfers (ours / plain) | bytes vs plain ring: chunks | key windows | imbalance (max / mean) |",
             "|---|---|---|---|---|---|---|"]
    for r in planner:
        lines.append(f"| {r['mask']} | {r['world']} | {r['balance']} | {r['transfers']} / {r['plain_transfers']} | "
                     f"{r['bytes_ratio']:.2f} | {r['window_bytes_ratio']:.3f} | {r['imbalance']:.3f} |")
    gloo = [] if args.skip_run else gloo_rows(args.ranks, args.run_n, args.reps)
    if gloo:
        lines += ["", f"## Gloo run: {args.ranks} CPU ranks, N = {args.run_n}, H = 4 (H_kv = 2), D = 64, float32", "",
                  "One forward+backward, min / median / max of the repeats; slowest rank. Bytes: sent by all ranks together (forward and backward).", "",
                  "| mask | balance | ms | single process ms | bytes sent (MiB) | transfers posted / skipped |", "|---|---|---|---|---|---|"]
        spread = lambda r: f"{r['ms_min']:.0f} / {r['ms']:.0f} / {r['ms_max']:.0f}"  # noqa: E731
        single = {r["mask"]: r for r in gloo if r["balance"] == "single process"}
        for name in dict.fromkeys(r["mask"] for r in gloo):
            for balance in BALANCE_MODES:
                rs = [r for r in gloo if r["mask"] == name and r["balance"] == balance]
                lines.append(f"| {name} | {balance} | {spread(max(rs, key=lambda r: r['ms']))} | {spread(single[name])} | "
                             f"{sum(r['bytes_sent'] for r in rs) / 2**20:.1f} | {sum(r['posted'] for r in rs)} / {sum(r['skipped'] for r in rs)} |")
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m launch.bench.ring_cpu " + " ".join(sys.argv[1:])
    (args.out / "ring_cpu.json").write_text(json.dumps({"command": cmd, "planner": planner, "gloo": gloo}, indent=1))
    md = "\n".join(lines)
    (args.out / "ring_cpu.md").write_text(f"# Ring context parallelism\n\n`{cmd}`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores.\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
