"""What device memory at the peak of one step is made of, measured from the CUDA caching allocator's
own record of every allocation and free, not estimated from shapes.

    with record(device) as rec:                      # torch's allocator history, Python stacks
        step()
    out = peak_breakdown(rec.snapshot, rec.start_bytes, rec.device_index, max_entries=rec.max_entries)
    out["terms"]                                     # [{"where": "fm_parallel/longcontext/tiling.py:forward", "gib": ..}, ..]
    static_terms(model, optimizer, device=device)    # weights, adapters, gradients, optimizer state

``record`` notes what is allocated when it starts (weights, adapters, any optimizer state: the
"start") and turns on ``torch.cuda.memory._record_memory_history``, which keeps one trace entry per
allocator action with the Python stack of the call that made it. ``peak_breakdown`` replays that trace
(a pure function of the snapshot dict, testable without a GPU): it finds the moment the bytes
allocated during the recording were largest and groups the allocations live then by the innermost
frame in this project's code (fm_parallel, its kernels, launch/bench), so each term names the line of
ours that asked for the memory, directly or through torch / transformers / peft.

The allocator's trace actions, as torch documents them in ``torch.cuda.memory._snapshot`` and as its
own viewer (``torch/cuda/_memory_viz.py``, the "Active Memory Timeline") replays them:
``alloc`` a block handed out; ``free_requested`` the tensor released it (``memory_allocated`` drops
here); ``free_completed`` the block can be reused (later than the request when another stream still
used it: ``record_stream``, e.g. a checkpoint being copied to the host); ``segment_alloc`` /
``segment_free`` / ``segment_map`` / ``segment_unmap`` reserved memory (cudaMalloc / expandable
segments), not allocations; ``oom`` a request that failed; ``snapshot`` a marker. The peak is taken on
the memory that cannot be reused (an allocation counts until its ``free_completed``, as the viewer
counts it); the peak by ``memory_allocated``'s rule (until ``free_requested``) is reported beside it.
Sizes are the requested bytes of each allocation (the allocator rounds up to 512 bytes, so
``torch.cuda.max_memory_allocated`` reads slightly higher).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["Recording", "record", "peak_breakdown", "static_terms", "recording_conflict", "DEFAULT_MAX_ENTRIES"]

GIB = 2**30
# Trace entries kept (a ring buffer: past this, the oldest are overwritten and the replay cannot see
# them; peak_breakdown then says trace_truncated). Each entry costs host memory (its stack, several
# KB once the snapshot turns it into Python objects), so this bounds what recording can take.
DEFAULT_MAX_ENTRIES = 2_000_000
# Path fragments that mark this project's code. "/kernels/" is the top-level Triton folder of a
# checkout (installed as fm_parallel.kernels); an installed package of that name is someone else's.
_OURS = ("/launch/bench/", "/fm_parallel/", "/kernels/")
_INSTALLED = ("site-packages/", "dist-packages/")


@dataclass
class Recording:
    """What :func:`record` measured: ``start_bytes`` (``torch.cuda.memory_allocated`` when recording
    began), ``snapshot`` (``torch.cuda.memory._snapshot()`` when it ended; None until then),
    ``device_index`` (which of the snapshot's ``device_traces`` is this device's) and ``max_entries``."""

    device_index: int
    max_entries: int
    start_bytes: int = 0
    snapshot: dict | None = None


def _enable(max_entries: int, context: str, stacks: str) -> None:
    """Start the allocator's history. The keywords are those of torch 2.1 onwards (2.11 on the GPU
    machine, 2.13 here); ``clear_history`` (newer) drops entries of an earlier recording, where the
    running torch knows it."""
    enable = torch.cuda.memory._record_memory_history
    try:
        enable(enabled="all", context=context, stacks=stacks, max_entries=max_entries, clear_history=True)
    except TypeError:  # a torch without clear_history
        enable(enabled="all", context=context, stacks=stacks, max_entries=max_entries)


@contextlib.contextmanager
def record(device, max_entries: int = DEFAULT_MAX_ENTRIES, context: str = "all", stacks: str = "python"):
    """Record every allocator action on ``device`` inside the block; yields a :class:`Recording`
    whose ``snapshot`` is filled on exit, also when the block raised (an out-of-memory step's trace
    shows what filled the device, and its ``oom`` entry what was asked for). ``context="all"`` keeps a
    stack for frees too; ``"alloc"`` only for allocations, which is all the replay reads and saves
    host memory on a long trace. ``stacks="python"``: Python frames only (C++ frames are slow to
    gather and not needed to name our code)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"memory_breakdown.record: needs a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    rec = Recording(index, max_entries)
    torch.cuda.synchronize(device)  # frees still in flight on the device land before the start is read
    rec.start_bytes = torch.cuda.memory_allocated(device)
    _enable(max_entries, context, stacks)
    try:
        yield rec
    finally:
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a failed step can leave the device unusable; take what was recorded
            pass
        try:
            # _snapshot() holds every device's trace ("device" is ignored by recent torch; the index picks ours).
            rec.snapshot = torch.cuda.memory._snapshot(device)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


