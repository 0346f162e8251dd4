"""DeepSpeed sequence parallelism with FlashMask attention.

Two entry points:

(a) ``FlashMaskLocalAttention``: the local attention of ``deepspeed.sequence.layer.DistributedAttention``
    (DeepSpeed-Ulysses for Megatron-style models). DeepSpeed does the all-to-all; this runs FlashMask
    attention on the gathered ``[B, S, H / P, D]`` tensors with the full mask::

        local = FlashMaskLocalAttention(mask)                    # or mask=... per call
        attn = DistributedAttention(local, sp_group, scatter_idx=2, gather_idx=1)
        out = attn(q, k, v, 0)                                   # [B, S / P, H, D] in and out

(b) ``register_ulysses_hf``: DeepSpeed's Ulysses for Hugging Face models (``UlyssesSPAttentionHF``, the
    ALST stack) discards 4-D attention masks, so packed documents or DPO pairs would silently become
    one causal sequence. Registered with our transformers backend as its core attention, the FlashMask
    travels as a keyword argument (``model(ids, position_ids=..., flashmask=mask)``), which the wrapper
    passes through untouched to the gathered full sequence::

        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=fm_hf.NAME)
        mpu = register_ulysses_hf(model, sequence_parallel_size=4, micro_batch_size=1)
        engine, *_ = deepspeed.initialize(model=model, config="launch/ds_config.json", mpu=mpu)

(c) ``ulysses_parallelism_config``: the same wrapper through the HF ``Trainer`` (DeepSpeed's ALST as
    accelerate wires it): ``TrainingArguments(deepspeed=ds_config, parallelism_config=...)`` with our
    attention as the core attention; packed ``position_ids`` and a collator's ``flashmask`` reach it on
    the gathered sequence::

        args = TrainingArguments(..., deepspeed=ds_config, parallelism_config=ulysses_parallelism_config(2))

Masks shared by all heads only in (b) and (c) (the wrapper does not tell which heads a rank holds).
"""

from __future__ import annotations

import torch

try:  # ulysses_parallelism_config's base (the HF Trainer's ALST); the rest of this module needs no accelerate
    from accelerate.parallelism_config import ParallelismConfig as _ParallelismConfig
except ImportError:
    _ParallelismConfig = None

from fm_parallel.attention import flashmask_attention
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["FlashMaskLocalAttention", "register_ulysses_hf", "ulysses_parallelism_config"]


class FlashMaskLocalAttention(torch.nn.Module):
    """Local attention for ``DistributedAttention(..., scatter_idx=2, gather_idx=1)``, batch first.

    Args:
        mask: the full-sequence FlashMask (may also be given per call as ``mask=``).
        plan: the sharding plan when the ranks' tokens are not contiguous in rank order (zigzag or
            mask balance); the gathered sequence is then in ``cat(plan.positions)`` order.
        impl: local kernel, as for :func:`fm_parallel.flashmask_attention`.
    Call: ``(q, k, v)`` ``[B, S, H / P, D]`` -> ``[B, S, H / P, D]``.
    """

    def __init__(self, mask: FlashMask | None = None, plan: ShardPlan | None = None, impl: str = "auto", scale=None):
        super().__init__()
        self.mask, self.plan, self.impl, self.scale = mask, plan, impl, scale

    def forward(self, q, k, v, *args, mask: FlashMask | None = None, **kwargs):
        mask = mask if mask is not None else self.mask
        if mask is None:
            raise ValueError("mask: expected a FlashMask (at construction or per call), got None")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H/P, S, D]
        if self.plan is None:
            out = flashmask_attention(q, k, v, mask=mask.to(q.device), scale=self.scale, impl=self.impl)
        else:
            order = torch.cat(self.plan.positions).to(q.device)
            inverse = torch.argsort(order)
            q, k, v = (t.index_select(2, inverse) for t in (q, k, v))
            out = flashmask_attention(q, k, v, mask=mask.to(q.device), scale=self.scale, impl=self.impl)
            out = out.index_select(2, order)
        return out.transpose(1, 2)


def register_ulysses_hf(model, sequence_parallel_size: int, micro_batch_size: int = 1, seq_length: int | None = None,
                        disable_in_eval: bool = False):
    """Wrap our transformers backend in DeepSpeed's ``UlyssesSPAttentionHF``; returns DeepSpeed's mpu.

    The model must have been built with ``attn_implementation=fm_parallel.integrations.transformers.NAME``.
    Needs ``deepspeed.comm`` initialised (``deepspeed.init_distributed``).
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from fm_parallel.integrations import transformers as fm_hf

    name = fm_hf.register()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != name:
        raise ValueError(f"model: expected attn_implementation={name!r} (set it when loading), got {impl!r}")
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=name, sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size, seq_length=seq_length, seq_length_is_variable=seq_length is None,
        disable_in_eval=disable_in_eval,
    )


def ulysses_parallelism_config(sp_size: int, seq_length: int | None = None):
    """accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size)`` whose core attention
    is ours (``TrainingArguments(parallelism_config=...)``; the HF Trainer then shards each batch with
    DeepSpeed's ``UlyssesSPDataLoaderAdapter`` and wraps the attention in ``UlyssesSPAttentionHF``).

    ``seq_length``: every batch's length, or None (variable). On gloo every batch of a step must have
    the same length (DeepSpeed's loader gathers the ranks' batches with ``all_gather``, which gloo
    refuses for unequal shapes): pad rows to one length (``FlashMaskCollator(seq_len=...)``). The batch
    dimension must be ``per_device_train_batch_size`` (DeepSpeed checks it): one packed row per batch
    means a batch size of 1. Needs ``deepspeed.comm`` initialised (``deepspeed.init_distributed``;
    accelerate does not under ``use_cpu=True``).
    """
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    from fm_parallel.integrations import transformers as fm_hf

    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size: expected an int >= 1, got {sp_size!r}")
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=seq_length, sp_seq_length_is_variable=seq_length is None,
                                              sp_attn_implementation="sdpa")
    # accelerate's check lists flash-attn and sdpa names only; DeepSpeed's wrapper takes any name
    # transformers has registered, and ours is the one that reads packed position_ids and flashmask.
    handler.sp_attn_implementation = fm_hf.register()
    return LaunchCheckedParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=handler)


if _ParallelismConfig is not None:

    class LaunchCheckedParallelismConfig(_ParallelismConfig):
        """accelerate's ``ParallelismConfig`` that, when the ``Accelerator`` (the Trainer's) checks it, also
        refuses an accelerator over fewer processes than torchrun started (a CPU run without
        ``use_cpu=True``): DeepSpeed's Ulysses loader would then gather each rank's copy of the same
        batch and train every row twice, silently (:mod:`fm_parallel.integrations.world`). At module
        level so that ``TrainingArguments`` holding it pickle (the Trainer saves them in checkpoints)."""

        def _validate_accelerator(self, accelerator):
            from fm_parallel.integrations.world import check_processes

            check_processes(accelerator.num_processes)
            super()._validate_accelerator(accelerator)
