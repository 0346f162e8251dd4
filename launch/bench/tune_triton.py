"""Sweep block shapes of the three Triton FlashMask kernels on the GPU, one pass at a time.

    python launch/bench/tune_triton.py --d 128 --n 16384 --out docs/benchmarks
    python launch/bench/tune_triton.py --d 64 256 --tag tune_triton_d64_d256   # shapes spilling > 512 B skipped

For each pass (forward, dK/dV, dQ) and each candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) it
times that kernel alone on causal and packed-document masks (B=1, H=16, bf16) and reports
effective TFLOP/s (visible pairs only; forward = 2 matmuls, dK/dV = 4, dQ = 3). The winners go into
``_HOPPER`` in kernels/triton_flashmask.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch" / "bench"))

from kernel import build  # noqa: E402

from fm_parallel.kernels import triton_flashmask as tf  # noqa: E402

CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3)],
    "bwd_kv": [(64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3), (128, 128, 8, 2)],
    "bwd_q": [(128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 3)],
}
# Shapes that compile without spills at these head dims (launch/bench/triton_static.py, Triton 3.9,
# docs/benchmarks/README.md): tried on top of CANDIDATES there.
EXTRA = {
    128: {"fwd": [(64, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)], "bwd_kv": [(32, 64, 8, 2), (32, 32, 4, 2)],
          "bwd_q": [(64, 64, 8, 2), (128, 64, 8, 1)]},
    256: {"fwd": [(32, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 2)], "bwd_kv": [(32, 32, 8, 2), (16, 32, 4, 2)],
          "bwd_q": [(32, 32, 8, 2), (32, 64, 8, 2)]},
}
MATMULS = {"fwd": 2, "bwd_kv": 4, "bwd_q": 3}


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, nargs="+", default=[128])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--masks", nargs="+", default=["causal", "docs"])
    parser.add_argument("--kinds", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--max-spill", type=int, default=512,
                        help="skip shapes whose compiled kernel spills more bytes per thread than this (checked before timing)")
    parser.add_argument("--tag", default="tune_triton")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    from triton_static import resources

    @functools.cache
    def static_of(kind, d, cand) -> dict:
        """Registers and spills of one shape (compile only; the same for every mask, so once per shape).
        A failure here only loses the spill filter."""
        try:
            static = resources(kind, d, cand)
            return {"spill_bytes": static["spill_store_bytes"], "registers": static["registers"]}
        except Exception as e:  # noqa: BLE001
            return {"static_error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}

    rows = []
    for d in args.d:
        for name in args.masks:
            torch.manual_seed(0)
            fm = build(name, args.n)[0].to("cuda")
            pairs = int(fm.visible_pairs().sum())
            q, k, v = (torch.randn(1, args.heads, args.n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            do = torch.randn_like(q)
            pos = torch.arange(args.n, device="cuda")
            scale = d**-0.5
            out, lse = tf.flashmask_fwd(q, k, v, fm, pos, scale, 0)
            delta = tf._delta(out, do, None)
            calls = {
                "fwd": lambda: tf.flashmask_fwd(q, k, v, fm, pos, scale, 0),
                "bwd_kv": lambda: tf.bwd_kv(q, k, v, do, lse, delta, fm, pos, scale, 0),
                "bwd_q": lambda: tf.bwd_q(q, k, v, do, lse, delta, fm, pos, scale, 0),
            }
            for kind in args.kinds:
                default = tf._HOPPER[kind][d]
                for cand in dict.fromkeys([*CANDIDATES[kind], *EXTRA.get(d, {}).get(kind, [])]):
                    tf._HOPPER[kind][d] = tf.KernelConfig(*cand)
                    row = {"d": d, "mask": name, "kind": kind, "config": cand}
                    row.update(static_of(kind, d, cand))
                    if row.get("spill_bytes", 0) > args.max_spill:
                        row["skipped"] = f"spills {row['spill_bytes']} B > --max-spill {args.max_spill}"
                        rows.append(row)
                        print(row, flush=True)
                        continue
                    try:
                        t0 = time.perf_counter()
                        calls[kind]()
                        torch.cuda.synchronize()
                        row["compile_s"] = time.perf_counter() - t0
                        lo, ms, hi = do_bench(calls[kind], warmup=10, rep=40, quantiles=[0.0, 0.5, 1.0])
                        row.update(ms=ms, ms_min=lo, ms_max=hi, tflops=2 * MATMULS[kind] * args.heads * d * pairs / ms / 1e9)
                    except Exception as e:  # e.g. a shape that needs more shared memory than the SM has
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    rows.append(row)
                    print(" ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()), flush=True)
                tf._HOPPER[kind][d] = default
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(rows, indent=1))
    print("\nbest per (d, mask, kind):")
    for key in sorted({(r["d"], r["mask"], r["kind"]) for r in rows}):
        ok = [r for r in rows if (r["d"], r["mask"], r["kind"]) == key and "ms" in r]
        if ok:
            best = max(ok, key=lambda r: r["tflops"])
            print(key, best["config"], f"{best['tflops']:.0f} TF/s (ms min / median / max "
                  f"{best['ms_min']:.3f} / {best['ms']:.3f} / {best['ms_max']:.3f})")


if __name__ == "__main__":
    main()
