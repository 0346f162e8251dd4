"""The FlashMask type: validation, dense round trips, converters (Paddle, FlexAttention)."""

import pytest
import torch

from fm_parallel import FlashMask, masks
from tests.helpers import random_intervals
from tests.masks import paddle_reference


@pytest.mark.parametrize("seed", range(4))
def test_random_multi_interval_round_trip(seed):
    fms, fme, picture = random_intervals(2, 3, 37, 29, 4, seed)
    m = FlashMask(fms, fme, 37)
    assert torch.equal(m.to_dense(), picture)
    back = masks.from_dense(picture)
    assert torch.equal(back.to_dense(), picture)
    assert back.max_intervals <= 4
    assert torch.equal(m.visible_pairs(), picture.sum((-1, -2)))


def test_from_dense_float_and_limits():
    causal = masks.causal(6).to_dense()[0, 0]
    additive = torch.zeros(6, 6).masked_fill(~causal, float("-inf"))
    assert torch.equal(masks.from_dense(additive).to_dense()[0, 0], causal)
    hf_style = torch.zeros(6, 6).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert torch.equal(masks.from_dense(hf_style).to_dense()[0, 0], causal)
    with pytest.raises(masks.MaskNotExpressible, match="bias"):
        masks.from_dense(additive + 0.5)
    checker = (torch.arange(10).view(10, 1) + torch.arange(10).view(1, 10)) % 2 == 0
    with pytest.raises(masks.MaskNotExpressible, match="key column 0 needs 5 row intervals, at most 4"):
        masks.from_dense(checker)
    assert masks.from_dense(checker[:8]).max_intervals == 4


def test_shorthand_shapes_and_int64():
    m = FlashMask(torch.arange(5), torch.full((5,), 4))
    assert m.fms.shape == (1, 1, 5, 1) and m.fms.dtype == torch.int32
    assert torch.equal(m.to_dense()[0, 0], masks.causal(5).to_dense()[0, 0])


def test_empty_intervals_are_canonical():
    m = FlashMask(torch.tensor([3, 0]), torch.tensor([1, 1]), 4)
    assert m.fms.flatten().tolist() == [4, 0] and m.fme.flatten().tolist() == [-1, 1]


@pytest.mark.parametrize(
    "fms, fme, rows, message",
    [
        (torch.tensor([0.0, 1.0]), torch.tensor([1, 1]), None, "fms: expected an integer dtype"),
        (torch.tensor([0, 1]), torch.tensor([1, 1, 1]), None, "fme: expected the shape of fms"),
        (torch.tensor([-1, 0]), torch.tensor([1, 1]), None, r"fms: expected rows >= 0, got fms\[0, 0, 0, 0\] = -1"),
        (torch.tensor([0, 0]), torch.tensor([1, 2]), None, "fme: expected rows < num_rows = 2"),
        (torch.tensor([[[[0, 2]]]]), torch.tensor([[[[3, 5]]]]), 8, "expected the non-empty intervals of each column sorted and disjoint"),
        (torch.tensor([[[[4, 0]]]]), torch.tensor([[[[5, 1]]]]), 8, "sorted and disjoint"),
        (torch.zeros(1, 1, 2, 5, dtype=torch.int32), torch.zeros(1, 1, 2, 5, dtype=torch.int32), None, "expected 1 to 4 intervals"),
        (torch.zeros(2, 1, 1, 1, 1, dtype=torch.int32), torch.zeros(2, 1, 1, 1, 1, dtype=torch.int32), None, r"expected shape \[B, Hm, Nk\]"),
        (torch.tensor([0, 1]), torch.tensor([1, 1]), 0, "num_rows: expected a positive int <= 2147483647, got 0"),
        (torch.tensor([0, 1]), torch.tensor([1, 1]), 2**31, r"num_rows: expected a positive int <= 2147483647"),
    ],
)
def test_validation(fms, fme, rows, message):
    with pytest.raises(ValueError, match=message):
        FlashMask(fms, fme, rows)


