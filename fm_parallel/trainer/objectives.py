"""Training objectives: what a data file must hold, what rows a run trains on, what its loss of one row
is, and what the step's loss is normalised by. Adding an objective is one class here and one entry in
:data:`OBJECTIVES`.

Losses are sums over this rank's part of a row divided by the step's global :meth:`Objective.denominator`
(tokens for SFT, samples for DPO, over every row of the step on every data-parallel rank), so the
gradients summed over the world are the update one process would compute.

    objective = OBJECTIVES[cfg.data.objective](cfg)
    objective.validate(cfg.data.path, tokenizer)        # before training: where the first bad record is
    for row in objective.rows(tokenizer): ...
    loss = objective.loss(model, batch, layout) / objective.denominator(rows)
"""

from __future__ import annotations

import torch

from fm_parallel.formats import DataError, sft_document
from fm_parallel.logprobs import at_least_float32, response_sums, token_logps
from fm_parallel.preference import bradley_terry_loss, dpo_loss
from fm_parallel.trainer.config import OBJECTIVE_NAMES, Config, ConfigError
from fm_parallel.trainer.data import Row, check_dpo_sample, dpo_rows, rm_rows, rm_sample, sft_rows
from fm_parallel.trainer.fsdp import in_root, reference_model
from fm_parallel.trainer.model import hidden_states
from fm_parallel.trainer.sources import validate_records
from fm_parallel.longcontext.loss import chunked_cross_entropy
from fm_parallel.longcontext.tiles import tiled_map

__all__ = ["Objective", "SFT", "DPO", "RM", "OBJECTIVES", "objective", "rows_per_pass"]


class Objective:
    """One training objective. ``cfg``: the run's Config."""

    name = ""
    # String fields every record must hold, checked by the default :meth:`check_record` (the built-in
    # objectives check TRL's formats instead, :mod:`fm_parallel.formats`).
    FIELDS: tuple[str, ...] = ()
    # The model's head: "lm" (a causal LM, the next-token logits) or "score" (a sequence classifier with
    # one output, AutoModelForSequenceClassification's, read at chosen positions).
    HEAD = "lm"
    # Why this objective cannot train every weight (model.finetune = "full"), or "" when it can.
    NOT_FULL = ""
    # Whether the loss compares with a frozen reference model (built beside a full-parameter model).
    REFERENCE = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        if cfg.model.finetune == "full" and self.NOT_FULL:
            raise ConfigError(f"model.finetune: expected 'lora' with data.objective {self.name!r} ({self.NOT_FULL}), got 'full'")

    def validate(self, path: str, tokenizer, stop=None, key: str = "data.path", split: str | None = None) -> int:
        """One pass over the records of ``path`` (a file, folder or cached dataset name:
        :mod:`~fm_parallel.trainer.sources`, ``data.split``) before training; the number of records (-1
        when ``stop()`` ended the pass early). Each record is checked by :meth:`check_record` with the
        run's ``tokenizer`` (its form and its tokens); the first bad one raises
        :class:`~fm_parallel.trainer.data.DataError` naming where it is (``file:line``), or ``key``, the
        setting that named the source, when it is missing or empty. ``split``: the source's split (None:
        ``data.split``)."""
        check = lambda where, record: self.check_record(where, record, tokenizer)  # noqa: E731
        return validate_records(path, check, stop, key, self.cfg.data.split if split is None else split)

    def check_record(self, where: str, record: dict, tokenizer) -> None:
        """Raise :class:`~fm_parallel.trainer.data.DataError` naming ``where`` when ``record`` cannot be
        trained on; here, before the run, rather than at the step that reads it. By default: the
        :attr:`FIELDS` are strings."""
        missing = [k for k in self.FIELDS if not isinstance(record.get(k), str)]
        if missing:
            raise DataError(f"{where}: expected string fields {list(self.FIELDS)}, missing or not a string: {missing}")

    def rows(self, tokenizer, passes: int | None = None, window: tuple[int, int | None] = (0, None)):
        """The deterministic stream of packed :class:`Row` s (the same on every rank): ``passes`` passes
        over the data, or (None) endless; of each pass the records ``window = (start, stop)``."""
        raise NotImplementedError

    def longest_document(self) -> int:
        """The most tokens one document of a row can span, so that no row position sees further back
        (the memory plan measures the costliest mask under it); 0: unbounded (up to the whole row)."""
        return 0

    def denominator(self, rows: list[Row]) -> int:
        """What the summed losses of ``rows`` (the whole step's) are divided by; at least 1, so rows
        with nothing to predict contribute zero, not NaN."""
        raise NotImplementedError

    def loss(self, model, batch, layout) -> torch.Tensor:
        """This rank's summed loss of one row (a scalar; unnormalised)."""
        raise NotImplementedError

    # The sums :meth:`loss_and_sums` returns beside the loss: "count" (what they are divided by), then
    # each metric logged per count with every training step (TRL's names: ``rewards/chosen``, ...).
    STEP_SUMS: tuple[str, ...] = ()

    def loss_and_sums(self, model, batch, layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, sums)``: :meth:`loss`, and this rank's detached :attr:`STEP_SUMS` of the row (summed
        over the world, they are the step's)."""
        return self.loss(model, batch, layout), {}

    # The sums :meth:`eval_sums` returns: "loss" and "count" (what it is divided by), then any more,
    # each reported per count (``eval_<name>`` in metrics.jsonl).
    EVAL_SUMS = ("loss", "count")

    def eval_sums(self, model, batch, layout) -> dict[str, torch.Tensor]:
        """This rank's sums over one held-out row (scalars; summed over the world, they are the row's)."""
        raise NotImplementedError


