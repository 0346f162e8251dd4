"""The run's memory plan (``model.memory_plan = "auto"``): where each step's activation checkpoints
live, computed before the model is built, from its shape and one layer's memory measured on the GPU.

    plan = plan_run(cfg, device, vocab_size)   # None unless auto on a GPU; sets model.checkpoint_every
                                               # and model.offload_layers, or raises ConfigError naming
                                               # what the length needs and what the machine has

The measurement: a model of the run's shape with *one* decoder layer (the real vocabulary, the same
tiling, LoRA and loss), its checkpoint on the host, runs a training step at two lengths on the
costliest mask the run's data can give the tiled layer (:func:`worst_case_mask`); each phase's peak
above its static memory (:class:`PhasePeaks`: the forward, the loss's backward, the layers'
backward) gives a line ``fixed + per_token * n`` (a :class:`~fm_parallel.longcontext.memory.StepBudget`),
and the plan at the run's length takes the phase that needs the most there. The real model's static memory is the one
layer model's plus ``L - 1`` layers of parameters and every adapter's AdamW moments.
:func:`~fm_parallel.longcontext.memory.plan_memory` then picks the least recompute, then the fewest host
copies, that fit the device and host budgets (``model.device_memory_gib``, ``model.host_memory_gib``).
Under context parallelism each rank plans for its own tokens (``seq_len / cp``) and the ranks take the
largest measurement, so they agree; the ring's receive buffers are not in the measurement (the 6%
margin of the default device budget covers them).
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass
from typing import Callable

import torch

from fm_parallel.trainer.config import Config, ConfigError, model_dtype, processes_on_this_host
from fm_parallel.longcontext.plan import PHASES, PhasePeaks, dropped_gradient_input
from fm_parallel.longcontext.memory import (GIB, MemoryPlan, MemoryPlanError, StepBudget, gpu_memory_budget,
                                       held_elsewhere_message, host_memory_bytes, plan_memory)

__all__ = ["PHASES", "PhasePeaks", "plan_run", "LayerBudget", "measure_layer_budget", "measure_one_layer",
           "measured_lengths", "dropped_gradient_input",
           "measured_loss", "worst_case_mask", "host_memory_bytes"]

def measured_loss(model, ids: torch.Tensor, labels: torch.Tensor, mask, loss_chunk: int, impl: str = "auto",
                  peaks: PhasePeaks | None = None) -> torch.Tensor:
    """The summed next-token loss of ``ids [1, n]`` against ``labels [1, n]``, computed as the trainer's
    step computes it (``objective.loss``), for the steps that measure memory (:func:`measure_one_layer`,
    ``launch/bench/max_context.py``): the decoder's final hidden state ``[1, n, hidden]`` ends referenced
    by the loss's graph only, so the backward frees it after the loss's own backward. Held by a
    caller through the layers' backward it adds n x hidden (8 GiB of the 8B shape at 1M) that the
    trainer never holds (both measurements did until 2026-12-06). ``peaks``: watches that state (its
    gradient ends the loss's backward)."""
    from fm_parallel.trainer.model import hidden
    from fm_parallel.longcontext.loss import chunked_cross_entropy

    n = ids.shape[1]
    h = hidden(model, ids, torch.arange(n, device=ids.device).view(1, n), mask, None, impl)
    if peaks is not None:
        peaks.watch(h)
    return chunked_cross_entropy(model.get_base_model().lm_head, h, labels, loss_chunk)


def worst_case_mask(cfg: Config, n: int):
    """The mask of ``n`` tokens the plan measures, the costliest the run's data can give the tiled layer.

    In general one causal document: its query chunks see windows that grow to the whole row, and their
    keys' gradients add up in float32. When the data bounds its documents
    (:meth:`~fm_parallel.trainer.objectives.Objective.longest_document`: ``data.max_doc_tokens`` for
    ``sft``) by at most ``model.attention_chunk`` every chunk is cut between documents and
    is its own problem (no windows overlap, no float32 sums): documents of exactly that length are
    then the worst case, with about half the causal document's memory per token (the 8B shape on the
    H100: 48 KiB measured on a causal document, 24 on packed documents)."""
    from fm_parallel import masks
    from fm_parallel.trainer.objectives import objective

    bound = objective(cfg).longest_document()
    if 0 < bound < n and cfg.model.attention_chunk and bound <= cfg.model.attention_chunk:
        return masks.document([bound] * (n // bound) + ([n % bound] if n % bound else []))
    return masks.causal(n)


def measure_one_layer(cfg: Config, device: torch.device, vocab_size: int, lengths: tuple[int, int], *,
                      layer_input: Callable = dropped_gradient_input) -> dict:
    """Build the run's model with one decoder layer (checkpoint on the host) on ``device`` and run a
    training step of each of ``lengths`` tokens (on :func:`worst_case_mask`); ``layer_input``: a forward
    hook on the input embeddings that makes the layer's input (launch/bench/one_layer_input.py
    compares others). Returns ``static`` (bytes before
    the steps), ``layer`` (one decoder layer's parameter bytes), ``adapter`` (the trainable parameters'
    bytes) and ``peaks`` (``{n: {phase: bytes above static}}``, :class:`PhasePeaks`; the final hidden
    state is held by the loss's graph only, as in the trainer's step)."""
    from fm_parallel.longcontext.memory import decoder_layers
    from fm_parallel.trainer.model import build_model

    one = copy.deepcopy(cfg)
    one.model.layers, one.model.checkpoint_every, one.model.offload_layers = 1, 1, -1
    one.model.activation_checkpointing, one.model.memory_plan = True, "fixed"
    model = build_model(one, vocab_size, device)
    # Every real layer but the first takes an input that needs a gradient, so its backward makes dx
    # (n x hidden, 8 GiB of the 8B shape at 1M) and each tile's input gradient; the one layer here
    # would take the frozen embedding's output and make neither (tiling.py allocates dx only when the
    # input needs a gradient). The input is not a leaf: the layer below a real layer consumes dx and
    # frees it, where a leaf's dx would be kept in its .grad through the step. Measured on the H100 at
    # the 1M config's lengths (the layers' backward): 32.5 KiB per token this way, 40.0 with a leaf
    # input, 24.5 with an input needing no gradient; the real model's 1M runs imply about 32.
    model.get_input_embeddings().register_forward_hook(layer_input)
    layer = sum(p.numel() * p.element_size() for p in decoder_layers(model)[0].parameters())
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    peaks = {}
    for n in lengths:
        gc.collect()
        torch.cuda.empty_cache()
        mask = worst_case_mask(cfg, n).to(device)
        ids = torch.randint(0, vocab_size, (1, n), device=device)
        phases = PhasePeaks(device)
        static = phases.static
        loss = measured_loss(model, ids, ids, mask, cfg.training.loss_chunk, cfg.parallel.impl or "auto", phases)
        phases.end("forward")
        loss.backward()
        del loss
        phases.end("layers_backward")
        peaks[n] = phases.peaks
        model.zero_grad(set_to_none=True)
    result = {"static": static, "layer": layer, "adapter": adapter, "peaks": peaks}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def measured_lengths(cfg: Config, n: int) -> tuple[int, int]:
    """The two lengths :func:`plan_run` measures one layer at for a step of ``n`` tokens per rank:
    two of each chunk the tiled layer and the loss cut (so both lengths run every tiled path), then
    twice that, neither far beyond ``n``."""
    m = cfg.model
    base = max(2 * m.attention_chunk, 2 * m.tile_chunk, 2 * cfg.training.loss_chunk, 8192) if m.tile_chunk else 8192
    lengths = (min(base, n), min(2 * base, 2 * n)) if n > 1 else (1, 2)
    return (lengths[0], lengths[0] * 2) if lengths[0] == lengths[1] else lengths


@dataclass(frozen=True)
class LayerBudget:
    """One decoder layer's memory, measured by :func:`measure_layer_budget`: ``budget`` (a line per
    phase above the one-layer model's static memory), the ``lengths`` it was measured at, and, in
    bytes, the one-layer model's ``static`` memory, one decoder ``layer``'s parameters and the
    one-layer model's trainable parameters (``adapter``)."""

    budget: StepBudget
    lengths: tuple[int, int]
    static: float
    layer: float
    adapter: float

    @property
    def where(self) -> str:
        return f"measured on one layer at {self.lengths[0]} and {self.lengths[1]} tokens"


def measure_layer_budget(cfg: Config, device: torch.device, vocab_size: int, lengths: tuple[int, int], *,
                         measure: Callable[..., dict] | None = None,
                         agree: Callable[[list[float]], list[float]] | None = None) -> LayerBudget:
    """Measure one decoder layer at ``lengths`` (:func:`measure_one_layer`, or ``measure`` with its
    signature) and fit the :class:`LayerBudget`. ``agree``: the element-wise maximum over the ranks
    (so they plan alike). The one measurement both planners use: the trainer's (:func:`plan_run`)
    and ``launch/bench/max_context.py``'s."""
    got = (measure or measure_one_layer)(cfg, device, vocab_size, lengths)
    phases = [p for p in PHASES if all(p in got["peaks"][k] for k in lengths)]
    values = (agree or _largest_over_ranks)([got["static"], got["layer"], got["adapter"],
                                             *(got["peaks"][k][p] for k in lengths for p in phases)])
    static, layer, adapter, *rest = values
    budget = StepBudget.fit({k: dict(zip(phases, rest[i * len(phases):(i + 1) * len(phases)]))
                             for i, k in enumerate(lengths)})
    return LayerBudget(budget, tuple(lengths), static, layer, adapter)


def plan_run(cfg: Config, device: torch.device, vocab_size: int, *, cp: int = 1,
             measure: Callable[..., dict] | None = None, agree: Callable[[list[float]], list[float]] | None = None,
             say: Callable[[str], None] = print) -> MemoryPlan | None:
    """Plan ``model.memory_plan = "auto"`` for a run whose rows hold ``data.seq_len / cp`` tokens per
    rank; sets ``model.checkpoint_every`` and ``model.offload_layers`` and returns the plan, or raises
    :class:`ConfigError` (before any model of the run is built) naming what the length would need.
    ``fixed``: returns None. Without a GPU nothing can be measured: a checkpoint per layer, none
    offloaded, said once. ``measure``, ``agree``: as :func:`measure_layer_budget`."""
    m = cfg.model
    if m.memory_plan != "auto":
        return None
    if device.type != "cuda":
        say("memory plan: model.memory_plan = 'auto' measures on a GPU; on the CPU a checkpoint per layer, none offloaded")
        m.checkpoint_every, m.offload_layers = 1, 0
        return None
    if not m.activation_checkpointing:
        raise ConfigError("model.memory_plan: expected 'fixed' without activation checkpointing (the plan places "
                          "checkpoints), got 'auto'")
    n = cfg.data.seq_len // cp
    got = measure_layer_budget(cfg, device, vocab_size, measured_lengths(cfg, n), measure=measure, agree=agree)
    layers, hidden = _shape(cfg)
    device_budget, elsewhere = (m.device_memory_gib * GIB, 0.0) if m.device_memory_gib else gpu_memory_budget(device, 0.94)
    host_budget = m.host_memory_gib * GIB if m.host_memory_gib else 0.75 * host_memory_bytes() / processes_on_this_host()
    # Every rank plans alike, under the smallest budgets of any (a GPU shared with another job, hosts of
    # other sizes): ranks with different plans would recompute, and so call the ring, in different orders.
    lowest_device, lowest_host, elsewhere = (agree or _largest_over_ranks)([-device_budget, -host_budget, elsewhere])
    device_budget, host_budget = -lowest_device, -lowest_host
    if elsewhere:  # the most any rank's GPU has held by other processes
        say(f"memory plan: {held_elsewhere_message(elsewhere, device_budget)} (model.device_memory_gib sets it)")
    # The real model's static memory: the one-layer model's, L - 1 more layers, every adapter's AdamW
    # moments; and the other layers' adapter gradients, made during the layers' backward (the one
    # layer's own are in its measured peaks).
    constant = (got.static + (layers - 1) * got.layer + 2 * (layers - 1) * got.adapter
                + 2 * layers * got.adapter)
    itemsize = model_dtype(cfg, cuda=True).itemsize
    try:
        plan = plan_memory(n, layers=layers, hidden=hidden, itemsize=itemsize, static_bytes=constant,
                           budget=got.budget, device_budget=device_budget, host_budget=host_budget)
    except MemoryPlanError as e:
        raise ConfigError(f"data.seq_len: {e} (model.memory_plan = 'auto', {got.where})") from None
    measured = (f"{got.where}, the {plan.phase.replace('_', ' ')} peaks at this length: "
                f"{got.budget.describe(plan.phase, constant)}")
    m.checkpoint_every, m.offload_layers = plan.every, plan.offload_layers
    say(f"memory plan: {plan} ({measured})")
    return plan


def _largest_over_ranks(values: list[float]) -> list[float]:
    """The element-wise maximum over the job's ranks (every rank then plans alike); as is without one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _shape(cfg: Config) -> tuple[int, int]:
    """The decoder's layer count and width: the built Llama's, or ``model.path``'s config (read once)."""
    if not cfg.model.path:
        return cfg.model.layers, cfg.model.hidden_size
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True).get_text_config()
    return text.num_hidden_layers, text.hidden_size
