"""FA4 calls replayed without FA4's Python: the compiled kernels of one call, recorded once per
signature and called directly afterwards.

FA4's interface functions (``_flash_attn_fwd`` / ``_flash_attn_bwd``, the pinned version, :mod:`.pin`) spend
0.3-0.5 ms of Python per call (argument checks, configuration, compile-key hashing) before they call
their compiled kernels. Context parallelism calls them for every chunk a rank sees, forward and
backward, in every layer: that Python was the largest part of the ring's host time on the H200
(``docs/benchmarks/README.md``). For one signature (the shapes, strides, dtypes, devices and 16-byte
alignment of the tensors that change per call; everything else fixed, from one mask) FA4 does the
same work every time: the same compiled functions with the same arguments, temporaries of the same
sizes. So the first call of a signature runs FA4 as usual, and the second (a signature seen once,
such as a decoding step's with its growing cache, never pays for a recording) runs it while
:func:`_record` watches:

* every compiled call (through the ``compile_cache`` of the interface module's functions) with its
  arguments;
* every tensor operation on the way (a ``TorchDispatchMode``): allocations become temporaries that
  a replay makes again, zero- or value-filled where FA4 filled them and at the same point; views of
  the call's tensors or of the mask's are mapped onto the new call's tensors;

and later calls with the same signature run that program (:func:`replay`). Whatever the recording
cannot map exactly (any other tensor operation, such as a copy, a computation or a host sync; a
tensor of unknown origin; an argument object holding tensors it cannot rebuild) leaves that
signature on FA4's own path for good: slower, never wrong. ``counters`` says which happened.

The records live in a dict the caller ties to the mask whose tensors they keep (its ``cached``
store), so they go with it. One thread records at a time: FA4 calls from other threads meanwhile pass
through unrecorded (and a call meeting another thread's recording takes FA4's path).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ENABLED", "INTERFACE", "counters", "launch", "signature"]

# Off: every call takes FA4's own path (benchmarks switch it to measure it; users with
# FM_PARALLEL_FA4_LAUNCH=0 in the environment).
ENABLED = os.environ.get("FM_PARALLEL_FA4_LAUNCH", "1") != "0"
# "recorded", "replayed", "refused" (a signature left on FA4's path; "refused: <why>" beside it),
# "retried" (a recording that saw a compile, made again on the next call).
counters: collections.Counter = collections.Counter()
_MAX_TRIES = 3  # recordings per signature (a first call that compiles does more than later calls)
INTERFACE = "flash_attn.cute.interface"  # the module whose functions' compile caches are watched
# One recording at a time in the process: a recording swaps the interface's compile caches, and two
# threads swapping them would restore each other's proxies.
_recording = threading.Lock()

_aten = torch.ops.aten
_ALLOC = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
          _aten.new_empty.default, _aten.new_empty_strided.default}
_ALLOC_FILLED = {_aten.zeros.default: 0, _aten.zeros_like.default: 0, _aten.new_zeros.default: 0}
_FILL = {_aten.zero_.default, _aten.fill_.Scalar}


class _Refused(Exception):
    """The call did something the recording cannot replay exactly."""


@dataclass
class _Record:
    calls: int = 0
    tries: int = 0
    program: list | None = None  # ("alloc", spec) / ("fill", view, value) / ("call", fn, args, kwargs)
    refused: bool = False


@dataclass
class _Watch:
    """What one recorded call did, in order."""

    thread: int
    steps: list = field(default_factory=list)  # ("alloc", tensor, value | None) / ("fill", tensor, value) / ("call", ...)
    temps: list = field(default_factory=list)  # tensors FA4 allocated (kept alive: no address reuse)
    problem: str | None = None
    compiled: bool = False


def signature(tensors) -> tuple:
    """What of the per-call tensors a recording depends on (``None`` entries allowed)."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                 for t in tensors)


