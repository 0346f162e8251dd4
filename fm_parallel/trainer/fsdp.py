"""Full-parameter training (``model.finetune = "full"``): every weight trained, sharded with PyTorch's
FSDP2 (``torch.distributed.fsdp.fully_shard``) over every rank of the job, data and context parallel
alike (as torchtitan shards over dp x cp), composed with the trainer's own layers.

    model = shard_full_model(base, cfg, device)       # one unit per checkpoint segment, then the root
    loss = model(objective.loss, model, batch, layout)  # every forward runs inside the root's

Units: each decoder layer, or with checkpoints every k layers each segment of k layers (its parameters
all-gathered for its forward, and again for its backward, where the checkpoint recomputes it), then the root: the embedding, the final norm and the head.
The trainer's objectives run the decoder and the chunked loss themselves, not the HF model's forward,
so :class:`ShardedModel` is the root: ``model(fn, *args)`` runs ``fn(*args)`` inside the root's
forward, where FSDP gathers the root's parameters and after which its backward reduces their
gradients. ``get_base_model()`` gives the Hugging Face model, as a peft model does.

Gradients are summed over the world (``set_gradient_divide_factor(1)``): the objectives divide the
losses by the whole step's tokens (or samples, pairs), so the sum is the one-process gradient, as the
LoRA path's all-reduce makes it. Each rank holds 1/world of every weight and of its AdamW moments
(``DTensor`` shards); on a GPU the layers compute in bfloat16 and reduce gradients in float32 over
float32 master weights (``MixedPrecisionPolicy``); ``model.offload_optimizer`` keeps parameters,
gradients and AdamW state on the host (``CPUOffloadPolicy``), the optimizer stepping there.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fm_parallel.trainer.config import Config
from fm_parallel.longcontext.memory import decoder_layers

__all__ = ["ShardedModel", "shard_full_model", "in_root", "reference_model"]


class ShardedModel(nn.Module):
    """The FSDP root around a Hugging Face model: ``model(fn, *args, **kwargs)`` returns ``fn(*args,
    **kwargs)`` run inside the root's forward (so the root's parameters are gathered for it and its
    gradients reduced after the backward); ``get_base_model()`` is the Hugging Face model."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base

    def get_base_model(self) -> nn.Module:
        return self.base

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def shard_full_model(base: nn.Module, cfg: Config, device: torch.device, reference: nn.Module | None = None,
                     every: int = 1) -> ShardedModel:
    """``base`` with every parameter trainable, sharded by FSDP2 over the default process group (all
    ranks, one flat mesh dimension): one unit per checkpoint segment (``every`` decoder layers: the
    layout ``checkpoint_layers`` applied, its policy's ``every``), then the root (:class:`ShardedModel`).
    Call after the layers are tiled / checkpointed (their forwards are wrapped in place, and FSDP's
    hooks run around them) and before the optimizer is built (it must see the sharded parameters).
    ``reference``: a frozen copy of the initial model (DPO's), sharded alike, no gradients, kept
    beside the root (:func:`reference_model`) and outside its modules, so that neither the optimizer,
    the checkpoints nor the export see it (a resumed run rebuilds it from the initial weights)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    base.requires_grad_(True)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    options = {"mesh": mesh}
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.model.offload_optimizer:
        options["offload_policy"] = CPUOffloadPolicy()
    _shard_segments(base, every, options)
    model = ShardedModel(base)
    fully_shard(model, **options)
    if reference is not None:
        reference.requires_grad_(False)
        _shard_segments(reference, 1, options)  # copied before the checkpoints wrapped the layers: one unit each
        frozen = ShardedModel(reference)
        fully_shard(frozen, **options)
        model.__dict__["reference"] = frozen  # not a submodule: not trained, saved or exported
    gloo = dist.get_backend() == "gloo"
    for module in model.modules():  # the objectives normalise by the whole step: gradients are summed
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            if gloo:  # gloo has no PREMUL_SUM / AVG (NCCL's fused scaling): plain sums, scaled after
                module.set_force_sum_reduction_for_comms(True)
    return model


def _shard_segments(base: nn.Module, every: int, options: dict) -> None:
    """One FSDP unit per checkpoint segment of ``every`` decoder layers (one per layer when 1). A
    segment's first layer runs the whole segment inside one checkpoint (``checkpoint_layers``) and
    calls the other layers' forwards directly, past their module hooks: as one unit (``fully_shard``
    of the list), every weight of the segment is gathered when its first layer starts, for the
    forward and for the backward's recompute, and resharded after its last layer."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(base)
    for start in range(0, len(layers), every):
        group = list(layers[start:start + every])
        fully_shard(group[0] if len(group) == 1 else group, **options)


@contextlib.contextmanager
def reference_model(model):
    """The frozen reference of a preference objective: a sharded model's copy of its initial weights
    (built with ``reference=``), or a LoRA model with its adapter disabled (the base). Run it with
    :func:`in_root`."""
    if isinstance(model, ShardedModel):
        reference = model.__dict__.get("reference")
        if reference is None:
            raise ValueError("model: expected a sharded model built with its reference (build_model(reference=True)), "
                             "got one without")
        yield reference
    else:
        with model.disable_adapter():
            yield model


def in_root(model, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, inside the FSDP root's forward when ``model`` is sharded (see
    :class:`ShardedModel`); a LoRA model's calls run as they are."""
    if isinstance(model, ShardedModel):
        return model(fn, *args, **kwargs)
    return fn(*args, **kwargs)