# torch's own bug (pytorch/pytorch#179536, open; a regression in 2.11): with the allocator's history on,
# code compiled by torch.compile that runs inside a non-reentrant checkpoint's recompute fails with
# this message instead of running. Met on the H200 (torch 2.11) with a checkpoint every 2 layers
# and the compiled per-token parts, at 64k and 1M tokens; a checkpoint per layer ran.
_CHECKPOINT_RECOMPUTE_BUG = "returned NULL without setting an exception"


def recording_conflict(error: str, checkpoint_every: int) -> str | None:
    """Why a step failed under :func:`record` when the failure is torch's known conflict between the
    allocator's history and an ``autograd.Function`` run inside a non-reentrant checkpoint's recompute
    (``error``: the step's error line; ``checkpoint_every``: the run's layers per checkpoint), with
    what to do; None for any other failure. Not a measurement of the step: the same step runs without
    the recording. Met on the GPU with compiled and with eager per-token parts alike (an H100 at 1M,
    2026-12-06): our tiled layer is such a Function, recomputed by every segment of k > 1 layers."""
    if _CHECKPOINT_RECOMPUTE_BUG not in error or checkpoint_every <= 1:
        return None
    return (f"torch's allocator history cannot record an autograd Function run inside a checkpoint's recompute "
            f"(pytorch/pytorch#179536, torch {torch.__version__}); this step has a checkpoint every "
            f"{checkpoint_every} layers, whose recompute runs the tiled layers (recordable_checkpoints turns "
            f"torch's early stop, the usual trigger, off). The step itself runs without the recording. To record "
            f"one: a length whose plan keeps a checkpoint per layer, or a torch with the fix")


def recordable_checkpoints(checkpoint_every: int):
    """Around a step recorded by :func:`record`: for ``checkpoint_every`` > 1, checkpoints that run
    their recompute to the end (``torch.utils.checkpoint.set_checkpoint_early_stop(False)``).

    Why: torch stops a recompute early by raising an exception from inside the hook that saves a
    tensor, here inside our tiled layer's ``autograd.Function``; with the allocator's history on, that
    exception is lost (pytorch/pytorch#179536: "returned NULL without setting an exception").
    Without the early stop the recompute also runs the segment's last layer forward, whose output it
    drops before the segment's backward. Measured on an H100 at 1M, a checkpoint every 3 layers
    (docs/long-context.md): the recorded step's peak equals the same step's without recording or
    this context to the byte (76.105 GiB). The breakdown says it ran so (``checkpoint_early_stop``)."""
    if checkpoint_every <= 1:
        return contextlib.nullcontext()
    from torch.utils.checkpoint import set_checkpoint_early_stop

    return set_checkpoint_early_stop(False)


def _ours(filename: str) -> str | None:
    """``filename`` from the start of this project's folder (``fm_parallel/trainer/loop.py``), or None
    when it is not our code."""
    path = filename.replace("\\", "/")
    for marker in _OURS:
        at = path.rfind(marker)
        if at < 0:
            continue
        if marker == "/kernels/" and any(p in path[:at + 1] for p in _INSTALLED) and "/fm_parallel/" not in path:
            continue  # an installed package's kernels/ folder (e.g. the PyPI `kernels`), not ours
        return path[at + 1:]
    return None


