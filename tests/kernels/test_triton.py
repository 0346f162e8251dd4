"""Triton kernels (forward, dK/dV, dQ) against the float64 oracle.

On a machine without a GPU they run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes; on a GPU the same tests run the compiled kernels.
"""

import pytest
import torch

from fm_parallel import FlashMask, flashmask_attention, masks
from fm_parallel.kernels.plan import build_plan
from fm_parallel.masks import TileClass
from fm_parallel.reference import reference_attention
from tests.helpers import assert_matches_reference, qkv
from tests.helpers import truth
from tests.helpers import random_intervals
from tests.helpers import mask_families

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 77
FAMILIES = mask_families(N)


def on_device(*ts):
    return [t.detach().to(DEVICE).requires_grad_() for t in ts]


def run(q, k, v, m, **kw):
    return lambda: flashmask_attention(q, k, v, mask=m.to(DEVICE), impl="triton", **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_family(family, dtype):
    q, k, v = on_device(*qkv(1, 2, 1, N, 32, dtype, seed=len(family)))
    m = FAMILIES[family]
    assert_matches_reference(run(q, k, v, m), q, k, v, m.to(DEVICE))


@pytest.mark.parametrize("hq,hkv,hm", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (3, 1, 3)])
def test_multi_interval_gqa_and_mask_heads(hq, hkv, hm):
    fms, fme, _ = random_intervals(2, hm, 70, 70, 4, seed=hq + hm)
    m = FlashMask(fms, fme, 70)
    q, k, v = on_device(*qkv(2, hq, hkv, 70, 16, torch.float32, seed=hm))
    assert_matches_reference(run(q, k, v, m), q, k, v, m.to(DEVICE))


@pytest.mark.parametrize("d", [64, 96, 128])
def test_head_dims(d):
    m = masks.dpo(30, 20, 20)
    q, k, v = on_device(*qkv(1, 1, 1, 70, d, torch.float16, seed=d))
    assert_matches_reference(run(q, k, v, m), q, k, v, m.to(DEVICE))


