"""Data: real text, a tokenizer, and packing into fixed-length rows with the FlashMask built alongside.

The default corpus exists wherever Python does: the standard library's own ``.py`` sources, in a
fixed order. Each row is packed greedily from whole documents (a document longer than the row is
cut into row-sized pieces, every piece trained on); the FlashMask of the row is built here, next to
``input_ids``, and labels are shifted inside each document so no token learns to predict the next
document.

Every record is trained on exactly once per pass over the data: the last, partial row of a pass is
padded and yielded, never dropped (a data set smaller than one row is one padded row per pass).
Records come from :mod:`.sources` (a JSONL, Parquet or Arrow file or folder, or a cached ``datasets``
name) in TRL's formats (:mod:`fm_parallel.formats`: text, messages, prompt-completion; preference pairs), and are
checked in one pass before training (:meth:`fm_parallel.trainer.objectives.Objective.validate`): a bad
record raises naming ``file:line``.

DPO rows pack several ``[prompt, chosen, rejected]`` samples with the ``dpo`` mask (``layout="shared"``:
the prompt computed once). The prompt's last token opens each response, so that every response token
is predicted from inside its response (the prompt's last position cannot predict both responses'
first tokens): each response's tokens and positions are TRL's ``prompt + response``, every response
token scored as TRL scores it. ``layout="separate"`` is the layout TRL trains: ``[prompt, chosen]``
and ``[prompt, rejected]`` as two causal documents, the prompt computed twice; the same tokens are
scored, so both layouts give the same loss (what the end-to-end comparison relies on). Reward-model
rows ``[prompt, r1, ..., rK]`` need nothing between: a reward is read at a response's last token.
A sample is never cut: one that does not fit a row raises naming its line and sizes.
"""

from __future__ import annotations

import glob
import itertools
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fm_parallel import masks
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.formats import DataError, HFTokens, open_responses, preference_sample, sft_document
from fm_parallel.trainer.sources import records

__all__ = ["ByteTokenizer", "load_tokenizer", "Row", "sft_rows", "dpo_rows", "stdlib_texts", "DataError",
           "DPO_LAYOUTS", "check_dpo_sample", "rm_sample", "rm_rows"]

DPO_LAYOUTS = ("shared", "separate")


class ByteTokenizer:
    """UTF-8 bytes, plus a document separator (256) and padding (257); no EOS and no chat template."""

    vocab_size = 258
    bos_id = 256
    pad_id = 257
    eos_text = ""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    text_ids = encode  # TRL's tokenizer(text): no special tokens to add here

    def chat_template(self, where: str = "") -> None:
        return None

    def chat_ids(self, messages, where: str, add_generation_prompt: bool = False, assistant_mask: bool = False):
        raise DataError(f"{where}: a conversation (a message list) needs a tokenizer with a chat template; the byte "
                        "tokenizer has none: set model.path (or data.tokenizer) to a Hugging Face folder whose tokenizer has one")


class _HFTokenizer(HFTokens):
    """The tokenizer of a local Hugging Face folder, used as TRL's trainers use it (:mod:`fm_parallel.formats`)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        super().__init__(AutoTokenizer.from_pretrained(path, local_files_only=True), name=path)


def load_tokenizer(path: str = ""):
    return _HFTokenizer(path) if path else ByteTokenizer()


@dataclass
class Row:
    """One packed row. ``segment``: per token, -1 padding; for DPO 0 prompt, 1 chosen, 2 rejected; for a
    reward model 0 prompt, ``r + 1`` response ``r``.
    ``sample``: per token, the index of its document (SFT) or sample (DPO) in the row, -1 padding.
    ``positions``: the position ids (rotary embeddings) of each token: the row's index for SFT; for
    DPO each response continues right after its prompt (the rejected response is not placed after
    the chosen one), as the collator does and as the separate layout has it by construction."""

    input_ids: torch.Tensor  # [N] int64
    labels: torch.Tensor  # [N] int64, -100 where nothing is predicted (RM: 1 at each response's last token)
    mask: FlashMask  # [1, 1, N]
    segment: torch.Tensor  # [N] int64
    sample: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    scores: torch.Tensor | None = None  # RM: [samples, K] float64, each response's score (NaN: no such response)


def _window(items, window: tuple[int, int | None]):
    """The items ``window = (start, stop)`` of an iterator (stop None: to the end)."""
    start, stop = window
    return itertools.islice(items, start, stop) if (start or stop is not None) else items


def _passes(passes: int | None):
    """The passes over the data a row stream makes: ``passes`` of them, or (None) for ever."""
    return itertools.count() if passes is None else range(passes)


def stdlib_texts() -> Iterator[str]:
    """The standard library's Python sources, sorted by path (the same on every machine of one Python)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "site-packages" not in p)
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            yield text