def test_select_keys_keeps_global_rows():
    m = masks.document([5, 7, 4])
    part = m.select_keys(slice(5, 12))
    assert part.num_rows == 16 and part.num_keys == 7
    assert torch.equal(part.to_dense(), m.to_dense()[..., 5:12])
    idx = torch.tensor([15, 0, 7])
    assert torch.equal(m.select_keys(idx).to_dense(), m.to_dense()[..., idx])
    rows = torch.tensor([3, 14, 6])
    assert torch.equal(m.to_dense(rows=rows), m.to_dense()[:, :, rows])


# ------------------------------------------------------------------ Paddle
# Paddle's own generators and dense reference (tests/masks/paddle_reference.py, ported from
# PaddlePaddle/flash-attention 9985af5). Shapes from Paddle's test_flashmask.py shape_cases, scaled
# down, with Nq != Nk both ways (its causal part is bottom-right aligned).
PADDLE_SHAPES = [(2, 2, 64, 64), (1, 1, 48, 64), (1, 2, 80, 64), (1, 1, 127, 128), (2, 1, 128, 127), (1, 1, 1, 128)]


def _paddle_accepts(x, causal):
    return x.dtype == torch.int32 and x.dim() == 4 and x.shape[-1] in ((1, 2) if causal else (2, 4))


@pytest.mark.parametrize("gen", paddle_reference.GENERATORS, ids=lambda g: g.__name__[len("generate_"):])
def test_from_paddle_matches_paddles_reference_on_paddles_generators(gen):
    for b, h, nq, nk in PADDLE_SHAPES:
        x, causal = gen(b, nq, nk, h)
        want = paddle_reference.startend_row_indices_to_attn_bias(x, nq, x.shape[1], causal)
        m = masks.from_paddle(x, causal, seqlen_q=nq)
        assert m.num_rows == nq and m.num_keys == nk
        assert torch.equal(m.to_dense(), want), (b, h, nq, nk)
        # And back: a form Paddle accepts, with the same picture by Paddle's reference and by ours.
        back, back_causal = masks.to_paddle(m)
        assert _paddle_accepts(back, back_causal)
        assert back.shape[-1] <= x.shape[-1] or back_causal != causal
        assert torch.equal(paddle_reference.startend_row_indices_to_attn_bias(back, nq, x.shape[1], back_causal), want)
        assert torch.equal(masks.from_paddle(back, back_causal, seqlen_q=nq).to_dense(), want)


def test_paddle_document_mask_is_read_as_paddle_computes_it():
    # Paddle's generate_document_mask gives document 1 (rows 3..7) the upper end len_1 = 5, not its
    # start 3: Paddle masks rows 3, 4 of column 3 (raw rows < UTE), where clipping to the upper
    # triangle (the old reading) kept them visible.
    x, causal = paddle_reference.generate_document_mask(1, 10, 10, 1, doc_seqlens=[3, 5, 2])
    assert x[0, 0, 3].tolist() == [8, 5] and not causal
    m = masks.from_paddle(x, causal)
    assert m.to_dense()[0, 0, :, 3].tolist() == [False] * 5 + [True] * 3 + [False] * 2