@pytest.mark.parametrize("n", [1, 63, 130])
def test_odd_lengths(n):
    m = masks.document([n // 3, n - n // 3]) if n > 1 else masks.causal(1)
    q, k, v = on_device(*qkv(1, 2, 2, n, 16, torch.float32, seed=n))
    assert_matches_reference(run(q, k, v, m), q, k, v, m.to(DEVICE))


def test_query_slice_key_chunk_and_positions():
    m = masks.union(masks.document([40, 50, 38]), masks.sliding_window(128, 6, sinks=2))
    q, k, v = qkv(1, 2, 1, 128, 16, torch.float64)
    ref, ref_lse = reference_attention(q, k, v, m)
    qd, kd, vd = (t.detach().float().to(DEVICE) for t in (q, k, v))
    md = m.to(DEVICE)
    # A ring step: queries 64..127 against key chunk 32..95, rows global.
    cols = slice(32, 96)
    out, lse = flashmask_attention(qd[:, :, 64:], kd[:, :, cols], vd[:, :, cols], mask=md.select_keys(cols),
                                   q_offset=64, impl="triton", return_lse=True)
    r, rl = reference_attention(q[:, :, 64:], k[:, :, cols], v[:, :, cols], m.select_keys(cols), q_positions=torch.arange(64, 128))
    torch.testing.assert_close(out.double().cpu(), r, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), rl, atol=2e-5, rtol=0)
    # A zigzag shard: head and tail rows.
    pos = torch.cat([torch.arange(0, 20), torch.arange(100, 128)])
    zq = qd[:, :, pos].clone().requires_grad_()
    kk, vv = kd.clone().requires_grad_(), vd.clone().requires_grad_()
    assert_matches_reference(
        lambda: flashmask_attention(zq, kk, vv, mask=md, q_positions=pos.to(DEVICE), impl="triton"),
        zq, kk, vv, md, positions=pos.to(DEVICE),
    )
    torch.testing.assert_close(
        flashmask_attention(zq, kk, vv, mask=md, q_positions=pos.to(DEVICE), impl="triton").double().cpu(),
        ref[:, :, pos], atol=2e-5, rtol=0,
    )


def test_fully_masked_rows_and_lse_gradient():
    m = masks.document([20, 0, 25], n=64)  # rows 45..63 see nothing
    q, k, v = on_device(*qkv(1, 2, 2, 64, 16, torch.float32))
    out, lse = flashmask_attention(q, k, v, mask=m.to(DEVICE), impl="triton", return_lse=True)
    assert (out[:, :, 45:] == 0).all() and (lse[:, :, 45:] == float("-inf")).all()
    w = torch.randn(lse.shape, device=DEVICE)
    (out.sum() + (torch.where(torch.isinf(lse), 0.0, lse) * w).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    r, rl = reference_attention(q64, k64, v64, m)
    (r.sum() + (torch.where(torch.isinf(rl), 0.0, rl) * w.double().cpu()).sum()).backward()
    for a, b in zip((q, k, v), (q64, k64, v64)):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("transposed", [False, True])
def test_plan_lists_exactly_the_non_skipped_tiles(transposed):
    m = masks.union(masks.dpo(40, 30, 27), masks.sliding_window(97, 5))
    plan = build_plan(m, torch.arange(97), 16, 8, transposed)
    want = truth(m.to_dense()[0, 0], torch.arange(97), 16, 8)
    want[:, -1] = torch.where(want[:, -1] == TileClass.FULL, TileClass.PARTIAL, want[:, -1])  # ragged last key block
    if transposed:
        want = want.T
    got = torch.zeros_like(want)
    for cls, off, runs in ((TileClass.FULL, plan.full_offsets, plan.full_runs), (TileClass.PARTIAL, plan.part_offsets, plan.part_runs)):
        for o in range(want.shape[0]):
            for r in range(int(off[o]), int(off[o + 1])):
                got[o, int(runs[r, 0]) : int(runs[r, 1])] = cls
    # The rule may call a tile partial that is in truth full; never the other way round.
    assert torch.equal(got == TileClass.SKIP, want == TileClass.SKIP)
    assert not ((got == TileClass.FULL) & (want != TileClass.FULL)).any()


def test_torch_compile_full_graph_without_recompiling_for_a_new_mask():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v, m: flashmask_attention(q, k, v, mask=m, impl="triton"), backend=counter, fullgraph=True)
    q, k, v = on_device(*qkv(1, 2, 1, 64, 16, torch.float32))
    for m in (masks.document([20, 44]), masks.dpo(20, 22, 22), masks.sliding_window(64, 9, sinks=1)):
        m = m.to(DEVICE)
        out = compiled(q, k, v, m)
        out.sum().backward()
        ref, _ = reference_attention(*(t.detach().double() for t in (q, k, v)), m)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
        assert torch.isfinite(q.grad).all()
    assert counter.frame_count == 1  # new masks are new data, not new graphs


def test_in_place_edit_of_the_bounds_is_not_served_a_stale_plan():
    q, k, v = (t.detach() for t in on_device(*qkv(1, 1, 1, 64, 16, torch.float32)))
    m = masks.causal(64).to(DEVICE)
    first = flashmask_attention(q, k, v, mask=m, impl="triton")
    m.fme.fill_(0)  # now only row 0 sees anything: a different mask in the same storage
    m.fms[..., 1:, :] = 64
    second = flashmask_attention(q, k, v, mask=FlashMask(m.fms, m.fme, 64), impl="triton")
    ref, _ = reference_attention(q.double(), k.double(), v.double(), FlashMask(m.fms, m.fme, 64))
    torch.testing.assert_close(second.double(), ref, atol=2e-5, rtol=0)
    assert not torch.allclose(first, second)


def test_both_orientations_from_one_classification():
    from fm_parallel.kernels.plan import build_plans

    m = masks.union(masks.document([50, 47]), masks.sliding_window(97, 4, sinks=1))
    pos = torch.arange(97)
    fwd, kv = build_plans(m, pos, 16, 8)
    for got, want in ((fwd, build_plan(m, pos, 16, 8, False)), (kv, build_plan(m, pos, 16, 8, True))):
        for name in ("full_offsets", "full_runs", "part_offsets", "part_runs", "order"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_backward_is_bitwise_reproducible_and_deterministic_true_is_accepted():
    fms, fme, _ = random_intervals(1, 2, 70, 70, 2, seed=8)
    m = FlashMask(fms, fme, 70).to(DEVICE)
    grads = []
    for deterministic in (False, True, True):
        q, k, v = on_device(*qkv(1, 4, 2, 70, 16, torch.float32, seed=9))
        flashmask_attention(q, k, v, mask=m, impl="triton", deterministic=deterministic).sum().backward()
        grads.append([x.grad for x in (q, k, v)])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))