def launch(store: dict, key: tuple, inputs: tuple, prepare, call) -> None:
    """Run ``call(prepare())`` (an FA4 call on ``inputs``, writing its results into some of them), or
    its recorded program for ``inputs`` of the same :func:`signature`.

    Args:
        store: where records live, as long as the tensors ``prepare`` returns (the FA4 backend's store for the mask).
        key: the rest of the signature (scale, options, which FA4 path, ...); None where the call has
            no stable one (it then runs FA4's own path, recording nothing).
        inputs: every tensor of this call that may differ between calls with this ``key``, exactly as
            passed to FA4 (outputs included).
        prepare: makes (or looks up) what FA4 is handed that stays the same for ``key``: the mask's
            block lists, bounds, ``cu_seqlens``. Runs outside the recording (building them may take
            any tensor operation, even a sync) and is skipped by a replay. Returns a tuple of objects
            holding those tensors (searched through tuples, lists and attributes).
        call: the FA4 call itself, given what ``prepare`` returned.
    """
    if not ENABLED or key is None:
        call(prepare())
        return
    full_key = (key, signature(inputs))
    rec = store.get(full_key)
    if rec is None:
        rec = store[full_key] = _Record()
    if rec.program is not None:
        _replay(rec.program, inputs)
        counters["replayed"] += 1
        return
    rec.calls += 1
    made = prepare()
    if rec.refused or rec.calls == 1:  # a signature seen once (a decoding step's) costs nothing extra
        call(made)
        return
    if not _recording.acquire(blocking=False):  # another thread is recording: its swapped caches are its own
        call(made)
        return
    rec.tries += 1
    try:
        program = _record(lambda: call(made), inputs, made)
    except _Refused as why:
        rec.refused = True
        counters["refused"] += 1
        counters[f"refused: {why}"] += 1
        _log_refusal(str(why))
        return
    finally:
        _recording.release()
    if program is None:  # the call compiled: record the next one, which does what later calls do
        counters["retried"] += 1
        if rec.tries >= _MAX_TRIES:
            rec.refused = True
            counters["refused"] += 1
        return
    rec.program = program
    counters["recorded"] += 1


def _log_refusal(why: str) -> None:
    from fm_parallel.backends import log_once

    log_once("fa4_launch:" + why.split(":")[0], f"FA4 launches: a signature stays on FA4's own path ({why})")


# --- recording -------------------------------------------------------------------------------------


class _Mode(TorchDispatchMode):
    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        w = self.watch
        if threading.get_ident() != w.thread or w.problem:
            return out
        if func in _ALLOC or func in _ALLOC_FILLED:
            w.temps.append(out)
            w.steps.append(("alloc", out, _ALLOC_FILLED.get(func)))
        elif func in _FILL:
            value = 0 if func is _aten.zero_.default else args[1]
            if not isinstance(value, (int, float, bool)):
                w.problem = f"fill with {type(value).__name__}"
            w.steps.append(("fill", args[0], value))
        elif not _is_view(func):
            w.problem = f"{func} inside FA4's call"
        return out


def _is_view(func) -> bool:
    schema = func._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


class _CacheProxy:
    """A function's ``compile_cache`` that logs the compiled calls made from the recording thread."""

    def __init__(self, cache, watch: _Watch):
        self._cache, self._watch = cache, watch

    def __contains__(self, key):
        found = key in self._cache
        if not found and threading.get_ident() == self._watch.thread:
            self._watch.compiled = True
        return found

    def __setitem__(self, key, value):
        self._cache[key] = value

    def __getitem__(self, key):
        fn = self._cache[key]
        watch = self._watch
        if threading.get_ident() != watch.thread:
            return fn

        def logged(*args, **kwargs):
            watch.steps.append(("call", fn, args, kwargs))
            return fn(*args, **kwargs)

        return logged

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _interface_functions():
    module = sys.modules.get(INTERFACE)
    if module is None:
        return []
    return [f for f in vars(module).values() if callable(f) and hasattr(f, "compile_cache")]


def _record(call, inputs, keep) -> list | None:
    """The program of ``call()`` (which runs, for real), None if it compiled, or raises _Refused."""
    watch = _Watch(thread=threading.get_ident())
    swapped = [(f, f.compile_cache) for f in _interface_functions()]
    for f, cache in swapped:
        f.compile_cache = _CacheProxy(cache, watch)
    try:
        with _Mode(watch):
            call()
    finally:
        for f, cache in swapped:
            f.compile_cache = cache
    if watch.problem:
        raise _Refused(watch.problem)
    if watch.compiled:
        return None
    return _program(watch, inputs, keep)


