"""Context-parallel scaling: ring, Ulysses and hybrid against the single-GPU kernel, per GPU.

    torchrun --nproc_per_node 8 -m launch.bench.cp_scaling                         # H200s: 128k, 512k, 1M
    torchrun --nproc_per_node 4 -m launch.bench.cp_scaling --device cpu --ns 512 \\
        --heads 8 --kv-heads 2 --head-dim 16 --dtype float32 --repeat 2            # mechanics on a CPU

For each mask (packed documents, DPO), length, balance mode and CP mode, rank 0 reports:
  * effective TFLOP/s per GPU, forward and forward + backward: ``4 H D pairs / P / time`` (x 3.5 for
    forward + backward), pairs = visible (query, key) pairs of the whole mask;
  * the single-GPU kernel's TFLOP/s on the whole problem (where it fits, ``--single-max``) and the
    per-GPU efficiency = CP TFLOP/s per GPU / single-GPU TFLOP/s;
  * bytes each mode moves per call (ring: measured ``RingStats.bytes_sent``, summed over ranks, and a
    plain ring's ``3 (P - 1)`` chunks per rank for comparison; Ulysses: its all-to-alls, counted);
  * transfers skipped, load imbalance (max / mean of the visible pairs per rank, from the planner);
  * exposed time: ``time - single_time / P * imbalance``, what neither the kernel nor the imbalance
    explains (communication not hidden behind compute, and overheads); an estimate, not a trace.
The mask is prepared once per (mask, balance, mode), as the trainer does per step, so a call is what
one layer costs. Times: min / median / max of ``--repeat`` calls after a warm-up, each ended by a
barrier; TFLOP/s from the medians.
Writes docs/benchmarks/cp_scaling_<device>_x<P>.json, a markdown table and a plot.
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
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.cp_scaling")

from launch.bench.harness import DTYPES, check_device, error_line, init_ranks, spread



def build_mask(name: str, n: int):
    from fm_parallel import masks

    if name == "docs":
        return masks.document(masks.sample_lengths(n, mean=min(2048, max(n // 8, 8))))
    if name == "dpo":
        return masks.dpo(n // 2, n // 4, n - n // 2 - n // 4)
    raise ValueError(f"mask: expected docs or dpo, got {name!r}")


def timed(fn, repeat: int, device, barrier: bool = True) -> dict:
    """Seconds of ``repeat`` calls after a warm-up, ``{"min", "median", "max"}``; each call ends
    synchronised (and, with ``barrier``, after every rank finished)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        if barrier and dist.is_initialized():
            dist.barrier()

    fn()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return spread(times)