def test_64_bit_offsets_are_chosen_past_2_to_the_31_elements():
    from fm_parallel.kernels.triton import backend as tf

    m = masks.causal(1 << 20)
    small = torch.empty(1, 16, 1 << 20, 128, device="meta")  # 2^31 elements: offsets up to 2^31 - 1 still fit
    big = torch.empty(1, 32, 1 << 20, 128, device="meta")
    assert tf._meta(small, small, m)["WIDE"] is False
    assert tf._meta(small, small, m, big)["WIDE"] is True
    # A [B, N, H, D] tensor seen as [B, H, N, D]: the span, not the shape, decides.
    seq_major = torch.empty(1, 1 << 20, 32, 128, device="meta").transpose(1, 2)
    assert tf._meta(seq_major, seq_major, m)["WIDE"] is True


def test_64_bit_offset_path_matches_the_reference(monkeypatch):
    """The WIDE variant (forced on small shapes) computes exactly what the 32-bit one does."""
    from fm_parallel.kernels.triton import backend as tf

    meta = tf._meta
    monkeypatch.setattr(tf, "_meta", lambda *a: {**meta(*a), "WIDE": True})
    fms, fme, _ = random_intervals(1, 2, 70, 70, 2, seed=5)
    m = FlashMask(fms, fme, 70)
    q, k, v = on_device(*qkv(1, 4, 2, 70, 16, torch.float32, seed=4))
    assert_matches_reference(run(q, k, v, m), q, k, v, m.to(DEVICE))


def test_backward_preprocess_kernel_matches_torch():
    from fm_parallel.kernels.triton import backend as tf

    g = torch.Generator().manual_seed(3)
    out, dout = (torch.randn(2, 3, 37, 24, generator=g).to(DEVICE) for _ in range(2))
    dlse = torch.randn(2, 3, 37, generator=g).to(DEVICE)
    want = (out.double() * dout.double()).sum(-1)
    torch.testing.assert_close(tf._delta(out, dout, None).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tf._delta(out, dout, dlse).double(), want - dlse.double(), atol=1e-5, rtol=1e-5)
    strided = torch.randn(2, 37, 3, 24, generator=g).to(DEVICE).transpose(1, 2)  # [B, N, H, D] seen as [B, H, N, D]
    torch.testing.assert_close(tf._delta(strided, dout, None).double(), (strided.double() * dout.double()).sum(-1),
                               atol=1e-5, rtol=1e-5)
    assert tf._delta(out[:, :, :0], dout[:, :, :0], None).shape == (2, 3, 0)


@pytest.mark.parametrize("layout", ["broadcast_heads", "sequence_major"])
def test_output_gradient_in_any_layout(layout):
    """dO as autograd hands it over: broadcast over heads (stride 0, e.g. the gradient of a head
    mean) or sequence-major ([B, N, H, D] seen as [B, H, N, D]); the preprocess and both passes read it
    through its strides."""
    fms, fme, _ = random_intervals(1, 1, 70, 70, 2, seed=15)
    m = FlashMask(fms, fme, 70).to(DEVICE)
    g = torch.Generator().manual_seed(16)
    if layout == "broadcast_heads":
        dout = torch.randn(1, 1, 70, 16, generator=g).expand(1, 4, 70, 16)
    else:
        dout = torch.randn(1, 70, 4, 16, generator=g).transpose(1, 2)
    q, k, v = on_device(*qkv(1, 4, 2, 70, 16, torch.float32, seed=17))
    flashmask_attention(q, k, v, mask=m, impl="triton").backward(dout.to(DEVICE))
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, m.to("cpu"))[0].backward(dout.double())
    for a, b in zip((q, k, v), (q64, k64, v64)):
        torch.testing.assert_close(a.grad.double().cpu(), b.grad, atol=5e-5, rtol=1e-4)
