"""Compile FA4's SM90 kernels with our mask_mod and block sparsity, without a GPU (nothing is launched).

    pip install 'fm_parallel[cute]'                      # flash-attn-4 + nvidia-cutlass-dsl, on any machine
    python tests/kernels/cute_compile_check.py           # ~1-3 min on a CPU
    python -m pytest -q tests/kernels/test_cute.py       # the same cases, as tests

FA4 compiles without launching under ``FakeTensorMode`` (its torch.compile path), and CuTe DSL
cross-compiles for ``sm_90a`` on a machine without a GPU (``CUTE_DSL_ARCH``, ``FLASH_ATTENTION_ARCH``,
``FLASH_ATTENTION_NUM_SMS``, set below). This script uses that to check, before any GPU time is
spent, that the ``impl="cute"`` backend traces and compiles through FA4's real forward and backward
kernels for every head dim and mask shape class, and that a *different* mask of the same class
(other documents, other lengths, other rows) reuses the compiled kernels: the kernel count must not
grow. Correctness of the numbers is ``tests/gpu/test_kernels.py``'s job, on the H200. Was
``launch/bench/cute_compile_check.py`` (issue 32.3); run by tests/kernels/test_cute.py.

Prints one line per case and PASS / FAIL; exits non-zero on failure; ``--json`` writes the rows.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


# (name, head dim, dtype, batch, Hq, Hkv, mask batch, mask heads, intervals, Nq, Nk, q_offset; None: explicit rows)
CASES = [
    ("d64 docs", 64, torch.bfloat16, 1, 4, 2, 1, 1, 1, 300, 300, 0),
    ("d96 docs", 96, torch.bfloat16, 1, 4, 2, 1, 1, 1, 300, 300, 0),
    ("d128 docs", 128, torch.bfloat16, 1, 4, 2, 1, 1, 1, 300, 300, 0),
    ("d192 docs", 192, torch.bfloat16, 1, 4, 2, 1, 1, 1, 300, 300, 0),
    ("d256 docs", 256, torch.bfloat16, 1, 4, 2, 1, 1, 1, 300, 300, 0),
    ("d128 fp16", 128, torch.float16, 1, 4, 2, 1, 1, 1, 300, 300, 0),
    ("d128 batch-2 mask", 128, torch.bfloat16, 2, 4, 2, 2, 1, 1, 300, 300, 0),
    ("d128 mask per KV head", 128, torch.bfloat16, 1, 4, 2, 1, 2, 1, 300, 300, 0),
    ("d128 mask per Q head", 128, torch.bfloat16, 1, 4, 2, 1, 4, 1, 300, 300, 0),
    ("d128 2 intervals", 128, torch.bfloat16, 1, 4, 2, 1, 1, 2, 300, 300, 0),
    ("d128 4 intervals", 128, torch.bfloat16, 1, 4, 2, 1, 1, 4, 300, 300, 0),
    ("d128 ring chunk (Nq != Nk, offset)", 128, torch.bfloat16, 1, 4, 2, 1, 1, 1, 128, 384, 256),
    ("d128 zigzag shard (explicit rows)", 128, torch.bfloat16, 1, 4, 2, 1, 1, 1, 128, 384, None),
]


def compiled_kernels() -> int:
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    return sum(len(f.compile_cache.cache) for f in (_flash_attn_fwd, _flash_attn_bwd))


def _sparsity_on_cpu(mask, positions, num_heads, head_dim, q_offset):
    """``fa4_backend._sparsity`` with the classification run on the CPU (fake CUDA tensors cannot run
    every op): the lists of an all-visible mask of the same shape, handed back as fake CUDA tensors
    of the shapes FA4 will see. Values do not matter for compiling; shapes and dtypes do."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from fm_parallel.kernels.fa4 import backend as fa4_backend
    from fm_parallel.kernels.fa4 import sparsity as fa4_sparsity
    from fm_parallel.masks.flashmask import FlashMask

    with unset_fake_temporarily():
        shape = tuple(mask.fms.shape)
        cpu_mask = FlashMask(torch.zeros(shape, dtype=torch.int32), torch.full(shape, mask.num_rows - 1, dtype=torch.int32),
                             mask.num_rows, validate=False)
        lists = fa4_sparsity.fa4_block_sparsity(cpu_mask, *fa4_sparsity.fa4_tile_shape(head_dim), num_heads,
                                                torch.arange(positions.numel()) + (q_offset or 0))
        handed_over = [s.to_fa4() for s in lists]
        ordered = fa4_backend.OPTIONS.schedule == "cost"
        orders = [fa4_sparsity.cost_order(s) if ordered else None for s in lists]
    fake = tuple(t._replace(**{name: torch.empty(x.shape, dtype=x.dtype, device="cuda") for name, x in t._asdict().items()
                               if isinstance(x, torch.Tensor)}) for t in handed_over)
    return (*fake, *(None if o is None else torch.empty(o.shape, dtype=o.dtype, device="cuda") for o in orders))


