"""The blockwise PyTorch path (impl="torch") and the dense path against the float64 oracle."""

import pytest
import torch

from fm_parallel import FlashMask, flashmask_attention, masks
from fm_parallel.reference import reference_attention
from tests.helpers import assert_matches_reference, mask_families, qkv
from tests.helpers import random_intervals

N = 77


FAMILIES = mask_families(N)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["torch", "dense"])
def test_every_family(family, dtype, impl):
    q, k, v = qkv(1, 4, 2, N, 16, dtype, seed=hash(family) % 1000)
    m = FAMILIES[family]
    assert_matches_reference(lambda: flashmask_attention(q, k, v, mask=m, impl=impl, block_size=16), q, k, v, m)


@pytest.mark.parametrize("hq,hkv,hm", [(4, 4, 1), (4, 2, 1), (4, 2, 2), (4, 2, 4), (6, 1, 6)])
@pytest.mark.parametrize("batch_mask", [1, 2])
def test_gqa_and_mask_heads(hq, hkv, hm, batch_mask):
    fms, fme, _ = random_intervals(batch_mask, hm, N, N, 4, seed=hq * 10 + hm)
    m = FlashMask(fms, fme, N)
    q, k, v = qkv(2, hq, hkv, N, 8, torch.float32, seed=hm)
    assert_matches_reference(lambda: flashmask_attention(q, k, v, mask=m, block_size=16), q, k, v, m)


def test_fp16_and_value_dim():
    q, k, v = qkv(1, 2, 2, N, 16, torch.float16, dv=24)
    m = FAMILIES["dpo"]
    assert_matches_reference(lambda: flashmask_attention(q, k, v, mask=m, block_size=32), q, k, v, m)


@pytest.mark.parametrize("n", [1, 63, 130])
def test_odd_lengths_and_block_sizes(n):
    m = masks.document([n // 2, n - n // 2]) if n > 1 else masks.causal(1)
    q, k, v = qkv(1, 2, 1, n, 8, torch.float32, seed=n)
    for block in (1, 16, 64, 1000):
        if n > 63 and block == 1:
            continue
        assert_matches_reference(lambda: flashmask_attention(q, k, v, mask=m, block_size=block), q, k, v, m)


def test_query_slice_with_offset_and_positions():
    m = masks.document([40, 60, 28])
    q, k, v = qkv(1, 2, 2, 128, 8, torch.float64)
    full_out = flashmask_attention(q, k, v, mask=m)
    part = flashmask_attention(q[:, :, 32:96], k, v, mask=m, q_offset=32)
    torch.testing.assert_close(part, full_out[:, :, 32:96], rtol=0, atol=1e-12)
    pos = torch.cat([torch.arange(0, 16), torch.arange(112, 128)])  # a zigzag shard
    zz = flashmask_attention(q[:, :, pos], k, v, mask=m, q_positions=pos)
    torch.testing.assert_close(zz, full_out[:, :, pos], rtol=0, atol=1e-12)
    qs = q[:, :, pos].detach().clone().requires_grad_()
    assert_matches_reference(lambda: flashmask_attention(qs, k, v, mask=m, q_positions=pos, block_size=8), qs, k, v, m, positions=pos)


def test_key_chunk_with_global_rows():
    """A ring step: local queries against one key chunk, columns selected, rows global."""
    m = masks.dpo(50, 40, 38)
    q, k, v = qkv(1, 2, 2, 128, 8, torch.float64)
    rows, cols = slice(64, 128), slice(0, 64)
    out, lse = flashmask_attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask=m.select_keys(cols), q_offset=64, return_lse=True)
    ref, ref_lse = reference_attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], m.select_keys(cols), q_positions=torch.arange(64, 128))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_fully_masked_rows_are_zero_without_nan():
    m = masks.document([10, 0, 10], n=32)  # rows 20..31 are padding
    q, k, v = qkv(1, 2, 2, 32, 8, torch.float32)
    out, lse = flashmask_attention(q, k, v, mask=m, return_lse=True, block_size=8)
    assert (out[:, :, 20:] == 0).all() and torch.isinf(lse[:, :, 20:]).all() and (lse[:, :, 20:] < 0).all()
    (out.sum() + lse[:, :, :20].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 20:] == 0).all() and (k.grad[:, :, 20:] == 0).all()


def test_lse_output_and_its_gradient():
    m = FAMILIES["sliding_sinks"]
    q, k, v = qkv(1, 2, 1, N, 8, torch.float64)
    out, lse = flashmask_attention(q, k, v, mask=m, return_lse=True, block_size=16)
    ref, ref_lse = reference_attention(q, k, v, m)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    w = torch.randn_like(ref_lse)
    g = torch.autograd.grad((out.sum() + (lse * w).sum()), (q, k, v))
    g_ref = torch.autograd.grad((ref.sum() + (ref_lse * w).sum()), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
