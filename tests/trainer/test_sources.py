"""``data.path`` beyond JSONL: Parquet, Arrow and JSON files, folders, ``save_to_disk`` folders and the
name of a dataset in the local ``datasets`` cache give the JSONL's records in its order, a cached name
trains exactly like the same JSONL, and a name that is not cached (runs never download) or a split
that does not exist is one ``error:`` line, exit 2, nothing written. A TRL user's ``messages`` and
``prompt`` / ``completion`` JSONL train with the trainer's command plus ``--data.path`` and
``--model.path``."""

import glob
import json
import os
import shutil

import pytest

from fm_parallel.trainer.sources import records
from tests.trainer.test_model import _run

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")
pytest.importorskip("peft")

RECORDS = [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(40)]
ARGS = ["--model.hidden_size", "64", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
        "--model.intermediate_size", "128", "--model.lora_rank", "4", "--training.warmup", "0", "--training.steps", "3",
        "--parallel.cp", "none", "--output.checkpoint_every", "0", "--data.seq_len", "128", "--model.tile_chunk", "0"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cache_as(name: str, jsonl: str, cache: str) -> None:
    """Put ``jsonl`` in the datasets cache ``cache`` as the hub dataset ``name`` would be after a
    ``load_dataset(name)`` (the layout datasets' offline lookup reads), without a network."""
    work = os.path.join(cache, "_build")
    datasets.load_dataset("json", data_files=jsonl, cache_dir=work)
    built = glob.glob(os.path.join(work, "json", "*", "*", "*"))[0]
    owner, short = name.split("/")
    target = os.path.join(cache, f"{owner}___{short}", "default", "0.0.0", "0")
    shutil.copytree(built, target)
    for f in glob.glob(os.path.join(target, "json-*.arrow")):
        os.rename(f, f.replace(os.sep + "json-", os.sep + f"{short}-"))
    shutil.rmtree(work)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = str(tmp_path / "hf_datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    return folder


def test_every_source_gives_the_jsonls_records_in_order(tmp_path, cache):
    jsonl = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    table = datasets.Dataset.from_list(RECORDS)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_json(str(tmp_path / "d.json"))
    (tmp_path / "folder").mkdir()
    table.to_parquet(str(tmp_path / "folder" / "train.parquet"))
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(str(tmp_path / "saved"))
    cache_as("someone/tiny-code", jsonl, cache)
    want = [r for _, r in records(jsonl)]
    assert want == RECORDS
    (tmp_path / "jsonl_folder").mkdir()
    write_jsonl(tmp_path / "jsonl_folder" / "a.jsonl", RECORDS[:25])
    write_jsonl(tmp_path / "jsonl_folder" / "b.jsonl", RECORDS[25:])
    for source in ("d.parquet", "d.json", "folder", "jsonl_folder", "saved"):
        assert [r for _, r in records(str(tmp_path / source))] == RECORDS, source
    assert [r for _, r in records(str(tmp_path / "saved"), split="test")] == RECORDS[:3]
    arrow = sorted(glob.glob(str(tmp_path / "saved" / "train" / "*.arrow")))  # an Arrow file as save_to_disk writes it
    assert len(arrow) == 1 and [r for _, r in records(arrow[0])] == RECORDS
    got = list(records("someone/tiny-code"))
    assert [r for _, r in got] == RECORDS and got[2][0] == "someone/tiny-code[train] row 3"
    assert next(records(jsonl))[0] == f"{jsonl}:1"


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and '"eval_' not in line]


def test_a_cached_dataset_trains_like_the_same_jsonl(tmp_path, cache, capsys):
    jsonl = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    cache_as("someone/tiny-code", jsonl, cache)
    code, _, err = _run([*ARGS, "--data.path", jsonl, "--output.dir", str(tmp_path / "a")], capsys)
    assert code == 0, err
    code, _, err = _run([*ARGS, "--data.path", "someone/tiny-code", "--output.dir", str(tmp_path / "b")], capsys)
    assert code == 0, err
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b") and len(_losses(tmp_path / "a")) == 3


@pytest.mark.parametrize("argv, message", [
    (["--data.path", "nobody/not-cached"], r"error: data.path: expected a JSONL, Parquet, Arrow or JSON file, a folder of "
                                           r"them, or the name of a dataset in the local datasets cache .*got "
                                           r"'nobody/not-cached': no such file, and not cached \(runs never download"),
    (["--data.path", "data/missing.jsonl"], r"error: data.path: expected an existing file or folder, got "
                                            r"'data/missing.jsonl' \(no such file or folder\)"),
    (["--data.path", "FILE", "--data.split", "test"], r"error: data.split: expected 'train' for the file '.*d.jsonl' \(a "
                                                      r"file is one split; splits are a folder's or a dataset's\), got 'test'"),
    (["--data.path", "SAVED", "--data.split", "validation"], r"error: data.split: expected one of \['test', 'train'\] "
                                                             r"\(the splits of data.path .*saved'\), got 'validation'"),
])
def test_a_source_that_cannot_be_read_is_one_error_line(tmp_path, cache, capsys, argv, message):
    import re

    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS), "test": datasets.Dataset.from_list(RECORDS)}
                         ).save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "d.jsonl", RECORDS)
    argv = [{"SAVED": str(tmp_path / "saved"), "FILE": str(tmp_path / "d.jsonl")}.get(a, a) for a in argv]
    capsys.readouterr()  # save_to_disk's progress bar
    out = tmp_path / "run"
    code, _, err = _run([*ARGS, *argv, "--output.dir", str(out)], capsys)
    assert code == 2 and re.search(message, err), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_trl_users_messages_and_prompt_completion_files_train(tmp_path, capsys):
    """The README's trainer command plus --data.path and --model.path (a model folder carrying its
    tokenizer and chat template) trains on TRL's conversational and prompt-completion records."""
    from tests.trainer.test_formats import CHAT, SFT_RECORDS, make_tokenizer
    from tests.trainer.test_model import _model_folder

    folder = tmp_path / "model"
    make_tokenizer(folder)
    from transformers import AutoTokenizer

    _model_folder(folder, len(AutoTokenizer.from_pretrained(str(folder))))
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 6)
    pairs = write_jsonl(tmp_path / "pc.jsonl", SFT_RECORDS["prompt_completion"] * 6)
    for data in (chats, pairs):
        out = tmp_path / ("run_" + os.path.basename(data))
        code, _, err = _run(["--model.path", str(folder), "--data.path", data, "--output.dir", str(out), "--parallel.cp",
                             "none", "--training.steps", "2", "--data.seq_len", "256", "--model.tile_chunk", "0"], capsys)
        assert code == 0, err
        losses = _losses(out)
        assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)
        assert json.loads((out / "run.json").read_text())["data"]["assistant_only_loss"] is True


