"""The memory plan for any Hugging Face model with the long-context components: where a step's
activation checkpoints live (a checkpoint every k layers, the first c on the host) so that a length
fits the device and host memory you state, or a refusal naming the GiB it needs and the GiB given.

    from fm_parallel.longcontext import long_context, measure_budget, plan_long_context

    long_context(model, tile_chunk=16384, offload_layers=-1, loss_chunk=4096)   # the components, as they will run
    budget = measure_budget(model, (32768, 65536))          # one GPU: two short steps through one decoder layer
    plan = plan_long_context(model, 262144, budget, device_gib=75, host_gib=100)  # or MemoryPlanError
    long_context(model, tile_chunk=16384, checkpoint_every=plan.every, offload_layers=plan.offload_layers,
                 loss_chunk=4096)                           # applied again: the plan's layout

The arithmetic (:func:`~fm_parallel.longcontext.memory.plan_memory`) is the trainer's
(``model.memory_plan = "auto"``): the model's static memory (its parameters, and for the trainable
ones their gradients and the optimizer's states), each phase's measured line ``fixed + per_token * n``
(:class:`~fm_parallel.longcontext.memory.StepBudget`, :class:`PhasePeaks`) and the checkpoints each
phase holds; the least recompute, then the fewest host copies, that fit.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from fm_parallel.longcontext.memory import (GIB, MemoryPlan, StepBudget, decoder_layers, plan_memory)

__all__ = ["PHASES", "PhasePeaks", "measure_budget", "plan_long_context", "static_bytes", "dropped_gradient_input"]

PHASES = ("forward", "loss_backward", "layers_backward", "optimizer")


class PhasePeaks:
    """The device's allocation peaks of one training step, phase by phase, in bytes above what was
    allocated when it was made (``static``)::

        peaks = PhasePeaks(device)
        h = hidden(model, ...)            # the decoder's final hidden state [1, n, hidden]
        peaks.watch(h)                    # its gradient arriving ends the loss's backward
        loss = chunked_cross_entropy(head, h, ...)
        del h                             # as the trainer: held by the loss's graph only
        peaks.end("forward")
        loss.backward()                   # "loss_backward" ends inside, at h's gradient
        peaks.end("layers_backward")
        optim.step(); peaks.end("optimizer")
        peaks.peaks                       # {"forward": ..., "loss_backward": ..., ...}

    Each end reads the allocator's peak since the previous one and restarts it
    (``torch.cuda.reset_peak_memory_stats``: the peak restarts at what is allocated then), so
    another reader of the device's peak over the step sees only the last phase: take
    ``static + max(peaks.values())`` instead (:attr:`overall`). Why by phase:
    :class:`~fm_parallel.longcontext.memory.StepBudget`. ``read`` / ``reset``: the allocator's peak and its
    reset (stand-ins where there is no GPU)."""

    def __init__(self, device: torch.device | None = None, *, read: Callable[[], float] | None = None,
                 reset: Callable[[], None] | None = None, allocated: Callable[[], float] | None = None,
                 reserved: Callable[[], float] | None = None):
        cuda = read is None
        self._read = read or (lambda: torch.cuda.max_memory_allocated(device))
        self._reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self._reserved = reserved or ((lambda: torch.cuda.max_memory_reserved(device)) if cuda else (lambda: 0.0))
        self._reset()
        self.static = float((allocated or (lambda: torch.cuda.memory_allocated(device)))())
        self.peaks: dict[str, float] = {}
        self.reserved = 0.0  # the most the allocator reserved over the phases (the reset restarts its peak too)

    def end(self, phase: str) -> None:
        """End ``phase``: its peak is the allocator's since the last end (or since made)."""
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), self._read() - self.static)
        self.reserved = max(self.reserved, float(self._reserved()))
        self._reset()

    def finish(self) -> None:
        """End the phase that was running, if any (a step that failed in it, out of memory say): the
        first of :data:`PHASES` after the last one ended."""
        ended = [i for i, p in enumerate(PHASES) if p in self.peaks]
        following = PHASES[max(ended, default=-1) + 1:]
        if following:
            self.end(following[0])

    def watch(self, hidden: torch.Tensor) -> None:
        """End ``loss_backward`` when the gradient of ``hidden`` (the decoder's output, the loss's input)
        is complete: the loss and the head are done and the layers' backward starts."""
        def ended(grad: torch.Tensor) -> None:  # returns None: the gradient passes on unchanged
            self.end("loss_backward")

        if hidden.requires_grad:
            hidden.register_hook(ended)

    @property
    def overall(self) -> float:
        """The step's peak in bytes, static included."""
        return self.static + max(self.peaks.values(), default=0.0)


class _DropGradient(torch.autograd.Function):
    """``x`` unchanged, needing a gradient (through ``anchor``, a scalar that needs one) that the
    backward drops at once: a layer's input as the layer below consumes its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def dropped_gradient_input(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The one layer's input as the one-layer measurements make it (a forward hook on the input
    embeddings): the embeddings' output, needing a gradient that is dropped once made. Every real
    layer but the first takes an input that needs a gradient, so its backward makes ``dx`` (n x
    hidden) and each tile's input gradient; a lone first layer on the frozen embeddings' output would
    make neither (the 8B shape on the H100 at 1M: 32.5 KiB per token this way, 24.5 without)."""
    return _DropGradient.apply(out.detach(), torch.zeros((), device=out.device, requires_grad=True))


