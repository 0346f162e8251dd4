"""Query chunks of a mask: rows cut where no visibility crosses (between packed documents, between
DPO samples), each with the window of keys its rows see and a mask of its own. The tiled decoder
layer (``fm_parallel/longcontext/tiling.py``) runs attention per chunk, so the full q, the attention
output and its gradient never exist at once.

    chunks, overlap = attention_chunks(mask, 65536)   # cached on the mask for the step
    for c in chunks: backend.forward(q[c.r0:c.r1], k[c.k0:c.k1], v[c.k0:c.k1], c.mask, c.positions, scale,
                                     q_offset=c.q_offset)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from fm_parallel.masks.flashmask import FlashMask

__all__ = ["AttentionChunk", "attention_chunks"]


@dataclass(frozen=True)
class AttentionChunk:
    """Query rows ``[r0, r1)`` and the key window ``[k0, k1)`` they see (``k0 == k1``: none).
    ``mask``: the window's mask; ``local``: rows and keys renumbered from ``r0`` (the chunk is an
    independent problem: its rows see only its keys and no other row sees them), else the parent's
    global rows with ``q_offset = r0``. ``positions``: the rows as the kernel reads them."""

    r0: int
    r1: int
    k0: int
    k1: int
    mask: FlashMask | None
    local: bool
    positions: torch.Tensor | None

    @property
    def q_offset(self) -> int:
        return 0 if self.local else self.r0


def attention_chunks(mask: FlashMask, rows: int) -> tuple[tuple[AttentionChunk, ...], bool]:
    """The query chunks of at most ``rows`` rows that :class:`TiledLayer` runs attention over, and
    whether their key windows overlap (keys' gradients then add up over chunks, in float32).

    Chunks end at *cuts* where possible: a row ``b`` such that no row ``>= b`` sees a key ``< b``
    and no row ``< b`` sees a key ``>= b`` (between packed documents, between DPO samples). A chunk
    between two cuts is local (an independent attention problem; causal documents stay known, so FA4
    runs its varlen kernel on it). Where no cut lies within ``rows`` (one long document), the chunk
    ends at ``rows`` and sees the window of keys its rows see.

    Cached on the mask (``("attention_chunks", rows)``, one device sync to make): every layer of a
    step uses the same chunks, and each chunk's mask keeps its kernels' plans for the step."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows: expected a positive number of query rows per chunk, got {rows!r}")
    return mask.cached(("attention_chunks", rows), lambda: _make_chunks(mask, rows))


def _make_chunks(mask: FlashMask, rows: int) -> tuple[tuple[AttentionChunk, ...], bool]:
    n = mask.num_keys
    if mask.num_rows != n or n <= rows:
        positions = torch.arange(mask.num_rows, dtype=torch.int32, device=mask.device)
        return (AttentionChunk(0, mask.num_rows, 0, n, mask, False, positions),), False
    first_row = mask.fms.amin(dim=(0, 1, 3)).long()  # [N]: the first row that sees key j (num_rows: none)
    last_row = mask.fme.amax(dim=(0, 1, 3)).long()  # [N]: the last (-1: none)
    b = torch.arange(1, n, device=mask.device)
    seen_later = torch.cummax(last_row, 0).values[:-1] >= b  # a key < b seen by a row >= b
    seen_earlier = torch.flip(torch.cummin(torch.flip(first_row, (0,)), 0).values, (0,))[1:] < b  # a key >= b by a row < b
    cuts = b[~(seen_later | seen_earlier)].tolist() + [n]
    bounds, r0 = [], 0
    while r0 < n:
        i = bisect.bisect_right(cuts, r0 + rows) - 1
        r1 = cuts[i] if i >= 0 and cuts[i] > r0 else min(r0 + rows, n)
        bounds.append((r0, r1))
        r0 = r1
    cut_set = set(cuts) | {0}
    windows, idx = [], torch.arange(n, device=mask.device)
    for r0, r1 in bounds:  # the hull of the keys some row of [r0, r1) may see
        sees = (first_row <= r1 - 1) & (last_row >= r0)
        windows.append(torch.stack([torch.where(sees, idx, n).min(), torch.where(sees, idx, -1).max() + 1]))
    windows = torch.stack(windows).tolist()  # one sync for all chunks
    documents = mask.causal_documents()
    doc_ends = None if documents is None else [0, *_cumsum(documents)]
    plain = None if documents is not None else _causal_document_keys(mask)  # padded rows: per chunk
    chunks = []
    for (r0, r1), (k0, k1) in zip(bounds, windows):
        if k1 <= k0:
            chunks.append(AttentionChunk(r0, r1, 0, 0, None, False, None))
            continue
        if r0 in cut_set and r1 in cut_set and r0 <= k0 and k1 <= r1:
            ends = doc_ends
            if plain is not None and all(plain[0][r0:r1]):  # this chunk is causal documents (the row's padding is not)
                ends = [r0, *(j + 1 for j in range(r0, r1) if plain[1][j])]
            sub = _local_mask(mask, r0, r1, ends)
            chunks.append(AttentionChunk(r0, r1, r0, r1, sub, True,
                                         torch.arange(r1 - r0, dtype=torch.int32, device=mask.device)))
        else:
            chunks.append(AttentionChunk(r0, r1, k0, k1, mask.select_keys(slice(k0, k1)), False,
                                         torch.arange(r0, r1, dtype=torch.int32, device=mask.device)))
    spans = sorted((c.k0, c.k1) for c in chunks if c.k1 > c.k0)
    overlap = any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    return tuple(chunks), overlap


def _causal_document_keys(mask: FlashMask):
    """``(causal, ends)`` host lists over the keys (one sync), or None: ``causal[j]`` when key ``j`` is
    seen exactly by rows ``j .. e`` with ``e`` the next document end, ``ends[j]`` when ``j`` ends a
    document (its last row is itself). A chunk of causal keys between cuts is packed causal documents
    even when the row is padded after them (a padded row's own mask says None)."""
    if mask.batch != 1 or mask.heads != 1:
        return None
    fms, fme = mask.fms[0, 0], mask.fme[0, 0]
    n = fms.shape[0]
    cols = torch.arange(n, device=mask.device, dtype=fms.dtype)
    ends = fme[:, 0] == cols
    next_end = torch.flip(torch.cummin(torch.flip(torch.where(ends, cols, n), (0,)), 0).values, (0,))
    causal = (fms[:, 0] == cols) & (fme[:, 0] == next_end)
    if fms.shape[1] > 1:
        causal &= (fms[:, 1:] > fme[:, 1:]).all(1)
    both = torch.stack([causal, ends]).cpu().tolist()
    return both[0], both[1]


def _cumsum(xs):
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def _local_mask(mask: FlashMask, r0: int, r1: int, doc_ends) -> FlashMask:
    """Rows and keys ``[r0, r1)`` of ``mask`` renumbered from 0 (empty intervals canonical)."""
    n = r1 - r0
    fms, fme = mask.fms[:, :, r0:r1], mask.fme[:, :, r0:r1]
    empty = fms > fme
    sub = FlashMask(torch.where(empty, n, fms - r0), torch.where(empty, -1, fme - r0), n, validate=False)
    if doc_ends is not None:  # the parent's documents inside the chunk (its ends are document ends)
        inside = [e - r0 for e in doc_ends if r0 <= e <= r1]
        sub.set_causal_documents(tuple(b - a for a, b in zip(inside, inside[1:])))
    return sub