def _short(filename: str) -> str:
    """A library file from its package folder (``torch/nn/functional.py``), else its last two parts."""
    path = filename.replace("\\", "/")
    for p in _INSTALLED:
        at = path.rfind(p)
        if at >= 0:
            return path[at + len(p):]
    return "/".join(path.split("/")[-2:])


def _where(frames) -> tuple[str, str]:
    """(term, innermost frame) of one allocation: the term is the innermost frame in our code as
    ``file:function``, else the innermost frame at all prefixed ``torch:`` (an allocation made with no
    frame of ours on the stack: an autograd backward node, an optimizer), else ``unknown`` (no Python
    frame recorded: a C++ thread such as autograd's backward engine running a kernel's backward)."""
    frames = frames or []
    inner = f"{_short(frames[0]['filename'])}:{frames[0]['name']}" if frames else "unknown"
    for f in frames:  # innermost first, as the allocator records them (torch's viewer reverses them for flame graphs)
        rel = _ours(f.get("filename", ""))
        if rel is not None:
            return f"{rel}:{f.get('name', '?')}", inner
    return (f"torch:{inner}" if frames else "unknown"), inner


def peak_breakdown(snapshot: dict, start_bytes: int, device_index: int = 0, max_entries: int | None = None,
                   top_inner: int = 3) -> dict:
    """Replay ``snapshot["device_traces"][device_index]`` and break the moment of most memory in use
    into terms. Pure: no CUDA call, so it runs on a saved or synthetic snapshot.

    Live bytes are those allocated during the recording and not yet reusable: an ``alloc`` adds its
    size, the ``free_completed`` of that address removes it (``free_requested`` when the trace holds no
    ``free_completed`` at all, e.g. recorded with it skipped). A free of an address not allocated in the
    trace is of memory from before the recording (in ``start_bytes``): ignored, but counted in
    ``unknown_freed_gib``. The peak is the first event at which live bytes are largest.

    Returns ``start_gib`` (``start_bytes``: weights, adapters, optimizer state held before),
    ``step_peak_gib`` (most live bytes), ``peak_gib`` (their sum), ``peak_event`` (its index in the
    trace) and ``events``, ``terms`` (the allocations live at the peak grouped by :func:`_where`,
    largest first: ``where``, ``gib``, ``count``, and ``inner``, the ``top_inner`` largest innermost
    frames inside the term), ``awaiting_free_gib`` (of the peak, bytes already released but waiting on
    another stream), ``step_peak_allocated_gib`` (the peak by ``memory_allocated``'s rule, freed at
    ``free_requested``), ``oom`` (failed requests: ``requested_gib``, ``device_free_gib``),
    ``unknown_freed_gib`` and ``trace_truncated``: True when the trace is full (``max_entries``
    entries: the ring buffer dropped its oldest) or freed more unknown bytes than existed before the
    recording (only dropped entries explain that); a truncated trace undercounts the peak."""
    trace = snapshot["device_traces"][device_index] if device_index < len(snapshot.get("device_traces", [])) else []
    actions = {e.get("action") for e in trace}
    free_action = "free_completed" if "free_completed" in actions else "free_requested"
    # memory_allocated's rule: a block stops counting when released (free_requested), if recorded at all.
    release_action = "free_requested" if "free_requested" in actions else free_action

    def replay(stop: int | None):
        """Walk the trace up to (and including) event ``stop``; the live allocations there and the peak."""
        live: dict[int, tuple[int, list, bool]] = {}  # addr -> (size, frames, free requested)
        allocated: set[int] = set()  # addrs allocated in the trace and not yet freed by memory_allocated's rule
        cur = alloc_cur = peak = alloc_peak = 0
        peak_at = -1
        unknown = 0
        for i, e in enumerate(trace):
            action, addr = e.get("action"), e.get("addr")
            if action == "alloc":
                live[addr] = (int(e.get("size", 0)), e.get("frames") or [], False)
                allocated.add(addr)
                cur += live[addr][0]
                alloc_cur += live[addr][0]
            elif action in ("free_requested", "free_completed"):
                if action == release_action and addr in allocated:
                    allocated.discard(addr)
                    alloc_cur -= live[addr][0]
                if addr not in live:
                    if action == free_action:
                        unknown += int(e.get("size", 0))
                elif action == free_action:
                    cur -= live.pop(addr)[0]  # the size allocated, not the size freed: they can differ by rounding
                else:
                    size, frames, _ = live[addr]
                    live[addr] = (size, frames, True)
            if cur > peak:
                peak, peak_at = cur, i
            alloc_peak = max(alloc_peak, alloc_cur)
            if stop is not None and i == stop:
                break
        return live, peak, peak_at, alloc_peak, unknown

    # Two passes: copying the live set at every new maximum would cost the square of the trace length.
    _, peak, peak_at, alloc_peak, unknown = replay(None)
    live = replay(peak_at)[0] if peak_at >= 0 else {}

    terms: dict[str, dict] = {}
    awaiting = 0
    for size, frames, requested in live.values():
        where, inner = _where(frames)
        t = terms.setdefault(where, {"where": where, "bytes": 0, "count": 0, "inner": {}})
        t["bytes"] += size
        t["count"] += 1
        t["inner"][inner] = t["inner"].get(inner, 0) + size
        awaiting += size if requested else 0
    out_terms = []
    for t in sorted(terms.values(), key=lambda t: (-t["bytes"], t["where"])):
        inner = sorted(t["inner"].items(), key=lambda kv: (-kv[1], kv[0]))[:top_inner]
        out_terms.append({"where": t["where"], "gib": t["bytes"] / GIB, "count": t["count"],
                          "inner": [{"where": w, "gib": b / GIB} for w, b in inner]})
    ooms = [{"requested_gib": e.get("size", 0) / GIB, "device_free_gib": e.get("device_free", 0) / GIB}
            for e in trace if e.get("action") == "oom"]
    truncated = (bool(max_entries) and len(trace) >= max_entries) or unknown > start_bytes
    return {"start_gib": start_bytes / GIB, "peak_gib": (start_bytes + peak) / GIB, "step_peak_gib": peak / GIB,
            "step_peak_allocated_gib": alloc_peak / GIB, "peak_event": peak_at, "events": len(trace),
            "freed_at": free_action, "awaiting_free_gib": awaiting / GIB, "terms": out_terms, "oom": ooms,
            "unknown_freed_gib": unknown / GIB, "trace_truncated": truncated}