def static_bytes(model, optimizer_states: int = 2) -> int:
    """Bytes a training step holds before it starts: every parameter of ``model`` (a Hugging Face
    model or its peft wrapper; of a sharded one, this rank's shards), and for each trainable one its
    gradient and ``optimizer_states`` tensors of its size (AdamW: 2)."""
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states: expected an int >= 0, got {optimizer_states!r}")
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a sharded (DTensor) parameter: this rank's part
        size = local.numel() * local.element_size()
        total += size * (1 + (1 + optimizer_states if p.requires_grad else 0))
    return total


def _gib(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: expected a number of GiB > 0, got {value!r}")
    return float(value) * GIB


def plan_long_context(model, length: int, budget: StepBudget, *, device_gib: float, host_gib: float,
                      optimizer_states: int = 2) -> MemoryPlan:
    """The layout for a step of ``length`` tokens of ``model`` (a Hugging Face decoder or its peft
    wrapper, in the dtype it trains in) within ``device_gib`` of GPU memory and ``host_gib`` of host
    memory: a :class:`~fm_parallel.longcontext.memory.MemoryPlan` (``every``: layers per checkpoint,
    ``offload_layers``: the first layers whose checkpoints live on the host, -1 all; the predicted
    peaks). ``budget``: the step's lines beyond static memory and checkpoints (:func:`measure_budget`
    on the GPU, or stated). Raises :class:`~fm_parallel.longcontext.memory.MemoryPlanError` (a
    ``ValueError``) naming the device and host memory the closest layout needs and those given."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length: expected an int >= 1, got {length!r}")
    if not isinstance(budget, StepBudget):
        raise ValueError(f"budget: expected a StepBudget (measure_budget's), got {type(budget).__name__}")
    device, host = _gib("device_gib", device_gib), _gib("host_gib", host_gib)
    layers = decoder_layers(model)
    config = _text_config(model)
    itemsize = next(layers[0].parameters()).element_size()
    return plan_memory(length, layers=len(layers), hidden=config.hidden_size, itemsize=itemsize,
                       static_bytes=static_bytes(model, optimizer_states), budget=budget, device_budget=device,
                       host_budget=host)


def _text_config(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def measure_budget(model, lengths: tuple[int, int], *, mask: Callable | None = None, device=None) -> StepBudget:
    """Measure the step's lines on the GPU: a training step of each of ``lengths`` tokens (random ids,
    the labels the ids) through ``model``'s first decoder layer alone (its input needing a gradient, as
    every later layer's does: :func:`dropped_gradient_input`), its checkpoint on the host, with
    the components as applied (tiles, the chunked loss: apply :func:`~fm_parallel.longcontext.long_context`
    first); each phase's peak above the memory held before the step (:class:`PhasePeaks`) at the two
    lengths gives its line. ``mask(n)``: the costliest :class:`~fm_parallel.masks.FlashMask` the run's
    rows can hold (default: one causal document, the worst case of packed documents too). The other
    layers are left out for the measurement and put back after; gradients made are freed. Raises
    ``ValueError`` off a GPU (a CPU has no allocator peaks to read)."""
    from fm_parallel import masks
    from fm_parallel.longcontext.memory import checkpoint_layers

    if len(lengths) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths) or lengths[0] == lengths[1]:
        raise ValueError(f"lengths: expected 2 distinct token counts >= 1, got {lengths!r}")
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    if device.type != "cuda":
        raise ValueError(f"model: expected it on a CUDA GPU (the budget is read from the allocator's peaks), got {device}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    holder = base.model if hasattr(base, "model") and hasattr(base.model, "layers") else base
    everything = holder.layers
    first = everything[0]
    saved = {name: first.__dict__.get(name) for name in ("forward", "_fm_unwrapped_forward", "_fm_checkpoint_forward")}
    config = _text_config(model)
    count = config.num_hidden_layers
    mask = mask or masks.causal
    vocab = config.vocab_size
    peaks_by_length = {}
    # The lone layer's input needs a gradient, dropped once made: as every real layer's but the first.
    hook = base.get_input_embeddings().register_forward_hook(dropped_gradient_input)
    try:
        holder.layers = torch.nn.ModuleList([first])
        config.num_hidden_layers = 1
        checkpoint_layers(base, offload_layers=-1)  # the one layer's checkpoint on the host, as the lines assume
        for n in lengths:
            gc.collect()
            torch.cuda.empty_cache()
            ids = torch.randint(0, vocab, (1, n), device=device)
            peaks = PhasePeaks(device)
            _watch_final_hidden(base, peaks)
            loss = model(input_ids=ids, labels=ids, flashmask=mask(n).to(device),
                         position_ids=torch.arange(n, device=device).view(1, n)).loss
            peaks.end("forward")
            loss.backward()
            del loss
            peaks.finish()  # the layers' backward (the loss's ended at the final hidden state's gradient)
            peaks_by_length[n] = peaks.peaks
            model.zero_grad(set_to_none=True)
    finally:
        hook.remove()
        holder.layers = everything
        config.num_hidden_layers = count
        for name, value in saved.items():
            if value is None:
                first.__dict__.pop(name, None)
            else:
                first.__dict__[name] = value
        _watch_final_hidden(base, None)
    return StepBudget.fit(peaks_by_length)


def _watch_final_hidden(base, peaks: PhasePeaks | None) -> None:
    """End ``loss_backward`` of ``peaks`` at the final norm's output gradient (the decoder's output,
    the loss's input); None: remove the hook."""
    norm = getattr(getattr(base, "model", base), "norm", None)
    handle = getattr(base, "_fm_plan_hook", None)
    if handle is not None:
        handle.remove()
        base._fm_plan_hook = None
    if peaks is not None and isinstance(norm, torch.nn.Module):
        base._fm_plan_hook = norm.register_forward_hook(lambda module, args, out: peaks.watch(out))
