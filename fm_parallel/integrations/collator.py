"""A Hugging Face data collator for masks ``position_ids`` cannot express: shared-prompt preference
pairs (DPO, reward models with k responses) and prefix-LM documents, packed into rows with the
FlashMask built next to ``input_ids``.

    collator = FlashMaskCollator(seq_len=4096)                # or seq_len=None: one row, as long as the batch
    trainer = Trainer(model=model, args=TrainingArguments(..., remove_unused_columns=False),
                      train_dataset=examples, data_collator=collator)

Examples (one kind per batch):

* ``{"input_ids": [...]}``: a causal document; ``{"input_ids": [...], "prefix_len": p}``: its first
  ``p`` tokens attend bidirectionally (prefix-LM) and are not scored.
* ``{"prompt_ids": [...], "response_ids": [[...], [...], ...]}``: one prompt, k responses that each see
  the prompt and themselves, never each other (``{"prompt_ids", "chosen_ids", "rejected_ids"}`` is the
  DPO form, k = 2). Responses get the ``position_ids`` they would have after the prompt alone.

The batch holds ``input_ids``, ``labels`` (-100 where nothing is scored; a model shifts them as usual),
``position_ids`` ``[B, N]`` and ``flashmask`` (a :class:`FlashMask` ``[B, 1, N]``), which the
``fm_parallel`` attention backend reads; preference batches also hold ``fm_segment`` (0 prompt,
r + 1 response r, -1 padding) and ``fm_sample`` (sample index in the row, -1 padding) for
:func:`response_logps`. A response's first token is not scored: the prompt's last position is shared
by all responses, so it cannot predict each response's first token (score a separator first if that
token matters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fm_parallel import masks
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["FlashMaskCollator", "response_logps"]


def _ids(value, where: str) -> list[int]:
    """``value`` as a list of token ids; ``where`` names it in the error (``examples[3]['prompt_ids']``)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    return list(value)


