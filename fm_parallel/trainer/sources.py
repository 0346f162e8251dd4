"""Where records come from: ``data.path`` (and ``eval.path``) as a file, a folder or a dataset's name.

    for where, record in records("data/train.parquet"): ...      # where: "data/train.parquet row 3"
    for where, record in records("chat.jsonl"): ...              # where: "chat.jsonl:3" (its line)

* a JSONL file (any name but ``.parquet``, ``.arrow`` and ``.json``): read here, line by line, so that
  every error names ``file:line``;
* a ``.parquet``, ``.arrow`` or ``.json`` file, or a folder of data files: read by ``datasets``
  (``load_dataset``), ``data.split`` chosen; a folder written by ``Dataset.save_to_disk`` through
  ``load_from_disk``;
* anything else: the name of a dataset already in the local ``datasets`` cache (``load_dataset(name,
  split=...)`` offline): a run never downloads, and a name not in the cache is one error.

Records come in the source's order, the same on every rank; packing them into rows is the trainer's
(:mod:`fm_parallel.trainer.data`), streaming and deterministic.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from fm_parallel.formats import DataError, json_kind

__all__ = ["records", "validate_records", "DATASETS_SUFFIXES"]

# Files read through datasets' own builders (by suffix); every other file is JSONL, read here.
DATASETS_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}


def _line_record(path: str, n: int, raw: bytes) -> dict | None:
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
        raise DataError(f"{path}:{n}: expected a JSON object, got {json_kind(record)}")
    return record


def _jsonl(path: str) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            record = _line_record(path, n, raw)
            if record is not None:
                yield f"{path}:{n}", record


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"data.path: Parquet, Arrow and JSON files, folders and dataset names are read by the 'datasets' "
                        f"package, not installed ({e}); pip install 'fm_parallel[data]', or give a JSONL file") from None
    return datasets


def _split(table, path: str, split: str, key: str):
    """``table``'s ``split`` when it is a ``DatasetDict``; a ``Dataset`` is its one split."""
    if hasattr(table, "keys") and not hasattr(table, "features"):  # a DatasetDict
        if split not in table:
            raise DataError(f"data.split: expected one of {sorted(table)} (the splits of {key} {path!r}), got {split!r}")
        return table[split]
    return table


def _looks_like_a_path(path: str) -> bool:
    """A file name (a suffix, a leading ``/ . ~``, several folders), never a dataset's ``org/name``."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or bool(Path(path).suffix) or os.sep != "/" and os.sep in path


def _load(path: str, split: str, key: str):
    """The ``datasets.Dataset`` that ``path`` names (see the module's docstring)."""
    datasets = _datasets()
    p = Path(path)
    try:
        if p.is_file():
            table = datasets.load_dataset(DATASETS_SUFFIXES[p.suffix], data_files={"train": str(p)})
            return _split(table, path, "train", key)
        if p.is_dir():
            if (p / "dataset_dict.json").is_file() or (p / "dataset_info.json").is_file() and (p / "state.json").is_file():
                return _split(datasets.load_from_disk(str(p)), path, split, key)
            return _split(datasets.load_dataset(str(p)), path, split, key)
    except Exception as e:  # noqa: BLE001 - pyarrow's, datasets' and the builders' own errors: one line each
        if isinstance(e, DataError):
            raise
        raise DataError(f"{key}: {path!r} could not be read as a dataset ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    if _looks_like_a_path(path):
        raise DataError(f"{key}: expected an existing file or folder, got {path!r} (no such file or folder)")
    # A name: the local cache only (a run never downloads: offline for this call, whatever the environment).
    from datasets import config as ds_config

    offline = ds_config.HF_HUB_OFFLINE
    ds_config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises ConnectionError, FileNotFoundError, ValueError here
        if "split" in str(e).lower() and "unknown split" in str(e).lower():
            raise DataError(f"data.split: {split!r} is not a split of the cached dataset {path!r} ({str(e).splitlines()[0][:200]})") from None
        raise DataError(f"{key}: expected a JSONL, Parquet, Arrow or JSON file, a folder of them, or the name of a "
                        f"dataset in the local datasets cache ({ds_config.HF_DATASETS_CACHE}), got {path!r}: no such file, "
                        f"and not cached (runs never download; load it once with datasets.load_dataset({path!r}))") from None
    finally:
        ds_config.HF_HUB_OFFLINE = offline


def records(path: str, split: str = "train", key: str = "data.path") -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for every record of ``path``, in order; ``where`` names it in errors
    (``file:line`` for JSONL, ``path row i`` (from 1) for a dataset). ``key``: the setting that
    named ``path`` (``data.path`` or ``eval.path``)."""
    p = Path(path)
    if p.is_file() and split != "train":
        section = key.split(".")[0]
        raise DataError(f"{section}.split: expected 'train' for the file {path!r} (a file is one split; splits are a "
                        f"folder's or a dataset's), got {split!r}")
    if p.is_file() and p.suffix not in DATASETS_SUFFIXES:
        yield from _jsonl(path)
        return
    table = _load(path, split, key)
    shown = path if p.exists() else f"{path}[{split}]"
    for i, record in enumerate(table, 1):
        yield f"{shown} row {i}", record


def validate_records(path: str, check=None, stop=None, key: str = "data.path", split: str = "train") -> int:
    """One pass over ``path`` before training; returns the number of records (-1 when ``stop()`` ended
    the pass early).

    Raises :class:`DataError` naming ``file:line`` (or the row) for the first record that is not a JSON
    object (JSONL: not UTF-8, not JSON); ``check(where, record)`` is called on every record and raises
    for one the objective cannot train on. ``stop()``: polled, a stop request ends the pass early."""
    if not path:
        raise DataError(f"{key}: expected a data file, folder or dataset name, got an empty string")
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):
        raise DataError(f"{key}: expected a file or folder, got {path!r}")
    count = 0
    for where, record in records(path, split, key):
        count += 1
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {json_kind(record)}")
        if check is not None:
            check(where, record)
        if stop is not None and count % 1024 == 0 and stop():
            return -1
    if count == 0:
        raise DataError(f"{key}: expected at least one record, got none in {path}")
    return count
