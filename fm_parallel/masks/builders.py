"""Builders: one pure function per mask idea, each returning a :class:`FlashMask`.

All are vectorised over tokens (Python loops run over batch rows and documents only), so they are
cheap enough to run in the data loader next to ``input_ids``. Tokens past the last document of a row
(trailing padding) and documents of length 0 are handled: a padding key is seen by no row and a
padding query row sees no key (its attention output is 0).

Shapes: builders return ``[B, 1, N]`` masks (one mask shared by all heads), ``B = 1`` unless the
argument lists one layout per batch row.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from functools import reduce

import torch

from fm_parallel.masks import intervals
from fm_parallel.masks.flashmask import _INT32_MAX, MAX_INTERVALS, FlashMask
from fm_parallel.masks.intervals import MaskNotExpressible

__all__ = [
    "causal",
    "full",
    "document",
    "prefix_lm",
    "dpo",
    "preference",
    "sliding_window",
    "union",
    "intersect",
    "stack",
    "from_dense",
    "sample_lengths",
]


# ------------------------------------------------------------------ helpers
def _is_bool(value) -> bool:
    """Python, NumPy and torch booleans: ``True`` is an ``int`` to Python, never a size to us."""
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def check_int(name: str, value, low: int = 0, high: int = _INT32_MAX) -> int:
    """``value`` as an int in ``[low, high]``, or a ValueError naming ``name``, the range and the value.

    The one validator for integer arguments of the public API (builders, converters,
    ``flashmask_attention``). Takes Python and NumPy ints and one-element integer tensors; refuses
    bools of every kind (``True`` would be a 1 that nobody meant), floats, strings and wider tensors.
    Rows and lengths are int32 in a FlashMask, hence the default ``high = 2^31 - 1``.
    """
    index = None
    if not _is_bool(value):
        try:
            index = operator.index(value)
        except (TypeError, RuntimeError, ValueError):  # a float, a str, a tensor of several elements
            index = None
    if high == _INT32_MAX:
        expected = f"an int >= {low}"
        if index is not None and index > high:
            raise ValueError(f"{name}: expected {expected} and <= {high} (rows are int32), got {value!r}")
    else:
        expected = f"an int in [{low}, {high}]"
    if index is None or not low <= index <= high:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return index


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool (Python or NumPy), else a ValueError naming ``name`` (a truthy
    ``'x'`` or ``1`` is a mistake to report, not a flag to guess)."""
    if isinstance(value, bool) or (not isinstance(value, torch.Tensor) and _is_bool(value)):
        return bool(value)
    raise ValueError(f"{name}: expected a bool (True or False), got {value!r}")


_check_int = check_int  # the builders' historical name