def _storages(objects) -> dict[int, torch.Tensor]:
    """Storage address -> a tensor on it, for every tensor in ``objects`` (tuples, lists, attributes)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(x, depth=0):
        if id(x) in seen or depth > 4:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.setdefault(x.untyped_storage().data_ptr(), x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                visit(y, depth + 1)
        elif hasattr(x, "__dict__"):
            for y in vars(x).values():
                visit(y, depth + 1)

    try:
        visit(objects)
        return found
    finally:
        del visit  # the recursive closure's cycle would hold the tensors found (see _make)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Element offsets ``[first, last + 1)`` of a tensor in its storage."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return t.storage_offset(), t.storage_offset() + last + 1


def _program(watch: _Watch, inputs, keep) -> list:
    inputs_by_storage: dict[int, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(inputs):
        if t is not None:
            inputs_by_storage[t.untyped_storage().data_ptr()].append(i)
    temps_by_storage = {t.untyped_storage().data_ptr(): j for j, t in enumerate(watch.temps)}
    keeps = _storages(keep)

    def tensor_ref(t: torch.Tensor):
        address = t.untyped_storage().data_ptr()
        if address == 0:
            raise _Refused("a tensor without storage")
        for i in inputs_by_storage.get(address, ()):
            base = inputs[i]
            lo, hi = _span(base)
            a, b = _span(t)
            if base.dtype == t.dtype and lo <= a and b <= hi:
                return ("in", i, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
        if address in temps_by_storage:
            j = temps_by_storage[address]
            base = watch.temps[j]
            if base.dtype != t.dtype:
                raise _Refused("a temporary reinterpreted")
            return ("tmp", j, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
        if address in keeps:
            return ("keep", t)
        raise _Refused("a tensor of unknown origin")

    def plan(x):
        """("const", x) where x needs nothing of the call, else a recipe."""
        if isinstance(x, torch.Tensor):
            ref = tensor_ref(x)
            return ("const", ref[1]) if ref[0] == "keep" else ref
        if isinstance(x, (tuple, list)):
            parts = [plan(y) for y in x]
            if all(p[0] == "const" for p in parts):
                return ("const", x)
            return ("seq", type(x), parts)
        held = _storages([vars(x)]) if hasattr(x, "__dict__") else {}
        if any(tensor_ref(t)[0] != "keep" for t in held.values()):
            raise _Refused(f"a {type(x).__name__} holding the call's tensors")
        return ("const", x)

    program = []
    try:
        for step in watch.steps:
            if step[0] == "alloc":
                t, value = step[1], step[2]
                program.append(("alloc", (tuple(t.shape), t.stride(), t.dtype, t.device), value))
            elif step[0] == "fill":
                ref = tensor_ref(step[1])
                if ref[0] != "tmp":
                    raise _Refused("a fill of a tensor FA4 did not allocate")
                program.append(("fill", ref, step[2]))
            else:
                _, fn, args, kwargs = step
                program.append(("call", fn, [plan(a) for a in args], {k: plan(v) for k, v in kwargs.items()}))
    finally:
        del plan, tensor_ref  # recursive closures: their cycle would hold the recorded call's tensors (see _make)
    return program


# --- replay ----------------------------------------------------------------------------------------


# Why module-level helpers, not nested functions: a nested function that calls itself (a recursive
# ``make``) sits in a reference cycle with its closure, which then holds the call's tensors (inputs,
# temporaries) until Python's cyclic GC happens to run. In a training step that kept every layer's
# attention output and backward temporaries alive together (the 1B trainer at 32k peaked at 20.7 GiB
# with the replay against 6.4 GiB without it, on the H200): every call here frees its tensors on return.


def _view(base: torch.Tensor, shape, stride, delta) -> torch.Tensor:
    if delta == 0 and tuple(base.shape) == shape and base.stride() == stride:
        return base
    return base.as_strided(shape, stride, base.storage_offset() + delta)


def _make(p, inputs: list, temps: list):
    kind = p[0]
    if kind == "const":
        return p[1]
    if kind == "in":
        return _view(inputs[p[1]], *p[2:])
    if kind == "tmp":
        return _view(temps[p[1]], *p[2:])
    items = [_make(q, inputs, temps) for q in p[2]]
    cls = p[1]
    return cls(*items) if hasattr(cls, "_fields") else cls(items)  # NamedTuple, or tuple / list


def _replay(program: list, inputs) -> None:
    inputs = [t.detach() if t is not None and t.requires_grad else t for t in inputs]
    temps: list[torch.Tensor] = []
    for step in program:
        if step[0] == "alloc":
            (shape, stride, dtype, device), value = step[1], step[2]
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if value is not None:
                t.fill_(value)
            temps.append(t)
        elif step[0] == "fill":
            _make(step[1], inputs, temps).fill_(step[2])
        else:
            _, fn, args, kwargs = step
            fn(*[_make(a, inputs, temps) for a in args], **{k: _make(v, inputs, temps) for k, v in kwargs.items()})
