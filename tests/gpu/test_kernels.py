"""GPU correctness of the kernels against the float64 reference: outputs, lse and dq / dk / dv.

    python -m pytest -q -rs tests/gpu/test_kernels.py      # on the H200: impl cute and triton, every case

For each case: one forward with ``return_lse=True`` and a backward of ``(out * dout).sum() + (lse *
dlse).sum()`` over the finite lse rows (so the lse gradient path, which the ring merge uses, is
checked too), compared with :func:`fm_parallel.reference.reference_attention` in float64 on the same
GPU. Error measure: ``||x - ref|| / ||ref||`` per tensor (bf16 limit 8e-3, fp16 1.5e-3); lse: max
absolute error on finite rows and exact -inf rows where the reference row sees no key.

Cases: every mask family (causal, packed docs with empty rows, bidirectional docs, DPO, reward model,
prefix-LM, sliding window + sinks, global rows + window, a multi-interval union) at an odd N, GQA
(8 query / 2 KV heads), head dims 64 / 128 / 256, fp16 and bf16, masks per batch row and per head, and a
query chunk with a row offset (Nq != Nk, what ring attention runs). ``impl="cute"`` must also take FA4's
own causal / varlen kernel on the cases that say so. Was ``launch/bench/verify_gpu.py`` (issue 32.3).
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from fm_parallel import FlashMask, flashmask_attention, masks
from fm_parallel.reference import reference_attention
from tests.gpu import needs_cuda

LIMITS = {torch.bfloat16: 8e-3, torch.float16: 1.5e-3}  # ~5x the rounding error of bf16 / fp16 outputs
N = 1001  # odd: ragged tiles
# Cases that must run FA4's own kernel under impl="cute" (masks that know they are causal documents).
FA4_PATHS = {"(varlen path)": "fa4_varlen", "(causal path)": "fa4_causal"}


def families(n: int) -> dict[str, FlashMask]:
    """The mask families of the kernel issue, sized for ``n`` rows (several 128-row tiles, ragged)."""
    third = n // 3
    return {
        "causal": masks.causal(n),
        "docs_with_padding": masks.document([third, 0, third + 7, n // 5], n=n),  # padding rows see nothing
        "docs_bidirectional": masks.document([n // 2, n - n // 2], causal=False),
        "dpo": masks.dpo(n // 2, n // 4, n - n // 2 - n // 4),
        "reward_model": masks.preference(n // 4, [n // 4, n // 4, n - 3 * (n // 4)]),
        "prefix_lm_docs": masks.prefix_lm(prefix_len=[n // 8, 40], lengths=[n // 2, n - n // 2]),
        "sliding_window_sinks": masks.sliding_window(n, 300, sinks=4),
        # 6 global rows that read every key, + the window: 2 intervals, one query block far heavier than
        # the rest (the cost-ordered schedule runs it first; every block must still run exactly once)
        "global_rows_window": masks.union(masks.sliding_window(n, 300, sinks=4), masks.FlashMask(
            torch.zeros(n, dtype=torch.int32), torch.full((n,), 5, dtype=torch.int32))),
        # packed docs whose last 200 rows also read every earlier token (a summary): 2 intervals per column
        "multi_interval": masks.union(masks.document([third, third, n - 2 * third]),
                                      masks.intersect(masks.causal(n), masks.FlashMask(
                                          torch.full((n,), n - 200), torch.full((n,), n - 1)))),
    }


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref.detach()).norm() / ref.detach().norm().clamp_min(1e-30))


def check(impl, mask, b, hq, hkv, nq, d, dtype, q_offset=0, seed=0, device="cuda") -> dict:
    """Run one case; returns the errors and PASS / FAIL. ``q_offset``: an int (consecutive rows) or a
    tensor of ``nq`` global rows (a zigzag shard, passed as ``q_positions``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nk = mask.num_keys
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=g).requires_grad_()
    dout = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=g)
    dlse = torch.randn(b, hq, nq, device=device, generator=g)
    explicit = isinstance(q_offset, torch.Tensor)
    rows = q_offset.to(device) if explicit else torch.arange(q_offset, q_offset + nq, device=device)
    where = {"q_positions": rows} if explicit else {"q_offset": q_offset}

    def loss(out, lse):
        finite = torch.isfinite(lse)
        return (out.float() * dout.float()).sum() + (torch.where(finite, lse, torch.zeros_like(lse)) * dlse).sum()

    taken = _paths(impl)
    out, lse = flashmask_attention(q, k, v, mask=mask, impl=impl, return_lse=True, **where)
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    taken = sorted((_paths(impl) - taken).elements())  # which kernel ran (cute: FA4 causal / varlen / block sparse)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(q64, k64, v64, mask, q_positions=rows)
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), (q64, k64, v64))

    finite = torch.isfinite(ref_lse)
    result = {"out": rel(out, ref_out), **{n: rel(x, r) for n, x, r in zip(("dq", "dk", "dv"), grads, ref_grads)}}
    result["lse_max_abs"] = float((lse.detach().double() - ref_lse.detach())[finite].abs().max()) if finite.any() else 0.0
    result["empty_rows_ok"] = bool(torch.equal(torch.isfinite(lse), finite))
    result["nan"] = any(bool(torch.isnan(t).any()) for t in (out, lse, *grads))
    limit = LIMITS[dtype]
    ok = (all(result[n] < limit for n in ("out", "dq", "dk", "dv")) and result["lse_max_abs"] < 50 * limit
          and result["empty_rows_ok"] and not result["nan"])
    return {**result, "path": taken[0] if taken else impl, "status": "PASS" if ok else "FAIL"}


