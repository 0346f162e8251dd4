"""Context-parallel correctness on several GPUs (NCCL) or CPU ranks (gloo): one PASS/FAIL line per case.

    torchrun --nproc_per_node 8 launch/bench/verify_multi_gpu.py                      # H200s: N 32k and 128k
    torchrun --nproc_per_node 4 launch/bench/verify_multi_gpu.py --device cpu --ns 256 \\
        --heads 8 --kv-heads 2 --head-dim 16 --dtype float64                          # mechanics on a CPU

For every mode (ring; Ulysses; hybrid ring x Ulysses where the world has at least 4 ranks), mask
family (packed documents, DPO, sliding window + sinks, prefix-LM) and balance mode (contiguous,
zigzag, mask), each rank runs forward + backward on its shard and compares its output and its
q / k / v gradients with its slice of the single-device result on the same data (every rank
computes that reference itself with the same kernel). Ring cases also check that the transfers this
rank skipped equal the planner's count (from the exact pair table, no N x N mask). Ulysses with
fewer KV heads than ranks exercises the KV-head replication. Rank 0 prints the lines and writes
docs/benchmarks/verify_multi_gpu_<device>.json; the exit code is 1 if any case failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch" / "bench"))

from ranks import DTYPES, init_ranks  # noqa: E402

# Max |distributed - single device| relative to max |single device|: the merge order of partial
# softmax results differs, so halves agree to their rounding, float64 to ~1e-12.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-9}


def build_masks(n: int) -> dict:
    from fm_parallel import masks

    window = min(1024, max(n // 16, 4))
    return {
        "docs": masks.document(masks.sample_lengths(n, mean=min(2048, max(n // 8, 8)))),
        "dpo": masks.dpo(n // 2, n // 4, n - n // 2 - n // 4),
        "sliding_sinks": masks.sliding_window(n, window, sinks=4),
        "prefix_lm": masks.prefix_lm(n, n // 4),
    }


def expected_skips(table: torch.Tensor, rank: int) -> int:
    """Transfers a plain ring makes that this rank skips: K/V forward and backward to a rank whose
    queries never see its keys, dK/dV back from a rank whose keys its queries never see."""
    world = table.shape[0]
    need = table > 0
    skips = 0
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        skips += 2 * int(not need[dst, rank]) + int(not need[rank, src])
    return skips


def modes(world: int, heads: int) -> list[tuple[str, int]]:
    """(mode, Ulysses degree) pairs this world can run."""
    out = [("ring", 1)]
    if heads % world == 0:
        out.append(("ulysses", world))
    if world >= 4 and world % 2 == 0 and heads % 2 == 0:
        out.append(("hybrid", 2))
    return out


def run_case(mode, uly, mask, plan, q, k, v, dout, ref, mesh, rank, impl):
    from fm_parallel.distributed import RingStats, hybrid_attention, ring_attention, ulysses_attention

    ql, kl, vl = (plan.shard(t.detach(), rank, 2).requires_grad_() for t in (q, k, v))
    stats = RingStats()
    if mode == "ring":
        out = ring_attention(ql, kl, vl, mask, plan, stats=stats, impl=impl)
    elif mode == "ulysses":
        out = ulysses_attention(ql, kl, vl, mask, plan, impl=impl or "auto")
    else:
        out = hybrid_attention(ql, kl, vl, mask, plan, mesh, stats=stats, impl=impl)
    out.backward(plan.shard(dout, rank, 2))
    errors = {}
    for name, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]), ("dv", vl.grad, ref[3])):
        want = plan.shard(want, rank, 2)
        scale = want.float().abs().max().item() or 1.0
        errors[name] = (got.float() - want.float()).abs().max().item() / scale
    return errors, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ns", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--masks", nargs="+", default=["docs", "dpo", "sliding_sinks", "prefix_lm"])
    parser.add_argument("--balances", nargs="+", default=["contiguous", "zigzag", "mask"])
    parser.add_argument("--impl", default=None, help="local kernel (default: Triton on CUDA, PyTorch on CPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()

    from fm_parallel import flashmask_attention
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.sharding import pair_counts

    rank, world, device, mesh = init_ranks(args.device)
    cuda = device.type == "cuda"
    dtype, impl = DTYPES[args.dtype], args.impl
    results, failed = [], 0
    for n in args.ns:
        families = build_masks(n)
        for mask_name in args.masks:
            mask = families[mask_name].to(device)
            torch.manual_seed(n + len(mask_name))
            q = torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(1, args.kv_heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(1, args.kv_heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            dout = torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype)
            single = flashmask_attention(q, k, v, mask=mask, impl=impl or ("triton" if cuda else "torch"))
            single.backward(dout)
            ref = (single.detach(), q.grad, k.grad, v.grad)
            for balance in args.balances:
                plan = shard(mask.to("cpu"), world, balance)
                table = pair_counts(mask.to("cpu"), plan.positions)
                for mode, uly in modes(world, args.heads):
                    t0 = time.perf_counter()
                    try:
                        errors, stats = run_case(mode, uly, mask, plan, q, k, v, dout, ref, mesh, rank, impl)
                        row = {"errors": errors, "skipped": stats.transfers_skipped, "posted": stats.transfers_posted}
                        if mode == "ring":
                            row["expected_skipped"] = expected_skips(table, rank)
                    except Exception as e:  # noqa: BLE001 - reported as a failed case, the others still run
                        row = {"exception": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                    row["seconds"] = time.perf_counter() - t0
                    gathered = [None] * world
                    dist.all_gather_object(gathered, row)
                    case = {"n": n, "mask": mask_name, "balance": balance, "mode": mode, "ulysses": uly,
                            "heads": args.heads, "kv_heads": args.kv_heads, "dtype": args.dtype, "ranks": gathered}
                    tol = TOLERANCE[dtype]
                    ok = all("exception" not in r and max(r["errors"].values()) <= tol
                             and r.get("expected_skipped", r["skipped"]) == r["skipped"] for r in gathered)
                    case["pass"] = ok
                    failed += not ok
                    results.append(case)
                    if rank == 0:
                        worst = max((max(r["errors"].values()) for r in gathered if "errors" in r), default=float("nan"))
                        skip = sum(r.get("skipped", 0) for r in gathered)
                        note = next((r["exception"] for r in gathered if "exception" in r), "")
                        print(f"{'PASS' if ok else 'FAIL'} n={n} mask={mask_name} balance={balance} mode={mode} world={world} "
                              f"worst_rel_err={worst:.2e} (tol {tol:.0e}) skipped={skip} {note}", flush=True)
            del q, k, v, dout, single, ref
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        cmd = f"torchrun --nproc_per_node {world} launch/bench/verify_multi_gpu.py " + " ".join(sys.argv[1:])
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        (args.out / f"verify_multi_gpu_{device.type}_x{world}.json").write_text(
            json.dumps({"command": cmd, "device": name, "world": world, "cases": results}, indent=1))
        print(f"{len(results) - failed} of {len(results)} cases passed on {world} x {name}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