def _dpo_size(p: int, c: int, r: int, layout: str) -> int:
    """Tokens of one sample in a row: the prompt's last token opens each response (``open_responses``);
    ``separate`` repeats the prompt."""
    if not p:
        return c + r
    return (2 if layout == "separate" else 1) * (p - 1) + c + r + 2


def check_dpo_sample(where: str, tokenizer, record: dict, seq_len: int,
                     layout: str = "shared") -> tuple[list[int], list[int], list[int]]:
    """The (prompt, chosen, rejected) tokens of the DPO ``record`` found at ``where`` (``file:line``):
    TRL's tokens (:func:`~fm_parallel.formats.preference_sample`); a :class:`DataError` naming
    ``where`` and the sizes if the sample does not fit one row of ``seq_len`` tokens in ``layout`` (a
    sample is never cut)."""
    p, (c, r), _ = preference_sample(tokenizer, record, where)
    size = _dpo_size(len(p), len(c), len(r), layout)
    if size > seq_len:
        prompt = f"prompt {len(p)}" if layout == "shared" else f"2 x prompt {len(p)} (data.dpo_layout = 'separate')"
        raise DataError(f"{where}: a DPO sample of {size} tokens ({prompt} + chosen {len(c)} + rejected {len(r)}, the "
                        f"prompt's last token opening each response) does not fit data.seq_len = {seq_len}; raise "
                        "seq_len or shorten the sample")
    return p, c, r


