"""The FlashMask type: per key column, the inclusive query rows that may see it.

    visible(i, j)  <=>  exists m:  fms[b, h, j, m] <= i <= fme[b, h, j, m]

Rows are global query positions; a query slice (ring chunk, zigzag shard) passes where its rows sit
and the mask is never rewritten. Memory is O(N): ``2 * 4 * B * Hm * Nk * M`` bytes.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fm_parallel.masks import intervals

if TYPE_CHECKING:
    from fm_parallel.masks.blocks import BlockSummary

__all__ = ["FlashMask", "MaskStats", "MAX_INTERVALS"]

MAX_INTERVALS = 4
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class MaskStats:
    """Tile counts and density of a mask at one square tile size (summed over batch rows and mask heads)."""

    block: int
    num_rows: int
    num_keys: int
    tiles_total: int
    tiles_skipped: int
    tiles_partial: int
    tiles_full: int
    visible_pairs: int  # summed over [B, Hm]; per head when Hm == 1
    density: float  # visible_pairs / (B * Hm * num_rows * num_keys)

    @property
    def skip_ratio(self) -> float:
        return self.tiles_skipped / max(self.tiles_total, 1)


class FlashMask:
    """A column-wise attention mask: ``fms``, ``fme`` int32 of shape ``[B, Hm, Nk, M]``.

    Args:
        fms: first visible row of each interval, ``[B, Hm, Nk]`` or ``[B, Hm, Nk, M]`` (``M <= 4``);
            ``[Nk]`` and ``[B, Nk]`` are accepted as shorthands for ``B = Hm = 1`` / ``Hm = 1``.
            Any integer dtype; stored as int32.
        fme: last visible row (inclusive), same shape. An interval with ``fms > fme`` is empty.
        num_rows: number of query rows the mask describes (the global sequence length);
            defaults to ``Nk`` (self-attention).
        validate: check ranges and interval order (one device sync). Builders pass False.

    Non-empty intervals of a column must be sorted and disjoint; rows must lie in ``[0, num_rows)``.
    Empty intervals are stored canonically as ``(num_rows, -1)``.
    """

    __slots__ = ("fms", "fme", "num_rows", "_cache", "__weakref__")

    def __init__(self, fms: torch.Tensor, fme: torch.Tensor, num_rows: int | None = None, *, validate: bool = True):
        fms, fme = _as_bounds("fms", fms), _as_bounds("fme", fme)
        if fms.shape != fme.shape:
            raise ValueError(f"fme: expected the shape of fms {tuple(fms.shape)}, got {tuple(fme.shape)}")
        if fms.device != fme.device:
            raise ValueError(f"fme: expected the device of fms ({fms.device}), got {fme.device}")
        num_keys = fms.shape[2]
        if num_rows is None:
            num_rows = num_keys
        if num_keys < 1:
            raise ValueError(f"fms: expected at least one key column, got shape {tuple(fms.shape)}")
        if not isinstance(num_rows, int) or isinstance(num_rows, bool) or not 1 <= num_rows <= _INT32_MAX:
            raise ValueError(f"num_rows: expected a positive int <= {_INT32_MAX}, got {num_rows!r}")
        if validate:
            _validate(fms, fme, num_rows)
            empty = fms > fme
            fms = torch.where(empty, torch.full_like(fms, num_rows), fms)
            fme = torch.where(empty, torch.full_like(fme, -1), fme)
        self.fms, self.fme, self.num_rows = fms.contiguous(), fme.contiguous(), num_rows
        # Derived data (block summaries, kernel plans) keyed by what they depend on and the bounds' versions.
        self._cache: dict = {}
        _OWNERS.add(self)

    @staticmethod
    def owning(fms: torch.Tensor, fme: torch.Tensor, num_rows: int) -> "FlashMask | None":
        """The live mask whose bounds are these tensors (the same memory, shape and strides: the
        objects themselves or aliases of them, never copies), or None. Lets code that receives only
        tensors (a ``torch.library`` op, forward and backward) find the mask's caches."""
        return _OWNERS.find(fms, fme, num_rows)

    # ----------------------------------------------------------------- shape
    @property
    def batch(self) -> int:
        return self.fms.shape[0]

    @property
    def heads(self) -> int:
        return self.fms.shape[1]

    @property
    def num_keys(self) -> int:
        return self.fms.shape[2]

    @property
    def max_intervals(self) -> int:
        return self.fms.shape[3]

    @property
    def device(self) -> torch.device:
        return self.fms.device

    @property
    def nbytes(self) -> int:
        return self.fms.nbytes + self.fme.nbytes

    def __repr__(self) -> str:
        return (
            f"FlashMask(B={self.batch}, Hm={self.heads}, Nk={self.num_keys}, M={self.max_intervals}, "
            f"num_rows={self.num_rows}, device={self.device})"
        )

    # ------------------------------------------------------------ transforms
    def to(self, device) -> "FlashMask":
        """The same mask on another device (block summaries are recomputed there on demand; what
        :meth:`causal_documents` knows is carried over, so a GPU mask knows it without a sync)."""
        fms, fme = self.fms.to(device), self.fme.to(device)
        if fms is self.fms and fme is self.fme:
            return self  # already there: keep the caches
        moved = FlashMask(fms, fme, self.num_rows, validate=False)
        digest = ("digest", self.fms._version, self.fme._version)
        if digest in self._cache:
            moved._cache[("digest", moved.fms._version, moved.fme._version)] = self._cache[digest]
        key = self._documents_key()
        if key in self._cache or self.device.type == "cpu":
            moved.set_causal_documents(self.causal_documents())
        return moved

    # ------------------------------------------------------------- structure
    def _documents_key(self) -> tuple:
        # Keyed on the bounds' version counters: an in-place edit forgets the answer.
        return ("causal_documents", self.fms._version, self.fme._version)

    def causal_documents(self) -> tuple[int, ...] | None:
        """The document lengths if this mask is exactly packed *causal* documents over all its rows
        and keys (``B = Hm = 1``, ``num_rows == Nk``, no padding; plain causal is one document),
        else None. Dense kernels have special paths for these (FA4's causal and varlen kernels,
        ``impl="cute"``).

        Never syncs: computed for masks on the CPU (where the data loader builds them) and carried by
        :meth:`to`; a mask made on the GPU and never told (:meth:`set_causal_documents`) says None."""
        key = self._documents_key()
        if key not in self._cache:
            if self.device.type != "cpu":
                return None
            self._cache[key] = _causal_documents(self.fms, self.fme, self.num_rows)
        return self._cache[key]

    def set_causal_documents(self, lengths: tuple[int, ...] | None) -> None:
        """Record what :meth:`causal_documents` answers, for the current bounds (no check made)."""
        self._cache[self._documents_key()] = None if lengths is None else tuple(int(x) for x in lengths)

    def select_keys(self, index: torch.Tensor | slice) -> "FlashMask":
        """The columns of the keys at ``index`` (a slice or a 1-D index tensor); rows stay global."""
        if isinstance(index, slice):
            return FlashMask(self.fms[:, :, index], self.fme[:, :, index], self.num_rows, validate=False)
        index = index.to(self.device)
        return FlashMask(self.fms.index_select(2, index), self.fme.index_select(2, index), self.num_rows, validate=False)

    def expand_intervals(self, m: int) -> "FlashMask":
        """The same mask with at least ``m`` interval slots (extra slots empty)."""
        if m <= self.max_intervals:
            return self
        pad = m - self.max_intervals
        shape = (*self.fms.shape[:3], pad)
        fms = torch.cat([self.fms, torch.full(shape, self.num_rows, dtype=torch.int32, device=self.device)], -1)
        fme = torch.cat([self.fme, torch.full(shape, -1, dtype=torch.int32, device=self.device)], -1)
        return FlashMask(fms, fme, self.num_rows, validate=False)

    # ----------------------------------------------------------------- views
    def to_dense(self, nq: int | None = None, *, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The boolean picture ``[B, Hm, Nq, Nk]`` (True = visible). For tests and the dense fallback.

        Args:
            nq: rows ``0 .. nq-1`` (default ``num_rows``).
            rows: explicit global row positions ``[Nq]`` instead (a slice of queries).
        """
        if rows is None:
            rows = torch.arange(self.num_rows if nq is None else nq, device=self.device)
        rows = rows.to(self.device).view(1, 1, -1, 1, 1)
        fms, fme = self.fms.unsqueeze(2), self.fme.unsqueeze(2)  # [B, Hm, 1, Nk, M]
        return ((fms <= rows) & (rows <= fme)).any(dim=-1)

    def visible_pairs(self, nq: int | None = None) -> torch.Tensor:
        """Visible (query, key) pairs per mask row, ``[B, Hm]`` int64, for rows ``0 .. nq-1``."""
        return intervals.count_rows(self.fms, self.fme, self.num_rows if nq is None else nq).sum(-1)

    def digest(self) -> int:
        """A 63-bit BLAKE2b digest of the bounds' bytes, shape and ``num_rows``, for checking that
        ranks hold the same mask (two different masks collide with probability 2^-63, not by
        construction as with a weighted sum). Cached per mask and carried by :meth:`to`; a GPU mask
        that was never told copies its bounds to the host once (one sync)."""
        key = ("digest", self.fms._version, self.fme._version)
        if key not in self._cache:
            h = hashlib.blake2b(digest_size=8)
            h.update(repr((tuple(self.fms.shape), self.num_rows)).encode())
            for bounds in (self.fms, self.fme):
                h.update(bounds.detach().to("cpu", torch.int32).contiguous().numpy().tobytes())
            self._cache[key] = int.from_bytes(h.digest(), "little") >> 1  # fits an int64
        return self._cache[key]

    def block_summary(self, block: int) -> "BlockSummary":
        """Min/max of the bounds per key block of ``block`` columns (cached per block size)."""
        from fm_parallel.masks.blocks import summarize

        return self.cached(("summary", block), lambda: summarize(self, block))

    def cached(self, key, make):
        """``make()``, computed once per mask and ``key`` (for data derived from the bounds alone).
        Keyed on the bounds' version counters too: an in-place edit of ``fms`` / ``fme`` is a miss."""
        key = (key, self.fms._version, self.fme._version)
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def stats(self, block: int = 128) -> MaskStats:
        """Tile counts (square ``block`` x ``block`` tiles) and density, for ``num_rows`` x ``Nk``."""
        from fm_parallel.masks.blocks import count_tiles

        skipped, partial, full = count_tiles(self, block_q=block, block_k=block)
        pairs = int(self.visible_pairs().sum())
        return MaskStats(
            block=block,
            num_rows=self.num_rows,
            num_keys=self.num_keys,
            tiles_total=skipped + partial + full,
            tiles_skipped=skipped,
            tiles_partial=partial,
            tiles_full=full,
            visible_pairs=pairs,
            density=pairs / max(self.batch * self.heads * self.num_rows * self.num_keys, 1),
        )


class _OwnerIndex:
    """Weak index from bounds tensors to the live FlashMasks holding them.

    Keyed on where the bounds' data sit (``data_ptr``, shape, device), because code that receives
    only tensors may get other tensor objects over the same memory (AOT autograd hands the backward
    an alias of a saved input). A hit is trusted only while its owner is alive and its own ``fms`` /
    ``fme`` still sit there with the same shape and strides: a live tensor's memory cannot be reused,
    so a dead owner or recycled memory is never a hit. Nothing is kept alive by the index. A builder
    may wrap the same tensors twice: the latest live owner wins."""

    def __init__(self, sweep_every: int = 4096):
        self._entries: dict[tuple, list[weakref.ref]] = {}
        self._sweep_every, self._added = sweep_every, 0

    @staticmethod
    def _key(fms: torch.Tensor, fme: torch.Tensor) -> tuple:
        return fms.data_ptr(), fme.data_ptr(), tuple(fms.shape), str(fms.device)

    def add(self, mask: "FlashMask") -> None:
        key = self._key(mask.fms, mask.fme)
        owners = [r for r in self._entries.get(key, ()) if r() is not None]
        self._entries[key] = owners + [weakref.ref(mask)]
        self._added += 1
        if self._added % self._sweep_every == 0:
            self._entries = {k: live for k, refs in self._entries.items() if (live := [r for r in refs if r() is not None])}

    def find(self, fms: torch.Tensor, fme: torch.Tensor, num_rows: int) -> "FlashMask | None":
        key = self._key(fms, fme)
        for ref in reversed(self._entries.get(key, ())):
            mask = ref()
            if (mask is not None and mask.num_rows == num_rows and self._key(mask.fms, mask.fme) == key
                    and mask.fms.stride() == fms.stride() and mask.fme.stride() == fme.stride()
                    and mask.fms.dtype == fms.dtype and mask.fme.dtype == fme.dtype):
                return mask
        return None


_OWNERS = _OwnerIndex()


def _causal_documents(fms: torch.Tensor, fme: torch.Tensor, num_rows: int) -> tuple[int, ...] | None:
    """Lengths of the packed causal documents these bounds are, or None (see FlashMask.causal_documents).
    Causal documents: key ``j`` of a document ending at ``e`` is seen by rows ``j .. e``, so
    ``fms[j] == j`` and ``fme[j]`` is the last token of ``j``'s document."""
    b, h, n, m = fms.shape
    if b != 1 or h != 1 or num_rows != n or (m > 1 and not bool((fms[0, 0, :, 1:] > fme[0, 0, :, 1:]).all())):
        return None
    first, last = fms[0, 0, :, 0], fme[0, 0, :, 0]
    cols = torch.arange(n, dtype=first.dtype)
    if not torch.equal(first, cols):
        return None
    ends = torch.nonzero(last == cols).flatten()  # the last token of each document
    if ends.numel() == 0 or int(ends[-1]) != n - 1:
        return None
    if not torch.equal(last, ends[torch.searchsorted(ends, cols.to(ends.dtype))].to(last.dtype)):
        return None
    return tuple(torch.diff(ends, prepend=ends.new_tensor([-1])).tolist())


def _as_bounds(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected an integer torch.Tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype (int32 preferred), got {x.dtype}")
    if x.dim() == 1:
        x = x.view(1, 1, -1)
    elif x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    if x.dim() != 4:
        raise ValueError(f"{name}: expected shape [B, Hm, Nk] or [B, Hm, Nk, M], got {tuple(x.shape)}")
    if not 1 <= x.shape[-1] <= MAX_INTERVALS:
        raise ValueError(f"{name}: expected 1 to {MAX_INTERVALS} intervals per column (last dim), got {x.shape[-1]}")
    if x.dtype != torch.int32:
        if x.numel() and (int(x.max()) > _INT32_MAX or int(x.min()) < -_INT32_MAX - 1):
            raise ValueError(f"{name}: values must fit in int32, got range [{int(x.min())}, {int(x.max())}]")
        x = x.to(torch.int32)
    return x


def _validate(fms: torch.Tensor, fme: torch.Tensor, num_rows: int) -> None:
    if fms.numel() == 0:
        return
    nonempty = fms <= fme
    bad_start = nonempty & (fms < 0)
    bad_end = nonempty & (fme >= num_rows)
    # Each non-empty interval must start after every earlier non-empty interval of its column ends
    # (touching is allowed: [0, 3] then [4, 9]).
    ends = torch.where(nonempty, fme, torch.full_like(fme, -1))
    prev_end = torch.cummax(ends, dim=-1).values
    prev_end = torch.cat([torch.full_like(prev_end[..., :1], -1), prev_end[..., :-1]], dim=-1)
    unsorted = nonempty & (fms <= prev_end)
    flags = torch.stack([bad_start.any(), bad_end.any(), unsorted.any()]).tolist()
    if flags[0]:
        idx = tuple(torch.nonzero(bad_start)[0].tolist())
        raise ValueError(f"fms: expected rows >= 0, got fms{list(idx)} = {int(fms[idx])}")
    if flags[1]:
        idx = tuple(torch.nonzero(bad_end)[0].tolist())
        raise ValueError(
            f"fme: expected rows < num_rows = {num_rows} (bounds are inclusive), got fme{list(idx)} = {int(fme[idx])}"
        )
    if flags[2]:
        idx = tuple(torch.nonzero(unsorted)[0].tolist())
        col = idx[:3]
        raise ValueError(
            "fms/fme: expected the non-empty intervals of each column sorted and disjoint, got "
            f"column {list(col)} with intervals {list(zip(fms[col].tolist(), fme[col].tolist()))}"
        )
