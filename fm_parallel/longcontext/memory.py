"""Per-layer activation checkpointing, with the checkpointed layer inputs of chosen layers kept in
host memory.

At long context the checkpoints dominate device memory: each decoder layer keeps its input,
``N x hidden`` values (4 GiB for an 8B-shaped Llama at 512k tokens in bf16; 128 GiB for its 32
layers). ``checkpoint_layers`` wraps every decoder layer's forward in non-reentrant
``torch.utils.checkpoint`` and, for the first ``offload_layers`` layers, runs it under
``HostOffload``: non-reentrant checkpointing saves its positional tensor inputs through the
saved-tensor hooks active around it, so exactly the layer input moves to pinned host memory in the
forward and back in the backward, while everything inside the layer is recomputed (keyword inputs,
the rotary tables and the mask, are kept by reference: one copy shared by all layers).
Offloading only as many layers as needed keeps the rest of the step at full speed and bounds the
host memory taken (a one-GPU machine with 128 GiB of host memory cannot hold all 32 layers at 512k).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointPolicy", "HostOffload", "MemoryPlan", "MemoryPlanError", "StepBudget", "checkpoint_layers",
           "decoder_layers", "decoder_parameters", "host_memory_bytes", "inputs_held", "plan_memory",
           "prefer_expandable_segments", "unwrapped_forward"]

ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prefer_expandable_segments() -> bool:
    """Ask torch's CUDA caching allocator for expandable segments before CUDA starts; True if this call
    set it. Left alone where the user set the allocator's variable (``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF``), without a GPU, or once CUDA is initialised (too late to take effect).

    Why: a long row's tensors come in many sizes (tiles of varying length, one window per attention
    chunk, loss chunks, checkpoints copied back from the host). With fixed segments the blocks freed
    at one size do not serve the next, so the memory reserved runs above the memory allocated, which
    is what the memory plan budgets; a plan that fits by allocated bytes can then run out. Expandable
    segments grow one mapping per stream instead. The older name is set: torch 2.9.1 ignores the newer
    ``PYTORCH_ALLOC_CONF`` for this setting on CUDA (pytorch/pytorch#183387); torch 2.8 to 2.11 warn
    once that the older name is deprecated."""
    if any(os.environ.get(name) for name in ALLOCATOR_ENV):
        return False
    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


@dataclass
class CheckpointPolicy:
    """Live settings of ``checkpoint_layers``: change ``offload_layers`` between steps freely.

    ``offload_layers``: how many decoder layers (from the first) keep their checkpoint on the host;
    -1 means all (with ``every`` k, a segment's checkpoint is offloaded when its first layer is). ``host_bytes``: bytes of checkpointed inputs held in host memory since the last
    ``reset()`` (one step's offloaded checkpoints when reset per step; on a CPU run they are counted
    though nothing moves). ``host_alloc_s``: seconds the host spent allocating those buffers since the
    last ``reset()`` (pinning them, on a GPU: a block taken from torch's pinned cache costs nothing, a
    new one is page-locked, which is why a process's first long step is slower; an upper bound on
    what the step's wall time lost to it, as the GPU may still be busy with queued work meanwhile).
    """

    num_layers: int
    offload_layers: int = 0
    host_bytes: int = 0
    host_alloc_s: float = 0.0
    every: int = 1  # layers per checkpoint (fixed when the layers are wrapped: call checkpoint_layers again)

    def offloads(self, index: int) -> bool:
        return self.offload_layers < 0 or index < self.offload_layers

    def reset(self) -> None:
        self.host_bytes = 0
        self.host_alloc_s = 0.0


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Tensors saved for the backward go to host memory (pinned when a GPU is present) in the forward
    and come back to their device when the backward unpacks them. Host tensors stay where they are.

    On a GPU the copy out runs on a side stream (:func:`_copy_stream`), overlapped with the layers that
    follow: the device tensor is marked used by that stream (``record_stream``), so its memory is not
    reused before the copy has read it, and the copy back waits for the copy out's event."""

    def __init__(self, policy: CheckpointPolicy):
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            policy.host_bytes += t.numel() * t.element_size()
            if t.device.type == "cpu":
                return None, t, None
            began = time.perf_counter()
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            policy.host_alloc_s += time.perf_counter() - began
            if t.device.type != "cuda":
                host.copy_(t)
                return t.device, host, None
            stream = _copy_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written before it is read
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
            return t.device, host, done

        def unpack(packed):
            device, host, done = packed
            if device is None:
                return host
            if done is not None:
                torch.cuda.current_stream(device).wait_event(done)
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    """One side stream per GPU for the checkpoints' copies to the host."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (also under a peft wrapper), in order."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    layers = getattr(inner, "layers", None)
    if layers is None or len(layers) == 0:
        raise ValueError(f"model: expected a decoder with `.model.layers`, got {type(base).__name__}")
    return list(layers)


def checkpoint_layers(model, offload_layers: int = 0, every: int = 1) -> CheckpointPolicy:
    """Checkpoint the decoder layers of ``model`` (non-reentrant), offloading the checkpoints of the
    first ``offload_layers`` layers (-1: all) to host memory. Returns the live policy.

    ``every``: layers per checkpoint. 1: each layer keeps its input (one recompute in the backward).
    k > 1: only every k-th layer's input is kept (``ceil(L / k)`` checkpoints instead of L); the
    backward recomputes the k layers of a segment from it, holding their k inputs while it goes back
    through them one layer at a time (nested checkpoints: one more forward of every layer, exact: the
    same kernels on the same inputs). The first layer of a segment runs the whole segment; the other
    layers of it pass their input through, so the model's own loop is unchanged. Every layer of a
    segment gets the keyword inputs the loop gives the first (the mask, the rotary tables): true of
    decoders whose layers all share one attention type."""
    layers = decoder_layers(model)
    if offload_layers < -1 or offload_layers > len(layers):
        raise ValueError(f"offload_layers: expected -1 (all) or 0..{len(layers)}, got {offload_layers}")
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= len(layers):
        raise ValueError(f"every: expected layers per checkpoint in 1..{len(layers)}, got {every!r}")
    kinds = {getattr(layer, "attention_type", None) for layer in layers}
    if every > 1 and len(kinds) > 1:
        raise ValueError(f"every: expected 1 for a decoder whose layers differ in attention type ({sorted(map(str, kinds))}), "
                         f"got {every}: a segment's layers would all get the first layer's mask")
    policy = CheckpointPolicy(num_layers=len(layers), offload_layers=offload_layers, every=every)
    # A second call re-plans the same model (another length): it wraps the layers' own forwards again,
    # the ones they have now (tiled anew, say), not the ones first wrapped.
    forwards = [unwrapped_forward(layer) for layer in layers]
    for layer, forward in zip(layers, forwards):
        layer._fm_unwrapped_forward = forward

    def each_layer(index: int):
        # A tiled layer (tiling.TiledLayer) is its own checkpoint: it saves its input alone. Wrapped in
        # a second one, the backward would run its whole forward again only to re-save that input.
        own = getattr(layers[index], "_fm_self_checkpointed", False)

        def checkpointed(*args, _forward=forwards[index], **kwargs):
            if not torch.is_grad_enabled() or own:
                run = _forward
            else:
                run = lambda *a, **k: checkpoint(_forward, *a, use_reentrant=False, **k)  # noqa: E731
            if torch.is_grad_enabled() and every == 1 and policy.offloads(index):
                with HostOffload(policy):
                    return run(*args, **kwargs)
            return run(*args, **kwargs)

        return checkpointed

    if every == 1:
        for index, layer in enumerate(layers):
            layer.forward = layer._fm_checkpoint_forward = each_layer(index)
        return policy
    for start in range(0, len(layers), every):
        group = [each_layer(i) for i in range(start, min(start + every, len(layers)))]
        plain = forwards[start:start + every]

        def run(hidden_states, *args, _group=group, **kwargs):
            for forward in _group:
                hidden_states = forward(hidden_states, *args, **kwargs)
            return hidden_states

        def segment(hidden_states, *args, _run=run, _plain=plain, _start=start, **kwargs):
            if not torch.is_grad_enabled():
                for forward in _plain:
                    hidden_states = forward(hidden_states, *args, **kwargs)
                return hidden_states
            if policy.offloads(_start):
                with HostOffload(policy):
                    return checkpoint(_run, hidden_states, *args, use_reentrant=False, **kwargs)
            return checkpoint(_run, hidden_states, *args, use_reentrant=False, **kwargs)

        layers[start].forward = layers[start]._fm_checkpoint_forward = segment
        for layer in layers[start + 1:start + every]:
            layer.forward = layer._fm_checkpoint_forward = _pass_through
    return policy


def unwrapped_forward(layer):
    """``layer``'s forward without :func:`checkpoint_layers`'s wrapper: the one it wrapped, while that
    wrapper is still the layer's forward; else the layer's forward as it is (replaced since, or never
    wrapped)."""
    d = layer.__dict__
    if "_fm_checkpoint_forward" in d and d.get("forward") is d["_fm_checkpoint_forward"]:
        return d["_fm_unwrapped_forward"]
    return layer.forward


def _pass_through(hidden_states, *args, **kwargs):
    """A layer inside a checkpoint segment: its segment's first layer has already run it."""
    return hidden_states


GIB = 2**30


class MemoryPlanError(ValueError):
    """No plan fits: the message names what the length needs and what the machine has."""


@dataclass(frozen=True)
class MemoryPlan:
    """Where one step's checkpoints live at length ``n``: ``every`` layers per checkpoint, the first
    ``offload_layers`` layers' checkpoints (-1: all) on the host; the predicted peaks in bytes, and the
    phase (``fm_parallel.trainer.capacity.PHASES``) predicted to set the device's peak."""

    n: int
    every: int
    offload_layers: int
    device_bytes: int
    host_bytes: int
    phase: str = ""

    def __str__(self) -> str:
        return (f"{self.n} tokens: a checkpoint every {self.every} layer(s), {self.offload_layers} layer(s) offloaded "
                f"(-1: all); predicted {self.device_bytes / GIB:.1f} GiB on the device, {self.host_bytes / GIB:.1f} GiB host")


def inputs_held(phase: str, layers: int, every: int, offloaded: int) -> int:
    """How many layer inputs (``n x hidden`` each: kept checkpoints and a segment's recomputed inputs)
    the device holds at ``phase``'s peak beyond those in that phase's measured line, with a checkpoint
    every ``every`` layers of which the first ``offloaded`` (of ``ceil(layers / every)``) are on the
    host. The lines are measured with a checkpoint per layer, each on the host: they hold no kept
    checkpoint, and in the layers' backward one input copied back from the host.

    * ``forward``, ``loss_backward``: every kept checkpoint (none is freed before the layers' backward).
    * ``layers_backward``: the backward runs from the last segment down and frees each segment's
      checkpoint after it, so segment ``s`` reaches its peak holding the kept checkpoints below it
      (``max(s - offloaded, 0)``: the kept ones are the last) and its other ``len(s) - 1`` inputs,
      recomputed; its own checkpoint, kept or copied back, is the line's copied-back input. The most
      over the segments. Counting every kept checkpoint here (the plan until 2026-12-06) put the
      trainer's 1M plans one checkpoint (8 GiB) above what its steps held, on the H100 (2 kept) and
      the H200 (9 kept) alike (docs/long-context.md).
    * ``optimizer``: none. Any other phase (a line through a step's overall peaks): the most any
      phase holds, every kept checkpoint and a segment's other inputs."""
    count = math.ceil(layers / every)
    kept = count - offloaded
    if phase in ("forward", "loss_backward"):
        return kept
    if phase == "optimizer":
        return 0
    if phase == "layers_backward":
        return max(max(s - offloaded, 0) + min(every, layers - s * every) - 1 for s in range(count))
    return kept + every - 1


# The plan's margin, bytes per token added to every phase's line: the plan promises an upper bound, and
# the lines, measured at two short lengths, miss the real model's peak by up to about 0.75 KiB per token
# (measured without it, H100: max_context.py's 8B plans at 256k and 512k 0.12 and 0.37 GiB under their
# steps, its 1B plan at 2M 0.9 GiB under; the trainer's small-model plan at 64k under by less than
# 0.05 GiB; the trainer's 8B plans at 1M 0.05-0.10 GiB over: docs/long-context.md, the memory plan).
MARGIN_PER_TOKEN = 1024


@dataclass(frozen=True)
class StepBudget:
    """What one training step needs on the device beyond its static memory and its checkpoints, phase
    by phase: ``lines[phase] = (fixed bytes, bytes per token)``, each fitted through that phase's peak
    at two measured lengths (:meth:`fit`). The phases (``fm_parallel.trainer.capacity.PHASES``) peak
    in different terms that grow at different rates: the loss's chunks over the vocabulary are large
    and nearly constant, a layer's backward is small at a short length and grows fastest. One line
    through the step's overall peaks at two short lengths, where the loss sets the peak, follows the
    loss and is flatter than the layers' line that sets the peak at a long one (8B shape, 64k and
    128k on an H100: 23.5 KiB per token and 11.9 GiB fitted, about 40 KiB per token measured at 1M,
    a 9.6 GiB miss; docs/long-context.md). The phases also hold different layer inputs
    (:func:`inputs_held`); :meth:`need` takes, for a length and a layout, the phase that needs the
    most."""

    lines: dict[str, tuple[float, float]]

    @classmethod
    def fit(cls, peaks: dict[int, dict[str, float]]) -> "StepBudget":
        """``peaks[n][phase]``: bytes above static at two lengths ``n``; a line per phase present at
        both (a per-token slope below zero, from noise, is taken as zero)."""
        if len(peaks) != 2:
            raise ValueError(f"peaks: expected the peaks at 2 lengths, got {sorted(peaks)}")
        (n1, p1), (n2, p2) = sorted(peaks.items())
        if n1 == n2 or n1 < 1:
            raise ValueError(f"peaks: expected 2 distinct lengths >= 1, got {n1} and {n2}")
        lines = {}
        for phase in p1.keys() & p2.keys():
            per_token = max((p2[phase] - p1[phase]) / (n2 - n1), 0.0)
            lines[phase] = (max(p1[phase] - per_token * n1, 0.0), per_token)
        if not lines:
            raise ValueError(f"peaks: no phase measured at both lengths, got {sorted(p1)} and {sorted(p2)}")
        return cls(dict(sorted(lines.items())))

    def need(self, n: int, input_bytes: float, layers: int, every: int, offloaded: int) -> tuple[str, float]:
        """The phase that needs the most at ``n`` tokens with a checkpoint every ``every`` of ``layers``
        layers, the first ``offloaded`` checkpoints on the host, and its bytes: its line plus the layer
        inputs of ``input_bytes`` each that it holds beyond the line (:func:`inputs_held`) and the
        plan's margin (:data:`MARGIN_PER_TOKEN`)."""
        needs = {phase: fixed + (per_token + MARGIN_PER_TOKEN) * n
                 + inputs_held(phase, layers, every, offloaded) * input_bytes for phase, (fixed, per_token) in self.lines.items()}
        phase = max(needs, key=needs.get)
        return phase, needs[phase]

    def describe(self, phase: str, static_bytes: float) -> str:
        """``phase``'s line in words, as the plan and a refusal print it (``static_bytes``: the plan's)."""
        fixed, per_token = self.lines[phase]
        return (f"{per_token / 2**10:.0f} KiB per token beyond the checkpoints and {MARGIN_PER_TOKEN / 2**10:.0f} KiB "
                f"of margin, {(static_bytes + fixed) / GIB:.1f} GiB fixed")


def host_memory_bytes() -> int:
    """The host's memory (``MemTotal``), 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# This process's CUDA context and the kernels it loads: device memory in use that neither the allocator
# nor another process holds (about 0.6 GiB on an H100 with torch 2.11); what a plan's fraction leaves over.
CONTEXT_BYTES = GIB


def gpu_memory_budget(device: torch.device, fraction: float) -> tuple[float, float]:
    """What a memory plan may use on CUDA ``device``: ``fraction`` of its memory, less what other
    processes hold there (another job, a notebook holding a model, ranks sharing the GPU), and what
    libraries hold outside PyTorch's allocator beyond ``CONTEXT_BYTES`` (NCCL's buffers, by the time a
    multi-GPU run plans: the measurement's agreement is its first collective).

    Returns ``(budget, elsewhere)`` in bytes; ``elsewhere`` is the memory held outside this process
    (``total - free - reserved by this allocator``, less ``CONTEXT_BYTES`` for this process's own context),
    0 on a GPU this process has to itself. A plan of the whole GPU there would run out of memory
    mid-step, after minutes of building and measuring."""
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    elsewhere = float(total - free - torch.cuda.memory_reserved(device) - CONTEXT_BYTES)
    elsewhere = elsewhere if elsewhere >= GIB / 4 else 0.0  # below that: the context estimate's own error
    return fraction * total - elsewhere, elsewhere


def held_elsewhere_message(elsewhere: float, budget: float) -> str:
    """What a plan says when ``elsewhere`` bytes of its GPU are held outside this process's tensors
    (:func:`gpu_memory_budget`) and it keeps within ``budget`` bytes: one wording for the trainer and
    ``max_context.py``, each of which adds what sets or limits its budget."""
    return (f"{elsewhere / GIB:.1f} GiB of this GPU is held outside this process's tensors (another process, "
            f"or a library's own buffers); the plan keeps within the {budget / GIB:.1f} GiB left")


def decoder_parameters(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                       head_dim: int | None = None) -> int:
    """The parameters of a Llama decoder's ``layers`` (q / k / v / o projections, the gated MLP's three,
    two norms) and its final norm: the model's, less its embeddings and head."""
    d = head_dim or hidden // heads
    per_layer = 2 * hidden * heads * d + 2 * hidden * kv_heads * d + 3 * hidden * intermediate + 2 * hidden
    return layers * per_layer + hidden


def plan_shortfall(plan: MemoryPlan | None, peak_bytes: float) -> str | None:
    """The warning for a step whose measured device peak ``peak_bytes`` is above what ``plan``
    predicted (None when it is not, or when nothing was predicted). A plan is promised to fit the
    first time; a step above it fitted with less room than planned, so a costlier row or another
    GPU can run out of memory (measured once: ``max_context.py``'s 8B shape at 1M on an H100, 76.1
    GiB against 66.5 planned, docs/long-context.md)."""
    if plan is None or not plan.device_bytes or peak_bytes <= plan.device_bytes:
        return None
    return (f"memory plan missed: the step peaked at {peak_bytes / GIB:.1f} GiB on the device, "
            f"{(peak_bytes - plan.device_bytes) / GIB:.1f} GiB above the plan's {plan.device_bytes / GIB:.1f} GiB "
            f"for {plan.n} tokens (a checkpoint every {plan.every} layer(s), {plan.offload_layers} offloaded); a costlier "
            f"row may run out of memory: give model.device_memory_gib lower to plan with more room")


def plan_memory(n: int, *, layers: int, hidden: int, itemsize: int, static_bytes: float, budget: StepBudget,
                device_budget: float, host_budget: float, every: int | None = None,
                offload_layers: int | None = None) -> MemoryPlan:
    """The plan for a step of ``n`` tokens that does the least extra work, from the model's shape and
    a measured budget (no trial and error): ``static_bytes`` (weights, adapters and their optimizer
    state: what is allocated before the step) and ``budget`` (each phase's ``fixed + per_token * n``
    above it beyond the checkpoints: a layer's working set, its recompute, the tiled MLP and loss
    chunks; measured by two short steps with every checkpoint on the host, :class:`StepBudget`).

    A layer input (a checkpoint) is ``n * hidden * itemsize`` bytes. With ``C = ceil(layers / every)``
    checkpoints of which the first ``c`` are offloaded, the device needs, in the phase that needs the
    most (:meth:`StepBudget.need`), ``static + fixed + per_token * n`` and the layer inputs that phase
    holds (:func:`inputs_held`: the ``C - c`` kept checkpoints in the forward and the loss's backward;
    in the layers' backward, a segment's other ``every - 1`` inputs being recomputed and the kept
    checkpoints below it) and the margin; the host holds ``c``. Measured against it
    (docs/long-context.md): 512k, ``every`` 1, 24 of 32 offloaded: 70.8 GiB planned without the
    margin, 71.3 with it, 71.1 measured (H100).
    Candidates go from ``every`` 1 (no recompute beyond the tiled layers' own), then 2, 3, ... (each
    costs the same one more forward of every layer: the order among them only trades device memory
    for host copies; docs/long-context.md) and, for each, the fewest offloaded checkpoints (host
    copies cost time). ``every`` / ``offload_layers`` given: fixed.
    Raises :class:`MemoryPlanError` naming the smallest device and host memory any plan needs."""
    if n < 1:
        raise ValueError(f"n: expected a length >= 1, got {n}")
    ckpt = n * hidden * itemsize
    best: tuple[float, float, float, str] | None = None  # (overflow, device, host, phase) of the closest miss
    for k in ([every] if every is not None else range(1, layers + 1)):
        count = math.ceil(layers / k)
        choices = range(count + 1)
        if offload_layers is not None:
            choices = [count if offload_layers < 0 else math.ceil(min(offload_layers, layers) / k)]
        for off in choices:
            phase, need = budget.need(n, ckpt, layers, k, off)
            device, host = static_bytes + need, off * ckpt
            if device <= device_budget and host <= host_budget:
                return MemoryPlan(n, k, -1 if off == count else min(off * k, layers), int(device), int(host), phase)
            miss = max(device - device_budget, 0) + max(host - host_budget, 0)
            if best is None or miss < best[0]:
                best = (miss, device, host, phase)
    _, device, host, phase = best
    raise MemoryPlanError(
        f"n: {n} tokens do not fit: the closest plan needs {device / GIB:.1f} GiB on the device and {host / GIB:.1f} GiB "
        f"of host memory, this machine gives {device_budget / GIB:.1f} GiB and {host_budget / GIB:.1f} GiB "
        f"({layers} layers, a checkpoint of {ckpt / GIB:.2f} GiB each; at its peak, the {phase.replace('_', ' ')}: "
        f"{budget.describe(phase, static_bytes)})")
