"""Context parallelism in the Hugging Face ``Trainer`` and TRL's ``SFTTrainer``: one switch, any FlashMask.

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    cp = ContextParallelConfig(degree=2, mode="ring")            # "ring" | "ulysses" | "hybrid"
    trainer = context_parallel(Trainer)(model=model, args=args, train_dataset=docs,
                                        data_collator=DataCollatorWithFlattening(), cp=cp)
    trainer = context_parallel(SFTTrainer)(model=model, args=SFTConfig(padding_free=True, ...), ..., cp=cp)
    trainer = context_parallel(FlashMaskDPOTrainer)(model=peft_model, args=args, train_dataset=pairs, cp=cp)

launched with ``torchrun --nproc_per_node W script.py`` (``W`` a multiple of ``degree``: ``W / degree``
data-parallel groups of ``degree`` ranks each). The model must run our attention
(``attn_implementation=fm_parallel.integrations.transformers.register()``).

Per micro-batch, on every rank of a CP group (which all hold the same batch):

1. the batch is checked to be the same on every rank of the group (one small all-gather; a rank
   whose batch differs makes every rank raise the same ``ValueError``);
2. the row's mask is built on the full row: the collator's ``flashmask`` (or ``fms`` / ``fme``), else
   packed documents from ``cu_seq_lens_k`` or from ``position_ids`` that restart, else causal; a 2-D
   padding ``attention_mask`` is folded in;
3. labels are shifted on the full row, per document (a document's last token predicts nothing), so no
   shard loses the target that sits on its neighbour; the row is padded to what the plan needs
   (padding is its own invisible document, never a target);
4. the row is sharded by :func:`fm_parallel.distributed.shard` (``balance``), the mask prepared once
   (:meth:`ContextParallel.prepare`), the model run on the rank's tokens with their global positions;
5. the loss is the token-summed cross-entropy of the rank's targets divided by the targets of the
   whole step (all micro-batches, all data-parallel groups, each CP group counted once), so the ranks'
   shares sum to the one-process loss and DDP's gradient mean gives the one-process gradient.

Data: ranks of one CP group get the same batches (accelerate's sampler sharded over the data-parallel
groups, not over every rank). DDP or DeepSpeed ZeRO (stages 1-3, parameters partitioned over every
rank) reduce the gradients. What the Trainer would get wrong under CP is refused by name
(``compute_loss_func``, label smoothing, ``average_tokens_across_devices=False``, DataParallel,
FSDP (untested here), accelerate's own CP / SP, ranks the Trainer does not run distributed). ``degree=1`` runs the same code on one process (the
reference the tests compare against).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fm_parallel.distributed.context import CP_MODES
from fm_parallel.distributed.layout import CPLayout
from fm_parallel.distributed.sharding import BALANCE_MODES
from fm_parallel.integrations.world import check_trainer_world, launched_world
from fm_parallel.longcontext.loss import has_chunked_loss
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ContextParallelConfig", "ContextParallelMixin", "context_parallel", "batch_row", "row_mask", "shifted"]

# Keys a batch may carry besides the ones read below: flash-attn's maxima (derived from cu_seq_lens).
_IGNORED_KEYS = ("max_length_q", "max_length_k", "seq_idx", "use_cache")
_READ_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "flashmask", "fms", "fme",
              "cu_seq_lens_q", "cu_seq_lens_k", "fm_segment", "fm_sample")


@dataclass(frozen=True)
class ContextParallelConfig:
    """The switch.

    Args:
        degree: ranks per context-parallel group (1: no CP, the same code on one process).
        mode: ``"ring"``, ``"ulysses"`` or ``"hybrid"`` (Ulysses inside, ring outside).
        ulysses_degree: hybrid only: the Ulysses size inside a group (a divisor of ``degree``; default 2).
        balance: :func:`fm_parallel.distributed.shard`'s ``"contiguous"``, ``"zigzag"`` or ``"mask"``.
        impl: the local kernel (None: ``"auto"``).
    """

    degree: int = 1
    mode: str = "ring"
    ulysses_degree: int | None = None
    balance: str = "contiguous"
    impl: str | None = None

    def __post_init__(self):
        # Every field is checked by type and value, each naming cp.<field>: a bool is not a count, a
        # float or a string is not an int (0 once silently became the default 2).
        def positive_int(name, value):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cp.{name}: expected an int >= 1, got {value!r}")

        def one_of(name, value, choices):
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"cp.{name}: expected one of {tuple(choices)}, got {value!r}")

        positive_int("degree", self.degree)
        one_of("mode", self.mode, CP_MODES)
        one_of("balance", self.balance, BALANCE_MODES)
        if self.impl is not None:
            from fm_parallel import backends

            one_of("impl", self.impl, backends.names())
        if self.ulysses_degree is not None and self.mode != "hybrid":
            raise ValueError(f"cp.ulysses_degree: expected None for mode={self.mode!r} (hybrid only), got {self.ulysses_degree!r}")
        if self.ulysses_degree is not None:
            positive_int("ulysses_degree", self.ulysses_degree)
        if self.mode == "hybrid" and self.degree > 1 and self.degree % self.ulysses:
            raise ValueError(f"cp.ulysses_degree: expected a divisor of cp.degree = {self.degree}, got {self.ulysses}")

    @property
    def ulysses(self) -> int:
        """Ulysses ranks per group: ``degree`` for Ulysses, 1 for the ring, ``ulysses_degree`` (2) for hybrid."""
        return {"ring": 1, "ulysses": self.degree, "hybrid": 2 if self.ulysses_degree is None else self.ulysses_degree}[self.mode]


def _layout(cfg: ContextParallelConfig) -> CPLayout:
    """This rank's :class:`~fm_parallel.distributed.layout.CPLayout` (the trainer's too) for ``cfg``,
    its degree checked against the launched ranks first (naming ``cp.degree``)."""
    world = launched_world()
    if world % cfg.degree:
        raise ValueError(f"cp.degree: expected a divisor of the {world} ranks (WORLD_SIZE), got {cfg.degree}")
    return CPLayout(cfg.mode, cfg.degree, ulysses=cfg.ulysses, balance=cfg.balance, impl=cfg.impl)


def _digest(t) -> int:
    """63-bit BLAKE2b of a tensor's bytes and shape (0 for None): the batch agreement's values."""
    if t is None:
        return 0
    if isinstance(t, FlashMask):
        return t.digest()
    t = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(repr((tuple(t.shape), str(t.dtype))).encode(), digest_size=8)
    h.update(t.numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def _by_rank(message: str) -> str:
    """The agreement's ``name: expected the same value on every rank, got [d0, d1, ...] (by rank)``
    with each digest shown as ``same as rank 0`` / ``different`` (the digests themselves say nothing)."""
    import re

    found = re.search(r"got \[([0-9', ]+)\] \(by rank\)", message)
    if not found:
        return message
    codes = [c.strip(" '") for c in found.group(1).split(",")]
    shown = ", ".join("same as rank 0" if c == codes[0] else "different" for c in codes)
    return message[: found.start()] + f"got [{shown}] (by rank of the group)" + message[found.end():]


def row_mask(inputs: dict, causal: bool = True) -> FlashMask:
    """The full row's FlashMask ``[B, 1|H, N]`` from a batch (``input_ids [B, N]``), in the HF
    backend's order: ``flashmask`` / ``fms``+``fme``, else ``cu_seq_lens_k``, else restarting
    ``position_ids``, else causal; a 2-D ``attention_mask`` ``[B, N]`` makes padding keys invisible."""
    from fm_parallel.integrations import transformers as fm_hf

    b, n = inputs["input_ids"].shape
    mask = fm_hf._caller_mask(inputs.get("flashmask"), inputs.get("fms"), inputs.get("fme"), n, "cpu")
    if mask is None and inputs.get("cu_seq_lens_k") is not None:
        mask = fm_hf._documents_from_cu_seqlens(inputs.get("cu_seq_lens_q"), inputs["cu_seq_lens_k"], n, causal, "cpu")
    elif mask is None and inputs.get("position_ids") is not None:
        mask = fm_hf._documents_from_positions(inputs["position_ids"].cpu(), b, n, causal, "cpu")
    elif mask is None:
        mask = fm_hf._default_mask(n, causal, torch.device("cpu"))
    if mask.num_rows != n:
        raise ValueError(f"flashmask: expected a mask over the batch's {n} tokens, got {mask.num_rows} rows")
    padding = inputs.get("attention_mask")
    if padding is not None:
        padding = fm_hf.padding_keep(padding.cpu())  # HF's int64 / int32 / float 0-1 masks as well as bool
    if padding is not None and not bool(padding.all()):
        mask = fm_hf._with_padding(mask, padding)
    return mask


def shifted(inputs: dict, name: str = "labels", fill: int = -100) -> torch.Tensor:
    """``inputs[name] [B, N]`` moved one position left on the full row, per document: position ``t``
    holds what it predicts (``labels[:, t + 1]``), ``fill`` at each document's last token (where the
    next position starts a new document by ``position_ids`` / ``cu_seq_lens_k``) and at the row's end.
    ``shift_labels`` from the collator, when present, are taken as they are."""
    if name == "labels" and inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    x = inputs[name]
    out = torch.full_like(x, fill)
    out[:, :-1] = x[:, 1:]
    starts = None
    if inputs.get("cu_seq_lens_k") is not None:
        starts = torch.zeros_like(x, dtype=torch.bool)
        bounds = inputs["cu_seq_lens_k"].to(x.device).long()
        starts[:, bounds[(bounds > 0) & (bounds < x.shape[1])]] = True
    elif inputs.get("position_ids") is not None and inputs.get("flashmask") is None:
        pos = inputs["position_ids"].to(x.device).expand_as(x)
        starts = torch.zeros_like(x, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if starts is not None:  # a document's last token does not predict the next document's first
        out[:, :-1] = torch.where(starts[:, 1:], torch.full_like(out[:, :-1], fill), out[:, :-1])
    return out


def batch_row(inputs: dict, causal: bool = True) -> tuple[FlashMask, torch.Tensor]:
    """A Hugging Face batch as the row both front doors compute on: its FlashMask ``[B, 1|H, N]``
    (:func:`row_mask`: the collator's ``flashmask`` / ``fms``+``fme``, else ``cu_seq_lens_k``, else
    restarting ``position_ids``, else causal; a 2-D padding ``attention_mask`` folded in) and its
    labels shifted on the whole row, per document (:func:`shifted`; -100 where nothing is predicted).
    Shard both with :meth:`fm_parallel.distributed.layout.CPLayout.shard_row`."""
    return row_mask(inputs, causal), shifted(inputs)


@dataclass
class _Row:
    """One micro-batch as this rank computes on it. ``model_inputs``: what the model is called with
    (this rank's ``[B, N / P]`` tokens and global positions, the prepared mask, the context; or the
    full row at degree 1). ``targets``, ``segment``, ``sample``: the shifted labels / layout, this rank's
    tokens. ``samples``: preference samples per row (0 for documents)."""

    model_inputs: dict
    targets: torch.Tensor
    segment: torch.Tensor | None
    sample: torch.Tensor | None
    samples: int


class ContextParallelMixin:
    """Put before a ``transformers.Trainer`` subclass (or use :func:`context_parallel`); adds ``cp=``.

    Args:
        cp: a :class:`ContextParallelConfig` (default: degree 1).
        *args, **kwargs: the trainer's own.
    ``self.cp_layout`` says where this rank sits (``dp``, ``dp_rank``, ``cp_rank``).
    """

    loss_is_scaled_for_ga = True  # normalised by the whole step's targets (num_items_in_batch), as HF's own loss

    def __init__(self, *args, cp: ContextParallelConfig | None = None, **kwargs):
        cp = ContextParallelConfig() if cp is None else cp
        if not isinstance(cp, ContextParallelConfig):
            raise ValueError(f"cp: expected a ContextParallelConfig, got {type(cp).__name__}")
        super().__init__(*args, **kwargs)
        self.cp = cp
        self._check_arguments()
        self.cp_layout = _layout(cp)

    def _check_arguments(self) -> None:
        """Refuse, by name, what would be silently wrong under this wrapper's loss and sampling."""
        from fm_parallel.integrations.dpo import _check_attention

        args = self.args
        _check_attention(self.model, "model")  # any other attention ignores the mask (and the context)
        if self.compute_loss_func is not None:
            raise ValueError("compute_loss_func: expected None with cp= (the loss is computed on the rank's shard), got a function")
        if getattr(self, "label_smoother", None) is not None:
            raise ValueError(f"label_smoothing_factor: expected 0 with cp=, got {args.label_smoothing_factor}")
        if not args.average_tokens_across_devices:
            raise ValueError("average_tokens_across_devices: expected True with cp= (the loss is divided by the targets of "
                             "every rank of the step, each CP group counted once), got False")
        if args.n_gpu > 1:
            raise ValueError(f"n_gpu: expected at most 1 per process with cp= (launch one process per GPU with torchrun; "
                             f"DataParallel would split the row), got {args.n_gpu}")
        check_trainer_world(args)
        if self.is_fsdp_enabled:
            # accelerate runs FSDP only on GPUs (not MULTI_CPU): no CPU test could hold this composition
            # to one process's losses yet, so it is refused rather than trusted.
            raise ValueError("fsdp: expected none with cp= (DDP, or DeepSpeed ZeRO 1-3: tested against one process on "
                             "gloo; FSDP under cp= is not yet tested), got fsdp")
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
            raise ValueError("parallelism_config: expected no accelerate cp_size / sp_size with cp= (two context "
                             "parallelisms; accelerate's forces a causal mask), got " + repr(pc))

    # ------------------------------------------------------------------ data
    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None):
        """The Trainer's loaders (training and evaluation), sharded over the data-parallel groups:
        every rank of a CP group gets the same batches (accelerate's ``prepare`` would give each rank
        its own)."""
        if self.cp.degree == 1:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        lay = self.cp_layout
        if not is_training and lay.dp > 1 and hasattr(dataset, "__len__") and len(dataset) % (lay.dp * batch_size):
            # accelerate evens the groups' last batches by repeating samples and drops them by a sample
            # count, while a packed batch yields one loss per row: the repeats would be counted.
            raise ValueError(f"eval_dataset: expected a length divisible by data-parallel groups x per_device_eval_batch_size "
                             f"= {lay.dp} x {batch_size} = {lay.dp * batch_size} under cp=, got {len(dataset)}")
        from accelerate.data_loader import prepare_data_loader
        from torch.utils.data import DataLoader

        acc = self.accelerator
        real = acc.prepare
        captured = {}

        def capture(loader, *a, **k):  # the Trainer's own DataLoader (collator, sampler, workers), unprepared
            captured["loader"] = loader
            return loader

        acc.prepare = capture
        try:
            super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        finally:
            acc.prepare = real
        loader: DataLoader = captured["loader"]
        return prepare_data_loader(loader, acc.device, num_processes=lay.dp, process_index=lay.dp_rank,
                                   split_batches=acc.split_batches, put_on_device=acc.device_placement,
                                   rng_types=acc.rng_types.copy(), dispatch_batches=False, even_batches=acc.even_batches,
                                   use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
                                   non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """Targets of the whole step: the shifted labels of every micro-batch, summed over the
        data-parallel groups (each CP group's ranks hold the same batch: counted once)."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        count = sum(int((shifted(b) != -100).sum()) for b in batch_samples)
        total = torch.tensor(count, dtype=torch.int64, device=device)
        if self.cp_layout.world > 1:
            dist.all_reduce(total)  # on the Trainer's device (NCCL: the GPU); the world's sum counts each group degree times
            total = total // self.cp.degree
        return total

    # ------------------------------------------------------------------ one row
    def _cp_row(self, inputs: dict, shift: bool = True) -> _Row:
        """Shard one micro-batch (see the module docstring, steps 1-4). ``shift=False``: ``labels``,
        ``fm_segment`` and ``fm_sample`` are taken as they are (per position, not per target: the reward
        model reads each response's last token itself)."""
        lay, cfg = self.cp_layout, self.cp
        unknown = sorted(k for k in inputs if k not in _READ_KEYS and k not in _IGNORED_KEYS)
        problem = (f"inputs: expected only the keys {list(_READ_KEYS)} (and {list(_IGNORED_KEYS)}) with cp=, got {unknown} "
                   "(a per-token field this wrapper would not shard)") if unknown else None
        if cfg.degree > 1:
            # First, before anything one rank alone could fail on: the group holds one batch.
            from fm_parallel.distributed.comm import check_agreement

            names = ["input_ids", "labels", "position_ids", "flashmask", "fms", "cu_seq_lens_k", "attention_mask", "fm_segment"]
            try:
                check_agreement([_digest(inputs.get(k)) for k in names], names, groups=lay.groups, problem=problem)
            except ValueError as e:
                if str(e).startswith("rank "):  # a rank's own problem, raised by every rank as it is
                    raise
                raise ValueError(f"batch: expected the same batch on every rank of a context-parallel group (its ranks hold "
                                 f"shards of one row; data parallelism runs across groups), got {_by_rank(str(e))}") from None
        elif problem:
            raise ValueError(problem)
        ids = inputs["input_ids"]
        device = ids.device
        b, n = ids.shape
        segment = sample = None
        samples = 0
        if inputs.get("fm_segment") is not None:
            if shift:
                segment, sample = shifted(inputs, "fm_segment", -1), shifted(inputs, "fm_sample", -1)
            else:
                segment, sample = inputs["fm_segment"], inputs["fm_sample"]
            samples = int(inputs["fm_sample"].max()) + 1
        positions = inputs.get("position_ids")
        positions = torch.arange(n, device=device).expand(b, n) if positions is None else positions.to(device).expand(b, n)
        mask, labels = batch_row(inputs) if shift else (row_mask(inputs), inputs["labels"])
        fields = {"input_ids": ids, "labels": labels, "positions": positions, "segment": segment, "sample": sample}
        row = lay.shard_row(mask, fields, device)
        t = row.tensors
        model_inputs = {"input_ids": t["input_ids"], "position_ids": t["positions"], "flashmask": row.mask}
        if row.ctx is not None:
            model_inputs["fm_context"] = row.ctx
        return _Row(model_inputs, t["labels"], t["segment"], t["sample"], samples)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Next-token loss of the rank's shard: ``sum CE / num_items_in_batch x world`` (DDP averages
        the gradients over the world; the shares of a CP group sum to its row's loss). Without
        ``num_items_in_batch`` (evaluation) the group's loss on this batch, replicated."""
        self._check_attention_now(model)
        row = self._cp_row(inputs)
        if has_chunked_loss(self.accelerator.unwrap_model(model)):
            # long_context(loss_chunk=): the model sums its chunked loss over the shard's own targets
            # (HF's loss divided by num_items_in_batch = 1); no logits are built.
            outputs = model(**row.model_inputs, use_cache=False, labels=row.targets, shift_labels=row.targets,
                            num_items_in_batch=1)
            local = outputs.loss
        else:
            outputs = model(**row.model_inputs, use_cache=False)
            local = F.cross_entropy(outputs.logits.flatten(0, 1).float(), row.targets.flatten(), ignore_index=-100,
                                    reduction="sum")
        if num_items_in_batch is not None:
            loss = local / num_items_in_batch * self.cp_layout.world
        else:
            # A batch with no target is NaN (0 / 0), as one process's mean cross-entropy is, so that
            # evaluate() leaves it out as it does there (the Trainer drops NaN batch losses).
            count = torch.tensor(float((row.targets != -100).sum()), device=local.device)
            loss = self.cp_layout.cp_sum(local) / self.cp_layout.cp_sum(count)
        return (loss, outputs) if return_outputs else loss

    def _check_attention_now(self, model) -> None:
        """The model still runs our attention (a dict lookup per step): one switched to ``sdpa`` after
        this trainer was built would attend each rank's own shard only, silently."""
        from fm_parallel.integrations.dpo import _check_attention

        _check_attention(self.accelerator.unwrap_model(model), "model")

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Under CP the logits are a shard's: evaluation gives the loss only.
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


class _ContextParallelPreference(ContextParallelMixin):
    """What the preference trainers share under CP: a micro-batch's loss is a mean over its own samples
    or pairs (not over the step's tokens), and each batch is checked to be preference rows and the model
    to run our attention before anything is sharded."""

    loss_is_scaled_for_ga = False  # a mean over this micro-batch's samples, as the wrapped trainer's

    def _get_num_items_in_batch(self, batch_samples, device):
        return None

    def _preference_row_checks(self, model, inputs) -> None:
        from fm_parallel.integrations.dpo import check_preference_rows

        check_preference_rows(inputs)
        self._check_attention_now(model)


class _ContextParallelDPO(_ContextParallelPreference):
    """:class:`fm_parallel.integrations.dpo.FlashMaskDPOTrainer` under CP: each rank sums the
    log-probabilities of its tokens per (sample, response), the sums are added over the CP group
    (differentiable), and the replicated DPO loss follows (the mean over the micro-batch's pairs)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from fm_parallel import logprobs

        self._preference_row_checks(model, inputs)
        row = self._cp_row(inputs)
        slots = logprobs.sample_slots(inputs["fm_sample"])

        def logps(logits):
            per_token = logprobs.token_logps(logits, row.targets)
            sums = logprobs.response_sums(per_token, row.segment, row.sample, samples=row.samples, responses=2,
                                          scored=row.targets >= 0)
            sums = self.cp_layout.cp_sum(sums)
            return sums[slots.to(sums.device)]

        return self.dpo_step(model, row.model_inputs, logps, return_outputs)


class _ContextParallelRM(_ContextParallelPreference):
    """:class:`fm_parallel.integrations.reward.FlashMaskRewardTrainer` under CP: each rank runs the
    score head on its tokens and keeps the responses' last tokens it holds, the per-response rewards
    are added over the CP group (differentiable: the rank holding a last token gets its gradient), and
    the replicated Bradley-Terry loss follows (the mean over the micro-batch's ranked pairs)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from fm_parallel import logprobs
        from fm_parallel.integrations.collator import response_ends

        self._preference_row_checks(model, inputs)
        responses = int(inputs["fm_segment"].max())
        ends = response_ends(inputs["fm_segment"], inputs["fm_sample"])
        # The positions whose reward is read travel as the row's labels (1 there, -100 elsewhere): sharded
        # with the tokens; the scores table is per sample and stays whole on every rank.
        rows = {k: v for k, v in inputs.items() if k != "fm_scores"}
        rows["labels"] = torch.where(ends, 1, -100)
        row = self._cp_row(rows, shift=False)

        def rewards(values):
            sums = logprobs.response_sums(values, row.segment, row.sample, samples=row.samples, responses=responses,
                                          scored=row.targets >= 0)
            return self.cp_layout.cp_sum(sums)

        return self.reward_step(model, row.model_inputs, rewards, inputs, return_outputs)


@functools.lru_cache(maxsize=None)
def context_parallel(trainer_class: type) -> type:
    """``trainer_class`` (``Trainer``, TRL's ``SFTTrainer``, ``FlashMaskDPOTrainer``, a subclass) with the
    ``cp=`` switch: ``ContextParallel<Name>``, the mixin first in its MRO. The same class every call."""
    from transformers import Trainer

    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer

    if not isinstance(trainer_class, type) or not issubclass(trainer_class, Trainer):
        raise ValueError(f"trainer_class: expected a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ContextParallelMixin):
        return trainer_class
    mixin = (_ContextParallelDPO if issubclass(trainer_class, FlashMaskDPOTrainer)
             else _ContextParallelRM if issubclass(trainer_class, FlashMaskRewardTrainer) else ContextParallelMixin)
    return type(f"ContextParallel{trainer_class.__name__}", (mixin, trainer_class), {"__module__": __name__})
