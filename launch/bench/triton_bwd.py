"""The Triton backward, piece by piece, against FlexAttention's default (Triton) backend in one process.

    python launch/bench/triton_bwd.py --ns 16384 65536 --masks docs dpo sliding prefix

For each mask (B=1, H=16, D=128 bf16, kernel.py's builders; without a GPU it runs through Triton's
interpreter, ``TRITON_INTERPRET=1``, as a smoke test of the script only) and each backward variant
it times, as min / median / max over repeats (``triton.testing.do_bench``):
  * ``delta``: the backward's preprocess ``rowsum(dO * O)``, as torch ops (before) and as the kernel;
  * ``bwd``: ``flashmask_bwd`` alone (preprocess + dK/dV + dQ), with ``kv`` / ``q`` each pass alone
    for the first variant (the shipped one), and every variant's gradients against the first's;
  * ``fwd+bwd``: the autograd call users make (``flashmask_attention(..., impl="triton")`` then
    ``backward``), the figure compared with Flex's compiled ``flex_attention`` forward + backward,
    timed by do_bench (L2 emptied before every call) and back to back (as a training loop runs);
and one profiled forward + backward of ours and of Flex (CUDA time per kernel, torch.profiler), which
says where the difference goes. Variants: the passes' block shapes (kernels/triton_flashmask.py
``_HOPPER``). Writes ``--tag``.json / .md under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch" / "bench"))

from kernel import build  # noqa: E402
from repeats import spread  # noqa: E402

from fm_parallel import flashmask_attention  # noqa: E402
from fm_parallel.kernels import triton_flashmask as tf  # noqa: E402

# label -> {pass: (BLOCK_M, BLOCK_N, num_warps, num_stages)} for the passes a variant changes
# (kernels/triton_flashmask.py ``_HOPPER``). Measured on the H200 on 2026-12-03 and removed from the
# kernels (docs/benchmarks/README.md, "The Triton backward"): both backward passes in one launch
# (FlexAttention's layout; triton_bwd_h200_16k_one_launch.md) and the looped-over tiles read
# through TMA tensor descriptors (commit 2fff1e8; triton_bwd_h200.md).
VARIANTS = {
    "64x64, 4 warps (shipped)": {},
    "dK/dV 64x128 8 warps 3 stages": {"bwd_kv": (64, 128, 8, 3)},
}


def timed(fn, reps: int = 40) -> dict:
    if not torch.cuda.is_available():  # the CPU smoke run (TRITON_INTERPRET=1): three wall-clock calls
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return spread(times)
    from triton.testing import do_bench

    return spread(do_bench(fn, warmup=10, rep=reps, return_mode="all"))


def torch_delta(out, dout):
    """The preprocess before the kernel: four elementwise ops, three float32 copies."""
    return (dout.float() * out.float()).sum(-1).contiguous()


def kernel_table(fn, top: int = 8) -> list[dict]:
    """CUDA time per kernel over 3 profiled calls of ``fn`` (after one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / 3, "us_per_step": us / 3})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def with_variant(spec: dict):
    """Install a variant's configs (D = 128); returns the restore."""
    saved = {kind: tf._HOPPER[kind][128] for kind in spec}
    for kind, cfg in spec.items():
        tf._HOPPER[kind][128] = tf.KernelConfig(*cfg)

    def restore():
        for kind, cfg in saved.items():
            tf._HOPPER[kind][128] = cfg
    return restore


def back_to_back(fn, calls: int = 5) -> dict:
    """ms per call over ``calls`` calls queued back to back, as a training loop runs them (do_bench
    instead empties the L2 cache before every call and times each alone); min / median / max of 3."""
    if not torch.cuda.is_available():
        return timed(fn)
    fn()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return spread(times)