class FlashMaskCollator:
    """Pack examples greedily into rows (in order, never cutting one) and build each row's FlashMask.

    Args:
        seq_len: tokens per row (padded); None: one row holding the whole batch.
        pad_token_id: id written into padding.
    """

    def __init__(self, seq_len: int | None = None, pad_token_id: int = 0):
        if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2):
            raise ValueError(f"seq_len: expected None or an int >= 2, got {seq_len!r}")
        if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool) or pad_token_id < 0:
            raise ValueError(f"pad_token_id: expected an int >= 0, got {pad_token_id!r}")
        self.seq_len, self.pad_token_id = seq_len, pad_token_id

    # ------------------------------------------------------------- examples
    @staticmethod
    def _parse(example, index: int) -> tuple[str, list[list[int]], int]:
        """(kind, segments, prefix or prompt length) of one example."""
        if not isinstance(example, dict):
            raise ValueError(f"examples[{index}]: expected a dict, got {type(example).__name__}")
        if "prompt_ids" in example:
            prompt = _ids(example["prompt_ids"], f"examples[{index}]['prompt_ids']")
            if "response_ids" in example:
                raw = example["response_ids"]
                if not isinstance(raw, Sequence) or not raw:
                    raise ValueError(f"examples[{index}]['response_ids']: expected a non-empty list of responses, got {raw!r}")
                responses = [_ids(r, f"examples[{index}]['response_ids'][{i}]") for i, r in enumerate(raw)]
            else:
                responses = [_ids(example.get(k), f"examples[{index}][{k!r}]") for k in ("chosen_ids", "rejected_ids")]
            if any(len(r) == 0 for r in responses):
                raise ValueError(f"examples[{index}]: expected non-empty responses, got lengths {[len(r) for r in responses]}")
            return "preference", [prompt] + responses, len(prompt)
        if "input_ids" in example:
            ids = _ids(example["input_ids"], f"examples[{index}]['input_ids']")
            if not ids:
                raise ValueError(f"examples[{index}]['input_ids']: expected at least one token, got none")
            prefix = example.get("prefix_len", 0)
            if not isinstance(prefix, int) or isinstance(prefix, bool) or not 0 <= prefix <= len(ids):
                raise ValueError(f"examples[{index}]['prefix_len']: expected an int in [0, {len(ids)}], got {prefix!r}")
            return "document", [ids], prefix
        raise ValueError(f"examples[{index}]: expected 'input_ids' or 'prompt_ids' (+ responses), got keys {sorted(example)}")

    def _rows(self, parsed) -> list[list[int]]:
        """Indices of the examples in each row."""
        sizes = [sum(len(s) for s in segs) for _, segs, _ in parsed]
        if self.seq_len is None:
            return [list(range(len(parsed)))]
        rows, used = [[]], 0
        for i, size in enumerate(sizes):
            if size > self.seq_len:
                raise ValueError(f"examples[{i}]: {size} tokens do not fit seq_len = {self.seq_len}; raise seq_len or "
                                 "truncate the example (it is never cut silently)")
            if used + size > self.seq_len:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += size
        return rows

    # ------------------------------------------------------------- batch
    def __call__(self, examples: list[dict]) -> dict:
        if not isinstance(examples, Sequence) or not examples:
            raise ValueError(f"examples: expected a non-empty list of dicts, got {examples!r}")
        parsed = [self._parse(e, i) for i, e in enumerate(examples)]
        kinds = {k for k, _, _ in parsed}
        if len(kinds) > 1:
            raise ValueError(f"examples: expected one kind per batch, got {sorted(kinds)} (documents and preference samples)")
        kind = kinds.pop()
        rows = self._rows(parsed)
        n = self.seq_len or sum(len(s) for _, segs, _ in parsed for s in segs)
        out = {name: [] for name in ("input_ids", "labels", "position_ids", "fm_segment", "fm_sample")}
        row_masks: list[FlashMask] = []
        for members in rows:
            ids, labels, pos, seg, smp = [], [], [], [], []
            lengths, extra = [], []
            for s, i in enumerate(members):
                _, segs, p = parsed[i]
                if kind == "document":
                    doc = segs[0]
                    ids += doc
                    labels += [-100] * max(p, 1) + doc[max(p, 1):]  # prefix and the first token are no targets
                    pos += list(range(len(doc)))
                    seg += [0] * len(doc)
                    lengths.append(len(doc))
                    extra.append(p)
                else:
                    prompt, responses = segs[0], segs[1:]
                    ids += prompt
                    labels += [-100] * len(prompt)
                    pos += list(range(len(prompt)))
                    seg += [0] * len(prompt)
                    for r, resp in enumerate(responses):
                        ids += resp
                        labels += [-100] + resp[1:]
                        pos += list(range(len(prompt), len(prompt) + len(resp)))
                        seg += [r + 1] * len(resp)
                    lengths.append(len(prompt))
                    extra.append([len(r) for r in responses])
                smp += [s] * (len(ids) - len(smp))
            pad = n - len(ids)
            out["input_ids"].append(ids + [self.pad_token_id] * pad)
            out["labels"].append(labels + [-100] * pad)
            out["position_ids"].append(pos + [0] * pad)
            out["fm_segment"].append(seg + [-1] * pad)
            out["fm_sample"].append(smp + [-1] * pad)
            if kind == "document":
                row_masks.append(masks.prefix_lm(prefix_len=[extra], lengths=[lengths], n=n))
            else:
                row_masks.append(masks.preference(lengths, extra, n=n))
        batch = {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
        batch["flashmask"] = row_masks[0] if len(row_masks) == 1 else masks.stack(row_masks)
        if kind == "document":
            del batch["fm_segment"], batch["fm_sample"]
        return batch


def response_logps(logits: torch.Tensor, batch: dict, responses: int = 2) -> torch.Tensor:
    """Summed log-probabilities of each preference sample's responses: ``[samples, responses]``, rows
    in order (a row's samples, then the next row's). ``logits [B, N, V]`` from the model on ``batch``
    (a :class:`FlashMaskCollator` preference batch). With ``responses=2`` column 0 is chosen and 1
    rejected: ``margin = (pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])`` is the DPO margin."""
    labels, seg, smp = batch["labels"], batch["fm_segment"], batch["fm_sample"]
    targets = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    scored = targets >= 0
    per_row = int(smp.max()) + 1 if smp.numel() else 0
    slot = (smp[:, 1:] + per_row * torch.arange(labels.shape[0], device=smp.device).view(-1, 1)) * responses + (seg[:, 1:] - 1)
    total = per_row * labels.shape[0] * responses
    slot = torch.where(scored, slot, torch.full_like(slot, total))
    sums = torch.zeros(total + 1, dtype=logp.dtype, device=logp.device).index_add(0, slot.flatten(), torch.where(scored, logp, 0).flatten())
    table = sums[:total].view(labels.shape[0], per_row, responses)
    kept = [table[b, : int(smp[b].max()) + 1] for b in range(labels.shape[0]) if bool((smp[b] >= 0).any())]
    return torch.cat(kept) if kept else table.new_zeros(0, responses)
