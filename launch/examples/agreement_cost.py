"""What the per-call agreement costs: one ring layer (forward + backward) on 2 gloo ranks, and the
agreement alone, median over repeats::

    python launch/examples/agreement_cost.py [--n 1024] [--repeats 50]

Prints rank 0's medians in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, init_file, n, repeats, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from fm_parallel import masks
    from fm_parallel.distributed import prepare, ring_attention, shard

    mask = masks.document([n // 4, n // 2, n // 4])
    plan = shard(mask, world, "zigzag")
    prepared = prepare(mask, plan)
    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 4, n // world, 32, requires_grad=True) for _ in range(3))
    layer, agree = [], []
    for i in range(repeats + 5):
        dist.barrier()
        t0 = time.perf_counter()
        ring_attention(q, k, v, prepared).sum().backward()
        layer.append(time.perf_counter() - t0)
    for i in range(repeats + 5):  # back to back, so the ranks' skew is paid once, not per call
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            prepared.agree(q, k, v, None)  # what every layer call runs first (before: a cached no-op after the first)
        agree.append((time.perf_counter() - t0) / 20)
    layer, agree = layer[5:], agree[5:]
    if rank == 0:
        out.put((statistics.median(layer) * 1e3, statistics.median(agree) * 1e3))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="the per-call agreement's cost on 2 gloo ranks")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, os.path.join(tmp, "init"), args.n, args.repeats, out), nprocs=2,
                           start_method="spawn")
    layer, agree = out.get()
    print(f"N={args.n}, 2 gloo ranks: ring layer forward+backward {layer:.2f} ms (median of {args.repeats}); "
          f"one call's agreement alone {agree:.3f} ms")


if __name__ == "__main__":
    main()
