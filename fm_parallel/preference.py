"""The preference losses, written once for every front door (the trainer's objectives and the Hugging
Face trainers): DPO's sigmoid loss with the metrics TRL logs, and the reward model's Bradley-Terry loss
over every ranked pair of a sample's responses.

    losses, metrics = dpo_loss(policy, reference, beta)      # [samples], {"rewards/chosen": [samples], ...}
    losses, metrics = bradley_terry_loss(rewards, scores)     # [pairs], {"accuracy": [pairs], ...}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["dpo_loss", "ranked_pairs", "bradley_terry_loss"]


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sigmoid DPO loss of ``policy`` / ``reference`` log-probabilities ``[samples, 2]`` (column 0
    chosen, 1 rejected): ``(losses [samples], metrics)``, the metrics per sample and detached, named as
    TRL's ``DPOTrainer`` logs them (``rewards/chosen`` = beta * (pi - ref) of the chosen response, ...)."""
    chosen = policy[:, 0] - reference[:, 0]
    rejected = policy[:, 1] - reference[:, 1]
    losses = -F.logsigmoid(beta * (chosen - rejected))
    r_chosen, r_rejected = beta * chosen.detach(), beta * rejected.detach()
    metrics = {"rewards/chosen": r_chosen, "rewards/rejected": r_rejected, "rewards/margins": r_chosen - r_rejected,
               "rewards/accuracies": (r_chosen > r_rejected).to(r_chosen.dtype),
               "logps/chosen": policy[:, 0].detach(), "logps/rejected": policy[:, 1].detach()}
    return losses, metrics


def ranked_pairs(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every ordered pair of one sample's responses whose scores differ, the better first (InstructGPT's
    K-wise comparisons): ``(sample, better, worse)`` index tensors ``[pairs]``, samples in order.
    ``scores [samples, K]``; NaN marks a response slot a sample does not have. Ties make no pair."""
    s, k = scores.shape
    i, j = torch.triu_indices(k, k, offset=1, device=scores.device)
    a, b = scores[:, i], scores[:, j]  # [samples, K(K-1)/2]
    valid = (a != b) & ~a.isnan() & ~b.isnan()
    sample = torch.arange(s, device=scores.device).view(-1, 1).expand_as(a)[valid]
    first_better = (a > b)[valid]
    ii, jj = i.expand_as(a)[valid], j.expand_as(a)[valid]
    return sample, torch.where(first_better, ii, jj), torch.where(first_better, jj, ii)


def bradley_terry_loss(rewards: torch.Tensor, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reward model's Bradley-Terry loss ``-log sigmoid(r_better - r_worse)`` of every ranked pair
    (:func:`ranked_pairs`): ``(losses [pairs], metrics)``. ``rewards [samples, K]`` the scalar rewards of
    each sample's responses; ``scores`` their ranking ``[samples, K]`` (None: column 0 chosen over
    column 1, the pair form). Metrics per pair, detached: ``accuracy`` (the better response rewarded
    higher), ``margin`` (r_better - r_worse), ``rewards/chosen`` and ``rewards/rejected`` (the better
    and the worse response's rewards), as TRL's ``RewardTrainer`` names its accuracy and margin."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards: expected [samples, K >= 2], got shape {tuple(rewards.shape)}")
    if scores is None:
        if rewards.shape[1] != 2:
            raise ValueError(f"scores: expected a ranking for {rewards.shape[1]} responses per sample, got None (the pair form)")
        sample = torch.arange(rewards.shape[0], device=rewards.device)
        better, worse = torch.zeros_like(sample), torch.ones_like(sample)
    else:
        if scores.shape != rewards.shape:
            raise ValueError(f"scores: expected the rewards' shape {tuple(rewards.shape)}, got {tuple(scores.shape)}")
        sample, better, worse = ranked_pairs(scores.to(rewards.device))
    chosen, rejected = rewards[sample, better], rewards[sample, worse]
    margin = chosen - rejected
    losses = -F.logsigmoid(margin)
    metrics = {"accuracy": (margin > 0).to(rewards.dtype).detach(), "margin": margin.detach(),
               "rewards/chosen": chosen.detach(), "rewards/rejected": rejected.detach()}
    return losses, metrics
