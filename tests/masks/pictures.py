"""Dense pictures of each mask family, written from the definitions alone (no FlashMask code).

Each returns a bool tensor [N, N], True where row i may attend to key j.
"""

import torch


def _ij(n):
    i = torch.arange(n).view(n, 1)
    j = torch.arange(n).view(1, n)
    return i, j


def segment_ids(lengths, n):
    """Id of the segment of every token (-1 past the end), built by plain Python."""
    ids = []
    for s, length in enumerate(lengths):
        ids += [s] * length
    ids += [-1] * (n - len(ids))
    return torch.tensor(ids, dtype=torch.int64)


def causal(n):
    i, j = _ij(n)
    return j <= i


def full(n):
    return torch.ones(n, n, dtype=torch.bool)


def document(lengths, n, causal_=True):
    i, j = _ij(n)
    doc = segment_ids(lengths, n)
    same = (doc.view(n, 1) == doc.view(1, n)) & (doc.view(1, n) >= 0)
    return same & (j <= i) if causal_ else same


def prefix_lm_docs(lengths, prefixes, n):
    i, j = _ij(n)
    doc = segment_ids(lengths, n)
    starts = []
    for s, length in enumerate(lengths):
        starts += [sum(lengths[:s])] * length
    starts += [0] * (n - len(starts))
    start = torch.tensor(starts)
    pre = []
    for s, length in enumerate(lengths):
        pre += [prefixes[s]] * length
    pre += [0] * (n - len(pre))
    in_prefix = (torch.arange(n) - start) < torch.tensor(pre)
    same = (doc.view(n, 1) == doc.view(1, n)) & (doc.view(1, n) >= 0)
    return same & ((j <= i) | in_prefix.view(1, n))


def preference(samples, n):
    """samples: list of (prompt_len, [response lengths])."""
    i, j = _ij(n)
    sample, part = [], []
    for s, (p, responses) in enumerate(samples):
        sample += [s] * (p + sum(responses))
        part += [0] * p
        for r, length in enumerate(responses):
            part += [r + 1] * length
    sample += [-1] * (n - len(sample))
    part += [-1] * (n - len(part))
    sample, part = torch.tensor(sample), torch.tensor(part)
    same_sample = (sample.view(n, 1) == sample.view(1, n)) & (sample.view(1, n) >= 0)
    sees = (part.view(1, n) == 0) | (part.view(1, n) == part.view(n, 1))
    return same_sample & sees & (j <= i)


def sliding_window(n, window, sinks):
    i, j = _ij(n)
    return (j <= i) & (((i - j) < window) | (j < sinks))
