"""GPU kernel benchmark: our Triton FlashMask kernel against its peers, in the same process.

    python -m launch.bench.kernel                      # the full table (H200: about 8 minutes)
    python -m launch.bench.kernel --ns 16384 --masks docs dpo --quick

Masks (B=1, H=16, D=128 bf16 unless told): causal, packed causal documents (lengths uniform in
[512, 3584], mean 2048, the anchors' generator), DPO (prompt N/2, chosen N/4, rejected N/4),
sliding window 1024 + 4 sinks, prefix-LM (N/4), a two-interval mask (packed docs whose last 256
rows also see every earlier token), and issue 21's two: ``window_sinks`` (window 2048 + 8 sinks) and
``global_window`` (8 global rows that see every key, with that window: two intervals per column). Effective TFLOP/s count only visible pairs:
``4 * B * H * D * pairs / t`` forward, 3.5x that for forward+backward. Peers: FlexAttention compiled
(block mask built with ``_compile=True``), FlexAttention's FLASH backend and FlashAttention-4 when
``flash_attn.cute`` imports (see ../shared/bench/fa4_wheels.sh), SDPA flash (causal only) and SDPA with
a dense bool mask (N <= 32k). Also: packed docs at 256k, 512k and 1M (``--long``), and the mask
preparation time (builder + launch plans) per N.

Writes kernel_h200.json (or --tag) and a markdown table under --out, and a plot.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.kernel")

from fm_parallel import flashmask_attention, masks
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.kernels.triton.backend import config_for
from fm_parallel.kernels.plan import build_plans, build_plans_consecutive
from launch.bench.harness import error_line, spread

MASKS = ("causal", "docs", "dpo", "sliding", "prefix", "multi", "window_sinks", "global_window")


def doc_lengths(n: int, mean: int = 2048, seed: int = 1) -> list[int]:
    """The anchors' generator (``masks.sample_lengths``)."""
    return masks.sample_lengths(n, mean, seed)


def build(name: str, n: int):
    """(FlashMask, Flex mask_mod written as a Flex user would) for one family."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "causal":
        return masks.causal(n), lambda b, h, q, k: q >= k
    if name in ("docs", "multi"):
        lens = doc_lengths(n)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
        fm = masks.document(lens)
        if name == "docs":
            return fm, lambda b, h, q, k: (q >= k) & (doc[q] == doc[k])
        tail = n - 256
        summary = masks.intersect(masks.causal(n), masks.FlashMask(torch.full((n,), tail), torch.full((n,), n - 1)))
        return masks.union(fm, summary), lambda b, h, q, k: (q >= k) & ((doc[q] == doc[k]) | (q >= tail))
    if name == "dpo":
        p, c = n // 2, n // 4

        def dpo(b, h, q, k):
            seg_q = (q >= p).int() + (q >= p + c).int()
            seg_k = (k >= p).int() + (k >= p + c).int()
            return (q >= k) & ((seg_k == 0) | (seg_q == seg_k))

        return masks.dpo(p, c, n - p - c), dpo
    if name == "sliding":
        return masks.sliding_window(n, 1024, sinks=4), lambda b, h, q, k: (q >= k) & ((q - k < 1024) | (k < 4))
    if name == "prefix":
        return masks.prefix_lm(n, n // 4), lambda b, h, q, k: (q >= k) | (k < n // 4)
    if name == "window_sinks":  # issue 21's sliding window: 2048 + 8 sinks
        return masks.sliding_window(n, 2048, sinks=8), lambda b, h, q, k: (q >= k) & ((q - k < 2048) | (k < 8))
    if name == "global_window":  # issue 21's 2-interval mask: 8 global rows see every key, + window 2048 + 8 sinks
        glob = masks.FlashMask(torch.zeros(n, dtype=torch.int32), torch.full((n,), 7, dtype=torch.int32))
        return (masks.union(masks.sliding_window(n, 2048, sinks=8), glob),
                lambda b, h, q, k: ((q >= k) & ((q - k < 2048) | (k < 8))) | (q < 8))
    raise ValueError(f"mask: expected one of {MASKS}, got {name!r}")


def bench(fn, quick: bool) -> dict:
    from triton.testing import do_bench

    return spread(do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="all"))


def measure(label, fwd, q, k, v, do, pairs, heads, d, quick, with_bwd=True):
    """Median ms (TF/s from it) and the min / max of the repeats beside it."""
    row = {"impl": label}
    try:
        t = bench(fwd, quick)
        row.update(fwd_ms=t["median"], fwd_ms_min=t["min"], fwd_ms_max=t["max"],
                   fwd_tflops=4 * heads * d * pairs / t["median"] / 1e9)
        if with_bwd:
            def fb():
                for x in (q, k, v):
                    x.grad = None
                fwd().backward(do)

            t2 = bench(fb, quick)
            row.update(fwdbwd_ms=t2["median"], fwdbwd_ms_min=t2["min"], fwdbwd_ms_max=t2["max"],
                       fwdbwd_tflops=3.5 * 4 * heads * d * pairs / t2["median"] / 1e9)
    except Exception as e:  # a peer that cannot run this case is reported, not fatal
        row["error"] = error_line(e)
        torch.cuda.empty_cache()
    return row


def prep_ms(name: str, n: int, d: int) -> dict:
    """Mask preparation: build the FlashMask on the host, copy it, build the three launch plans."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fm, _ = build(name, n)
    t1 = time.perf_counter()
    fm = fm.to("cuda")
    pos = torch.arange(n, device="cuda")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    shapes = {(config_for(kind, d).block_m, config_for(kind, d).block_n) for kind in ("fwd", "bwd_kv", "bwd_q")}
    for block_m, block_n in shapes:  # what the launchers build: both orientations per block shape
        build_plans_consecutive(fm, 0, n, block_m, block_n)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    for block_m, block_n in shapes:  # the dense-grid builder (arbitrary row positions), for comparison
        build_plans(fm, pos, block_m, block_n)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return {"builder_ms": 1e3 * (t1 - t0), "copy_ms": 1e3 * (t2 - t1), "plans_ms": 1e3 * (t3 - t2),
            "plans_dense_ms": 1e3 * (t4 - t3)}