class SFT(Objective):
    """Next-token cross-entropy on packed documents, summed over the scored tokens."""

    name = "sft"

    def longest_document(self) -> int:
        return self.cfg.data.max_doc_tokens  # sft_rows splits longer documents

    def check_record(self, where, record, tokenizer):
        d = self.cfg.data
        sft_document(tokenizer, record, where, d.assistant_only_loss, d.completion_only_loss)

    def rows(self, tokenizer, passes=None, window=(0, None)):
        d = self.cfg.data
        return sft_rows(d.seq_len, tokenizer, d.path, d.max_doc_tokens, d.split, d.assistant_only_loss,
                        d.completion_only_loss, passes, window)

    def denominator(self, rows):
        return max(sum(int((r.labels != -100).sum()) for r in rows), 1)

    def loss(self, model, batch, layout):
        head = model.get_base_model().lm_head
        return chunked_cross_entropy(head, hidden_states(model, batch), batch.labels, self.cfg.training.loss_chunk)

    def eval_sums(self, model, batch, layout):
        return {"loss": self.loss(model, batch, layout), "count": (batch.labels >= 0).sum()}


class DPO(Objective):
    """DPO on packed preference samples (shared prompt or TRL's layout, ``data.dpo_layout``); the
    reference model is the base with the adapter disabled (LoRA) or a frozen copy of the initial
    weights (full). Summed over samples."""

    name = "dpo"
    REFERENCE = True

    def rows(self, tokenizer, passes=None, window=(0, None)):
        d = self.cfg.data
        return dpo_rows(d.seq_len, tokenizer, d.path, d.dpo_layout, d.split, passes, window)

    def check_record(self, where, record, tokenizer):
        # A sample is never cut (its responses would lose their ends), so one longer than a row is refused.
        check_dpo_sample(where, tokenizer, record, self.cfg.data.seq_len, self.cfg.data.dpo_layout)

    def denominator(self, rows):
        return max(sum(int(r.sample.max()) + 1 for r in rows), 1)

    def response_logps(self, model, batch) -> torch.Tensor:
        """``[samples, 2]``: summed log-probs of each sample's chosen and rejected tokens (this rank's part)."""
        hidden = hidden_states(model, batch)
        head = model.get_base_model().lm_head
        chunk = self.cfg.training.loss_chunk
        logps = tiled_map(lambda h_, y_: token_logps(head(h_), y_), hidden, chunk, batch.labels,
                          params=head.parameters())
        # The trainer's labels are shifted (position t scores token t + 1, inside the same response), so a
        # scored position's own segment and sample are its target's.
        return response_sums(logps, batch.segment, batch.sample, samples=batch.samples, responses=2,
                             scored=batch.labels >= 0)

    def logps(self, model, batch, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(policy, reference)``, each ``[samples, 2]``: the whole row's summed log-probabilities of each
        sample's chosen and rejected responses (summed over the CP ranks, the same on each)."""
        policy = self.response_logps(model, batch)
        with torch.no_grad(), reference_model(model) as frozen:
            reference = in_root(frozen, self.response_logps, frozen, batch)
        return layout.cp_sum(policy), layout.cp_sum(reference)

    def loss(self, model, batch, layout):
        return self.loss_and_sums(model, batch, layout)[0]

    # TRL's DPOTrainer logs these every step, per sample.
    STEP_SUMS = ("count", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")

    def loss_and_sums(self, model, batch, layout):
        losses, metrics = dpo_loss(*self.logps(model, batch, layout), self.cfg.training.dpo_beta)
        # Each CP rank holds the same per-sample sums; 1/cp makes the world-summed gradient (and sums) exact.
        cp = layout.cp
        sums = {k: metrics[k].sum() / cp for k in self.STEP_SUMS[1:]}
        return losses.sum() / cp, {"count": torch.tensor(losses.numel() / cp), **sums}

    # TRL's rewards/accuracies (chosen reward above rejected) and rewards/margins, per sample.
    EVAL_SUMS = ("loss", "count", "reward_accuracy", "reward_margin")

    def eval_sums(self, model, batch, layout):
        losses, metrics = dpo_loss(*self.logps(model, batch, layout), self.cfg.training.dpo_beta)
        cp = layout.cp
        return {"loss": losses.sum() / cp, "count": torch.tensor(losses.numel() / cp),
                "reward_accuracy": metrics["rewards/accuracies"].sum() / cp, "reward_margin": metrics["rewards/margins"].sum() / cp}


class RM(Objective):
    """A reward model on packed samples of one prompt and K responses (the ``preference`` mask): each
    response's reward is the ``score`` head on its last token, and the loss is the Bradley-Terry loss
    over every ranked pair of a sample's responses (``fm_parallel.preference``), summed over pairs."""

    name = "rm"
    HEAD = "score"

    def rows(self, tokenizer, passes=None, window=(0, None)):
        return rm_rows(self.cfg.data.seq_len, tokenizer, self.cfg.data.path, self.cfg.data.split, passes, window)

    def check_record(self, where, record, tokenizer):
        rm_sample(where, tokenizer, record, self.cfg.data.seq_len)

    def denominator(self, rows):
        from fm_parallel.preference import ranked_pairs

        return max(sum(len(ranked_pairs(r.scores)[0]) for r in rows), 1)

    def rewards(self, model, batch, layout) -> torch.Tensor:
        """``[samples, K]``: each response's reward, the whole row's (this rank's responses' last tokens
        summed over the CP ranks, the same on each; a rank's gradient reaches the tokens it holds)."""
        values = at_least_float32(model.get_base_model().score(hidden_states(model, batch)).squeeze(-1))  # [1, n]
        table = response_sums(values, batch.segment, batch.sample, samples=batch.samples, responses=batch.scores.shape[1],
                              scored=batch.labels >= 0)  # the responses' last tokens: their rewards
        return layout.cp_sum(table)

    def _pairs(self, model, batch, layout):
        return bradley_terry_loss(self.rewards(model, batch, layout), batch.scores)

    def loss(self, model, batch, layout):
        return self.loss_and_sums(model, batch, layout)[0]

    # Per ranked pair, every step: TRL's RewardTrainer's accuracy and margin, and the pairs' rewards.
    STEP_SUMS = ("count", "accuracy", "margin", "rewards/chosen", "rewards/rejected")

    def loss_and_sums(self, model, batch, layout):
        losses, metrics = self._pairs(model, batch, layout)
        # Each CP rank holds the same rewards; 1/cp makes the world-summed gradient (and sums) exact.
        cp = layout.cp
        sums = {k: metrics[k].detach().sum() / cp for k in self.STEP_SUMS[1:]}
        return losses.sum() / cp, {"count": torch.tensor(losses.numel() / cp), **sums}

    # TRL's RewardTrainer metrics, per ranked pair.
    EVAL_SUMS = ("loss", "count", "accuracy", "margin", "reward_chosen", "reward_rejected")

    def eval_sums(self, model, batch, layout):
        losses, metrics = self._pairs(model, batch, layout)
        cp = layout.cp
        return {"loss": losses.sum() / cp, "count": torch.tensor(losses.numel() / cp),
                "accuracy": metrics["accuracy"].sum() / cp, "margin": metrics["margin"].sum() / cp,
                "reward_chosen": metrics["rewards/chosen"].sum() / cp, "reward_rejected": metrics["rewards/rejected"].sum() / cp}


OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (SFT, DPO, RM)}
if tuple(OBJECTIVES) != OBJECTIVE_NAMES:  # data.objective's choices (config.py) name exactly these classes
    raise ImportError(f"config.OBJECTIVE_NAMES {OBJECTIVE_NAMES} != the objectives' names {tuple(OBJECTIVES)}")


def rows_per_pass(cfg: Config, objective: Objective, tokenizer, held_out: int = 0,
                  window: tuple[int, int | None] = (0, None)) -> int | None:
    """The training rows one pass over the data packs into (its records ``window``, less ``held_out``
    rows held out of the stream for evaluation): what ``training.epochs`` and the logged ``epoch``
    count in. None for the built-in corpus unless ``training.epochs`` asks (counting costs a pass)."""
    if not (cfg.data.path or cfg.training.epochs):
        return None
    rows = sum(1 for _ in objective.rows(tokenizer, passes=1, window=window)) - held_out
    if rows < 1:
        raise ConfigError(f"eval.rows: expected fewer rows than the {rows + held_out} of one pass over the training data, "
                          f"got {held_out}: none would be left to train on")
    return rows


def objective(cfg: Config) -> Objective:
    """The configured objective (``data.objective``)."""
    return OBJECTIVES[cfg.data.objective](cfg)