def static_terms(model, optimizer=None, device=None) -> dict:
    """Measured bytes (GiB) of what a LoRA model holds between steps, by walking its tensors: the
    frozen base parameters, the trainable (LoRA) parameters, their gradients where present, the
    optimizer's state tensors (``optimizer.state``: AdamW's two moments and step) and the module
    buffers (rotary tables). Each storage is counted once, in the first of those groups that holds it
    (tied or shared weights, views into one buffer); ``device``: only tensors there (None: all), to
    set beside :func:`record`'s ``start_bytes`` of that device."""
    seen: set[tuple] = set()
    dev = torch.device(device) if device is not None else None

    def size(t) -> int:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return 0
        if dev is not None and (t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index)):
            return 0
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            return 0
        seen.add(key)
        return storage.nbytes()  # the whole storage: what the allocator holds, also for a view

    params = list(model.parameters())  # each Parameter once (tied weights are one object)
    out = {"frozen_params_gib": sum(size(p) for p in params if not p.requires_grad) / GIB,
           "trainable_params_gib": sum(size(p) for p in params if p.requires_grad) / GIB,
           "grads_gib": sum(size(p.grad) for p in params if p.grad is not None) / GIB,
           "optimizer_state_gib": 0.0 if optimizer is None else
           sum(size(v) for state in optimizer.state.values() for v in state.values()) / GIB}
    out["buffers_gib"] = sum(size(b) for b in model.buffers()) / GIB
    out["total_gib"] = sum(out.values())
    return out