def ulysses_bytes(n: int, hq: int, hkv: int, d: int, itemsize: int, world: int, with_bwd: bool) -> int:
    """Bytes all ranks send in Ulysses' all-to-alls: q, k, v in and the output back (forward);
    dO in, dQ, dK, dV back (backward). Each all-to-all keeps 1/P of a tensor local."""
    from fm_parallel.distributed.ulysses import ulysses_heads

    kv = hkv * ulysses_heads(hq, hkv, world)
    per_call = (2 * hq + 2 * kv) * n * d * itemsize  # q, out; k, v
    if with_bwd:
        per_call += (2 * hq + 2 * kv) * n * d * itemsize  # dout, dq; dk, dv
    return per_call * (world - 1) // world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ns", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--masks", nargs="+", default=["docs", "dpo"])
    parser.add_argument("--balances", nargs="+", default=["contiguous", "zigzag", "mask"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--single-max", type=int, default=1048576, help="longest N for the single-GPU baseline")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--impl", default="auto", help="local kernel, resolved like flashmask_attention's")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on cuda:0, gloo, host-staged transfers (mechanics only: times are not NCCL's)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    check_device(parser, args.device, "on a CPU pass --device cpu (gloo)")

    from fm_parallel import backends, flashmask_attention
    from fm_parallel.distributed import RingStats, hybrid_attention, prepare, ring_attention, shard, ulysses_attention
    from fm_parallel.distributed.sharding import pair_counts

    rank, world, device, mesh = init_ranks(args.device, shared_gpu=args.shared_gpu)
    cuda = device.type == "cuda"
    dtype, h, hkv, d = DTYPES[args.dtype], args.heads, args.kv_heads, args.head_dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    impl = backends.resolve(args.impl, device, dtype, d, chunked=True)
    modes = ["ring"] + (["ulysses"] if h % world == 0 else []) + (["hybrid"] if mesh is not None else [])
    rows = []
    for n in args.ns:
        for mask_name in args.masks:
            mask_cpu = build_mask(mask_name, n)
            mask = mask_cpu.to(device)
            pairs = int(mask_cpu.visible_pairs().sum())
            flops = 4 * h * d * pairs
            single = {}
            if n <= args.single_max and rank == 0:
                # The whole problem on rank 0's GPU, timed alone (the other ranks wait at the broadcast).
                q, k, v = (torch.randn(1, hh, n, d, device=device, dtype=dtype, requires_grad=True) for hh in (h, hkv, hkv))
                dout = torch.randn(1, h, n, d, device=device, dtype=dtype)

                def run_single(with_bwd):
                    def fn():
                        for t in (q, k, v):
                            t.grad = None
                        out = flashmask_attention(q, k, v, mask=mask, impl=impl)
                        if with_bwd:
                            out.backward(dout)

                    return timed(fn, args.repeat, device, barrier=False)

                single = {"fwd_s": run_single(False), "fwdbwd_s": run_single(True)}
                del q, k, v, dout
            box = [single]
            dist.broadcast_object_list(box, src=0)
            single = box[0]
            for balance in args.balances:
                plan = shard(mask_cpu, world, balance)
                table = pair_counts(mask_cpu, plan.positions)
                per_rank = table.sum(1).double()
                imbalance = float(per_rank.max() / per_rank.mean()) if per_rank.sum() > 0 else 1.0
                need = table > 0
                torch.manual_seed(rank)
                local = plan.positions[rank].numel()
                ql, kl, vl = (torch.randn(1, hh, local, d, device=device, dtype=dtype, requires_grad=True) for hh in (h, hkv, hkv))
                dl = torch.randn(1, h, local, d, device=device, dtype=dtype)
                for mode in modes:
                    stats = RingStats()
                    # One step's prepared mask (from the host mask, as the trainer does): every call is a layer.
                    prepared = prepare(mask_cpu, plan, mesh=mesh, device=device) if mode == "hybrid" else \
                        prepare(mask_cpu, plan, device=device)

                    def call(with_bwd, stats=stats, mode=mode, prepared=prepared):
                        for t in (ql, kl, vl):
                            t.grad = None
                        if mode == "ring":
                            out = ring_attention(ql, kl, vl, prepared, stats=stats, impl=impl)
                        elif mode == "ulysses":
                            out = ulysses_attention(ql, kl, vl, prepared, impl=impl)
                        else:
                            out = hybrid_attention(ql, kl, vl, prepared, None, mesh, stats=stats, impl=impl)
                        if with_bwd:
                            out.backward(dl)

                    row = {"n": n, "mask": mask_name, "balance": balance, "mode": mode, "world": world, "pairs": pairs,
                           "imbalance": imbalance, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
                    try:
                        row["fwd_s"] = timed(lambda: call(False), args.repeat, device)
                        stats.bytes_sent = stats.transfers_skipped = stats.transfers_posted = 0
                        row["fwdbwd_s"] = timed(lambda: call(True), args.repeat, device)
                        calls = args.repeat + 1  # the warm-up and the timed calls since the reset
                        sent = torch.tensor([stats.bytes_sent / calls, stats.transfers_skipped / calls], dtype=torch.float64)
                        dist.all_reduce(sent)
                        row["fwdbwd_tflops_per_gpu"] = 3.5 * flops / world / row["fwdbwd_s"]["median"] / 1e12
                        row["fwd_tflops_per_gpu"] = flops / world / row["fwd_s"]["median"] / 1e12
                        if mode == "ulysses":
                            row["bytes_moved"] = ulysses_bytes(n, h, hkv, d, itemsize, world, True)
                        else:
                            row["bytes_moved"] = float(sent[0])
                            row["transfers_skipped"] = float(sent[1])
                        chunk = (n // world) * hkv * d * itemsize
                        row["plain_ring_bytes"] = world * 3 * (world - 1) * 2 * chunk  # K/V fwd, K/V bwd, dK/dV
                        row["ring_pairs_needed"] = int(need.sum())
                        if single:
                            row["single_fwd_tflops"] = flops / single["fwd_s"]["median"] / 1e12
                            row["single_fwdbwd_tflops"] = 3.5 * flops / single["fwdbwd_s"]["median"] / 1e12
                            row["efficiency_fwdbwd"] = row["fwdbwd_tflops_per_gpu"] / row["single_fwdbwd_tflops"]
                            row["exposed_fwdbwd_s"] = row["fwdbwd_s"]["median"] - single["fwdbwd_s"]["median"] / world * imbalance
                    except Exception as e:  # noqa: BLE001 - a mode that cannot run this size is reported
                        row["error"] = error_line(e, 200)
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
    if rank == 0:
        write(rows, args, world, device)
    dist.destroy_process_group()


def write(rows, args, world, device) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"cp_scaling_{device.type}_x{world}"
    cmd = f"torchrun --nproc_per_node {world} -m launch.bench.cp_scaling " + " ".join(sys.argv[1:])
    (args.out / f"{tag}.json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    lines = ["| N | mask | balance | mode | fwd+bwd ms min / median / max | fwd TF/GPU | fwd+bwd TF/GPU | single-GPU fwd+bwd TF | "
             "efficiency | imbalance | GB moved | plain ring GB | exposed s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | {r['mask']} | {r['balance']} | {r['mode']} | {r['error'][:60]} |||||||||")
            continue
        eff = f"{r['efficiency_fwdbwd']:.0%}" if "efficiency_fwdbwd" in r else "-"
        single = f"{r['single_fwdbwd_tflops']:.3g}" if "single_fwdbwd_tflops" in r else "-"
        exposed = f"{r['exposed_fwdbwd_s']:.3g}" if "exposed_fwdbwd_s" in r else "-"
        spread = " / ".join(f"{1e3 * r['fwdbwd_s'][k]:.3g}" for k in ("min", "median", "max"))
        lines.append(f"| {r['n']} | {r['mask']} | {r['balance']} | {r['mode']} | {spread} | {r['fwd_tflops_per_gpu']:.3g} | "
                     f"{r['fwdbwd_tflops_per_gpu']:.3g} | {single} | {eff} | {r['imbalance']:.3f} | "
                     f"{r['bytes_moved'] / 1e9:.3g} | {r['plain_ring_bytes'] / 1e9:.3g} | {exposed} |")
    md = "\n".join(lines)
    (args.out / f"{tag}.md").write_text(f"# Context-parallel scaling, {world} ranks\n\n`{cmd}`\n\n{md}\n")
    print(md)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    masks_ = sorted({r["mask"] for r in ok})
    fig, axes = plt.subplots(1, max(len(masks_), 1), figsize=(6 * max(len(masks_), 1), 4), squeeze=False)
    for ax, m in zip(axes[0], masks_):
        for i, (mode, balance) in enumerate(sorted({(r["mode"], r["balance"]) for r in ok if r["mask"] == m})):
            pts = sorted((r["n"], r["fwdbwd_tflops_per_gpu"]) for r in ok if r["mask"] == m and r["mode"] == mode and r["balance"] == balance)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=f"{mode} / {balance}")
        single = sorted({(r["n"], r["single_fwdbwd_tflops"]) for r in ok if r["mask"] == m and "single_fwdbwd_tflops" in r})
        if single:
            ax.plot([p[0] for p in single], [p[1] for p in single], "k--", label="one GPU, whole problem")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("fwd+bwd TFLOP/s per GPU")
        ax.set_title(f"{m}, {world} ranks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / f"{tag}.png", dpi=110)


if __name__ == "__main__":
    main()
