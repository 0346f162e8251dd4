"""Data: real text, a tokenizer, and packing into fixed-length rows with the FlashMask built alongside.

The default corpus exists wherever Python does: the standard library's own ``.py`` sources, in a
fixed order. Each row is packed greedily from whole documents (a document longer than the row is
cut into row-sized pieces, every piece trained on); the FlashMask of the row is built here, next to
``input_ids``, and labels are shifted inside each document so no token learns to predict the next
document.

Every record is trained on exactly once per pass over the data: the last, partial row of a pass is
padded and yielded, never dropped (a data set smaller than one row is one padded row per pass).
A JSONL file is checked in one fast pass before training (:func:`validate_jsonl`): a line that is not
JSON, not an object, lacks a string field, or is not UTF-8 raises naming ``file:line``. Which fields a
record holds and what else it must satisfy is the objective's to say
(:meth:`fm_parallel.trainer.objectives.Objective.validate`): this module knows no objective by name.

DPO rows pack several ``[prompt, chosen, rejected]`` samples with the ``dpo`` mask (``layout="shared"``:
the prompt computed once). Each response starts with a separator token so that its first real token
is predicted from inside the response (the prompt's last position cannot predict both responses'
first tokens). ``layout="separate"`` is the layout TRL trains: ``[prompt, chosen]`` and
``[prompt, rejected]`` as two causal documents, the prompt computed twice; the same tokens are
scored, so both layouts give the same loss (what the end-to-end comparison relies on). A sample is
never cut: one that does not fit a row raises naming its line and sizes.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fm_parallel import masks
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ByteTokenizer", "load_tokenizer", "Row", "sft_rows", "dpo_rows", "stdlib_texts", "validate_jsonl", "DataError",
           "DPO_LAYOUTS", "SFT_FIELDS", "DPO_FIELDS", "RM_FIELDS", "check_dpo_sample", "rm_sample", "rm_rows"]

DPO_LAYOUTS = ("shared", "separate")
# The string fields of one JSONL record, per row format (data.path's format).
SFT_FIELDS = ("text",)
DPO_FIELDS = ("prompt", "chosen", "rejected")
# A reward model's record: {"prompt", "chosen", "rejected"} (the pair form) or {"prompt", "responses": [...],
# "scores": [...]} (K >= 2 responses ranked by score); "prompt" is the string field every record holds.
RM_FIELDS = ("prompt",)


class DataError(ValueError):
    """A data file or data setting the user must fix; the message names ``file:line``."""


class ByteTokenizer:
    """UTF-8 bytes, plus a document separator (256) and padding (257)."""

    vocab_size = 258
    bos_id = 256
    pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class _HFTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.bos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


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


def stdlib_texts() -> Iterator[str]:
    """The standard library's Python sources, sorted by path (the same on every machine of one Python)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "site-packages" not in p)
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            yield text


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _record(path: str, n: int, raw: bytes, keys: tuple[str, ...]) -> dict | None:
    """The record of line ``n`` (None for a blank line), or a DataError naming ``path:n``."""
    try:
        line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark on line 1 is not data
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{n}: expected UTF-8 text, got byte {raw[e.start]:#04x} at column {e.start + 1}") from None
    if not line.strip():
        return None
    try:
        # Without the line break: a missing '}' at the end is then at the line's last column + 1, not
        # "column 1" of a line 2 that the file does not have there.
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: expected one JSON object per line, got invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{n}: expected a JSON object with string fields {list(keys)}, got {_json_type(record)}")
    missing = [k for k in keys if not isinstance(record.get(k), str)]
    if missing:
        got = {k: _json_type(record[k]) for k in missing if k in record}
        raise DataError(f"{path}:{n}: expected string fields {list(keys)}, missing or not a string: {missing}"
                        + (f" (got {got})" if got else ""))
    for k in keys:
        try:
            record[k].encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape like "\ud800": no tokenizer can encode it
            raise DataError(f"{path}:{n}: field {k!r} holds an unpaired surrogate {record[k][e.start]!r} at character "
                            f"{e.start}, not valid Unicode") from None
    return record


def _jsonl(path: str, keys: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` of every non-blank line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            record = _record(path, n, raw, keys)
            if record is not None:
                yield n, record


def validate_jsonl(path: str, fields: tuple[str, ...], check=None, stop=None, key: str = "data.path") -> int:
    """One pass over a JSONL data file before training; returns the number of records.

    Raises :class:`DataError` naming ``file:line`` for the first line that is not UTF-8, not JSON, not
    an object or lacks one of the string ``fields``. ``check(line, record)``: called on every record
    (its fields already checked), raises for a record the objective cannot train on. ``stop()``:
    polled, a stop request ends the pass early (returns -1). ``key``: the setting that named ``path``
    (``data.path`` or ``eval.path``), named by the errors that are not a line's."""
    if not isinstance(fields, tuple) or not fields or not all(isinstance(f, str) for f in fields):
        raise ValueError(f"fields: expected a non-empty tuple of field names (str), got {fields!r}")
    if not os.path.isfile(path):
        raise DataError(f"{key}: expected an existing JSONL file, got {path!r}")
    count = 0
    for n, record in _jsonl(path, fields):
        count += 1
        if check is not None:
            check(n, record)
        if stop is not None and count % 1024 == 0 and stop():
            return -1
    if count == 0:
        raise DataError(f"{key}: expected at least one record, got none in {path}")
    return count


def _dpo_size(p: int, c: int, r: int, layout: str) -> int:
    """Tokens of one sample in a row: each response starts with a separator; ``separate`` repeats the prompt."""
    return (2 if layout == "separate" else 1) * p + c + r + 2


def check_dpo_sample(path: str, n: int, tokenizer, record: dict, seq_len: int,
                     layout: str = "shared") -> tuple[list[int], list[int], list[int]]:
    """The (prompt, chosen, rejected) tokens of the DPO ``record`` on line ``n`` of ``path``; a
    :class:`DataError` naming ``path:n`` and the sizes if the sample does not fit one row of
    ``seq_len`` tokens in ``layout`` (a sample is never cut)."""
    p, c, r = (tokenizer.encode(record[k]) for k in DPO_FIELDS)
    size = _dpo_size(len(p), len(c), len(r), layout)
    if size > seq_len:
        prompt = f"prompt {len(p)}" if layout == "shared" else f"2 x prompt {len(p)} (data.dpo_layout = 'separate')"
        raise DataError(f"{path}:{n}: a DPO sample of {size} tokens ({prompt} + chosen {len(c)} + rejected {len(r)}"
                        f" + 2 separators) does not fit data.seq_len = {seq_len}; raise seq_len or shorten the sample")
    return p, c, r


def _labels(ids: torch.Tensor, sample: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """labels[i] = ids[i + 1] where position i + 1 is in the same sample and scored, else -100."""
    nxt = torch.full_like(ids, -100)
    same = (sample[1:] == sample[:-1]) & (sample[1:] >= 0) & scored[1:]
    nxt[:-1] = torch.where(same, ids[1:], torch.full_like(ids[1:], -100))
    return nxt


def sft_rows(seq_len: int, tokenizer, path: str = "", max_doc_tokens: int = 0) -> Iterator[Row]:
    """Packed SFT rows of ``seq_len`` tokens, forever (the corpus repeats). Each pass over the corpus
    ends with its partial row, padded: every token of every record is in exactly one row per pass.
    A document longer than ``max_doc_tokens`` (0: ``seq_len``) is split into consecutive pieces of at
    most that many tokens, each its own document (no attention across pieces)."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"data.seq_len: expected an int >= 2, got {seq_len!r}")
    if not isinstance(max_doc_tokens, int) or max_doc_tokens < 0:
        raise DataError(f"data.max_doc_tokens: expected an int >= 0 (0: seq_len), got {max_doc_tokens!r}")
    piece_len = min(max_doc_tokens or seq_len, seq_len)
    texts = (lambda: (r["text"] for _, r in _jsonl(path, SFT_FIELDS))) if path else stdlib_texts
    while True:
        lengths: list[int] = []
        tokens: list[int] = []
        any_doc = False
        for text in texts():
            any_doc = True
            doc = [tokenizer.bos_id] + tokenizer.encode(text)
            for start in range(0, len(doc), piece_len):
                piece = doc[start : start + piece_len]
                if len(tokens) + len(piece) > seq_len:
                    yield _sft_row(tokens, lengths, seq_len, tokenizer)
                    tokens, lengths = [], []
                tokens += piece
                lengths.append(len(piece))
        if not any_doc:
            raise DataError(f"data.path: expected at least one document, got none in {path or 'the stdlib corpus'}")
        if tokens:
            yield _sft_row(tokens, lengths, seq_len, tokenizer)


def _sft_row(tokens, lengths, seq_len, tokenizer) -> Row:
    pad = seq_len - len(tokens)
    ids = torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sample = torch.cat([sample, torch.full((pad,), -1, dtype=torch.int64)])
    labels = _labels(ids, sample, sample >= 0)
    segment = torch.where(sample >= 0, 0, -1)
    return Row(ids, labels, masks.document(lengths, n=seq_len), segment, sample, torch.arange(seq_len))


def _dpo_samples(tokenizer, path: str, seq_len: int, layout: str = "shared") -> Iterator[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists. Without a path: from the stdlib, a file's opening as
    the prompt, its true continuation as chosen and the same tokens shuffled as rejected, each part sized to
    fit a quarter of a row (a fifth for the separate layout; synthetic samples, built to fit; a file's
    samples are never cut). Both layouts get the same samples for the same ``seq_len``."""
    if path:
        for n, r in _jsonl(path, DPO_FIELDS):
            yield check_dpo_sample(path, n, tokenizer, r, seq_len, layout)
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


def dpo_rows(seq_len: int, tokenizer, path: str = "", layout: str = "shared") -> Iterator[Row]:
    """Packed DPO rows: several samples per row. ``layout="shared"``: [prompt, SEP chosen, SEP rejected]
    under the ``dpo`` mask; ``"separate"``: [prompt, SEP chosen] and [prompt, SEP rejected] as two causal
    documents (TRL's layout). Samples are never cut; each pass ends with its partial row, padded."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"data.seq_len: expected an int >= 2, got {seq_len!r}")
    if layout not in DPO_LAYOUTS:
        raise DataError(f"data.dpo_layout: expected one of {DPO_LAYOUTS}, got {layout!r}")
    while True:
        parts: list[tuple[list[int], list[int], list[int]]] = []
        used = 0
        produced = False
        for p, c, r in _dpo_samples(tokenizer, path, seq_len, layout):
            produced = True
            size = _dpo_size(len(p), len(c), len(r), layout)
            c, r = [tokenizer.bos_id] + c, [tokenizer.bos_id] + r
            if used + size > seq_len:
                yield _dpo_row(parts, seq_len, tokenizer, layout)
                parts, used = [], 0
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


def rm_sample(path: str, n: int, tokenizer, record: dict, seq_len: int) -> tuple[list[int], list[list[int]], list[float]]:
    """The (prompt, responses, scores) tokens of the reward-model ``record`` on line ``n`` of ``path``:
    ``{"prompt", "chosen", "rejected"}`` (scores 1, 0) or ``{"prompt", "responses": [...], "scores": [...]}``.
    A :class:`DataError` naming ``path:n`` for a record of neither form, fewer than two responses, an
    empty response, a score count other than the responses', scores that rank nothing (all equal), or
    a sample that does not fit one row of ``seq_len`` tokens (a sample is never cut)."""
    where = f"{path}:{n}"
    if "responses" in record or "scores" in record:
        responses, scores = record.get("responses"), record.get("scores")
        if "chosen" in record or "rejected" in record:
            raise DataError(f"{where}: expected either chosen / rejected or responses / scores, got both forms")
        if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
            raise DataError(f"{where}: expected 'responses' as a list of strings, got {_json_type(responses)}")
        if (not isinstance(scores, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)
                or not all(math.isfinite(x) for x in scores)):
            raise DataError(f"{where}: expected 'scores' as a list of finite numbers, got {_json_type(scores)}")
        if len(scores) != len(responses):
            raise DataError(f"{where}: expected one score per response, got {len(scores)} scores for {len(responses)} responses")
    else:
        missing = [k for k in ("chosen", "rejected") if not isinstance(record.get(k), str)]
        if missing:
            raise DataError(f"{where}: expected string fields ['prompt', 'chosen', 'rejected'] or 'prompt' with "
                            f"'responses' and 'scores', missing or not a string: {missing}")
        responses, scores = [record["chosen"], record["rejected"]], [1.0, 0.0]
    if len(responses) < 2 or len(set(scores)) < 2:
        raise DataError(f"{where}: expected at least two responses with different scores (a ranking to learn), got "
                        f"{len(responses)} response(s) with scores {scores}")
    empty = [i for i, r in enumerate(responses) if not r]
    if empty:
        raise DataError(f"{where}: expected non-empty responses, got an empty response at index {empty[0]}")
    prompt, ids = tokenizer.encode(record["prompt"]), [tokenizer.encode(r) for r in responses]
    size = len(prompt) + sum(len(r) + 1 for r in ids)
    if size > seq_len:
        raise DataError(f"{where}: a reward-model sample of {size} tokens (prompt {len(prompt)} + {len(ids)} responses of "
                        f"{[len(r) for r in ids]} + a separator each) does not fit data.seq_len = {seq_len}; raise seq_len "
                        "or shorten the sample")
    return prompt, ids, [float(x) for x in scores]


def rm_rows(seq_len: int, tokenizer, path: str = "") -> Iterator[Row]:
    """Packed reward-model rows: several samples per row, each ``[prompt, SEP r1, ..., SEP rK]`` under the
    ``preference`` mask (a response sees the prompt and itself), each response's positions continuing
    right after the prompt. ``labels`` are 1 at each response's last token (where its reward is read),
    ``scores [samples, K]`` rank the responses. Without a path: the built-in pairs (:func:`_rm_builtin`:
    the true continuation over the same text with its letters' case swapped). Samples are never cut;
    each pass ends with its partial row, padded."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"data.seq_len: expected an int >= 2, got {seq_len!r}")

    def samples():
        if path:
            for n, r in _jsonl(path, RM_FIELDS):
                yield rm_sample(path, n, tokenizer, r, seq_len)
        else:
            yield from _rm_builtin(tokenizer, seq_len)

    while True:
        parts, used, produced = [], 0, False
        for p, responses, scores in samples():
            produced = True
            size = len(p) + sum(len(r) + 1 for r in responses)
            if used + size > seq_len:
                yield _rm_row(parts, seq_len, tokenizer)
                parts, used = [], 0
            parts.append((p, [[tokenizer.bos_id] + r for r in responses], scores))
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
