"""A Hugging Face data collator for masks ``position_ids`` cannot express: shared-prompt preference
pairs (DPO, reward models with k responses) and prefix-LM documents, packed into rows with the
FlashMask built next to ``input_ids``.

    collator = FlashMaskCollator(seq_len=4096)                # or seq_len=None: one row, as long as the batch
    trainer = Trainer(model=model, args=TrainingArguments(..., remove_unused_columns=False),
                      train_dataset=documents, data_collator=collator)             # SFT / prefix-LM rows
    trainer = FlashMaskDPOTrainer(model=peft_model, args=..., train_dataset=pairs)  # preference rows: DPO
                                                              # (fm_parallel.integrations.dpo)
    batch = FlashMaskCollator(preference=True)(pairs)         # preference rows for your own scoring

Examples (one kind per batch; token ids in ``[0, vocab_size)``):

* ``{"input_ids": [...]}``: a causal document; ``{"input_ids": [...], "prefix_len": p}``: its first
  ``p`` tokens attend bidirectionally (prefix-LM) and are not scored; an optional ``"labels"`` (-100
  or the input id at each position, unshifted) marks which tokens are scored (completion-only SFT).
* ``{"prompt_ids": [...], "response_ids": [[...], [...], ...]}``: one prompt, k responses that each see
  the prompt and themselves, never each other (``{"prompt_ids", "chosen_ids", "rejected_ids"}`` is the
  DPO form, k = 2; k is the same for every example of a batch; a reward model's K-wise form adds
  ``"scores": [...]``, one number per response, which the batch carries as ``fm_scores [samples, k]``).
  Responses get the ``position_ids``
  they would have after the prompt alone. Only with ``preference=True`` (``FlashMaskDPOTrainer`` sets it):
  a plain ``Trainer`` cannot train these rows, whatever its attention.

The batch holds ``input_ids``, ``labels`` (-100 where nothing is scored; a model shifts them as usual),
``position_ids`` ``[B, N]`` and ``flashmask`` (a :class:`FlashMask` ``[B, 1, N]``), which the
``fm_parallel`` attention backend reads; preference batches also hold ``fm_segment`` (0 prompt,
r + 1 response r, -1 padding) and ``fm_sample`` (sample index in the row, -1 padding) for
:func:`response_logps`. ``fm_segment`` also marks the batch as preference rows: a model forward that
receives it (a plain ``Trainer``, ``model(**batch)``) raises, because next-token loss on both
responses is not a preference objective; pass the model ``input_ids``, ``position_ids`` and
``flashmask`` only, or train with ``FlashMaskDPOTrainer``. A response's first token is not scored: the prompt's last position is shared
by all responses, so it cannot predict each response's first token (move the prompt's last token to the
front of each response when that token matters: :mod:`fm_parallel.integrations.text_examples` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fm_parallel import logprobs, masks
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["FlashMaskCollator", "response_logps", "response_ends"]


def _ids(value, where: str, vocab_size: int | None = None) -> list[int]:
    """``value`` as a list of token ids in ``[0, vocab_size)``; ``where`` names it in the error
    (``examples[3]['prompt_ids']``). A negative id would become a label (or -100's neighbour) and an
    embedding index; neither the model nor the loss would say so."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{where}: expected token ids {bound}, got {t} at index {i}")
    return list(value)


