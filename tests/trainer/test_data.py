"""Data: every record is trained on exactly once per pass (partial rows padded, long records in
pieces, DPO samples never cut), and a bad file fails up front naming file:line."""

import itertools
import json

import pytest
import torch

from fm_parallel.trainer.config import load_config
from fm_parallel.trainer.data import ByteTokenizer, DataError, dpo_rows, sft_rows
from fm_parallel.trainer.objectives import DPO, SFT

TOK = ByteTokenizer()


def validate_sft(path):
    """The trainer's check of an SFT data file before training (the number of records)."""
    return SFT(load_config([], environ={})).validate(str(path), TOK)


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def pass_tokens(rows):
    """The real (non-padding) token ids of rows, document by document, in order."""
    docs = []
    for row in rows:
        for d in range(int(row.sample.max()) + 1):
            docs.append(row.input_ids[row.sample == d].tolist())
    return docs


def test_every_record_reaches_a_row_once_per_pass(tmp_path):
    # Six 12-token records into 64-token rows: 5 fit the first row, the sixth was once dropped.
    texts = [f"abcdefghij{i}" for i in range(6)]
    path = write(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    rows = list(itertools.islice(sft_rows(64, TOK, path), 4))
    want = [[TOK.bos_id] + list(t.encode()) for t in texts]
    assert pass_tokens(rows[:2]) == want  # first pass: all six, in order
    assert pass_tokens(rows[2:]) == want  # second pass: the same again
    assert int((rows[1].sample >= 0).sum()) == 12 and (rows[1].input_ids[12:] == TOK.pad_id).all()
    assert (rows[1].labels[11:] == -100).all()  # padding predicts nothing


def test_a_record_longer_than_a_row_is_trained_in_full(tmp_path):
    text = "".join(chr(97 + i % 26) for i in range(149))
    path = write(tmp_path / "d.jsonl", [{"text": text}])
    rows = list(itertools.islice(sft_rows(64, TOK, path), 3))
    pieces = pass_tokens(rows)
    assert [len(p) for p in pieces] == [64, 64, 22]
    assert sum(pieces, []) == [TOK.bos_id] + list(text.encode())


def test_a_data_set_smaller_than_one_row_does_not_hang(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"text": "hello world"}])
    rows = list(itertools.islice(sft_rows(64, TOK, path), 3))  # returns: one padded row per pass
    assert [int((r.sample >= 0).sum()) for r in rows] == [12, 12, 12]


def test_dpo_samples_are_never_cut(tmp_path):
    sample = {"prompt": "p" * 40, "chosen": "c" * 50, "rejected": "r" * 45}
    path = write(tmp_path / "d.jsonl", [sample, sample])
    rows = list(itertools.islice(dpo_rows(256, TOK, path), 2))
    for row in rows:  # both samples (136 tokens each) do not fit one row: one per row, whole
        assert [int((row.segment == s).sum()) for s in (0, 1, 2)] == [39, 51, 46]
    with pytest.raises(DataError, match=r"d.jsonl:1: a DPO sample of 136 tokens .* does not fit data.seq_len = 128"):
        next(dpo_rows(128, TOK, path))
    with pytest.raises(DataError, match=r"d.jsonl:1: a DPO sample of 136 tokens"):
        # The objective's own record check, before training (the trainer's preflight runs it).
        DPO(load_config(["--data.objective", "dpo", "--data.seq_len", "128"], environ={})).validate(path, TOK)


@pytest.mark.parametrize("content, message", [
    (b'{"text": "a"}\nnot json\n', r":2: expected one JSON object per line, got invalid JSON"),
    (b'{"text": "a"}\n[1, 2]\n', r":2: expected a JSON object, got an array"),
    (b"null\n", r":1: expected a JSON object, got null"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r":2: expected UTF-8 text, got byte 0xff"),
    (b'{"text": 5}\n', r":1: expected an SFT record of one of the formats \{\"text\": str\}; .*; got fields \{'text': 'a number'\}"),
    (b'{"body": "a"}\n', r":1: expected an SFT record of one of the formats .*\{\"messages\".*got fields \{'body': 'a string'\}"),
    (b'\n\n', r"expected at least one record, got none"),
    (b'{"text": "ok"}\n{"text": "a\\ud800b"}\n', r":2: field 'text' holds an unpaired surrogate"),
    (b'{"text": "ok"}\n\xef\xbb\xbf{"text": "b"}\n', r":2: expected one JSON object per line, got invalid JSON"),
    # a missing closing brace: the column just past the line's end, where it belongs (was "column 1")
    (b'{"text": "ok"}\n{"text": "abc"\n', r":2: expected one JSON object per line, got invalid JSON \(Expecting ',' delimiter at column 15\)"),
    (b'{"text": "ok"}\r\n{"text": "abc"\r\n', r":2: .*at column 15\)"),
])
def test_bad_lines_are_named_by_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        validate_sft(path)
    assert str(path) in str(info.value)


def test_a_byte_order_mark_on_the_first_line_is_not_data(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hello"}\n{"text": "world"}\n')  # as some Windows tools write
    assert validate_sft(path) == 2
    row = next(sft_rows(64, TOK, str(path)))
    assert pass_tokens([row]) == [[TOK.bos_id] + list(b"hello"), [TOK.bos_id] + list(b"world")]


def test_validation_reaches_the_last_line_fast(tmp_path):
    # A bad line deep in the file is found before training, not at the step that reads it.
    lines = [{"text": f"record {i}"} for i in range(20000)] + ["{broken"]
    path = write(tmp_path / "big.jsonl", lines)
    with pytest.raises(DataError, match=r"big.jsonl:20001:"):
        validate_sft(path)
    assert validate_sft(write(tmp_path / "ok.jsonl", lines[:-1])) == 20000
    with pytest.raises(DataError, match="data.path: expected an existing file or folder, got .*missing.jsonl"):
        validate_sft(tmp_path / "missing.jsonl")


def test_builtin_dpo_samples_fit_small_rows():
    row = next(dpo_rows(64, TOK))
    assert int((row.segment >= 0).sum()) <= 64 and int(row.sample.max()) >= 0
    with pytest.raises(DataError, match="data.seq_len"):
        next(dpo_rows(1, TOK))
    with pytest.raises(DataError, match="data.seq_len"):
        next(sft_rows(0, TOK))
    assert torch.equal(next(sft_rows(64, TOK)).input_ids, next(sft_rows(64, TOK)).input_ids)


def test_max_doc_tokens_splits_long_documents_into_pieces():
    """The same tokens in the same order (a row ends where the next piece would not fit); no document
    (a causal block of the mask) longer than the cap."""
    from fm_parallel import masks
    from fm_parallel.trainer.data import DataError, load_tokenizer, sft_rows

    tok = load_tokenizer("")
    whole, split = next(sft_rows(4096, tok)), next(sft_rows(4096, tok, max_doc_tokens=300))
    real = split.input_ids[split.sample >= 0]
    assert len(real) == 13 * 300 and torch.equal(real, whole.input_ids[: len(real)])
    doc = split.sample[split.sample >= 0]
    lengths = torch.unique_consecutive(doc, return_counts=True)[1]
    assert lengths.tolist() == [300] * 13
    assert torch.equal(split.mask.fms, masks.document(lengths.tolist(), n=4096).fms)
    with pytest.raises(DataError, match=r"data.max_doc_tokens: expected an int >= 0 \(0: seq_len\), got -1"):
        next(sft_rows(4096, tok, max_doc_tokens=-1))