def _is_nested(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() == 2
    return isinstance(x, Sequence) and len(x) > 0 and all(
        isinstance(r, (Sequence, torch.Tensor)) and not isinstance(r, str) for r in x
    )


def _int_list(name: str, x) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor, got shape {tuple(x.shape)} {x.dtype}")
        x = x.tolist()
    if not isinstance(x, Sequence) or isinstance(x, str):
        raise ValueError(f"{name}: expected a sequence of ints, got {type(x).__name__}")
    return [_check_int(f"{name}[{i}]", v) for i, v in enumerate(x)]


def _rows(name: str, x) -> list[list[int]]:
    """One list of lengths per batch row."""
    if _is_nested(x):
        return [_int_list(f"{name}[{b}]", r) for b, r in enumerate(x)]
    return [_int_list(name, x)]


def _row_length(name: str, rows: list[list[int]], n) -> int:
    longest = max(sum(r) for r in rows)
    if longest > _INT32_MAX:
        raise ValueError(f"{name}: expected rows of at most {_INT32_MAX} tokens (int32 bounds), got {longest}")
    if n is None:
        if longest == 0:
            raise ValueError(f"{name}: expected at least one non-empty document (or n for an all-padding row), got {rows}")
        n = longest
    n = _check_int("n", n, low=1)
    if longest > n:
        raise ValueError(f"n: expected at least the longest row, {name} sum to {longest}, got n={n}")
    return n


def _layout(rows: list[list[int]], n: int):
    """Per token ``[B, n]`` int64: start and end (inclusive) of its segment, and a padding flag."""
    starts, ends, pads = [], [], []
    for row in rows:
        lens = torch.tensor(row + [n - sum(row)], dtype=torch.int64)
        first = torch.cumsum(lens, 0) - lens
        starts.append(torch.repeat_interleave(first, lens))
        ends.append(torch.repeat_interleave(first + lens - 1, lens))
        pads.append(torch.arange(n) >= sum(row))
    return torch.stack(starts), torch.stack(ends), torch.stack(pads)


def _make(fms: torch.Tensor, fme: torch.Tensor, pad: torch.Tensor | None, n: int, num_rows: int | None = None):
    """``[B, n]`` bounds (and padding keys) to a ``[B, 1, n, 1]`` FlashMask."""
    num_rows = n if num_rows is None else num_rows
    if pad is not None:
        fms = torch.where(pad, torch.full_like(fms, num_rows), fms)
        fme = torch.where(pad, torch.full_like(fme, -1), fme)
    fms = fms.clamp(max=num_rows).to(torch.int32)
    fme = fme.clamp(max=num_rows - 1).to(torch.int32)
    return FlashMask(fms[:, None, :, None], fme[:, None, :, None], num_rows, validate=False)


# ----------------------------------------------------------------- builders
def causal(n: int, num_rows: int | None = None) -> FlashMask:
    """Lower-triangular mask: row ``i`` sees keys ``j <= i``. ``[1, 1, n]``.

    ``num_rows`` (default ``n``): more query rows than keys, aligned top-left as SDPA's
    ``is_causal`` is (rows ``>= n`` see every key)."""
    n = _check_int("n", n, low=1)
    rows = n if num_rows is None else _check_int("num_rows", num_rows, low=n)
    j = torch.arange(n).view(1, n)
    return _make(j, torch.full_like(j, rows - 1), None, n, rows)


def full(n: int, num_rows: int | None = None) -> FlashMask:
    """No masking: every row of ``num_rows`` (default ``n``) sees all ``n`` keys."""
    n = _check_int("n", n, low=1)
    rows = n if num_rows is None else _check_int("num_rows", num_rows, low=1)
    return _make(torch.zeros(1, n, dtype=torch.int64), torch.full((1, n), rows - 1), None, n, rows)


def document(
    lengths=None, *, cu_seqlens=None, doc_ids=None, causal: bool = True, n: int | None = None
) -> FlashMask:
    """Packed documents: a token sees only tokens of its own document (causally by default).

    Give exactly one of:
        lengths: document lengths of one row (``[3, 5, 2]``) or one list per batch row.
        cu_seqlens: cumulative boundaries ``[0, 3, 8, 10]`` (flash-attn varlen style), or one per row.
        doc_ids: ``[N]`` or ``[B, N]`` document id of each token; a negative id marks padding.
            Each document must be one contiguous run.
    Args:
        causal: causal inside each document (SFT) or bidirectional (encoders).
        n: row length; tokens past the last document are padding (default: the longest row).
    """
    causal = check_bool("causal", causal)
    given = [x is not None for x in (lengths, cu_seqlens, doc_ids)]
    if sum(given) != 1:
        raise ValueError(f"document: expected exactly one of lengths, cu_seqlens, doc_ids, got {sum(given)}")
    if doc_ids is not None:
        start, end, pad = _runs(doc_ids)
        n_ids = start.shape[1]
        if n is not None and _check_int("n", n, low=1) != n_ids:
            raise ValueError(f"n: expected the length of doc_ids ({n_ids}), got {n}")
        n = n_ids
    else:
        if cu_seqlens is not None:
            cu_rows = _rows("cu_seqlens", cu_seqlens)
            rows = []
            for b, cu in enumerate(cu_rows):
                if not cu or cu[0] != 0 or any(b2 < a for a, b2 in zip(cu, cu[1:])):
                    raise ValueError(f"cu_seqlens: expected a non-decreasing list starting at 0, got row {b} = {cu}")
                rows.append([b2 - a for a, b2 in zip(cu, cu[1:])])
            name = "cu_seqlens"
        else:
            rows, name = _rows("lengths", lengths), "lengths"
        n = _row_length(name, rows, n)
        start, end, pad = _layout(rows, n)
    j = torch.arange(n).expand_as(start)
    return _make(j if causal else start, end, pad, n)


def _runs(doc_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not isinstance(doc_ids, torch.Tensor):
        doc_ids = torch.as_tensor(doc_ids)
    if (doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool
            or doc_ids.dim() not in (1, 2) or doc_ids.numel() == 0):
        raise ValueError(f"doc_ids: expected a non-empty [N] or [B, N] integer tensor, got {tuple(doc_ids.shape)} {doc_ids.dtype}")
    ids = doc_ids.to(torch.int64).cpu()
    ids = ids.view(1, -1) if ids.dim() == 1 else ids
    b, n = ids.shape
    pad = ids < 0
    opens = torch.ones_like(ids, dtype=torch.bool)
    opens[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run = (torch.cumsum(opens.to(torch.int64), 1) - 1) + torch.arange(b).view(b, 1) * n
    pos = torch.arange(n).expand(b, n)
    run_start = torch.full((b * n,), n, dtype=torch.int64).scatter_reduce(0, run.flatten(), pos.flatten(), "amin")
    run_end = torch.full((b * n,), -1, dtype=torch.int64).scatter_reduce(0, run.flatten(), pos.flatten(), "amax")
    # Documents must be contiguous: as many runs of real tokens as distinct real ids.
    runs_real = (opens & ~pad).sum(1)
    srt = ids.sort(1).values
    fresh = torch.ones_like(srt, dtype=torch.bool)
    fresh[:, 1:] = srt[:, 1:] != srt[:, :-1]
    distinct_real = (fresh & (srt >= 0)).sum(1)
    bad = torch.nonzero(runs_real != distinct_real)
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(
            f"doc_ids: expected every document to be one contiguous run, got row {row} with "
            f"{int(runs_real[row])} runs of {int(distinct_real[row])} distinct ids"
        )
    return run_start[run], run_end[run], pad


def prefix_lm(n: int | None = None, prefix_len=None, *, lengths=None) -> FlashMask:
    """Prefix-LM: the first ``prefix_len`` tokens attend bidirectionally, the rest causally.

    ``prefix_lm(n, prefix_len)`` for one sequence, or ``prefix_lm(prefix_len=..., lengths=[...])`` for
    packed documents, each with its own prefix (``prefix_len`` an int applied to every document,
    clipped to its length, or one per document in the nesting of ``lengths``).
    """
    if prefix_len is None:
        raise ValueError("prefix_len: expected an int or per-document lengths, got None")
    if lengths is None:
        if n is None:
            raise ValueError("n: expected the sequence length when lengths is not given, got None")
        n = _check_int("n", n, low=1)
        rows = [[n]]
    else:
        rows = _rows("lengths", lengths)
        n = _row_length("lengths", rows, n)
    if isinstance(prefix_len, (int, torch.Tensor)) and not _is_nested(prefix_len) and (
        not isinstance(prefix_len, torch.Tensor) or prefix_len.dim() == 0
    ):
        p = _check_int("prefix_len", prefix_len)
        if lengths is None and p > n:
            raise ValueError(f"prefix_len: expected at most n={n}, got {p}")
        prefixes = [[min(p, d) for d in row] for row in rows]
    else:
        prefixes = _rows("prefix_len", prefix_len) if lengths is not None else [_int_list("prefix_len", prefix_len)]
        if [len(r) for r in prefixes] != [len(r) for r in rows]:
            raise ValueError(f"prefix_len: expected one prefix per document {[len(r) for r in rows]}, got {[len(r) for r in prefixes]}")
        for b, (pr, ln) in enumerate(zip(prefixes, rows)):
            for d, (p, length) in enumerate(zip(pr, ln)):
                if p > length:
                    raise ValueError(f"prefix_len: expected at most the document length {length}, got row {b} doc {d} = {p}")
    start, end, pad = _layout(rows, n)
    prefix_end = torch.stack(
        [torch.repeat_interleave(torch.tensor(ps + [0]), torch.tensor(r + [n - sum(r)])) for ps, r in zip(prefixes, rows)]
    ) + start - 1
    j = torch.arange(n).expand_as(start)
    return _make(torch.where(j <= prefix_end, start, j), end, pad, n)


def _is_list(x) -> bool:
    """A list of sizes (one per packed sample) rather than one size."""
    if isinstance(x, torch.Tensor):
        return x.dim() > 0
    return isinstance(x, Sequence) and not isinstance(x, str)


def preference(prompt_len, response_lens, *, n: int | None = None) -> FlashMask:
    """One prompt followed by k responses (DPO: k = 2, reward models: any k), packable.

    Every token is causal; a response sees the prompt and itself, never another response.
    ``preference(p, [r1, ..., rk])`` for one sample, or ``preference([p1, p2], [[..], [..]])`` for
    several samples packed one after another in the row. ``n`` pads the row.
    """
    if not _is_list(prompt_len):
        prompts, responses = [check_int("prompt_len", prompt_len)], [_int_list("response_lens", response_lens)]
    else:
        prompts = _int_list("prompt_len", prompt_len)
        responses = _rows("response_lens", response_lens)
        if len(responses) != len(prompts):
            raise ValueError(f"response_lens: expected one list per prompt ({len(prompts)}), got {len(responses)}")
    given = f"prompt_len={prompt_len!r}, response_lens={response_lens!r}"
    return _preference(prompts, responses, n, "prompt_len, response_lens", given)


def _preference(prompts: list[int], responses: list[list[int]], n, names: str, given: str) -> FlashMask:
    """The preference layout; ``names`` / ``given`` are the caller's arguments, for its errors."""
    seg_len, seg_shared, seg_group_end = [], [], []
    offset = 0
    for p, rs in zip(prompts, responses):
        if not rs:
            raise ValueError("response_lens: expected at least one response per prompt, got an empty list")
        group_end = offset + p + sum(rs) - 1
        seg_len += [p] + rs
        seg_shared += [True] + [False] * len(rs)
        seg_group_end += [group_end] * (1 + len(rs))
        offset += p + sum(rs)
    if offset == 0 and n is None:
        raise ValueError(f"{names}: expected at least one non-zero length (or n for an all-padding row), got {given}")
    n = _row_length(names, [seg_len], n)
    start, end, pad = _layout([seg_len], n)
    lens = torch.tensor(seg_len + [n - offset])
    shared = torch.repeat_interleave(torch.tensor(seg_shared + [False]), lens).view(1, n)
    group_end = torch.repeat_interleave(torch.tensor(seg_group_end + [-1]), lens).view(1, n)
    j = torch.arange(n).view(1, n)
    return _make(j, torch.where(shared, group_end, end), pad, n)


def dpo(prompt_len, chosen_len, rejected_len, *, n: int | None = None) -> FlashMask:
    """``[prompt, chosen, rejected]`` in one row: ``preference(prompt_len, [chosen_len, rejected_len])``.

    Lists of equal length pack several pairs one after another.
    """
    names = "prompt_len, chosen_len, rejected_len"
    given = f"{prompt_len!r}, {chosen_len!r}, {rejected_len!r}"
    if _is_list(prompt_len):
        p, c, r = (_int_list(nm, x) for nm, x in (("prompt_len", prompt_len), ("chosen_len", chosen_len), ("rejected_len", rejected_len)))
        if not len(p) == len(c) == len(r):
            raise ValueError(f"chosen_len, rejected_len: expected {len(p)} entries like prompt_len, got {len(c)} and {len(r)}")
        return _preference(p, [[a, b] for a, b in zip(c, r)], n, names, given)
    pairs = [[check_int("chosen_len", chosen_len), check_int("rejected_len", rejected_len)]]
    return _preference([check_int("prompt_len", prompt_len)], pairs, n, names, given)


def sliding_window(n: int, window: int, sinks: int = 0) -> FlashMask:
    """Causal sliding window: row ``i`` sees keys ``i - window < j <= i``, plus the first ``sinks`` keys."""
    n, window, sinks = _check_int("n", n, 1), _check_int("window", window, 1), _check_int("sinks", sinks)
    j = torch.arange(n).view(1, n)
    fme = torch.where(j < sinks, torch.full_like(j, n - 1), j + window - 1)
    return _make(j, fme, None, n)


def sample_lengths(n: int, mean: int = 2048, seed: int = 1) -> list[int]:
    """Document lengths summing to ``n``: uniform in ``[mean/4, 7 mean/4)``, the last one cut to fit.

    The generator of the benchmark anchors (../shared/anchors.md), so benchmarks and tests that use it
    pack the same documents for the same ``n``, ``mean`` and ``seed``.
    """
    n, mean = _check_int("n", n, 1), _check_int("mean", mean, 4)
    # torch.Generator takes seeds in [-2^63, 2^64)
    g = torch.Generator().manual_seed(check_int("seed", seed, -(2**63), 2**64 - 1))
    lengths: list[int] = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(mean // 4, mean * 7 // 4, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - n
    return lengths


# ---------------------------------------------------------------- combinators
def _common(masks, name: str):
    """The masks of a combinator: FlashMasks of one shape of rows and keys, on one device. Errors
    name the argument at fault as ``masks[i]`` (the i-th mask given)."""
    if not masks:
        raise ValueError(f"masks: expected at least one FlashMask for {name}, got none")
    for i, m in enumerate(masks):
        if not isinstance(m, FlashMask):
            raise ValueError(f"masks[{i}]: expected a FlashMask for {name}, got {type(m).__name__}")
    first = masks[0]
    for i, m in enumerate(masks[1:], 1):
        if (m.num_keys, m.num_rows, m.device) != (first.num_keys, first.num_rows, first.device):
            raise ValueError(
                f"masks[{i}]: expected num_keys={first.num_keys}, num_rows={first.num_rows}, device={first.device} "
                f"like masks[0] for {name}, got num_keys={m.num_keys}, num_rows={m.num_rows}, device={m.device}"
            )


def _combine(op, name: str, masks, max_intervals: int) -> FlashMask:
    _common(masks, name)
    max_intervals = check_int("max_intervals", max_intervals, 1, MAX_INTERVALS)
    rows = masks[0].num_rows

    def pair(a, b):
        return op(a, b, rows, max_intervals, what=name)

    fms, fme = reduce(pair, [(m.fms, m.fme) for m in masks])
    return FlashMask(fms, fme, rows, validate=False)


def union(*masks: FlashMask, max_intervals: int = MAX_INTERVALS) -> FlashMask:
    """Visible where any mask is visible (e.g. ``union(sliding_window(...), document(...))``).

    Raises :class:`MaskNotExpressible` when a column would need more than ``max_intervals`` intervals.
    """
    return _combine(intervals.union, "union", masks, max_intervals)


def intersect(*masks: FlashMask, max_intervals: int = MAX_INTERVALS) -> FlashMask:
    """Visible where every mask is visible (e.g. a sliding window inside each document)."""
    return _combine(intervals.intersect, "intersect", masks, max_intervals)


def stack(masks: Sequence[FlashMask]) -> FlashMask:
    """Concatenate single-row masks along the batch dimension (one layout per batch row)."""
    if isinstance(masks, (FlashMask, str, torch.Tensor)) or not isinstance(masks, Iterable):
        raise ValueError(f"masks: expected a sequence of FlashMask (one per batch row), got {type(masks).__name__}")
    masks = list(masks)
    _common(masks, "stack")
    for i, x in enumerate(masks):
        if x.heads != masks[0].heads:
            raise ValueError(f"masks[{i}]: expected {masks[0].heads} mask heads like masks[0] for stack, got {x.heads}")
    m = max(x.max_intervals for x in masks)
    masks = [x.expand_intervals(m) for x in masks]
    return FlashMask(
        torch.cat([x.fms for x in masks]), torch.cat([x.fme for x in masks]), masks[0].num_rows, validate=False
    )


def from_dense(mask: torch.Tensor, max_intervals: int = MAX_INTERVALS) -> FlashMask:
    """Exact conversion of a dense mask to a FlashMask.

    Args:
        mask: ``[Nq, Nk]`` or ``[B, H, Nq, Nk]``; bool (True = visible) or additive float
            (0 = visible, ``-inf`` or the dtype's most negative value = masked).
        max_intervals: most intervals allowed per column.
    Raises:
        MaskNotExpressible: a column needs more intervals, or a float mask holds other values (a bias).
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask: expected a [Nq, Nk] or [B, H, Nq, Nk] tensor, got {shape}")
    max_intervals = check_int("max_intervals", max_intervals, 1, MAX_INTERVALS)
    if mask.numel() == 0:
        raise ValueError(f"mask: expected at least one query row and one key column, got shape {tuple(mask.shape)}")
    if mask.shape[-2] > _INT32_MAX or mask.shape[-1] > _INT32_MAX:
        raise ValueError(f"mask: expected at most {_INT32_MAX} rows and columns (int32 bounds), got {tuple(mask.shape)}")
    if mask.dim() == 2:
        mask = mask.view(1, 1, *mask.shape)
    if mask.dtype != torch.bool:
        if not mask.dtype.is_floating_point:
            raise ValueError(f"mask: expected a bool or float tensor, got {mask.dtype}")
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | masked).all()):
            raise MaskNotExpressible(None, None, None, "dense mask", "it holds values other than 0 and -inf (a bias)")
        mask = ~masked
    b, h, nq, nk = mask.shape
    cols = mask.transpose(-1, -2)  # [B, H, Nk, Nq]
    before = torch.zeros_like(cols[..., :1])
    opens = cols & ~torch.cat([before, cols[..., :-1]], -1)
    closes = cols & ~torch.cat([cols[..., 1:], before], -1)
    counts = opens.sum(-1)
    most = int(counts.max())
    if most > max_intervals:
        col = int(torch.nonzero(counts.reshape(-1) > max_intervals)[0]) % nk
        raise MaskNotExpressible(col, most, max_intervals, "dense mask")
    slots = max(most, 1)
    rows = torch.arange(nq, device=mask.device).expand_as(cols)

    def gather(flags: torch.Tensor, fill: int) -> torch.Tensor:
        slot = torch.where(flags, torch.cumsum(flags.to(torch.int64), -1) - 1, slots)
        out = torch.full((b, h, nk, slots + 1), fill, dtype=torch.int64, device=mask.device)
        out.scatter_(-1, slot, torch.where(flags, rows, torch.full_like(rows, fill)))
        return out[..., :slots]

    fms, fme = gather(opens, nq), gather(closes, -1)
    return FlashMask(fms.to(torch.int32), fme.to(torch.int32), nq, validate=False)