class FlashMaskCollator:
    """Pack examples greedily into rows (in order, never cutting one) and build each row's FlashMask.

    Args:
        seq_len: tokens per row (padded); None: one row holding the whole batch.
        pad_token_id: id written into padding.
        vocab_size: when given, token ids must be below it (``model.config.vocab_size``): an id past
            the embedding is refused here, by field, instead of failing inside the model (a device-side
            assert on a GPU). Negative ids are always refused.
        preference: True to accept preference rows (``prompt_ids`` + responses): their batches are for
            a preference loss, which ``FlashMaskDPOTrainer`` (it sets this) or your own scoring with
            :func:`response_logps` computes. False (the default) refuses them naming both, because a
            plain ``Trainer`` would train next-token loss on both responses, and with an attention
            other than ``fm_parallel`` (``sdpa``) nothing else could say so: the model ignores the mask.
    """

    def __init__(self, seq_len: int | None = None, pad_token_id: int = 0, vocab_size: int | None = None,
                 preference: bool = False):
        if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2):
            raise ValueError(f"seq_len: expected None or an int >= 2, got {seq_len!r}")
        if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1):
            raise ValueError(f"vocab_size: expected None or an int >= 1, got {vocab_size!r}")
        if (not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool) or pad_token_id < 0
                or (vocab_size is not None and pad_token_id >= vocab_size)):
            bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"pad_token_id: expected an int {bound}, got {pad_token_id!r}")
        if not isinstance(preference, bool):
            raise ValueError(f"preference: expected True or False, got {preference!r}")
        self.seq_len, self.pad_token_id, self.vocab_size = seq_len, pad_token_id, vocab_size
        self.preference = preference

    # ------------------------------------------------------------- examples
    def _parse(self, example, index: int) -> tuple[str, list[list[int]], int | list[bool]]:
        """(kind, segments, prompt length | the document's scored tokens) of one example."""
        if not isinstance(example, dict):
            raise ValueError(f"examples[{index}]: expected a dict, got {type(example).__name__}")
        where = f"examples[{index}]"
        ids_of = lambda key, value: _ids(value, f"{where}[{key!r}]", self.vocab_size)  # noqa: E731
        if "prompt_ids" in example:
            if not self.preference:
                raise ValueError(
                    f"{where}: expected documents (input_ids) from FlashMaskCollator(preference=False), got a preference "
                    "row (prompt_ids + responses): a plain Trainer would train next-token loss on both responses, not a "
                    "preference objective. Train with fm_parallel.integrations.dpo.FlashMaskDPOTrainer (it builds its "
                    "collator), or pass FlashMaskCollator(preference=True) and score the batch with response_logps")
            # Fields of the other forms would be dropped without a word: refuse them.
            clash = [k for k in ("input_ids", "labels", "prefix_len") if k in example]
            if "response_ids" in example:
                clash += [k for k in ("chosen_ids", "rejected_ids") if k in example]
            elif "scores" in example:
                clash += ["scores"]  # the pair form ranks chosen over rejected already
            if clash:
                raise ValueError(f"{where}: expected the fields of one form (prompt_ids + response_ids, or prompt_ids + "
                                 f"chosen_ids + rejected_ids; the collator makes the labels), got also {clash}")
            prompt = ids_of("prompt_ids", example["prompt_ids"])
            if "response_ids" in example:
                raw = example["response_ids"]
                if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
                    raise ValueError(f"{where}['response_ids']: expected a non-empty list of responses, got {raw!r}")
                responses = [_ids(r, f"{where}['response_ids'][{i}]", self.vocab_size) for i, r in enumerate(raw)]
            else:
                responses = [ids_of(k, example.get(k)) for k in ("chosen_ids", "rejected_ids")]
            if any(len(r) == 0 for r in responses):
                raise ValueError(f"{where}: expected non-empty responses, got lengths {[len(r) for r in responses]}")
            if "scores" in example:
                _scores(example["scores"], f"{where}['scores']", len(responses))
            return "preference", [prompt] + responses, len(prompt)
        if "input_ids" in example:
            ids = ids_of("input_ids", example["input_ids"])
            if not ids:
                raise ValueError(f"{where}['input_ids']: expected at least one token, got none")
            prefix = example.get("prefix_len", 0)
            if not isinstance(prefix, int) or isinstance(prefix, bool) or not 0 <= prefix <= len(ids):
                raise ValueError(f"{where}['prefix_len']: expected an int in [0, {len(ids)}], got {prefix!r}")
            scored = [i >= max(prefix, 1) for i in range(len(ids))]  # prefix and the first token are no targets
            if example.get("labels") is not None:
                # The dataset's own labels (completion-only SFT): honoured, never replaced silently. HF
                # convention: unshifted, -100 or the token itself.
                labels = example["labels"]
                labels = labels.tolist() if isinstance(labels, torch.Tensor) else labels
                if not isinstance(labels, Sequence) or isinstance(labels, str) or len(labels) != len(ids):
                    raise ValueError(f"{where}['labels']: expected {len(ids)} labels (one per input id), got "
                                     f"{len(labels) if isinstance(labels, Sequence) else type(labels).__name__}")
                for i, (t, y) in enumerate(zip(ids, labels)):
                    if y != -100 and y != t:
                        raise ValueError(f"{where}['labels']: expected -100 or the input id at each position (unshifted, "
                                         f"as Hugging Face models take them), got {y!r} at index {i} (input id {t})")
                scored = [s and y != -100 for s, y in zip(scored, labels)]
            return "document", [ids], scored
        raise ValueError(f"{where}: expected 'input_ids' or 'prompt_ids' (+ responses), got keys {sorted(example)}")

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
        if kind == "preference":
            counts = [len(segs) - 1 for _, segs, _ in parsed]
            odd = next((i for i, c in enumerate(counts) if c != counts[0]), None)
            if odd is not None:  # a batch has one layout: [samples, responses] log-probs, one DPO pairing
                raise ValueError(f"examples[{odd}]: expected {counts[0]} responses like examples[0] (one response count "
                                 f"per batch), got {counts[odd]}")
            scored = ["scores" in e for e in examples]
            if any(scored) and not all(scored):  # one ranking form per batch: a row's scores table is [samples, K]
                odd = scored.index(not scored[0])
                raise ValueError(f"examples[{odd}]: expected 'scores' {'like' if scored[0] else 'unlike'} examples[0] (one "
                                 f"ranking form per batch), got {'none' if scored[0] else 'scores'}")
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
                    labels += [t if scored else -100 for t, scored in zip(doc, p)]
                    pos += list(range(len(doc)))
                    seg += [0] * len(doc)
                    lengths.append(len(doc))
                    extra.append(examples[i].get("prefix_len", 0))
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
        if kind == "preference" and "scores" in examples[0]:
            # [samples, K] in the order of response_logps' table: a row's samples, then the next row's
            # (every row padded to the batch's most samples with NaN: no pair is made from those)
            most = max(len(m) for m in rows)
            table = torch.full((len(rows) * most, counts[0]), float("nan"), dtype=torch.float64)
            for r, members in enumerate(rows):
                for s, i in enumerate(members):
                    table[r * most + s] = torch.tensor([float(x) for x in examples[i]["scores"]], dtype=torch.float64)
            batch["fm_scores"] = table
        if kind == "document":
            del batch["fm_segment"], batch["fm_sample"]
        return batch


