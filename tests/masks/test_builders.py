"""Every builder against its dense picture (exact equality), at ugly sizes."""

import random

import pytest
import torch

from fm_parallel import masks
from tests.masks import pictures

SIZES = [1, 63, 1000]


def random_lengths(n, rng, mean=None, pad=0):
    """Random document lengths summing to n - pad, zero-length documents included."""
    mean = mean or max(1, n // 5)
    out, left = [], n - pad
    while left > 0:
        length = min(left, rng.choice([0, 1, rng.randint(1, 2 * mean)]))
        out.append(length)
        left -= length
    return out


def dense(mask, n=None):
    d = mask.to_dense(n)
    assert d.shape[:2] == (1, 1)
    return d[0, 0]


@pytest.mark.parametrize("n", SIZES)
def test_causal_and_full(n):
    assert torch.equal(dense(masks.causal(n)), pictures.causal(n))
    assert torch.equal(dense(masks.full(n)), pictures.full(n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_document_lengths_cu_seqlens_doc_ids(n, is_causal, seed):
    rng = random.Random(seed)
    pad = rng.randint(0, n // 4)
    lengths = random_lengths(n, rng, pad=pad)
    want = pictures.document(lengths, n, is_causal)
    by_len = masks.document(lengths, causal=is_causal, n=n)
    assert torch.equal(dense(by_len), want)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    assert torch.equal(dense(masks.document(cu_seqlens=torch.tensor(cu), causal=is_causal, n=n)), want)
    ids = pictures.segment_ids(lengths, n)
    assert torch.equal(dense(masks.document(doc_ids=ids, causal=is_causal)), want)


def test_document_per_batch_row():
    rows = [[3, 4, 0, 2], [9], [1, 1, 1]]
    m = masks.document(rows, n=10)
    assert m.fms.shape == (3, 1, 10, 1)
    for b, lengths in enumerate(rows):
        assert torch.equal(m.to_dense()[b, 0], pictures.document(lengths, 10))


def test_document_rejects_split_document():
    with pytest.raises(ValueError, match="doc_ids: expected every document to be one contiguous run"):
        masks.document(doc_ids=torch.tensor([0, 0, 1, 0]))


@pytest.mark.parametrize("n", SIZES)
def test_prefix_lm(n):
    for p in sorted({0, n // 3, n}):
        assert torch.equal(dense(masks.prefix_lm(n, p)), pictures.prefix_lm_docs([n], [p], n))


@pytest.mark.parametrize("n", [63, 1000])
def test_prefix_lm_per_document(n):
    rng = random.Random(n)
    lengths = random_lengths(n, rng, pad=3)
    prefixes = [rng.randint(0, length) for length in lengths]
    got = masks.prefix_lm(prefix_len=prefixes, lengths=lengths, n=n)
    assert torch.equal(dense(got), pictures.prefix_lm_docs(lengths, prefixes, n))
    scalar = masks.prefix_lm(prefix_len=5, lengths=lengths, n=n)
    assert torch.equal(dense(scalar), pictures.prefix_lm_docs(lengths, [min(5, x) for x in lengths], n))


@pytest.mark.parametrize("n", [3, 63, 1000])
def test_dpo_single_and_packed(n):
    p, c = n // 3, n // 3
    r = n - p - c
    assert torch.equal(dense(masks.dpo(p, c, r)), pictures.preference([(p, [c, r])], n))
    pairs = [(n // 10, n // 10, n // 20), (1, n // 7, n // 9), (n // 8, 1, 1)]
    got = masks.dpo([a for a, _, _ in pairs], [b for _, b, _ in pairs], [c for _, _, c in pairs], n=n)
    assert torch.equal(dense(got), pictures.preference([(a, [b, c]) for a, b, c in pairs], n))


@pytest.mark.parametrize("n", [63, 1000])
def test_preference_reward_model_k_responses(n):
    samples = [(n // 9, [n // 13, n // 17, 1, n // 11]), (2, [3, 5])]
    got = masks.preference([p for p, _ in samples], [r for _, r in samples], n=n)
    assert torch.equal(dense(got), pictures.preference(samples, n))
    one = masks.preference(n // 4, [n // 4, n // 4, n // 4])
    assert torch.equal(dense(one), pictures.preference([(n // 4, [n // 4] * 3)], 4 * (n // 4)))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("window,sinks", [(1, 0), (7, 0), (16, 4), (5000, 2)])
def test_sliding_window(n, window, sinks):
    assert torch.equal(dense(masks.sliding_window(n, window, sinks)), pictures.sliding_window(n, window, sinks))


@pytest.mark.parametrize("n", [63, 1000])
def test_union_and_intersect(n):
    rng = random.Random(7)
    lengths = random_lengths(n, rng)
    doc, sw = masks.document(lengths, n=n), masks.sliding_window(n, 9, 2)
    bidir = masks.document(random_lengths(n, rng), causal=False, n=n)
    assert torch.equal(dense(masks.intersect(doc, sw)), dense(doc) & dense(sw))
    u = masks.union(sw, bidir)
    assert torch.equal(dense(u), dense(sw) | dense(bidir))
    three = masks.union(sw, bidir, masks.prefix_lm(n, n // 5))
    assert torch.equal(dense(three), dense(sw) | dense(bidir) | dense(masks.prefix_lm(n, n // 5)))


def test_union_too_many_intervals_raises():
    # Five disjoint stripes in one column cannot be held in 4 intervals.
    n = 20
    stripes = [masks.from_dense(_rows_mask(n, range(4 * s, 4 * s + 2))) for s in range(5)]
    with pytest.raises(masks.MaskNotExpressible, match="needs 5 row intervals"):
        masks.union(*stripes)
    with pytest.raises(ValueError, match=r"max_intervals: expected an int in \[1, 4\], got 5"):
        masks.union(*stripes, max_intervals=5)
    assert masks.union(*stripes[:4]).max_intervals == 4


def _rows_mask(n, rows):
    m = torch.zeros(n, n, dtype=torch.bool)
    m[list(rows)] = True
    return m


def test_stack_rows():
    a, b = masks.causal(8), masks.union(masks.sliding_window(8, 2), masks.document([4, 4], causal=False))
    s = masks.stack([a, b])
    assert s.batch == 2 and torch.equal(s.to_dense()[0, 0], dense(a)) and torch.equal(s.to_dense()[1, 0], dense(b))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: masks.causal(0), "n: expected an int >= 1, got 0"),
        (lambda: masks.document([3, -1]), r"lengths\[1\]: expected an int >= 0, got -1"),
        (lambda: masks.document([3, 4], n=5), "n: expected at least the longest row"),
        (lambda: masks.document([3], doc_ids=torch.zeros(3)), "exactly one of lengths, cu_seqlens, doc_ids"),
        (lambda: masks.document(cu_seqlens=[1, 3]), "cu_seqlens: expected a non-decreasing list starting at 0"),
        (lambda: masks.prefix_lm(5, 6), "prefix_len: expected at most n=5, got 6"),
        (lambda: masks.prefix_lm(prefix_len=[1], lengths=[2, 2]), "prefix_len: expected one prefix per document"),
        (lambda: masks.sliding_window(5, 0), "window: expected an int >= 1, got 0"),
        (lambda: masks.dpo([1, 2], [1], [1, 1]), "expected 2 entries like prompt_len"),
        (lambda: masks.preference(3, []), "at least one response"),
        (lambda: masks.union(masks.causal(4), masks.causal(5)), r"masks\[1\]: expected num_keys=4, num_rows=4, device=cpu like masks\[0\]"),
        # The argument at fault is named (an empty list once blamed n), and sizes past int32 rows are refused.
        (lambda: masks.document([]), r"lengths: expected at least one non-empty document"),
        (lambda: masks.document([0, 0]), r"lengths: expected at least one non-empty document"),
        (lambda: masks.document([2**30, 2**30]), r"lengths: expected rows of at most 2147483647 tokens"),
        (lambda: masks.document(cu_seqlens=[]), "cu_seqlens: expected a non-decreasing list starting at 0"),
        (lambda: masks.causal(2**31), r"n: expected an int >= 1 and <= 2147483647 \(rows are int32\), got 2147483648"),
        (lambda: masks.full(4, num_rows=2**31), r"num_rows: expected an int >= 1 and <= 2147483647"),
        (lambda: masks.sliding_window(2**31, 4), r"n: expected an int >= 1 and <= 2147483647"),
        (lambda: masks.from_dense(torch.zeros(0, 0, dtype=torch.bool)), r"mask: expected at least one query row and one key column, got shape \(0, 0\)"),
        (lambda: masks.from_dense(torch.ones(1, 1, 3, 0, dtype=torch.bool)), r"mask: expected at least one query row and one key column"),
        (lambda: masks.from_dense([[True]]), r"mask: expected a \[Nq, Nk\] or \[B, H, Nq, Nk\] tensor, got list"),
    ],
)
def test_builder_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_builders_are_vectorised_at_long_lengths():
    # 1M tokens of packed documents: no Python loop per token, so this stays well under a second.
    import time

    t0 = time.perf_counter()
    m = masks.document([1000] * 1048, n=1 << 20)
    assert m.num_keys == 1 << 20 and time.perf_counter() - t0 < 5.0


def test_sample_lengths_is_the_anchors_generator():
    lens = masks.sample_lengths(100_000, mean=2048, seed=1)
    assert sum(lens) == 100_000 and all(512 <= x < 3584 for x in lens[:-1]) and 0 < lens[-1] < 3584
    assert lens == masks.sample_lengths(100_000)  # deterministic: mean 2048, seed 1 by default
    assert lens[:3] != masks.sample_lengths(100_000, seed=2)[:3]