def _allow_fake_semaphores() -> None:
    """FA4's deterministic backward converts its dQ semaphores with DLPack, which fake tensors lack:
    convert a real CPU tensor of the same shape, strides and dtype instead (only its layout is compiled in)."""
    from flash_attn.cute import utils
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    convert = utils.convert_from_dlpack_leading_static
    if getattr(convert, "fake_aware", False):
        return

    def fake_aware(x, *args, **kwargs):
        if isinstance(x, FakeTensor):
            with unset_fake_temporarily():
                return convert(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype), *args, **kwargs)
        return convert(x, *args, **kwargs)

    fake_aware.fake_aware = True
    utils.convert_from_dlpack_leading_static = fake_aware


def run_case(case, fresh_shape: bool) -> None:
    """Forward + backward of one case on fake CUDA tensors (compiles, launches nothing).
    ``fresh_shape``: other lengths than the case's (the "different mask, same class" run)."""
    from fm_parallel.kernels.fa4 import backend as fa4_backend
    from fm_parallel.kernels.fa4.backend import cute_bwd, cute_fwd
    from fm_parallel.masks.flashmask import FlashMask

    fa4_backend._sparsity = _sparsity_on_cpu
    _allow_fake_semaphores()

    _, d, dtype, b, hq, hkv, bm, hm, m, nq, nk, q_offset = case
    start = q_offset or 0
    if fresh_shape:
        nq, nk, start = nq + 77, nk + 77 + (start > 0) * 40, start + (start > 0) * 40
        q_offset = None if q_offset is None else start
    dev = "cuda"
    q = torch.empty(b, hq, nq, d, dtype=dtype, device=dev)
    k = torch.empty(b, hkv, nk, d, dtype=dtype, device=dev)
    v = torch.empty(b, hkv, nk, d, dtype=dtype, device=dev)
    bounds = [torch.empty(bm, hm, nk, m, dtype=torch.int32, device=dev) for _ in range(2)]
    mask = FlashMask(*bounds, num_rows=max(nk, start + nq), validate=False)
    positions = torch.arange(start, start + nq, device=dev, dtype=torch.int32)
    out, lse = cute_fwd(q, k, v, mask, positions, d**-0.5, q_offset)
    cute_bwd(q, k, v, out, lse, torch.empty_like(out), mask, positions, d**-0.5, None, q_offset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args()
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows = []
    for case in CASES:
        if args.only and args.only not in case[0]:
            continue
        row = {"case": case[0]}
        try:
            from fm_parallel.kernels.fa4.patches import traced

            traced.clear()
            with FakeTensorMode(allow_non_fake_inputs=True):
                before = compiled_kernels()
                t0 = time.perf_counter()
                run_case(case, fresh_shape=False)
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                row["kernels_compiled"] = compiled_kernels() - before
                row["traced"] = dict(traced)  # which masking / schedule the FA4 changes gave the kernels
                before = compiled_kernels()
                run_case(case, fresh_shape=True)
                row["recompiled_for_new_mask"] = compiled_kernels() - before
            row["status"] = "PASS" if row["recompiled_for_new_mask"] == 0 else "FAIL"
        except Exception as e:  # reported per case; the exit code says whether any failed
            row["status"], row["error"] = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        detail = row.get("error") or (f"{row['compile_s']:6.1f} s, {row['kernels_compiled']} kernels, "
                                      f"{row['recompiled_for_new_mask']} more for a new mask of the class, "
                                      + ", ".join(f"{k} {v}" for k, v in sorted(row["traced"].items())))
        print(f"{row['status']}  {case[0]:38s} {detail}", flush=True)
    failed = sum(r["status"] != "PASS" for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} PASS")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
