"""Context-parallel correctness on several GPUs (NCCL), on P ranks sharing one GPU, or on CPU ranks
(gloo): one PASS/FAIL line per case.

    torchrun --nproc_per_node 8 tests/gpu/multi_gpu.py                      # H200s: N 32k and 128k
    torchrun --nproc_per_node 8 tests/gpu/multi_gpu.py --cuda-graphs        # + the ring as CUDA graphs
    torchrun --nproc_per_node 4 tests/gpu/multi_gpu.py --shared-gpu            # 4 ranks on ONE GPU
    torchrun --nproc_per_node 4 tests/gpu/multi_gpu.py --device cpu --ns 256 \\
        --heads 8 --kv-heads 2 --head-dim 16 --dtype float64 --impls torch            # mechanics on a CPU

``--shared-gpu``: every rank is a process on the same GPU (``cuda:0``) and the process group is gloo;
the ring's and Ulysses' GPU tensors travel through host copies (:class:`RingComm` stages them, the
only difference from NCCL: transfers are slow and never overlap compute, which this script does not
time). Everything else is the code that runs on several GPUs: the prepared mask, the pair table and
transfer skipping, the kernels per chunk (column masks, explicit zigzag rows, FA4 block lists per
chunk), the lse merge in the input dtype's accumulators, the backward's dK/dV return trip.

For every local kernel (``--impls``), mode (ring; Ulysses; hybrid ring x Ulysses where the world
has at least 4 ranks), mask family and balance mode (contiguous, zigzag, mask), each rank prepares
the mask once (:func:`fm_parallel.distributed.prepare`), runs forward + backward on its shard and
compares its output and q / k / v gradients with its slice of the single-device result of the same
kernel on the same data (every rank computes that reference itself). Ring and hybrid cases also
check that the transfers this rank skipped equal the planner's count (from the exact pair table, no
N x N mask). Ulysses with fewer KV heads than ranks exercises the KV-head replication. Rank 0 prints
the lines and writes docs/benchmarks/verify_multi_gpu_<device>_x<P>[_virtual_<impls>].json; the exit code is
1 if any case failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.harness import DTYPES, init_ranks  # noqa: E402
from fm_parallel.distributed.sharding import BALANCE_MODES  # noqa: E402

# Max |distributed - single device| relative to max |single device|: the merge order of partial
# softmax results differs, so halves agree to their rounding, float64 to ~1e-12.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-9}


def build_masks(n: int) -> dict:
    from fm_parallel import masks

    window = min(1024, max(n // 16, 4))
    glob = min(64, max(n // 32, 1))
    lens = masks.sample_lengths(n, mean=min(2048, max(n // 8, 8)))
    response = (n - n // 2) // 4
    return {
        "causal": masks.causal(n),
        "docs": masks.document(lens),
        "docs_bidirectional": masks.document(lens, causal=False),
        "dpo": masks.dpo(n // 2, n // 4, n - n // 2 - n // 4),
        "rm4": masks.preference(n // 2, [response] * 3 + [n - n // 2 - 3 * response]),
        "sliding_sinks": masks.sliding_window(n, window, sinks=4),
        # Global tokens (the first rows see every key) and a sliding window: two intervals per column.
        "global_window": masks.union(masks.sliding_window(n, window, sinks=glob),
                                     masks.FlashMask(torch.zeros(n, dtype=torch.int32), torch.full((n,), glob - 1))),
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


def expected_bytes(windows: torch.Tensor, rank: int, per_key: int) -> int:
    """Bytes this rank's ring sends per call: K and V (forward, and again in the backward) to each rank
    that sees some of its keys, dK and dV back to each rank whose keys it saw, each the receiver's key
    window (``pair_table_and_key_windows``; ``per_key``: bytes of one key's row of K over its heads)."""
    world = windows.shape[0]
    width = (windows[..., 1] - windows[..., 0]).tolist()
    sent = 0
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        sent += 2 * 2 * per_key * width[dst][rank] + 2 * per_key * width[rank][src]
    return sent


GRAPH_LAYERS = 3  # eager, captured + replayed, replayed


def modes(world: int, heads: int, cuda_graphs: bool = False) -> list[tuple[str, int]]:
    """(mode, Ulysses degree) pairs this world can run; ``cuda_graphs`` adds the ring with CUDA graphs."""
    out = [("ring", 1)] + ([("ring_graphs", 1)] if cuda_graphs else [])
    if heads % world == 0:
        out.append(("ulysses", world))
    if world >= 4 and world % 2 == 0 and heads % 2 == 0:
        out.append(("hybrid", 2))
    return out


def run_case(mode, uly, mask, plan, q, k, v, dout, ref, mesh, rank, impl, mask_on="host"):
    from fm_parallel.distributed import RingStats, hybrid_attention, prepare, ring_attention, ulysses_attention

    if mode == "ring_graphs":
        return _graphed_ring_case(mask, plan, q, k, v, dout, ref, rank, impl, mask_on)
    ql, kl, vl = (plan.shard(t.detach(), rank, 2).requires_grad_() for t in (q, k, v))
    stats = RingStats()
    # Prepared once, as the trainer does per step (one agreement, the pair table, column masks).
    # From the loader's host mask (what the trainer and ContextParallel do: the diagonal chunk learns its
    # document structure there) or from a mask already on the device (what a bare-mask call gets).
    source = mask.to("cpu") if mask_on == "host" else mask
    prepared = (prepare(source, plan, mesh=mesh, device=q.device) if mode == "hybrid"
                else prepare(source, plan, device=q.device))
    if mode == "ring":
        out = ring_attention(ql, kl, vl, prepared, plan, stats=stats, impl=impl)
    elif mode == "ulysses":
        out = ulysses_attention(ql, kl, vl, prepared, plan, impl=impl)
    else:
        out = hybrid_attention(ql, kl, vl, prepared, plan, mesh, stats=stats, impl=impl)
    out.backward(plan.shard(dout, rank, 2))
    errors = {name: relative_error(got, plan.shard(want, rank, 2))
              for name, got, want in (("out", out, ref[0]), ("dq", ql.grad, ref[1]), ("dk", kl.grad, ref[2]),
                                      ("dv", vl.grad, ref[3]))}
    return errors, stats


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest reference value, in float64 (a float32 difference
    would round float64 results' differences away: it read 0.0)."""
    want = want.double()
    return (got.double() - want).abs().max().item() / (want.abs().max().item() or 1.0)


def _graphed_ring_case(mask, plan, q, k, v, dout, ref, rank, impl, mask_on):
    """The ring with ``prepare(..., cuda_graphs=True)`` over ``GRAPH_LAYERS`` layers (eager, captured and
    replayed, replayed) on new values each: layer l runs on V scaled by 2^l, so its output, dQ and dK
    are the reference's times 2^l exactly (a power-of-two scale is exact in floating point; the
    softmax does not see V) and dV is the reference's. A replay of stale values would fail. Returns
    the worst errors over the layers and the last (replayed) layer's transfer counts."""
    from fm_parallel.distributed import RingStats, prepare, ring_attention

    source = mask.to("cpu") if mask_on == "host" else mask
    prepared = prepare(source, plan, device=q.device, cuda_graphs=True)
    errors: dict[str, float] = {}
    for layer in range(GRAPH_LAYERS):
        c = 2.0 ** layer
        ql, kl = (plan.shard(t.detach(), rank, 2).requires_grad_() for t in (q, k))
        vl = (plan.shard(v.detach(), rank, 2) * c).requires_grad_()
        stats = RingStats()
        out = ring_attention(ql, kl, vl, prepared, plan, stats=stats, impl=impl)
        out.backward(plan.shard(dout, rank, 2))
        for name, got, want, scale in (("out", out, ref[0], c), ("dq", ql.grad, ref[1], c), ("dk", kl.grad, ref[2], c),
                                       ("dv", vl.grad, ref[3], 1.0)):
            error = relative_error(got, plan.shard(want, rank, 2).double() * scale)
            errors[name] = max(errors.get(name, 0.0), error)
    counters = prepared.graphs.counters
    if counters["failed"] or counters["replays"] != 2 * (GRAPH_LAYERS - 1):
        raise RuntimeError(f"CUDA graphs: expected every layer after the first replayed, got {counters}")
    return errors, stats


def hybrid_expected_skips(mask, plan, mesh) -> int:
    """The hybrid ring's skips for this rank: the ring runs over Ulysses groups with the group plan."""
    from fm_parallel.distributed.hybrid import group_plan
    from fm_parallel.distributed.sharding import pair_counts

    ring_plan, _ = group_plan(plan, mesh["ring"].size(), mesh["ulysses"].size())
    return expected_skips(pair_counts(mask, ring_plan.positions), mesh.get_local_rank("ring"))


@record  # the first rank's traceback goes into torchrun's summary, which the tests show when a run fails
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on cuda:0, gloo process group, host-staged transfers (one GPU)")
    parser.add_argument("--ns", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    mask_names = ["causal", "docs", "docs_bidirectional", "dpo", "rm4", "sliding_sinks", "global_window", "prefix_lm"]
    parser.add_argument("--masks", nargs="+", default=mask_names, choices=mask_names)
    parser.add_argument("--balances", nargs="+", default=list(BALANCE_MODES), choices=BALANCE_MODES)
    parser.add_argument("--mask-on", default="host", choices=["host", "device"],
                        help="where the mask is prepared from: the loader's host copy (the trainer's path) or the device")
    parser.add_argument("--impls", nargs="+", default=["auto"],
                        help="local kernels, each resolved like flashmask_attention's (auto: CuTe on Hopper with "
                             "the [cute] extra, else Triton; PyTorch on CPU)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also the ring with prepare(..., cuda_graphs=True), 3 layers on new values each (NCCL only)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    if args.cuda_graphs and (args.shared_gpu or args.device != "cuda"):
        parser.error("--cuda-graphs: expected NCCL ranks (--device cuda, one GPU per rank); gloo's host-staged "
                     "transfers cannot be captured")

    from fm_parallel import backends, flashmask_attention
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.sharding import pair_table_and_key_windows

    rank, world, device, mesh = init_ranks(args.device, shared_gpu=args.shared_gpu)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    results, failed = [], 0
    families: dict = {}
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    where = f"{world} ranks sharing one {name} (gloo, host-staged transfers)" if args.shared_gpu else f"{world} x {name}"

    def write(complete: bool) -> None:
        """The JSON of the cases so far (rank 0); ``complete`` false until the last case is done."""
        args.out.mkdir(parents=True, exist_ok=True)
        cmd = f"torchrun --nproc_per_node {world} tests/gpu/multi_gpu.py " + " ".join(sys.argv[1:])
        suffix = ("_virtual_" + "_".join(args.impls)) if args.shared_gpu else ""
        (args.out / f"verify_multi_gpu_{device.type}_x{world}{suffix}.json").write_text(
            json.dumps({"command": cmd, "device": name, "world": world, "shared_gpu": args.shared_gpu, "where": where,
                        "complete": complete, "cases": results}, indent=1))

    for impl, n, mask_name in itertools.product(args.impls, args.ns, args.masks):
        resolved = backends.resolve(impl, device, dtype, args.head_dim)
        if n not in families:
            families[n] = build_masks(n)
        mask = families[n][mask_name].to(device)
        torch.manual_seed(n + len(mask_name))
        q = torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, args.kv_heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, args.kv_heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
        dout = torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype)
        single = flashmask_attention(q, k, v, mask=mask, impl=resolved)
        single.backward(dout)
        ref = (single.detach(), q.grad, k.grad, v.grad)
        for balance in args.balances:
            plan = shard(mask.to("cpu"), world, balance)
            table, windows = pair_table_and_key_windows(mask.to("cpu"), plan.positions)
            for mode, uly in modes(world, args.heads, args.cuda_graphs):
                t0 = time.perf_counter()
                try:
                    errors, stats = run_case(mode, uly, mask, plan, q, k, v, dout, ref, mesh, rank, impl, args.mask_on)
                    row = {"errors": errors, "skipped": stats.transfers_skipped, "posted": stats.transfers_posted,
                           "bytes_sent": stats.bytes_sent}
                    if mode in ("ring", "ring_graphs"):
                        row["expected_skipped"] = expected_skips(table, rank)
                        row["expected_bytes"] = expected_bytes(windows, rank, args.kv_heads * args.head_dim * q.element_size())
                    elif mode == "hybrid":
                        row["expected_skipped"] = hybrid_expected_skips(mask.to("cpu"), plan, mesh)
                except Exception as e:  # noqa: BLE001 - reported as a failed case, the others still run
                    row = {"exception": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                row["seconds"] = time.perf_counter() - t0
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                case = {"impl": impl, "kernel": resolved, "n": n, "mask": mask_name, "balance": balance, "mask_on": args.mask_on,
                        "mode": mode, "ulysses": uly,
                        "heads": args.heads, "kv_heads": args.kv_heads, "dtype": args.dtype, "ranks": gathered}
                tol = TOLERANCE[dtype]
                ok = all("exception" not in r and max(r["errors"].values()) <= tol
                         and r.get("expected_skipped", r["skipped"]) == r["skipped"]
                         and r.get("expected_bytes", r["bytes_sent"]) == r["bytes_sent"] for r in gathered)
                case["pass"] = ok
                failed += not ok
                results.append(case)
                if rank == 0:
                    write(complete=False)  # after every case: a run stopped by a time limit keeps what it did
                    worst = max((max(r["errors"].values()) for r in gathered if "errors" in r), default=float("nan"))
                    skip = sum(r.get("skipped", 0) for r in gathered)
                    note = next((r["exception"] for r in gathered if "exception" in r), "")
                    print(f"{'PASS' if ok else 'FAIL'} kernel={resolved} n={n} mask={mask_name} balance={balance} mode={mode} world={world} "
                          f"worst_rel_err={worst:.2e} (tol {tol:.0e}) skipped={skip} {note}", flush=True)
        del q, k, v, dout, single, ref
    if rank == 0:
        write(complete=True)
        print(f"{len(results) - failed} of {len(results)} cases passed on {where}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
