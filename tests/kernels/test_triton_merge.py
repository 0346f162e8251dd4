"""The ring's fused log-sum-exp merge (kernels/triton_merge.py, the Triton interpreter here) against
the PyTorch merge: strided row windows of a running output, in place, rows that saw nothing."""

import pytest
import torch

from fm_parallel.distributed.merge import merge


@pytest.mark.parametrize("dv", [8, 24])
def test_fused_merge_matches_the_torch_merge_in_place_on_a_row_window(dv):
    pytest.importorskip("triton")
    from fm_parallel.kernels.triton_merge import merge_into

    torch.manual_seed(0)
    b, h, n = 2, 3, 40
    out = torch.randn(b, h, n, dv)
    lse = torch.randn(b, h, n)
    lse[:, :, :5] = float("-inf")  # rows the running result never saw
    o = torch.randn(b, h, 17, dv)
    l = torch.randn(b, h, 17)
    l[:, :, :2] = float("-inf")  # rows neither part saw (0 .. 1 of the window, rows 10 .. 11 of out)
    rows = slice(10, 27)
    lse[:, :, 10:12] = float("-inf")
    want_out, want_lse = out.clone(), lse.clone()
    m, ml = merge(out[:, :, rows], lse[:, :, rows], o, l)
    want_out[:, :, rows], want_lse[:, :, rows] = m, ml
    merge_into(out[:, :, rows], lse[:, :, rows], out[:, :, rows], lse[:, :, rows], o, l)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all() and torch.equal(out[:, :, 10:12], torch.zeros_like(out[:, :, 10:12]))
