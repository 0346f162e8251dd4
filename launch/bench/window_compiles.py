"""Do row windows of new lengths and offsets make the CuTe backend compile again? (H200 diagnostic)

    python launch/bench/window_compiles.py --n 32768 --ranks 4
    python launch/bench/window_compiles.py --n 2048 --heads 2 --kv-heads 1 --head-dim 16 --impl torch --device cpu --out /tmp/w

The ring runs each chunk on the rows that see it (a window ``[r0, r1)`` of the rank's local rows), so
every training step brings windows of new lengths and offsets. A kernel that compiled per window
length would compile in every step. This runs one rank's column masks (packed documents, contiguous
shards, prepared from the host mask as the trainer does) forward + backward through
``backends.get("cute")`` on windows of many lengths and offsets, counting ``cute.compile`` calls
(FA4's JIT) and timing each call after a synchronisation. Writes ``--out/window_compiles_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--windows", type=int, default=24, help="random windows after the fixed ones")
    parser.add_argument("--impl", default="cute", help="the backend (cute on the H200; torch for a CPU mechanics check)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("window_compiles.py: --device cuda needs a CUDA GPU (and the [cute] extra for --impl cute)")

    from fm_parallel import backends, masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.prepared import PreparedMask

    compiles = {"count": 0}
    if args.impl == "cute":
        import cutlass.cute as cute
        import flash_attn.cute.interface as fa4_interface

        real_compile = cute.compile

        def counted(*a, **kw):
            compiles["count"] += 1
            return real_compile(*a, **kw)

        cute.compile = counted
        fa4_interface.cute.compile = counted  # the module holds ``cute``; patching the attribute covers it

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    n, p = args.n, args.ranks
    host = masks.document(masks.sample_lengths(n, mean=2048))
    plan = shard(host, p, "contiguous")
    rank = 1
    prepared = PreparedMask(host.to(device), plan, rank, device, host_mask=host)
    rows = n // p
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, args.heads, rows, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, args.kv_heads, rows, args.head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    backend = backends.get(backends.resolve(args.impl, device, dtype, args.head_dim, args.head_dim, chunked=True))
    scale = 1.0 / math.sqrt(args.head_dim)
    g = torch.Generator().manual_seed(0)
    fixed = [(0, rows), prepared.window(rank - 1), (0, 1), (rows - 1, rows), (5, 133), (128, 256), (1000, 1129)]
    extra = []
    for _ in range(args.windows):
        length = int(torch.randint(1, rows, (1,), generator=g))
        r0 = int(torch.randint(0, rows - length + 1, (1,), generator=g))
        extra.append((r0, r0 + length))
    records = []
    for source in (rank - 1, rank):
        cols = prepared.columns(source)
        for r0, r1 in fixed + extra:
            if r1 <= r0:
                continue
            before = compiles["count"]
            sync()
            t0 = time.perf_counter()
            sl = slice(r0, r1)
            o, lse = backend.forward(q[:, :, sl], k, v, scale=scale, mask=cols, positions=prepared.local_rows[sl], q_offset=r0)
            backend.backward(q[:, :, sl], k, v, o, lse, dout[:, :, sl], scale=scale, mask=cols,
                             positions=prepared.local_rows[sl], q_offset=r0)
            sync()
            ms = 1e3 * (time.perf_counter() - t0)
            rec = {"source": source, "r0": r0, "r1": r1, "rows": r1 - r0, "ms": ms, "compiles": compiles["count"] - before}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    compiling = [(r["source"], r["r0"], r["r1"]) for r in records if r["compiles"]]
    steady = [r["ms"] for r in records if not r["compiles"]]
    summary = {"compiles_total": compiles["count"], "calls": len(records), "calls_that_compiled": compiling,
               "ms_of_calls_without_compiling_max": max(steady) if steady else None}
    print(json.dumps(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().lower().replace(" ", "_") if device.type == "cuda" else "cpu"
    (args.out / f"window_compiles_{name}.json").write_text(json.dumps(
        {"command": "python launch/bench/window_compiles.py " + " ".join(sys.argv[1:]), "summary": summary,
         "records": records}, indent=1))


if __name__ == "__main__":
    main()
