"""Objectives own their data check: the fields a JSONL record holds and what else it must satisfy
(``Objective.FIELDS`` / ``check_record``), run before training by ``preflight``; data.py knows no
objective by name. A new objective is one class."""

import json

import pytest

from fm_parallel.trainer.config import load_config
from fm_parallel.trainer.data import ByteTokenizer, DataError
from fm_parallel.trainer.objectives import OBJECTIVES, SFT, Objective
from fm_parallel.trainer.preflight import preflight

TOK = ByteTokenizer()


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_each_objective_validates_its_own_format(tmp_path):
    sft = write(tmp_path / "sft.jsonl", [{"text": "a"}, {"text": "b"}])
    dpo = write(tmp_path / "dpo.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    cfg = load_config([], environ={})
    assert OBJECTIVES["sft"](cfg).validate(sft, TOK) == 2
    assert OBJECTIVES["dpo"](cfg).validate(dpo, TOK) == 1
    with pytest.raises(DataError, match=r"sft.jsonl:1: expected a preference record of one of the formats "
                                        r"\{\"prompt\", \"chosen\", \"rejected\"\}.*got fields \{'text': 'a string'\}"):
        OBJECTIVES["dpo"](cfg).validate(sft, TOK)
    with pytest.raises(DataError, match=r"dpo.jsonl:1: expected an SFT record of one of the formats \{\"text\": str\}"):
        SFT(cfg).validate(dpo, TOK)


def test_a_new_objective_is_one_class_with_its_own_record_check(tmp_path):
    class Pairs(Objective):
        name = "pairs"
        FIELDS = ("question", "answer")

        def check_record(self, where, record, tokenizer):
            super().check_record(where, record, tokenizer)  # the FIELDS are strings
            if record["question"] == record["answer"]:
                raise DataError(f"{where}: expected an answer other than the question")

    path = write(tmp_path / "p.jsonl", [{"question": "q", "answer": "a"}, {"question": "x", "answer": "x"}])
    obj = Pairs(load_config([], environ={}))
    with pytest.raises(DataError, match=r"p.jsonl:2: expected an answer other than the question"):
        obj.validate(path, TOK)
    with pytest.raises(DataError, match=r"t.jsonl:1: expected string fields \['question', 'answer'\], missing or not a "
                                        r"string: \['answer'\]"):
        obj.validate(write(tmp_path / "t.jsonl", [{"question": "q"}]), TOK)


def test_preflight_runs_the_configured_objectives_check(tmp_path):
    sample = {"prompt": "p" * 40, "chosen": "c" * 50, "rejected": "r" * 45}
    path = write(tmp_path / "d.jsonl", [sample])
    fits = load_config(["--data.objective", "dpo", "--data.path", path, "--data.seq_len", "256"], environ={})
    preflight(fits, TOK, None)
    short = load_config(["--data.objective", "dpo", "--data.path", path, "--data.seq_len", "128"], environ={})
    with pytest.raises(DataError, match=r"d.jsonl:1: a DPO sample of 136 tokens .* does not fit data.seq_len = 128"):
        preflight(short, TOK, None)
    separate = load_config(["--data.objective", "dpo", "--data.path", path, "--data.seq_len", "160",
                            "--data.dpo_layout", "separate"], environ={})
    with pytest.raises(DataError, match=r"a DPO sample of 175 tokens \(2 x prompt 40"):
        preflight(separate, TOK, None)
    # SFT has no length rule: a record longer than a row is trained in pieces.
    preflight(load_config(["--data.path", write(tmp_path / "s.jsonl", [{"text": "x" * 500}]), "--data.seq_len", "64"],
                          environ={}), TOK, None)