@pytest.mark.parametrize("causal,width", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("nq,nk", [(1, 1), (9, 9), (7, 12), (12, 7)])
def test_from_paddle_random_raw_rows(causal, width, nq, nk):
    # Any rows in [0, Nq + 2], in any order: Paddle compares them raw (no triangle, no sorting).
    g = torch.Generator().manual_seed(nq * 100 + nk * 10 + width)
    x = torch.randint(0, nq + 3, (2, 3, nk, width), generator=g, dtype=torch.int32)
    want = paddle_reference.startend_row_indices_to_attn_bias(x, nq, 3, causal)
    m = masks.from_paddle(x, causal, seqlen_q=nq)
    assert torch.equal(m.to_dense(), want)
    back, back_causal = masks.to_paddle(m)
    assert _paddle_accepts(back, back_causal)
    assert torch.equal(paddle_reference.startend_row_indices_to_attn_bias(back, nq, 3, back_causal), want)


@pytest.mark.parametrize("seed", range(3))
def test_to_paddle_of_our_masks_or_not_expressible(seed):
    # Random FlashMasks (up to 3 visible ranges per column): to_paddle gives Paddle's picture exactly,
    # or raises MaskNotExpressible exactly when some column has more than 2 masked ranges.
    nq, nk = 11, 9
    fms, fme, picture = random_intervals(1, 2, nq, nk, 3, seed)
    m = FlashMask(fms, fme, nq)
    padded = torch.nn.functional.pad(picture.transpose(-1, -2), (1, 1), value=True)  # [B, H, Nk, Nq + 2]
    masked_ranges = (~padded[..., 1:-1] & padded[..., :-2]).sum(-1)
    if int(masked_ranges.max()) > 2:
        with pytest.raises(masks.MaskNotExpressible, match="Paddle form"):
            masks.to_paddle(m)
        return
    x, causal = masks.to_paddle(m)
    assert _paddle_accepts(x, causal)
    assert torch.equal(paddle_reference.startend_row_indices_to_attn_bias(x, nq, 2, causal), picture)


def test_to_paddle_picks_the_smallest_form_paddle_accepts():
    x, c = masks.to_paddle(masks.document([3, 5, 2]))
    assert c and x.shape[-1] == 1 and x[0, 0, :, 0].tolist() == [3, 3, 3, 8, 8, 8, 8, 8, 10, 10]
    x, c = masks.to_paddle(masks.sliding_window(6, 2))
    assert c and x.shape[-1] == 1 and x[0, 0, :, 0].tolist() == [2, 3, 4, 5, 6, 6]
    gap = masks.causal(6).to_dense()[0, 0]
    gap[2:4, 0] = False  # column 0 masks rows 2, 3 and sees 4, 5 again: causal, width 2
    x, c = masks.to_paddle(masks.from_dense(gap))
    assert c and x[0, 0].tolist() == [[2, 4]] + [[6, 6]] * 5
    # Bidirectional documents: once the non-causal width-1 form (which Paddle refuses), now width 2.
    x, c = masks.to_paddle(masks.document([3, 5, 2], causal=False))
    assert not c and x[0, 0].tolist() == [[3, 0]] * 3 + [[8, 3]] * 5 + [[10, 8]] * 2
    x, c = masks.to_paddle(masks.full(4))
    assert not c and x.shape[-1] == 2
    # SDPA-style top-left causal with more rows than keys is not Paddle's bottom-right causal.
    x, c = masks.to_paddle(masks.causal(4, num_rows=6))
    assert not c and x.shape[-1] == 2
    assert torch.equal(masks.from_paddle(x, c, seqlen_q=6).to_dense(), masks.causal(4, num_rows=6).to_dense())
    # Two masked ranges (above and below a global row): width 4.
    two = torch.ones(5, 5, dtype=torch.bool)
    two[[1, 3], 0] = False
    x, c = masks.to_paddle(masks.from_dense(two))
    assert not c and x.shape[-1] == 4
    with pytest.raises(masks.MaskNotExpressible, match="key column 0 has 3 masked row ranges"):
        stripes = torch.ones(6, 6, dtype=torch.bool)
        stripes[[0, 2, 4], 0] = False
        masks.to_paddle(masks.from_dense(stripes))


@pytest.mark.parametrize(
    "call, message",
    [
        # Paddle's interface.py refuses these (int32 only, rank 4, width 1|2 causal, 2|4 non-causal).
        (lambda: masks.from_paddle(torch.zeros(1, 1, 4, 1, dtype=torch.int32), False), r"expected an int32 tensor \[B, H, Nk, 2 or 4\] with causal=False"),
        (lambda: masks.from_paddle(torch.zeros(1, 1, 4, 4, dtype=torch.int32), True), r"\[B, H, Nk, 1 or 2\] with causal=True"),
        (lambda: masks.from_paddle(torch.zeros(1, 1, 4, 2, dtype=torch.int64), False), "got shape \\(1, 1, 4, 2\\) torch.int64"),
        (lambda: masks.from_paddle(torch.zeros(1, 4, 2, dtype=torch.int32), False), "startend_row_indices: expected an int32 tensor"),
        (lambda: masks.from_paddle([[[[0, 0]]]], False), "got list"),
        (lambda: masks.from_paddle(torch.tensor([[[[2, -1]]]], dtype=torch.int32), False), r"expected rows >= 0, got startend_row_indices\[0, 0, 0, 1\] = -1"),
        (lambda: masks.from_paddle(torch.zeros(1, 1, 4, 2, dtype=torch.int32), 1), r"causal: expected a bool \(True or False\), got 1"),
        (lambda: masks.from_paddle(torch.zeros(1, 1, 4, 2, dtype=torch.int32), False, seqlen_q=0), "seqlen_q: expected an int >= 1, got 0"),
        (lambda: masks.to_paddle(torch.zeros(4, 4)), "mask: expected a FlashMask, got Tensor"),
    ],
)
def test_paddle_refusals(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------ FlexAttention
@pytest.mark.parametrize("heads", [1, 2])
def test_flex_mask_mod_matches_dense(heads):
    from torch.nn.attention.flex_attention import create_mask

    fms, fme, picture = random_intervals(2, heads, 33, 33, 3, seed=heads)
    m = FlashMask(fms, fme, 33)
    got = create_mask(masks.to_flex_mask_mod(m), 2, heads, 33, 33, device="cpu")
    assert torch.equal(got, picture)
    gqa = create_mask(masks.to_flex_mask_mod(m, q_heads=2 * heads), 2, 2 * heads, 33, 33, device="cpu")
    assert torch.equal(gqa, picture.repeat_interleave(2, dim=1))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_agrees_on_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    from fm_parallel import flashmask_attention

    m = masks.union(masks.sliding_window(128, 16, 2), masks.document([64, 64], causal=False))
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    ours = flashmask_attention(q, k, v, mask=m, impl="torch", block_size=32)
    theirs = flex_attention(q, k, v, block_mask=masks.to_block_mask(m))
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_causal_documents_is_known_for_exactly_packed_causal_documents():
    from fm_parallel import masks as m

    assert m.causal(37).causal_documents() == (37,)
    assert m.document([3, 5, 2]).causal_documents() == (3, 5, 2)
    assert m.document(cu_seqlens=[0, 4, 9]).causal_documents() == (4, 5)
    assert m.document(doc_ids=torch.tensor([0, 0, 1, 1, 1, 2])).causal_documents() == (2, 3, 1)
    # not plain causal documents: bidirectional, padding, per-row batches, other families, unions
    for other in (m.document([3, 5, 2], causal=False), m.document([3, 5], n=10), m.document([[3, 5], [4, 4]]),
                  m.sliding_window(10, 3), m.dpo(4, 3, 3), m.prefix_lm(10, 3), m.full(10),
                  m.union(m.document([5, 5]), m.sliding_window(10, 2))):
        assert other.causal_documents() is None, other
    # the same bounds with a second (empty) interval slot still qualify; one row short does not
    assert m.document([6, 4]).expand_intervals(2).causal_documents() == (6, 4)
    c = m.causal(8)
    assert FlashMask(c.fms, c.fme, 9, validate=False).causal_documents() is None


def test_causal_documents_travel_with_to_and_are_forgotten_on_in_place_edits():
    from fm_parallel import masks as m

    docs = m.document([6, 10])
    moved = docs.to("cpu")
    assert moved.causal_documents() == (6, 10)
    made_elsewhere = FlashMask(docs.fms.clone(), docs.fme.clone(), 16, validate=False)
    made_elsewhere._cache.clear()
    made_elsewhere.set_causal_documents(None)  # what a GPU mask says when never told
    assert made_elsewhere.causal_documents() is None
    docs.fme[0, 0, 0, 0] = 15  # no longer documents; the version counter forgets the answer
    assert docs.causal_documents() is None


def test_to_the_same_device_keeps_the_mask_and_its_caches():
    from fm_parallel import masks as m

    docs = m.document([6, 10])
    docs.cached(("anything",), lambda: 1)
    assert docs.to("cpu") is docs and docs.to(torch.device("cpu")) is docs
