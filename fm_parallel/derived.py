"""Data derived from objects (masks, tensors), cached by the code that derives it, keyed by identity.

One primitive, :class:`IdentityCache`, for every cache of derived data outside the masks layer: a
backend's launch plans, block lists and recorded launches per mask (``derived_for_mask``), and the
Hugging Face attention's per-forward masks (one entry: each layer of a forward receives the same
tensors). An entry is keyed by its objects' identity and version counters, and held weakly:

* it is found only while each of its objects is alive and the very same object (an ``id`` reused by a
  new object is a miss);
* an in-place edit of a tensor (or of a mask's bounds) bumps its version: a miss;
* it is dropped when one of its objects is freed (so a cache never keeps a mask or a batch alive;
  values must not hold their key objects, or they would: ``tests/test_derived.py`` checks the
  backends' values).

One off switch for all of them: ``FM_PARALLEL_CACHE=0`` in the environment, or :func:`caching`
(a context manager) in code; everything is then recomputed on each call (for a suspected stale
cache: the results must not change).

What the masks layer derives from the bounds alone (block summaries, the digest, the document
structure) stays on the mask (``FlashMask.cached``); docs/architecture.md lists every cache and its owner.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch

__all__ = ["IdentityCache", "caching", "caching_enabled", "derived_for_mask"]

_state = threading.local()


def caching_enabled() -> bool:
    """False under ``FM_PARALLEL_CACHE=0`` or inside ``caching(False)``."""
    forced = getattr(_state, "enabled", None)
    if forced is not None:
        return forced
    return os.environ.get("FM_PARALLEL_CACHE", "1") != "0"


@contextlib.contextmanager
def caching(enabled: bool) -> Iterator[None]:
    """Switch every :class:`IdentityCache` on or off for this thread, inside the block."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected a bool, got {enabled!r}")
    before = getattr(_state, "enabled", None)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = before


def _version(obj) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj._version
    bounds = getattr(obj, "fms", None), getattr(obj, "fme", None)  # a FlashMask: its bounds' versions
    if all(isinstance(b, torch.Tensor) for b in bounds):
        return bounds[0]._version, bounds[1]._version
    return None


class IdentityCache:
    """Values derived from a tuple of objects, per key.

    Args:
        name: what the values are (error messages, ``repr``).
        entries: how many object tuples are kept, the most recently used (None: every live one).
    """

    def __init__(self, name: str, entries: int | None = None):
        if entries is not None and (not isinstance(entries, int) or entries < 1):
            raise ValueError(f"entries: expected a positive int or None, got {entries!r}")
        self.name, self.entries = name, entries
        self._table: OrderedDict[tuple, tuple[tuple, dict]] = OrderedDict()  # ids -> (weak refs, {key: value})
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"IdentityCache({self.name!r}, entries={self.entries}, live={len(self._table)})"

    def __len__(self) -> int:
        return len(self._table)

    def get(self, objects: tuple, key, make: Callable[[], Any]):
        """``make()`` for ``objects`` (None entries ignored) and ``key``, computed once while the objects
        live unchanged (identity and versions)."""
        if not caching_enabled():
            return make()
        objects = tuple(o for o in objects if o is not None)
        ids = tuple(map(id, objects))
        full_key = (key, tuple(_version(o) for o in objects))
        with self._lock:
            found = self._table.get(ids)
            if found is not None and all(r() is o for r, o in zip(found[0], objects)):
                self._table.move_to_end(ids)
                if full_key in found[1]:
                    return found[1][full_key]
                values = found[1]
            else:
                values = None
        value = make()
        with self._lock:
            if values is None:
                refs = tuple(weakref.ref(o, self._dropper(ids)) for o in objects)
                values = {}
                self._table[ids] = (refs, values)
                while self.entries is not None and len(self._table) > self.entries:
                    self._table.popitem(last=False)
            values[full_key] = value
        return value

    def _dropper(self, ids: tuple):
        table = weakref.ref(self._table)

        def drop(_ref):
            t = table()
            if t is not None:
                entry = t.get(ids)
                if entry is not None and any(r is _ref for r in entry[0]):
                    t.pop(ids, None)

        return drop

    def clear(self) -> None:
        with self._lock:
            self._table.clear()


_MASK_STORES: dict[str, IdentityCache] = {}


def derived_for_mask(owner: str) -> IdentityCache:
    """The store of what ``owner`` (a backend's name: ``"triton"``, ``"fa4"``, ``"torch"``) derives from
    masks; use it as ``derived_for_mask("triton").get((mask,), key, make)``. One store per owner."""
    if owner not in _MASK_STORES:
        _MASK_STORES[owner] = IdentityCache(f"{owner}: data derived from masks")
    return _MASK_STORES[owner]