def run_mask(name: str, n: int, heads: int, variants: dict, flex) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    torch.manual_seed(0)
    fm, mod = build(name, n)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fm = fm.to(dev)
    d = 128
    q, k, v = (torch.randn(1, heads, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    pos = torch.arange(n, device=dev)
    scale = d**-0.5
    out, lse = tf.flashmask_fwd(q.detach(), k.detach(), v.detach(), fm, pos, scale, 0)
    result = {"mask": name, "n": n, "heads": heads, "head_dim": d, "variants": {}}

    def fwd_bwd(call):
        def step():
            for x in (q, k, v):
                x.grad = None
            call().backward(do)
        return step

    ours = lambda: flashmask_attention(q, k, v, mask=fm, impl="triton")  # noqa: E731
    result["delta_torch"] = timed(lambda: torch_delta(out, do))
    result["delta_kernel"] = timed(lambda: tf._delta(out, do, None))
    print(f"{name} {n}: delta torch {result['delta_torch']['median'] * 1e3:.0f} us, "
          f"kernel {result['delta_kernel']['median'] * 1e3:.0f} us", flush=True)
    first = None  # the first variant's gradients: every other variant must give the same
    for label, spec in variants.items():
        restore = with_variant(spec)
        try:
            row = {}
            bwd = lambda: tf.flashmask_bwd(q.detach(), k.detach(), v.detach(), out, lse, do, fm, pos, scale, q_offset=0)  # noqa: E731
            t0 = time.perf_counter()
            grads = bwd()
            if dev == "cuda":
                torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t0
            first = first or grads
            row["max_abs_diff_vs_first"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, first))
            row["bwd"] = timed(bwd)
            row["fwd"] = timed(ours)
            if first is grads:  # each pass alone, for the first variant
                delta = tf._delta(out, do, None)
                row["kv"] = timed(lambda: tf.bwd_kv(q.detach(), k.detach(), v.detach(), do, lse, delta, fm, pos, scale, 0))
                row["q"] = timed(lambda: tf.bwd_q(q.detach(), k.detach(), v.detach(), do, lse, delta, fm, pos, scale, 0))
            row["fwdbwd"] = timed(fwd_bwd(ours))
            row["fwdbwd_back_to_back"] = back_to_back(fwd_bwd(ours))
        except Exception as e:  # noqa: BLE001  (a shape that does not fit is reported, not fatal)
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        finally:
            restore()
        result["variants"][label] = row
        parts = " ".join(f"{key} {row[key]['median']:.3f}" for key in ("fwd", "bwd", "kv", "q", "fwdbwd", "fwdbwd_back_to_back")
                         if key in row)
        diff = f" (grads vs first variant: {row['max_abs_diff_vs_first']:.1e})" if "max_abs_diff_vs_first" in row else ""
        print(f"  {label:55s} {parts or row.get('error')} ms{diff}", flush=True)
    if flex is not None:
        t0 = time.perf_counter()
        bm = create_block_mask(mod, 1, None, n, n, device=dev, _compile=True)
        call = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
        fwd_bwd(call)()
        if dev == "cuda":
            torch.cuda.synchronize()
        result["flex_compile_s"] = time.perf_counter() - t0
        result["flex_fwd"] = timed(call)
        result["flex_fwdbwd"] = timed(fwd_bwd(call))
        result["flex_fwdbwd_back_to_back"] = back_to_back(fwd_bwd(call))
        result["flex_kernels"] = kernel_table(fwd_bwd(call))
        print(f"  Flex fwd {result['flex_fwd']['median']:.3f} fwd+bwd {result['flex_fwdbwd']['median']:.3f} "
              f"back to back {result['flex_fwdbwd_back_to_back']['median']:.3f} ms "
              f"(compile {result['flex_compile_s']:.0f} s)", flush=True)
    result["ours_kernels"] = kernel_table(fwd_bwd(ours))
    for who in ("ours", "flex"):
        for r in result.get(f"{who}_kernels", []):
            print(f"    {who:5s} {r['us_per_step']:8.1f} us x{r['calls_per_step']:.0f}  {r['kernel']}", flush=True)
    del q, k, v, do
    torch.cuda.empty_cache()
    return result


def markdown(results: list[dict]) -> str:
    lines = ["| mask | N | variant | fwd ms | bwd ms | fwd+bwd ms min / median / max | vs Flex | back to back ms | vs Flex |",
             "|---|---|---|---|---|---|---|---|---|"]
    spread_of = lambda t: f"{t['min']:.3f} / {t['median']:.3f} / {t['max']:.3f}"  # noqa: E731
    for r in results:
        flex, flex_b2b = (r.get(key, {}).get("median") for key in ("flex_fwdbwd", "flex_fwdbwd_back_to_back"))
        for label, row in r["variants"].items():
            if "error" in row:
                lines.append(f"| {r['mask']} | {r['n']} | {label} | {row['error']} | | | | | |")
                continue
            fb, b2b = row["fwdbwd"], row["fwdbwd_back_to_back"]
            ratio = f"{flex / fb['median']:.2f}x" if flex else ""
            ratio_b2b = f"{flex_b2b / b2b['median']:.2f}x" if flex_b2b else ""
            lines.append(f"| {r['mask']} | {r['n']} | {label} | {row['fwd']['median']:.3f} | {row['bwd']['median']:.3f} | "
                         f"{spread_of(fb)} | {ratio} | "
                         f"{spread_of(b2b)} | {ratio_b2b} |")
        if flex:
            lines.append(f"| {r['mask']} | {r['n']} | Flex (default backend) | {r['flex_fwd']['median']:.3f} | | "
                         f"{spread_of(r['flex_fwdbwd'])} | 1.00x | "
                         f"{spread_of(r['flex_fwdbwd_back_to_back'])} | 1.00x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[16384])
    parser.add_argument("--masks", nargs="+", default=["docs", "dpo", "sliding", "prefix"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--tag", default="triton_bwd_h200")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    flex = None
    if not args.no_flex:
        warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    print("torch", torch.__version__, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.ns:
        for name in args.masks:
            results.append(run_mask(name, n, args.heads, {v: VARIANTS[v] for v in args.variants}, flex))
            # after every mask: a run cut short keeps what it measured
            (args.out / f"{args.tag}.json").write_text(json.dumps({"meta": {"torch": torch.__version__}, "rows": results}, indent=1))
            (args.out / f"{args.tag}.md").write_text(markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