def mask_churn(n: int, heads: int, impl: str, calls: int = 100) -> dict:
    """Seconds for ``calls`` forward+backward calls that each get a *different* packed-doc mask (new
    lengths, fresh tensors: block lists rebuilt, no kernel may recompile) vs the same mask every
    call. Masks are built before the clock starts; their preparation inside the call is counted."""
    from tqdm import tqdm

    label, impl = impl, impl.replace("_sparse", "")
    if impl == "cute":
        from fm_parallel.kernels.fa4 import patches as fa4_patches
        from fm_parallel.kernels.fa4 import backend as fa4_backend

        fa4_backend.OPTIONS = fa4_patches.Options()
    fresh = [masks.document(doc_lengths(n, seed=100 + i)).to("cuda") for i in range(calls)]
    if label == "cute_sparse":  # block lists and bounds per new mask, not FA4's varlen kernel
        fresh = [without_structure(m) for m in fresh]
    q, k, v = (torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def run(mask_for_call, label: str) -> float:
        flashmask_attention(q, k, v, mask=fresh[0], impl=impl).backward(do)  # compile / warm up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in tqdm(range(calls), desc=f"{impl}, {label}", leave=False):
            flashmask_attention(q, k, v, mask=mask_for_call(i), impl=impl).backward(do)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    same = run(lambda i: fresh[0], "same mask")
    new = run(lambda i: fresh[i], "new masks")
    # Why a new mask costs what it does: host time of one call (a new mask's preparation is launched
    # from Python) and whether anything in it waits for the GPU (a sync makes that host time add up).
    unseen = masks.document(doc_lengths(n, seed=99)).to("cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        unseen = without_structure(unseen) if label == "cute_sparse" else unseen
        out = flashmask_attention(q, k, v, mask=unseen, impl=impl)
        host_fwd = time.perf_counter() - t0
        t0 = time.perf_counter()
        out.backward(do)
        host_bwd = time.perf_counter() - t0
        torch.cuda.set_sync_debug_mode("default")
        syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)})
    torch.cuda.synchronize()
    return {"impl": label, "n": n, "calls": calls, "same_mask_s": same, "new_masks_s": new, "ratio": new / same,
            "new_mask_host_fwd_ms": 1e3 * host_fwd, "new_mask_host_bwd_ms": 1e3 * host_bwd, "syncs": syncs}


# impl="cute" with FlashMask's changes to FA4 (kernels/fa4/patches.py), and without them to measure
# what each brings; impl -> Options(column-first masking, schedule). "cute" is the backend as shipped
# (heaviest-first cost order); "cute_lpt" the schedule before the cost order (FA4's reversed forward,
# grid-order backward); "cute_col" only the column-first masking (FA4's grid order both ways);
# "cute_plain" FA4 unchanged (per-score mask_mod, grid order).
# "cute_sparse" is "cute" on a mask that does not know it is causal documents: the block-sparse path
# even where the backend would run FA4's causal / varlen kernel (what FlashMask on FA4 reaches alone).
CUTE_VARIANTS = {"cute": (True, "cost"), "cute_sparse": (True, "cost"), "cute_lpt": (True, "reversed"),
                 "cute_col": (True, "grid"), "cute_plain": (False, "grid")}