def _scores(value, where: str, responses: int) -> list[float]:
    """A preference example's ``scores``: one finite number per response, not all equal (a ranking)."""
    import math

    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if (not isinstance(value, Sequence) or isinstance(value, str)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)):
        raise ValueError(f"{where}: expected a list of finite numbers, one per response, got {value!r}")
    if len(value) != responses:
        raise ValueError(f"{where}: expected {responses} scores (one per response), got {len(value)}")
    if responses < 2 or len(set(value)) == 1:
        raise ValueError(f"{where}: expected at least two responses with different scores (a ranking to learn), got {list(value)}")
    return list(value)


def response_ends(segment: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` bool: the last token of each response (``segment >= 1``) of a preference row, where a
    reward model reads its scalar reward (the last token of prompt + response, as a sequence
    classifier does on the response alone). ``segment`` / ``sample``: the batch's ``fm_segment`` /
    ``fm_sample``, unshifted."""
    nxt_seg = torch.cat([segment[:, 1:], torch.full_like(segment[:, :1], -1)], 1)
    nxt_smp = torch.cat([sample[:, 1:], torch.full_like(sample[:, :1], -1)], 1)
    return (segment >= 1) & ((nxt_seg != segment) | (nxt_smp != sample))


def response_logps(logits: torch.Tensor, batch: dict, responses: int | None = None) -> torch.Tensor:
    """Summed log-probabilities of each preference sample's responses: ``[samples, k]``, rows in order
    (a row's samples, then the next row's). ``logits [B, N, V]`` from the model on ``batch`` (a
    :class:`FlashMaskCollator` preference batch). The layout is the batch's (``fm_segment``,
    ``fm_sample``); ``responses``, when given, must agree with it (2 for DPO: column 0 chosen, 1
    rejected, ``margin = (pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1])``).
    See :func:`fm_parallel.logprobs.response_logps`."""
    if not isinstance(batch, dict) or any(k not in batch for k in ("labels", "fm_segment", "fm_sample")):
        got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"batch: expected a FlashMaskCollator preference batch (labels, fm_segment, fm_sample), got {got}")
    return logprobs.response_logps(logits, batch["labels"], batch["fm_segment"], batch["fm_sample"], responses)