def _paths(impl: str) -> Counter:
    if impl != "cute":
        return Counter()
    from fm_parallel.kernels.fa4 import backend as fa4_backend

    return Counter(fa4_backend.paths)


def cases(n: int, device: str):
    """(name, mask, batch, Hq, Hkv, Nq, D, dtype, q_offset: int or a tensor of rows)."""
    fam = families(n)  # built once: the later cases reuse these masks
    for name, m in fam.items():
        yield name, m.to(device), 1, 8, 2, n, 128, torch.bfloat16, 0
    docs, dpo = fam["docs_with_padding"].to(device), fam["dpo"].to(device)
    for d in (64, 256):
        yield f"docs_with_padding D={d}", docs, 1, 8, 2, n, d, torch.bfloat16, 0
    yield "docs_with_padding fp16", docs, 1, 8, 2, n, 128, torch.float16, 0
    yield "dpo ring chunk (Nq = N/3 at row N/3)", dpo, 1, 8, 2, n // 3, 128, torch.bfloat16, n // 3
    sixth = n // 6
    zigzag = torch.cat([torch.arange(sixth), torch.arange(n - sixth, n)])  # rank 0 of 3 under zigzag
    yield "dpo zigzag shard (explicit rows)", dpo, 1, 8, 2, 2 * sixth, 128, torch.bfloat16, zigzag
    # Masks that know they are causal documents (built on the CPU, moved with .to): FA4's own kernels.
    packed = masks.document([n // 3, n // 4 + 5, n - n // 3 - n // 4 - 5]).to(device)
    yield "packed causal docs, no padding (varlen path)", packed, 1, 8, 2, n, 128, torch.bfloat16, 0
    yield "packed causal docs D=64 fp16 (varlen path)", packed, 1, 4, 4, n, 64, torch.float16, 0
    yield "causal B=2 (causal path)", fam["causal"].to(device), 2, 8, 2, n, 128, torch.bfloat16, 0
    per_batch = masks.stack([fam["dpo"], fam["sliding_window_sinks"]]).to(device)
    yield "mask per batch row (B=2)", per_batch, 2, 8, 2, n, 128, torch.bfloat16, 0
    two = masks.stack([fam["causal"], fam["sliding_window_sinks"]])  # [2, 1, N, M]
    per_kv_head = FlashMask(two.fms.transpose(0, 1), two.fme.transpose(0, 1), n).to(device)  # [1, 2, N, M]
    yield "mask per KV head (Hm=2)", per_kv_head, 1, 8, 2, n, 128, torch.bfloat16, 0


@functools.lru_cache(maxsize=2)
def case_table(n: int, device: str) -> dict:
    """name -> the arguments of :func:`check` (the masks built once per device)."""
    return {name: args for name, *args in cases(n, device)}


CASE_NAMES = list(case_table(N, "cpu"))


def run_case(impl: str, name: str, n: int, device: str) -> dict:
    """One case through ``impl``, with the FA4 kernel the case must take under ``cute``."""
    mask, b, hq, hkv, nq, d, dtype, q_offset = case_table(n, device)[name]
    result = check(impl, mask, b, hq, hkv, nq, d, dtype, q_offset, device=device)
    want = next((path for tag, path in FA4_PATHS.items() if tag in name), None)
    if impl == "cute" and want and result["path"] != want and result["status"] == "PASS":
        result["status"], result["error"] = "FAIL", f"expected FA4's {want} kernel, ran {result['path']}"
    return result


@needs_cuda
@pytest.mark.parametrize("impl", ["cute", "triton"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_the_kernel_matches_the_float64_reference(impl, name):
    if impl == "cute":
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 not importable (the [cute] extra, or FM_FA4_SITE)")
    result = run_case(impl, name, N, "cuda")
    assert result["status"] == "PASS", result


def test_the_cases_pass_on_the_cpu_through_the_pytorch_path():
    """The cases, the reference, the limits and the checks themselves, run through impl="torch" on the
    CPU, so that a GPU session never finds this file broken."""
    rows = {name: run_case("torch", name, 301, "cpu") for name in case_table(301, "cpu")}
    assert len(rows) == len(CASE_NAMES) == 19
    assert {name: r["status"] for name, r in rows.items() if r["status"] != "PASS"} == {}, rows
    assert "global_rows_window" in rows  # the heavy-block case of the launch order
    assert {r["path"] for r in rows.values()} == {"torch"}
    assert all({"out", "dq", "dk", "dv", "lse_max_abs"} <= set(r) for r in rows.values())


@needs_cuda
@pytest.mark.parametrize("impl", ["cute", "triton"])
def test_a_backends_store_never_keeps_a_mask_alive(impl):
    """What a GPU backend derives from a mask (plans, FA4 block lists, bounds, recorded launches) lives in
    the backend's store keyed weakly by the mask (fm_parallel/derived.py): freed with the mask, so no
    value may hold the mask itself. Several calls, so FA4's launches are recorded and replayed."""
    import gc

    from fm_parallel.derived import derived_for_mask

    if impl == "cute":
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 not importable (the [cute] extra, or FM_FA4_SITE)")
    store = derived_for_mask("fa4" if impl == "cute" else "triton")
    store.clear()
    q, k, v = (torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = masks.sliding_window(1024, 200, sinks=4).to("cuda")
    for _ in range(3):
        flashmask_attention(q, k, v, mask=mask, impl=impl).sum().backward()
    assert len(store) == 1
    del mask
    gc.collect()
    assert len(store) == 0, "a value of the backend's store holds the mask"
