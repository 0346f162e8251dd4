"""Summed log-probabilities of the responses in packed preference rows (DPO pairs, reward-model rows
with k responses): one implementation for the Hugging Face collator's :func:`response_logps` and the
trainer's DPO.

A packed row carries its layout per token: ``segment`` (0 prompt, ``r + 1`` response ``r``, -1
padding) and ``sample`` (the sample's index in its row, -1 padding). Every layout question (how many
samples a row holds, how many responses a sample has) is answered from these two tensors, never from
an argument that could contradict them.

    logps = response_logps(logits, labels, segment, sample)          # [samples, k]; labels as HF's (unshifted)
    per_token = token_logps(logits_chunk, targets_chunk)               # [B, n]: chunked losses (the trainer)
    sums = response_sums(per_token, segment, sample, samples=s, responses=2)   # a context-parallel shard's part
"""

from __future__ import annotations

import torch

__all__ = ["token_logps", "response_sums", "response_logps", "sample_slots", "at_least_float32"]


def _check_layout(segment, sample, shape, where: str = "") -> None:
    for name, t in (("segment", segment), ("sample", sample)):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{where}{name}: expected an integer tensor {list(shape)}, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{where}{name}: expected shape {list(shape)} (one entry per token), got {list(t.shape)}")


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` for a loss: half precision raised to float32, float32 and float64 as they are (a float64
    model's losses stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def sample_slots(sample: torch.Tensor) -> torch.Tensor:
    """``[B * S]`` bool over a table of ``S`` rows per batch row (``S`` the batch's most samples, as
    :func:`response_sums` lays it out): True for the slots that are a row's real samples, so that
    ``table[sample_slots(sample)]`` lists the samples in row order (shorter rows leave empty slots).
    ``sample [B, N]``: each token's sample index in its row, -1 padding."""
    per_row = (sample.max(dim=1).values + 1).clamp(min=0) if sample.numel() else sample.new_zeros(sample.shape[0])
    most = int(per_row.max()) if per_row.numel() else 0
    return (torch.arange(most, device=sample.device).view(1, -1) < per_row.view(-1, 1)).flatten()


def token_logps(logits: torch.Tensor, targets: torch.Tensor, *, check_vocab: bool = True) -> torch.Tensor:
    """``log p(targets[b, t] | logits[b, t])`` per position, 0 where the target is negative (-100: not
    scored): ``logits [B, n, V]``, ``targets [B, n]`` -> ``[B, n]`` in float32 at least (float64
    stays float64). The targets are the tokens each position predicts (already shifted).
    ``check_vocab=False`` skips the one host sync that refuses targets ``>= V`` (for a caller that
    checked its ids once per row, calling this per chunk of a long row)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits: expected a float tensor [B, n, V], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(logits.shape[:2]) or targets.dtype.is_floating_point:
        raise ValueError(f"labels: expected an integer tensor {list(logits.shape[:2])} (the logits' batch and length), got "
                         f"{list(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    vocab = logits.shape[-1]
    if check_vocab and targets.numel():
        # One sync: an id past the vocabulary would be a device-side assert in gather on a GPU.
        high = int(targets.max())
        if high >= vocab:
            raise ValueError(f"labels: expected token ids < the logits' vocabulary size {vocab}, got {high}")
    logp = torch.log_softmax(at_least_float32(logits), -1)
    logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets >= 0, logp, torch.zeros_like(logp))


def response_sums(per_token: torch.Tensor, segment: torch.Tensor, sample: torch.Tensor, *, samples: int,
                  responses: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``per_token [B, n]`` into ``[B * samples, responses]`` by the layout of each position's
    target: ``segment [B, n]`` (``r + 1`` for response ``r``) and ``sample [B, n]``; row ``b``'s
    samples are rows ``b * samples ...`` of the result. ``scored [B, n]`` bool: the positions that
    count (the targets' ``>= 0``); default every position inside a sample.

    ``samples`` / ``responses`` size the table, so a context-parallel shard that holds only part of a
    row (some samples or responses absent) gets the same table as its peers; a position that names a
    sample or response outside the table contradicts them and raises (it would land in a neighbour's
    slot)."""
    _check_layout(segment, sample, per_token.shape)
    for name, value in (("samples", samples), ("responses", responses)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if scored is None:
        scored = torch.ones_like(segment, dtype=torch.bool)
    scored = scored & (segment >= 0) & (sample >= 0)
    if per_token.numel():
        seg_high, smp_high, stray = torch.stack([
            torch.where(scored, segment, 0).max(), torch.where(scored, sample, 0).max(), (scored & (segment == 0)).any().long(),
        ]).tolist()
        if seg_high > responses:
            raise ValueError(f"responses: expected at least {seg_high} (fm_segment holds response {seg_high}), got {responses}")
        if smp_high >= samples:
            raise ValueError(f"samples: expected at least {smp_high + 1} (fm_sample holds sample {smp_high}), got {samples}")
        if stray:
            raise ValueError("labels: expected scored tokens only inside responses (fm_segment >= 1), got a scored prompt token")
    b = per_token.shape[0]
    total = b * samples * responses
    row = torch.arange(b, device=segment.device).view(-1, 1)
    slot = (row * samples + sample) * responses + (segment - 1)
    slot = torch.where(scored, slot, torch.full_like(slot, total))  # everything not scored goes to a spare slot
    sums = torch.zeros(total + 1, dtype=per_token.dtype, device=per_token.device)
    sums = sums.index_add(0, slot.flatten(), torch.where(scored, per_token, 0).flatten())
    return sums[:total].view(b * samples, responses)


def response_logps(logits: torch.Tensor, labels: torch.Tensor, segment: torch.Tensor, sample: torch.Tensor,
                   responses: int | None = None) -> torch.Tensor:
    """Summed log-probabilities of each preference sample's responses: ``[samples, k]``, samples in
    row order (row 0's, then row 1's).

    Args:
        logits: ``[B, N, V]`` from the model on the batch.
        labels: ``[B, N]`` as Hugging Face models take them (unshifted: position ``t``'s logits
            predict ``labels[:, t + 1]``), -100 where nothing is scored.
        segment: ``[B, N]``, 0 prompt, ``r + 1`` response ``r``, -1 padding.
        sample: ``[B, N]``, the sample's index in its row, -1 padding.
        responses: the number of responses per sample the caller expects (2 for DPO: column 0 chosen,
            1 rejected); None takes it from ``segment``. A count that contradicts ``segment`` raises.
    The layout is checked: each row's samples are ``0 .. s_b - 1`` and each of them holds every one
    of the ``k`` responses."""
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError(f"labels: expected an integer tensor [B, N], got "
                         f"{list(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise ValueError(f"logits: expected [B, N, V] with B, N = {list(labels.shape)} (the labels'), got "
                         f"{list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    _check_layout(segment, sample, labels.shape, "fm_")
    segment, sample = segment.to(labels.device), sample.to(labels.device)
    if responses is not None and (not isinstance(responses, int) or isinstance(responses, bool) or responses < 1):
        raise ValueError(f"responses: expected None or an int >= 1, got {responses!r}")
    b = labels.shape[0]
    # The layout, in one host copy: per row its sample count; over the batch the response count.
    row_samples = (sample.max(dim=1).values + 1).clamp(min=0) if labels.numel() else labels.new_zeros(b)
    k_seen = int(segment.max()) if segment.numel() else 0
    row_samples = row_samples.tolist()
    if k_seen < 1 or max(row_samples, default=0) < 1:
        raise ValueError("fm_segment: expected preference rows (responses numbered from 1), got no response token")
    if responses is not None and responses != k_seen:
        raise ValueError(f"responses: expected {k_seen} (the batch's layout: fm_segment holds responses 1..{k_seen} "
                         f"per sample), got {responses}")
    k, per_row = k_seen, max(row_samples)
    # Every (row, sample, response) the table claims must exist: a sample without one of its responses
    # (a mixed batch, a hand-made layout) would otherwise read as a zero log-probability.
    inside = (segment >= 1) & (sample >= 0)
    slot = (torch.arange(b, device=segment.device).view(-1, 1) * per_row + sample) * k + (segment - 1)
    present = torch.zeros(b * per_row * k + 1, dtype=torch.bool, device=segment.device)
    present[torch.where(inside, slot, b * per_row * k).flatten()] = True
    expected = torch.zeros(b, per_row, k, dtype=torch.bool)
    for r, s in enumerate(row_samples):
        expected[r, :s] = True
    missing = (expected.to(segment.device).flatten() & ~present[:-1]).nonzero()
    if missing.numel():
        r, s, j = (int(x) for x in torch.unravel_index(missing[0, 0].cpu(), (b, per_row, k)))
        raise ValueError(f"fm_segment: expected every sample to hold responses 1..{k}, got row {r} sample {s} "
                         f"without response {j + 1}")
    targets = labels[:, 1:]
    per_token = token_logps(logits[:, :-1], targets)
    sums = response_sums(per_token, segment[:, 1:], sample[:, 1:], samples=per_row, responses=k, scored=targets >= 0)
    return sums[sample_slots(sample)]
