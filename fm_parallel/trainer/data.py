"""Data: real text, a tokenizer, and packing into fixed-length rows with the FlashMask built alongside.

The default corpus exists wherever Python does: the standard library's own ``.py`` sources, in a
fixed order. Each row is packed greedily from whole documents (a document longer than the row is
cut into row-sized pieces); the FlashMask of the row is built here, next to ``input_ids``, and labels
are shifted inside each document so no token learns to predict the next document.

DPO rows pack several ``[prompt, chosen, rejected]`` samples with the ``dpo`` mask. Each response
starts with a separator token so that its first real token is predicted from inside the response
(the prompt's last position cannot predict both responses' first tokens).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fm_parallel import masks
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ByteTokenizer", "load_tokenizer", "Row", "sft_rows", "dpo_rows", "stdlib_texts"]


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
    """One packed row. ``segment``: per token, -1 padding; for DPO 0 prompt, 1 chosen, 2 rejected.
    ``sample``: per token, the index of its document (SFT) or sample (DPO) in the row, -1 padding."""

    input_ids: torch.Tensor  # [N] int64
    labels: torch.Tensor  # [N] int64, -100 where nothing is predicted
    mask: FlashMask  # [1, 1, N]
    segment: torch.Tensor  # [N] int64
    sample: torch.Tensor  # [N] int64


def stdlib_texts() -> Iterator[str]:
    """The standard library's Python sources, sorted by path (the same on every machine of one Python)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "site-packages" not in p)
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            yield text


def _jsonl(path: str, keys: tuple[str, ...]) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            missing = [k for k in keys if not isinstance(record.get(k), str)]
            if missing:
                raise ValueError(f"{path}:{n}: expected string fields {keys}, missing {missing}")
            yield record


def _labels(ids: torch.Tensor, sample: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """labels[i] = ids[i + 1] where position i + 1 is in the same sample and scored, else -100."""
    nxt = torch.full_like(ids, -100)
    same = (sample[1:] == sample[:-1]) & (sample[1:] >= 0) & scored[1:]
    nxt[:-1] = torch.where(same, ids[1:], torch.full_like(ids[1:], -100))
    return nxt


def sft_rows(seq_len: int, tokenizer, path: str = "") -> Iterator[Row]:
    """Packed SFT rows of ``seq_len`` tokens, forever (the corpus repeats)."""
    texts = (lambda: (r["text"] for r in _jsonl(path, ("text",)))) if path else stdlib_texts
    while True:
        lengths: list[int] = []
        tokens: list[int] = []
        any_doc = False
        for text in texts():
            any_doc = True
            doc = [tokenizer.bos_id] + tokenizer.encode(text)
            for start in range(0, len(doc), seq_len):
                piece = doc[start : start + seq_len]
                if len(tokens) + len(piece) > seq_len:
                    yield _sft_row(tokens, lengths, seq_len, tokenizer)
                    tokens, lengths = [], []
                tokens += piece
                lengths.append(len(piece))
        if not any_doc:
            raise ValueError(f"data.path: expected at least one document, got none in {path or 'the stdlib corpus'}")


def _sft_row(tokens, lengths, seq_len, tokenizer) -> Row:
    pad = seq_len - len(tokens)
    ids = torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    sample = torch.cat([sample, torch.full((pad,), -1, dtype=torch.int64)])
    labels = _labels(ids, sample, sample >= 0)
    segment = torch.where(sample >= 0, 0, -1)
    return Row(ids, labels, masks.document(lengths, n=seq_len), segment, sample)


def _dpo_samples(tokenizer, path: str) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists. Without a path: from the stdlib, a file's opening as
    the prompt, its true continuation as chosen and another file's text as rejected."""
    if path:
        for r in _jsonl(path, ("prompt", "chosen", "rejected")):
            yield tokenizer.encode(r["prompt"]), tokenizer.encode(r["chosen"]), tokenizer.encode(r["rejected"])
        return
    previous = None
    for text in stdlib_texts():
        ids = tokenizer.encode(text)
        if len(ids) < 96:
            continue
        if previous is not None:
            yield ids[:64], ids[64:160], previous[64:160]
        previous = ids


def dpo_rows(seq_len: int, tokenizer, path: str = "", max_part: int | None = None) -> Iterator[Row]:
    """Packed DPO rows: several [prompt, SEP chosen, SEP rejected] samples per row, the ``dpo`` mask."""
    max_part = max_part or seq_len // 4
    while True:
        parts: list[tuple[list[int], list[int], list[int]]] = []
        used = 0
        produced = False
        for p, c, r in _dpo_samples(tokenizer, path):
            produced = True
            p, c, r = p[:max_part], [tokenizer.bos_id] + c[: max_part - 1], [tokenizer.bos_id] + r[: max_part - 1]
            size = len(p) + len(c) + len(r)
            if size > seq_len:
                continue
            if used + size > seq_len:
                yield _dpo_row(parts, seq_len, tokenizer)
                parts, used = [], 0
            parts.append((p, c, r))
            used += size
        if not produced:
            raise ValueError(f"data.path: expected DPO samples, got none in {path or 'the stdlib corpus'}")


def _dpo_row(parts, seq_len, tokenizer) -> Row:
    tokens, segment, sample = [], [], []
    for i, (p, c, r) in enumerate(parts):
        for seg, piece in enumerate((p, c, r)):
            tokens += piece
            segment += [seg] * len(piece)
            sample += [i] * len(piece)
    pad = seq_len - len(tokens)
    ids = torch.tensor(tokens + [tokenizer.pad_id] * pad, dtype=torch.int64)
    segment = torch.tensor(segment + [-1] * pad, dtype=torch.int64)
    sample = torch.tensor(sample + [-1] * pad, dtype=torch.int64)
    # Score response tokens only, each predicted from inside its own response.
    block = sample * 3 + segment
    labels = _labels(ids, torch.where(sample >= 0, block, -1), segment > 0)
    mask = masks.dpo([len(p) for p, _, _ in parts], [len(c) for _, c, _ in parts], [len(r) for _, _, r in parts], n=seq_len)
    return Row(ids, labels, mask, segment, sample)