def _labels(ids: torch.Tensor, sample: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """labels[i] = ids[i + 1] where position i + 1 is in the same sample and scored, else -100."""
    nxt = torch.full_like(ids, -100)
    same = (sample[1:] == sample[:-1]) & (sample[1:] >= 0) & scored[1:]
    nxt[:-1] = torch.where(same, ids[1:], torch.full_like(ids[1:], -100))
    return nxt


def sft_rows(seq_len: int, tokenizer, path: str = "", max_doc_tokens: int = 0, split: str = "train",
             assistant_only: bool = True, completion_only: bool = True, passes: int | None = None,
             window: tuple[int, int | None] = (0, None)) -> Iterator[Row]:
    """Packed SFT rows of ``seq_len`` tokens, forever (the corpus repeats). Each pass over the corpus
    ends with its partial row, padded: every token of every record is in exactly one row per pass.
    Records are any SFT format (:func:`~fm_parallel.formats.sft_document`; ``assistant_only``,
    ``completion_only``: which of their tokens are scored) from ``path`` (its ``split``; empty: the
    stdlib corpus as text). A document longer than ``max_doc_tokens`` (0: ``seq_len``) is split into
    consecutive pieces of at most that many tokens, each its own document (no attention across pieces).
    ``passes``: that many passes over the data (None: for ever); ``window``: ``(start, stop)``, the
    records of each pass taken (the held-out examples are a window, training the rest)."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"data.seq_len: expected an int >= 2, got {seq_len!r}")
    if not isinstance(max_doc_tokens, int) or max_doc_tokens < 0:
        raise DataError(f"data.max_doc_tokens: expected an int >= 0 (0: seq_len), got {max_doc_tokens!r}")
    piece_len = min(max_doc_tokens or seq_len, seq_len)

    def documents():
        if not path:
            for text in _window(stdlib_texts(), window):
                ids = [tokenizer.bos_id] + tokenizer.encode(text)
                yield ids, [True] * len(ids)
            return
        for where, record in _window(records(path, split), window):
            yield sft_document(tokenizer, record, where, assistant_only, completion_only)

    for _ in _passes(passes):
        lengths: list[int] = []
        tokens: list[int] = []
        scored: list[bool] = []
        any_doc = False
        for doc, doc_scored in documents():
            any_doc = True
            for start in range(0, len(doc), piece_len):
                piece = doc[start : start + piece_len]
                if len(tokens) + len(piece) > seq_len:
                    yield _sft_row(tokens, scored, lengths, seq_len, tokenizer)
                    tokens, scored, lengths = [], [], []
                tokens += piece
                scored += doc_scored[start : start + piece_len]
                lengths.append(len(piece))
        if not any_doc:
            raise DataError(f"data.path: expected at least one document, got none in {path or 'the stdlib corpus'}")
        if tokens:
            yield _sft_row(tokens, scored, lengths, seq_len, tokenizer)


def _sft_row(tokens, scored, lengths, seq_len, tokenizer) -> Row:
    pad = seq_len - len(tokens)
    ids = torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sample = torch.cat([sample, torch.full((pad,), -1, dtype=torch.int64)])
    labels = _labels(ids, sample, torch.tensor(scored + [False] * pad))
    segment = torch.where(sample >= 0, 0, -1)
    return Row(ids, labels, masks.document(lengths, n=seq_len), segment, sample, torch.arange(seq_len))


def _dpo_samples(tokenizer, path: str, seq_len: int, layout: str = "shared", split: str = "train",
                 window: tuple[int, int | None] = (0, None)) -> Iterator[tuple[list[int], list[int], list[int]]]:
    return _window(_all_dpo_samples(tokenizer, path, seq_len, layout, split), window)


def _all_dpo_samples(tokenizer, path: str, seq_len: int, layout: str = "shared",
                     split: str = "train") -> Iterator[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists. Without a path: from the stdlib, a file's opening as
    the prompt, its true continuation as chosen and the same tokens shuffled as rejected, each part sized to
    fit a quarter of a row (a fifth for the separate layout; synthetic samples, built to fit; a file's
    samples are never cut). Both layouts get the same samples for the same ``seq_len``."""
    if path:
        for where, r in records(path, split):
            yield check_dpo_sample(where, tokenizer, r, seq_len, layout)
        return
    prompt = min(64, seq_len // 5)
    response = max(min(96, seq_len // 5 - 1), 1)
    if prompt < 1 or _dpo_size(prompt, response, response, "separate") > seq_len:
        raise DataError(f"data.seq_len: expected at least 5 tokens for the built-in DPO samples, got {seq_len}")
    # Rejected: the chosen tokens in a shuffled order (seeded by the sample's index: the same on every rank
    # and machine). Another file's continuation, as before, is the same kind of text as the true one: a
    # small model learning from scratch cannot tell them apart, and the demo's loss stayed above ln 2
    # (0.6931 -> 0.7584). Shuffled, only the order differs (the same tokens, the same counts), so what the
    # policy learns to prefer is well-formed text.
    index = 0
    for text in stdlib_texts():
        ids = tokenizer.encode(text)
        if len(ids) < 96:
            continue
        chosen = ids[prompt : prompt + response]
        rejected = list(chosen)
        random.Random(index).shuffle(rejected)
        index += 1
        yield ids[:prompt], chosen, rejected


def dpo_rows(seq_len: int, tokenizer, path: str = "", layout: str = "shared", split: str = "train",
             passes: int | None = None, window: tuple[int, int | None] = (0, None)) -> Iterator[Row]:
    """Packed DPO rows: several samples per row. ``layout="shared"``: [prompt, SEP chosen, SEP rejected]
    under the ``dpo`` mask; ``"separate"``: [prompt, SEP chosen] and [prompt, SEP rejected] as two causal
    documents (TRL's layout). Samples are never cut; each pass ends with its partial row, padded."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"data.seq_len: expected an int >= 2, got {seq_len!r}")
    if layout not in DPO_LAYOUTS:
        raise DataError(f"data.dpo_layout: expected one of {DPO_LAYOUTS}, got {layout!r}")
    for _ in _passes(passes):
        parts: list[tuple[list[int], list[int], list[int]]] = []
        used = 0
        produced = False
        for p, c, r in _dpo_samples(tokenizer, path, seq_len, layout, split, window):
            produced = True
            size = _dpo_size(len(p), len(c), len(r), layout)
            if used + size > seq_len:
                yield _dpo_row(parts, seq_len, tokenizer, layout)
                parts, used = [], 0
            p, (c, r) = open_responses(p, [c, r])
            parts.append((p, c, r))
            used += size
        if not produced:
            raise DataError(f"data.path: expected DPO samples, got none in {path or 'the stdlib corpus'}")
        if parts:
            yield _dpo_row(parts, seq_len, tokenizer, layout)


def _dpo_row(parts, seq_len, tokenizer, layout: str = "shared") -> Row:
    tokens, segment, sample, positions = [], [], [], []
    pieces = ((0, 1), (0, 2)) if layout == "separate" else ((0, 1, 2),)  # segments: 0 prompt, 1 chosen, 2 rejected
    for i, sample_parts in enumerate(parts):
        prompt = len(sample_parts[0])
        for sequence in pieces:
            for seg in sequence:
                piece = sample_parts[seg]
                tokens += piece
                segment += [seg] * len(piece)
                sample += [i] * len(piece)
                # Every response starts right after its prompt: the same positions in both layouts.
                positions += list(range(len(piece))) if seg == 0 else list(range(prompt, prompt + len(piece)))
    pad = seq_len - len(tokens)
    ids = torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64)
    segment = torch.tensor(segment + [-1] * pad, dtype=torch.int64)
    sample = torch.tensor(sample + [-1] * pad, dtype=torch.int64)
    # Score response tokens only, each predicted from inside its own response.
    block = sample * 3 + segment
    labels = _labels(ids, torch.where(sample >= 0, block, -1), segment > 0)
    if layout == "separate":
        mask = masks.document([n for p, c, r in parts for n in (len(p) + len(c), len(p) + len(r))], n=seq_len)
    else:
        mask = masks.dpo([len(p) for p, _, _ in parts], [len(c) for _, c, _ in parts], [len(r) for _, _, r in parts], n=seq_len)
    row_positions = torch.tensor(positions + list(range(len(positions), seq_len)), dtype=torch.int64)
    return Row(ids, labels, mask, segment, sample, row_positions)


def rm_sample(where: str, tokenizer, record: dict, seq_len: int) -> tuple[list[int], list[list[int]], list[float]]:
    """The (prompt, responses, scores) tokens of the reward-model ``record`` found at ``where``
    (``file:line``): a preference pair (chosen scores 1, rejected 0; strings or message lists, the
    prompt explicit or implicit) or ``{"prompt", "responses": [...], "scores": [...]}``
    (:func:`~fm_parallel.formats.preference_sample`). A :class:`DataError` naming ``where`` for
    a record of no such form, fewer than two responses, an empty response, a score count other than the
    responses', scores that rank nothing (all equal), or a sample that does not fit one row of
    ``seq_len`` tokens (a sample is never cut)."""
    prompt, ids, scores = preference_sample(tokenizer, record, where, ranked=True)
    size = len(prompt) + sum(len(r) for r in ids)
    if size > seq_len:
        raise DataError(f"{where}: a reward-model sample of {size} tokens (prompt {len(prompt)} + {len(ids)} responses of "
                        f"{[len(r) for r in ids]}) does not fit data.seq_len = {seq_len}; raise seq_len or shorten the "
                        "sample")
    return prompt, ids, scores


def rm_rows(seq_len: int, tokenizer, path: str = "", split: str = "train", passes: int | None = None,
            window: tuple[int, int | None] = (0, None)) -> Iterator[Row]:
    """Packed reward-model rows: several samples per row, each ``[prompt, r1, ..., rK]`` under the
    ``preference`` mask (a response sees the prompt and itself), each response's positions continuing
    right after the prompt. ``labels`` are 1 at each response's last token (where its reward is read),
    ``scores [samples, K]`` rank the responses. Without a path: the built-in pairs (:func:`_rm_builtin`:
    the true continuation over the same text with its letters' case swapped). Samples are never cut;
    each pass ends with its partial row, padded."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"data.seq_len: expected an int >= 2, got {seq_len!r}")

    def samples():
        if path:
            for where, r in _window(records(path, split), window):
                yield rm_sample(where, tokenizer, r, seq_len)
        else:
            yield from _window(_rm_builtin(tokenizer, seq_len), window)

    for _ in _passes(passes):
        parts, used, produced = [], 0, False
        for p, responses, scores in samples():
            produced = True
            size = len(p) + sum(len(r) for r in responses)
            if used + size > seq_len:
                yield _rm_row(parts, seq_len, tokenizer)
                parts, used = [], 0
            parts.append((p, responses, scores))
            used += size
        if not produced:
            raise DataError(f"data.path: expected reward-model samples, got none in {path or 'the stdlib corpus'}")
        if parts:
            yield _rm_row(parts, seq_len, tokenizer)


def _rm_builtin(tokenizer, seq_len: int) -> Iterator[tuple[list[int], list[list[int]], list[float]]]:
    """The built-in reward-model pairs: a stdlib file's opening as the prompt, its true continuation ranked
    over the same text with its letters' case swapped. Unlike a shuffled continuation (the same tokens:
    the same mean of their embeddings), the swapped one changes which tokens occur, something even a
    LoRA on a randomly initialised model can read at the last token; the demo's accuracy rises."""
    prompt = min(64, seq_len // 5)
    response = max(min(96, seq_len // 5 - 1), 1)
    if prompt < 1 or prompt + 2 * (response + 1) > seq_len:
        raise DataError(f"data.seq_len: expected at least 5 tokens for the built-in reward-model samples, got {seq_len}")
    for text in stdlib_texts():
        ids = tokenizer.encode(text)
        if len(ids) < prompt + response:
            continue
        chosen = ids[prompt : prompt + response]
        swapped = tokenizer.encode(text.swapcase())[prompt : prompt + response]
        if swapped == chosen or len(swapped) != len(chosen):
            continue
        yield ids[:prompt], [chosen, swapped], [1.0, 0.0]


def _rm_row(parts, seq_len, tokenizer) -> Row:
    tokens, segment, sample, positions, last = [], [], [], [], []
    for i, (prompt, responses, _) in enumerate(parts):
        tokens += prompt
        segment += [0] * len(prompt)
        sample += [i] * len(prompt)
        positions += list(range(len(prompt)))
        last += [False] * len(prompt)
        for r, response in enumerate(responses):
            tokens += response
            segment += [r + 1] * len(response)
            sample += [i] * len(response)
            positions += list(range(len(prompt), len(prompt) + len(response)))
            last += [False] * (len(response) - 1) + [True]
    pad = seq_len - len(tokens)
    ids = torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64)
    labels = torch.where(torch.tensor(last + [False] * pad), 1, -100)
    mask = masks.preference([len(p) for p, _, _ in parts], [[len(r) for r in rs] for _, rs, _ in parts], n=seq_len)
    k = max(len(rs) for _, rs, _ in parts)
    scores = torch.full((len(parts), k), float("nan"), dtype=torch.float64)
    for i, (_, _, sc) in enumerate(parts):
        scores[i, : len(sc)] = torch.tensor(sc, dtype=torch.float64)
    row_positions = torch.tensor(positions + list(range(len(positions), seq_len)), dtype=torch.int64)
    return Row(ids, labels, mask, torch.tensor(segment + [-1] * pad, dtype=torch.int64),
               torch.tensor(sample + [-1] * pad, dtype=torch.int64), row_positions, scores)
