"""Host (Python) time per attention call against GPU time, ours and FA4's (H200 diagnostic).

    python launch/bench/host_overhead.py --n 16384 --masks docs sliding causal

A call whose kernels take less GPU time than Python needs to launch them is bound by the host:
timing it back to back measures Python, not the kernel. For each mask this prints, per forward and
per forward+backward: the host time of a call (mean of ``--calls`` calls launched without waiting),
the GPU time of its kernels (the profiler's kernel durations summed), the back-to-back time
(``triton.testing.do_bench``), and the top host functions (cProfile) of ``impl="cute"``.
The mask is the same every call (its block lists cached), as in a training step's layers.
Writes ``--out/<tag>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.bench.kernel import MASKS, bench, build, doc_lengths  # noqa: E402
from launch.bench.repeats import spread  # noqa: E402


def host_ms(fn, calls: int) -> float:
    """Host ms per call: ``calls`` calls launched without waiting, timed together (one batch)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e3 * host / calls


def host_spread(fn, calls: int, repeats: int = 5) -> dict:
    """:func:`host_ms` over ``repeats`` batches: min / median / max of the per-call means."""
    return spread(host_ms(fn, calls) for _ in range(repeats))


def gpu_ms(fn, calls: int) -> float:
    """Sum of the kernels' device durations per call (the profiler's CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0
                   and e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / 1e3 / calls


def top_host(fn, calls: int, lines: int = 14, sort: str | tuple[str, ...] = "cumulative") -> str:
    """cProfile of ``calls`` calls of ``fn``: the top ``lines`` host functions by ``sort`` (one key, or
    several: one table per key from the same profile)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for key in (sort,) if isinstance(sort, str) else sort:
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(lines)
    return out.getvalue()


def cute_layers(q, k, v, fm, calls: int) -> dict:
    """Host ms of one cute forward at each layer: FA4's launcher with our prepared arguments, our
    launcher (``cute_fwd``: lists and bounds from the mask's cache), the torch custom op with autograd,
    and ``flashmask_attention`` (validation included). The differences are each layer's cost."""
    from fm_parallel import flashmask_attention
    from fm_parallel.kernels import cute_fa4_patches, cute_flashmask

    scale = q.shape[-1] ** -0.5
    positions = torch.arange(q.shape[2], device=q.device)
    sparsity, _, order, _ = cute_flashmask._sparsity(fm, positions, q.shape[1], q.shape[-1], 0)
    mask_mod, aux = cute_flashmask._mask_args(fm, positions, q.shape[1], 0, order)
    out = q.new_empty(q.shape)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    qb, kb, vb = (cute_flashmask._bshd(x.detach()) for x in (q, k, v))

    def fa4_only():
        cute_flashmask._flash_attn_fwd(qb, kb, vb, softmax_scale=scale, mask_mod=mask_mod, aux_tensors=aux,
                                       block_sparse_tensors=sparsity, return_lse=True, out=out.transpose(1, 2), lse=lse)

    layers = {
        "fa4_launcher": fa4_only,
        "cute_fwd": lambda: cute_flashmask.cute_fwd(q.detach(), k.detach(), v.detach(), fm, positions, scale, 0),
        "custom_op_autograd": lambda: cute_flashmask.attention(q, k, v, fm, positions, scale, 0),
        "flashmask_attention": lambda: flashmask_attention(q, k, v, mask=fm, impl="cute"),
    }
    return {name: host_ms(fn, calls) for name, fn in layers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--masks", nargs="+", default=["docs", "sliding", "causal"], choices=MASKS)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--tag", default="host_overhead_h200")
    args = parser.parse_args()

    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    from fm_parallel import flashmask_attention

    n, d, heads = args.n, 128, args.heads
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    rows, profiles = [], {}
    for name in args.masks:
        fm = build(name, n)[0].to("cuda")
        calls = {"fm_cute": lambda: flashmask_attention(q, k, v, mask=fm, impl="cute"),
                 "fm_triton": lambda: flashmask_attention(q, k, v, mask=fm, impl="triton")}
        if name == "causal":
            calls["fa4"] = lambda: flash_attn_func(qt, kt, vt, causal=True)[0]
        if name == "docs":
            lens = doc_lengths(n)
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
            q1, k1, v1 = (x.detach()[0].requires_grad_() for x in (qt, kt, vt))
            calls["fa4_varlen"] = lambda: flash_attn_varlen_func(q1, k1, v1, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                 max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                                                 causal=True)[0]
        for impl, fwd in calls.items():
            grad_out = do[0].transpose(0, 1) if impl == "fa4_varlen" else do.transpose(1, 2) if impl == "fa4" else do

            def fwd_bwd(fwd=fwd, grad_out=grad_out):
                fwd().backward(grad_out)

            for _ in range(3):
                fwd_bwd()  # compile, cache the lists
            row = {"mask": name, "n": n, "impl": impl}
            for label, fn in (("fwd", fwd), ("fwdbwd", fwd_bwd)):
                host = host_spread(fn, args.calls)
                row[f"{label}_host_ms"] = host["median"]
                row[f"{label}_host_spread_ms"] = host
                row[f"{label}_gpu_ms"] = gpu_ms(fn, 10)
                spread = bench(fn, False)  # min / median / max of the repeats
                row[f"{label}_back_to_back_ms"] = spread["median"]
                row[f"{label}_back_to_back_spread_ms"] = spread
            rows.append(row)
            print(json.dumps(row), flush=True)
            if impl == "fm_cute":
                profiles[name] = top_host(fwd_bwd, 20)
                layers = cute_layers(q, k, v, fm, args.calls)
                rows.append({"mask": name, "n": n, "impl": "fm_cute forward layers, host ms", **layers})
                print(json.dumps(rows[-1]), flush=True)
    print(profiles.get(args.masks[0], ""))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python launch/bench/host_overhead.py " + " ".join(sys.argv[1:]),
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    (args.out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows, "cute_host_profile": profiles},
                                                          indent=1))
    print("| mask | impl | fwd host / GPU / back-to-back ms | fwd+bwd host / GPU / back-to-back ms |\n|---|---|---|---|")
    for r in rows:
        if "fwd_host_ms" not in r:  # the per-layer rows
            print(f"| {r['mask']} | {r['impl']} | " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()
                                                              if isinstance(v, float)) + " | |")
            continue
        fwd, fwdbwd = (" / ".join(f"{r[f'{p}_{m}_ms']:.3f}" for m in ("host", "gpu", "back_to_back"))
                       for p in ("fwd", "fwdbwd"))
        print(f"| {r['mask']} | {r['impl']} | {fwd} | {fwdbwd} |")


if __name__ == "__main__":
    main()
