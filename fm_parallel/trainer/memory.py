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

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointPolicy", "HostOffload", "checkpoint_layers", "decoder_layers"]


@dataclass
class CheckpointPolicy:
    """Live settings of ``checkpoint_layers``: change ``offload_layers`` between steps freely.

    ``offload_layers``: how many decoder layers (from the first) keep their checkpoint on the host;
    -1 means all. ``host_bytes``: bytes of checkpointed inputs held in host memory since the last
    ``reset()`` (one step's offloaded checkpoints when reset per step; on a CPU run they are counted
    though nothing moves).
    """

    num_layers: int
    offload_layers: int = 0
    host_bytes: int = 0

    def offloads(self, index: int) -> bool:
        return self.offload_layers < 0 or index < self.offload_layers

    def reset(self) -> None:
        self.host_bytes = 0


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Tensors saved for the backward go to host memory (pinned when a GPU is present) in the forward
    and come back to their device when the backward unpacks them. Host tensors stay where they are."""

    def __init__(self, policy: CheckpointPolicy):
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            policy.host_bytes += t.numel() * t.element_size()
            if t.device.type == "cpu":
                return None, t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t)  # synchronous: the device copy may be freed right after the forward
            return t.device, host

        def unpack(packed):
            device, host = packed
            return host if device is None else host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (also under a peft wrapper), in order."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    layers = getattr(inner, "layers", None)
    if layers is None or len(layers) == 0:
        raise ValueError(f"model: expected a decoder with `.model.layers`, got {type(base).__name__}")
    return list(layers)


def checkpoint_layers(model, offload_layers: int = 0) -> CheckpointPolicy:
    """Checkpoint every decoder layer of ``model`` (non-reentrant), offloading the inputs of the first
    ``offload_layers`` layers (-1: all) to host memory. Returns the live policy."""
    layers = decoder_layers(model)
    if offload_layers < -1 or offload_layers > len(layers):
        raise ValueError(f"offload_layers: expected -1 (all) or 0..{len(layers)}, got {offload_layers}")
    policy = CheckpointPolicy(num_layers=len(layers), offload_layers=offload_layers)
    for index, layer in enumerate(layers):
        forward = layer.forward

        def checkpointed(*args, _forward=forward, _index=index, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            if policy.offloads(_index):
                with HostOffload(policy):
                    return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    return policy
