"""PaddlePaddle FlashMask's own test reference and mask generators, ported to torch.

Source: PaddlePaddle/flash-attention at commit 9985af5, ``flashmask/tests/generate_startend_row_indices.py``
(Apache-2.0): ``startend_row_indices_to_attn_bias`` (lines 18-49) and the 12 generators of lines 54-364.
Ported line for line, quirks included (``generate_document_mask`` gives document ``i`` the upper end
``len_1 + .. + len_i`` rather than its own start ``len_0 + .. + len_(i-1)``, lines 130-134), because
the point is to agree with what Paddle computes, not with what the masks were meant to be. Left out:
Paddle's prints, a value ``generate_share_question_mask`` computes and never reads (line 154), and
NumPy's RNG (a torch generator draws the random eviction's positions).
Each generator returns ``(startend_row_indices [B, H, Nk, W] int32, causal)``.
"""

from __future__ import annotations

import torch


def startend_row_indices_to_attn_bias(startend_row_indices, seqlen_q, nheads, causal=True) -> torch.Tensor:
    """Paddle's dense reference (lines 18-49) as a visibility picture ``[B, nheads, Nq, Nk]`` bool
    (True where Paddle's bias is 0). Python slices, as in Paddle's loop: causal is bottom-right aligned."""
    bz, num_head, seqlen_k, bound_num = startend_row_indices.shape
    assert nheads % num_head == 0
    m = torch.zeros((bz, num_head, seqlen_q, seqlen_k), dtype=torch.bool)  # True = -inf
    has_end = (causal and bound_num == 2) or ((not causal) and bound_num == 4)
    x = startend_row_indices.tolist()
    for bi in range(bz):
        for hi in range(num_head):
            for j in range(seqlen_k):
                downstart = x[bi][hi][j][0]
                if has_end:
                    downend = x[bi][hi][j][1]
                    m[bi, hi, downstart:downend, j] = True
                else:
                    m[bi, hi, downstart:, j] = True
                if causal:
                    m[bi, hi, : max(0, j - (seqlen_k - seqlen_q)), j] = True
                else:
                    if has_end:
                        upstart, upend = x[bi][hi][j][2], x[bi][hi][j][3]
                        m[bi, hi, upstart:upend, j] = True
                    else:
                        upend = x[bi][hi][j][1]
                        m[bi, hi, :upend, j] = True
    m = m.repeat_interleave(nheads // num_head, dim=1)
    return ~m


def _column(values, batch_size) -> torch.Tensor:
    """``paddle.to_tensor(values, int32).reshape((1, 1, seqlen_k, 1)).repeat_interleave(batch_size, 0)``."""
    return torch.as_tensor(values, dtype=torch.int32).reshape(1, 1, -1, 1).repeat_interleave(batch_size, 0)


def _scaled(values, seqlen_k):
    return values if seqlen_k == 8192 else [int(v * (seqlen_k / 8192)) for v in values]


def generate_non_causal_mask(batch_size, seqlen_q, seqlen_k, h):  # lines 54-60
    down_left = _column([seqlen_k] * seqlen_k, batch_size)
    up_right = _column([0] * seqlen_k, batch_size)
    return torch.cat([down_left, up_right], -1), False


def generate_causal_mask(batch_size, seqlen_q, seqlen_k, h):  # lines 62-67
    return _column([seqlen_k] * seqlen_k, batch_size), True


def generate_sliding_window_mask(batch_size, seqlen_q, seqlen_k, h, window_size=None):  # lines 69-84
    if window_size is None:
        window_size = 1024 if seqlen_k == 8192 else int(1024 * (seqlen_k / 8192))
    x = torch.arange(window_size, seqlen_k + window_size, dtype=torch.int32).reshape(1, 1, seqlen_k, 1)
    return x.clip(max=seqlen_q).repeat_interleave(batch_size, 0), True


def _doc_lengths(seqlen_k, doc_seqlens):
    doc_seqlens = list(_scaled([2538, 1742, 3213], seqlen_k) if doc_seqlens is None else doc_seqlens)
    assert sum(doc_seqlens) <= seqlen_k and len(doc_seqlens) >= 3
    return doc_seqlens, seqlen_k - sum(doc_seqlens)


def _cumsum(values):
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def generate_causal_document_mask(batch_size, seqlen_q, seqlen_k, h, doc_seqlens=None):  # lines 86-105
    doc_seqlens, padding = _doc_lengths(seqlen_k, doc_seqlens)
    doc_seqlens[-1] += padding
    x = [c for c, n in zip(_cumsum(doc_seqlens), doc_seqlens) for _ in range(n)]  # np.repeat
    return _column(x, batch_size).clip(max=seqlen_q), True


def generate_document_mask(batch_size, seqlen_q, seqlen_k, h, doc_seqlens=None):  # lines 107-144
    doc_seqlens, padding = _doc_lengths(seqlen_k, doc_seqlens)
    down_left, up_right = [], []
    cur = doc_seqlens[0]
    for i in range(len(doc_seqlens)):
        down_left.extend([cur] * doc_seqlens[i])
        if i < len(doc_seqlens) - 1:
            cur += doc_seqlens[i + 1]
    if padding > 0:
        down_left.extend([cur] * padding)
    cur = 0
    for i in range(len(doc_seqlens)):
        up_right.extend([cur] * doc_seqlens[i])
        if i < len(doc_seqlens) - 1:
            cur += doc_seqlens[i + 1]  # Paddle's quirk: len_1 + .. + len_i, not document i's start
    if padding > 0:
        up_right.extend([cur] * padding)
    x = torch.cat([_column(down_left, batch_size), _column(up_right, batch_size)], -1)
    return x.clip(max=seqlen_q), False


def generate_share_question_mask(batch_size, seqlen_q, seqlen_k, h, doc_seqlens=None):  # lines 146-176
    doc_seqlens, padding = _doc_lengths(seqlen_k, doc_seqlens)
    total = sum(doc_seqlens)
    x = [total] * doc_seqlens[0]
    cur = doc_seqlens[0]
    for idx in range(1, len(doc_seqlens)):
        cur += doc_seqlens[idx]
        x.extend([cur] * doc_seqlens[idx])
    if padding > 0:
        x.extend([cur] * padding)
    return _column(x, batch_size).clip(max=seqlen_q), True


def generate_global_sliding_window_mask(batch_size, seqlen_q, seqlen_k, h, global_token=16, window_size=None):  # lines 178-214
    if window_size is None:
        window_size = tuple(_scaled([512, 512], seqlen_k))
    left, right = window_size
    lts = torch.arange(left + 1, seqlen_k + left + 1, dtype=torch.int32).clip(max=seqlen_q)
    lts[:global_token] = seqlen_q
    lte = torch.full([seqlen_k], seqlen_q, dtype=torch.int32)
    uts = torch.full([seqlen_k], global_token, dtype=torch.int32)
    uts[: global_token + right + 1] = 0
    ute = torch.arange(-right, seqlen_k - right, dtype=torch.int32)
    ute[: global_token + right + 1] = 0
    x = torch.cat([_column(t, batch_size) for t in (lts, lte, uts, ute)], -1)
    return x.clip(max=seqlen_q), False


def generate_causal_blockwise_mask(batch_size, seqlen_q, seqlen_k, h, doc_seqlens=None):  # lines 216-246
    doc_seqlens, padding = _doc_lengths(seqlen_k, doc_seqlens)
    start = []
    cur = doc_seqlens[0]
    for i in range(len(doc_seqlens)):
        start.extend([cur] * doc_seqlens[i])
        if i < len(doc_seqlens) - 1:
            cur += doc_seqlens[i + 1]
    if padding > 0:
        start.extend([cur] * padding)
    cs = _cumsum(doc_seqlens)
    end = [cs[-2]] * cs[-2] + [cs[-1]] * doc_seqlens[-1] + [seqlen_k] * padding
    x = torch.cat([_column(start, batch_size), _column(end, batch_size)], -1)
    return x.clip(max=seqlen_q), True


def generate_prefix_lm_document_mask(batch_size, seqlen_q, seqlen_k, h, doc_seqlens=None):  # lines 248-290
    if doc_seqlens is None:
        doc_seqlens = [(1024, 2538), (1742, 1742), (512, 3213)]
        if seqlen_k != 8192:
            doc_seqlens = [tuple(int(v * (seqlen_k / 8192)) for v in pair) for pair in doc_seqlens]
    assert len(doc_seqlens) >= 2
    total = sum(n for _, n in doc_seqlens)
    assert total <= seqlen_k
    padding = seqlen_k - total
    down_left = []
    cur = doc_seqlens[0][1]
    for i in range(len(doc_seqlens)):
        down_left.extend([cur] * doc_seqlens[i][1])
        if i < len(doc_seqlens) - 1:
            cur += doc_seqlens[i + 1][1]
    if padding > 0:
        down_left.extend([cur] * padding)
    up_right = []
    cur = 0
    for prefix, n in doc_seqlens:
        up_right.extend([cur] * prefix + list(range(cur + prefix, cur + n)))
        cur += n
    if padding > 0:
        up_right.extend([total] * padding)
    x = torch.cat([_column(down_left, batch_size), _column(up_right, batch_size)], -1)
    return x.clip(max=seqlen_q), False


def generate_prefix_lm_causal_mask(batch_size, seqlen_q, seqlen_k, h, prefix_length=None):  # lines 292-308
    if prefix_length is None:
        prefix_length = 1024 if seqlen_k == 8192 else int(1024 * (seqlen_k / 8192))
    assert prefix_length <= seqlen_k
    down_left = _column([seqlen_k] * seqlen_k, batch_size)
    up_right = _column([0] * prefix_length + list(range(prefix_length, seqlen_k)), batch_size)
    return torch.cat([down_left, up_right], -1).clip(max=seqlen_q), False


def generate_qk_sparse_mask(batch_size, seqlen_q, seqlen_k, h, maskout_pair=None):  # lines 310-343
    if maskout_pair is None:
        maskout_pair = [(1024, 538), (2358, 1700)]
        if seqlen_k != 8192:
            maskout_pair = [tuple(int(v * (seqlen_k / 8192)) for v in pair) for pair in maskout_pair]
    start, end = [], []
    last = 0
    for offset, length in maskout_pair:
        assert offset > last
        start.extend([seqlen_k] * (offset - last))
        end.extend([seqlen_k] * (offset - last))
        start.extend(range(offset, offset + length))
        end.extend([offset + length] * length)
        last = offset + length
    start.extend([seqlen_k] * (seqlen_k - last))
    end.extend([seqlen_k] * (seqlen_k - last))
    x = torch.cat([_column(start, batch_size), _column(end, batch_size)], -1)
    return x.clip(max=seqlen_q), True


def generate_random_eviction_mask(batch_size, seqlen_q, seqlen_k, h, start_row=None, seed=0):  # lines 345-364
    if start_row is None:
        start_row = 4096 if seqlen_k == 8192 else int(4096 * (seqlen_k / 8192))
    g = torch.Generator().manual_seed(seed)  # np.random.choice(seqlen_k - 1, seqlen_k - start_row, replace=False)
    rows = []
    for _ in range(batch_size):
        for _ in range(h):
            start_rows = torch.full([seqlen_k], seqlen_k + 1, dtype=torch.int64)
            mask_pos = torch.randperm(seqlen_k - 1, generator=g)[: seqlen_k - start_row]
            index = torch.arange(start_row, seqlen_k)
            mask_pos = torch.cat([mask_pos[mask_pos < index - 1], mask_pos[mask_pos >= index - 1]])
            start_rows[mask_pos] = index
            rows.append(start_rows)
    x = torch.stack(rows).to(torch.int32).reshape(batch_size, h, seqlen_k, 1)
    return x.clip(max=seqlen_q), True


GENERATORS = [
    generate_non_causal_mask,
    generate_causal_mask,
    generate_sliding_window_mask,
    generate_causal_document_mask,
    generate_document_mask,
    generate_share_question_mask,
    generate_global_sliding_window_mask,
    generate_causal_blockwise_mask,
    generate_prefix_lm_document_mask,
    generate_prefix_lm_causal_mask,
    generate_qk_sparse_mask,
    generate_random_eviction_mask,
]