def without_structure(fm: FlashMask) -> FlashMask:
    """The same bounds in a mask that knows nothing of its structure (as if made on the GPU)."""
    return FlashMask(fm.fms, fm.fme, fm.num_rows, validate=False)


def cute_call(options: tuple[bool, bool], q, k, v, fm):
    """``flashmask_attention(impl="cute")`` with these FA4 changes (column_first, schedule); the
    backward of the returned output uses them too (each setting has its own compiled kernels)."""
    from fm_parallel.kernels.fa4 import patches as fa4_patches
    from fm_parallel.kernels.fa4 import backend as fa4_backend

    def call():
        fa4_backend.OPTIONS = fa4_patches.Options(*options)
        return flashmask_attention(q, k, v, mask=fm, impl="cute")

    return call


def run_case(name, n, heads, d, impls, quick, peers) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask

    torch.manual_seed(0)
    fm, mod = build(name, n)
    fm = fm.to("cuda")
    pairs = int(fm.visible_pairs().sum())
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    base = {"mask": name, "n": n, "heads": heads, "head_dim": d, "density": pairs / n / n}
    rows = []
    ours = lambda: flashmask_attention(q, k, v, mask=fm, impl="triton")  # noqa: E731
    if "triton" in impls:
        rows.append(measure("fm_triton", ours, q, k, v, do, pairs, heads, d, quick))
    for impl, options in CUTE_VARIANTS.items():  # FA4's CuTe kernels with our block sparsity and mask_mod (issue 5)
        if impl in impls:
            if impl == "cute_sparse" and fm.causal_documents() is None:
                continue  # the same as "cute" for masks with no special path
            mask = without_structure(fm) if impl in ("cute_sparse", "cute_lpt", "cute_col", "cute_plain") else fm
            rows.append(measure(f"fm_{impl}", cute_call(options, q, k, v, mask), q, k, v, do, pairs, heads, d, quick))
    bm = None
    if {"flex", "flex_flash"} & set(impls):
        t0 = time.perf_counter()
        bm = create_block_mask(mod, 1, None, n, n, device="cuda", _compile=True)
        torch.cuda.synchronize()
        bm_s = time.perf_counter() - t0
    if "flex" in impls:
        rows.append(measure("flex", lambda: peers["flex"](q, k, v, block_mask=bm), q, k, v, do, pairs, heads, d, quick))
        rows[-1]["blockmask_s"] = bm_s
        if "triton" in impls and "error" not in rows[-1] and n <= 32768:
            diff = (ours().float() - peers["flex"](q, k, v, block_mask=bm).float()).abs().max().item()
            rows[0]["max_abs_diff_vs_flex"] = diff
    if "flex_flash" in impls and peers.get("flex_flash"):
        rows.append(measure("flex_flash", lambda: peers["flex_flash"](q, k, v, block_mask=bm), q, k, v, do, pairs, heads, d, quick))
    if "fa4" in impls and peers.get("fa4") and name in ("causal", "docs"):
        fa4, fa4_varlen = peers["fa4"]
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2).contiguous()
        if name == "causal":
            f = lambda: fa4(qt, kt, vt, causal=True)[0]  # noqa: E731
            rows.append(measure("fa4", f, qt, kt, vt, dot, pairs, heads, d, quick))
        else:
            lens = doc_lengths(n)
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
            q1, k1, v1 = (x.detach()[0].requires_grad_() for x in (qt, kt, vt))
            f = lambda: fa4_varlen(q1, k1, v1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),  # noqa: E731
                                   max_seqlen_k=max(lens), causal=True)[0]
            rows.append(measure("fa4_varlen", f, q1, k1, v1, dot[0], pairs, heads, d, quick))
    if "sdpa" in impls:
        if name == "causal":
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            rows.append(measure("sdpa_flash", f, q, k, v, do, pairs, heads, d, quick))
        elif n <= 32768 and name in ("docs", "dpo"):
            dense = fm.to_dense()[0, 0]
            f = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
            rows.append(measure("sdpa_dense_mask", f, q, k, v, do, pairs, heads, d, quick))
            del dense
    del q, k, v, do
    torch.cuda.empty_cache()
    return [dict(base, **r) for r in rows]