@pytest.mark.parametrize("objective", ["dpo", "rm"])
def test_conversational_preference_files_train_through_the_trainers_command(tmp_path, capsys, objective):
    """TRL's conversational preference records (explicit and implicit prompt) train DPO and a reward
    model with a model folder carrying a chat template."""
    from transformers import AutoTokenizer

    from tests.trainer.test_formats import PREFERENCE, make_tokenizer
    from tests.trainer.test_model import _model_folder

    folder = tmp_path / "model"
    make_tokenizer(folder)
    _model_folder(folder, len(AutoTokenizer.from_pretrained(str(folder))))
    data = write_jsonl(tmp_path / "pairs.jsonl", (PREFERENCE["chat_explicit"] + PREFERENCE["chat_implicit"]) * 4)
    out = tmp_path / "run"
    code, _, err = _run(["--model.path", str(folder), "--data.path", data, "--data.objective", objective, "--output.dir",
                         str(out), "--parallel.cp", "none", "--training.steps", "2", "--data.seq_len", "256",
                         "--model.tile_chunk", "0", "--training.warmup", "0"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["loss"] == r["loss"] for r in records)
    key = "rewards/margins" if objective == "dpo" else "accuracy"
    assert all(key in r for r in records) and records[0]["epoch"] > 0


def test_a_held_out_file_beside_a_split_dataset_needs_no_split(tmp_path, capsys):
    """data.path a saved dataset read at its 'test' split, eval.path a JSONL file: the file is its one
    split (eval.split empty), not refused for data.split's name."""
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:5]), "test": datasets.Dataset.from_list(RECORDS)}
                         ).save_to_disk(str(tmp_path / "saved"))
    held = write_jsonl(tmp_path / "held.jsonl", RECORDS[:4])
    capsys.readouterr()
    out = tmp_path / "run"
    code, _, err = _run([*ARGS, "--data.path", str(tmp_path / "saved"), "--data.split", "test", "--eval.path", held,
                         "--eval.examples", "4", "--eval.every", "3", "--output.dir", str(out)], capsys)
    assert code == 0, err
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [e["eval_examples"] for e in evals] == [4]