def load_peers(impls) -> dict:
    warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 1024
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 1024
    peers = {"flex": torch.compile(flex_attention, dynamic=False)}
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        peers["fa4"] = (flash_attn_func, flash_attn_varlen_func)
        flash = torch.compile(flex_attention, dynamic=False)
        peers["flex_flash"] = lambda q, k, v, block_mask: flash(q, k, v, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"})
    except Exception as e:
        print(f"FlashAttention-4 not importable ({type(e).__name__}: {e}); FA4 and Flex-FLASH rows skipped", flush=True)
    return peers


def _spread(row: dict, key: str) -> str:
    if key not in row:
        return ""
    if f"{key}_min" not in row:  # rows of runs made before the spread was recorded
        return f"{row[key]:.3f}"
    return f"{row[f'{key}_min']:.3f} / {row[key]:.3f} / {row[f'{key}_max']:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| mask | N | D | impl | fwd ms min / median / max | fwd TF/s | fwd+bwd ms min / median / max | fwd+bwd TF/s | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mask']} | {r['n']} | {r['head_dim']} | {r['impl']} | | | | | {r['error']} |")
            continue
        note = f"diff vs flex {r['max_abs_diff_vs_flex']:.1e}" if "max_abs_diff_vs_flex" in r else ""
        lines.append(
            f"| {r['mask']} | {r['n']} | {r['head_dim']} | {r['impl']} | {_spread(r, 'fwd_ms')} | {r['fwd_tflops']:.0f} | "
            f"{_spread(r, 'fwdbwd_ms')} | {r.get('fwdbwd_tflops', float('nan')):.0f} | {note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument("--impls", nargs="+", default=["triton", "flex", "flex_flash", "fa4", "sdpa"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--extra-dims-at", type=int, default=32768, help="also run D=64 and 256 at this N (0: no)")
    parser.add_argument("--long", type=int, nargs="*", default=[262144, 524288, 1048576], help="packed-doc lengths, ours and Flex only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--churn", type=int, nargs="*", default=[], help="also time 100 new masks vs 100 same-mask calls at these N")
    parser.add_argument("--tag", default="kernel_h200")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()

    peers = load_peers(args.impls)
    print("torch", torch.__version__, "device", torch.cuda.get_device_name(), flush=True)
    cases = [(m, n, d) for d in args.head_dims for n in args.ns for m in args.masks]
    if args.extra_dims_at:
        cases += [(m, args.extra_dims_at, d) for d in (64, 256) if d not in args.head_dims for m in args.masks if m != "multi"]
    cases += [("docs", n, 128) for n in args.long]
    rows, prep = [], []
    args.out.mkdir(parents=True, exist_ok=True)
    stream = open(args.out / f"{args.tag}.jsonl", "w")  # rows as they come: a run cut short keeps them
    for m, n, d in cases:
        impls = args.impls if n <= 131072 else [i for i in args.impls if i in ("triton", "flex")]
        new = run_case(m, n, args.heads, d, impls, args.quick, peers)
        rows += new
        for r in new:
            print(" ".join(f"{k_}={v_:.4g}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in r.items()), flush=True)
            stream.write(json.dumps(r) + "\n")
            stream.flush()
    churn = []
    for n in args.churn:
        for impl in [i for i in ("cute", "cute_sparse", "triton") if i in args.impls]:  # default FA4 changes
            try:
                churn.append(mask_churn(n, args.heads, impl))
            except Exception as e:  # reported like a peer that cannot run, the tables still get written
                churn.append({"impl": impl, "n": n, "error": error_line(e)})
            print(json.dumps(churn[-1]), flush=True)
    prep_ms("docs", 4096, 128)  # compiles the Triton plan builders: not part of any N's figure
    for n in sorted({n for _, n, _ in cases}):
        prep.append(dict(mask="docs", n=n, **prep_ms("docs", n, 128)))
        print(json.dumps(prep[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m launch.bench.kernel " + " ".join(sys.argv[1:]), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    (args.out / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows, "prep": prep, "churn": churn}, indent=1))
    md = table(rows)
    (args.out / f"{args.tag}.md").write_text(f"`{meta['command']}` on {meta['device']}, {meta['date']}\n\n{md}\n")
    print(md)
    print("\n| N | builder ms | copy ms | plans ms | plans ms, dense grid |\n|---|---|---|---|---|")
    for p in prep:
        print(f"| {p['n']} | {p['builder_ms']:.2f} | {p['copy_ms']:.2f} | {p['plans_ms']:.2f} | {p['plans_dense_ms']:.2f} |")


if __name__ == "__main__":
    main()
