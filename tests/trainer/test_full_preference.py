"""Full-parameter preference objectives in the trainer (``model.finetune = "full"``), float64 tiny
Llama, gloo.

DPO (``data.objective = "dpo"``): the reference is a frozen copy of the initial weights, sharded
beside the trained model:

- the first steps' loss is log 2 (policy = reference) and the loss then moves;
- ring and Ulysses on 2 ranks give one process's per-step losses and DPO metrics (1e-10), and so does
  ring 2 with a checkpoint every 2 of 4 layers (the trained model one FSDP unit per segment, the
  reference, whose layers no checkpoint wraps, one per layer);
- a run stopped after 2 steps on 2 ranks resumes in one process with the uninterrupted losses: the
  reference is rebuilt from the initial weights, not from the checkpoint (which holds the trained
  ones); the checkpoint and the export hold the trained model only.

A reward model (``data.objective = "rm"``, every weight and the score head): ring 2 gives one
process's losses and metrics (1e-10), and the export loads with
``AutoModelForSequenceClassification.from_pretrained`` (one label, float64, the trained score head).
"""

import json
import math
from pathlib import Path

import pytest

from fm_parallel.trainer.config import load_config
from tests.distributed.spawn import run_cases
from tests.trainer.test_full import TINY

pytest.importorskip("transformers")

DPO = TINY + ["--data.objective", "dpo", "--training.steps", "5", "--output.checkpoint_every", "2"]
RM = TINY + ["--data.objective", "rm"]
RUNS = {"ring2": (2, DPO + ["--parallel.cp", "ring"]),
        "ulysses2": (2, DPO + ["--parallel.cp", "ulysses", "--parallel.balance", "contiguous"]),
        "stop": (2, DPO + ["--parallel.cp", "ring", "--output.stop_after", "2"]),
        "rm_ring2": (2, RM + ["--parallel.cp", "ring"]),
        "ring2_k2": (2, DPO + ["--parallel.cp", "ring", "--model.layers", "4", "--model.checkpoint_every", "2"])}
RM_KEYS = ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _train(rank, world, argv, out):
    from fm_parallel.trainer.loop import train

    train(load_config(argv + ["--output.dir", out], environ={}))
    return {"ok": True}


def _steps(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full_dpo")
    results = run_cases(2, {name: (_train, (argv, str(tmp / ("resumed" if name == "stop" else name))))
                            for name, (_, argv) in RUNS.items()}, timeout=600)
    results.update(run_cases(1, {"single": (_train, (DPO + ["--parallel.cp", "none"], str(tmp / "single"))),
                                 "go_on": (_train, (DPO + ["--parallel.cp", "none", "--output.resume", "true"],
                                                    str(tmp / "resumed"))),
                                 "rm_single": (_train, (RM + ["--parallel.cp", "none"], str(tmp / "rm_single"))),
                                 "single_l4": (_train, (DPO + ["--parallel.cp", "none", "--model.layers", "4"],
                                                        str(tmp / "single_l4")))},
                             timeout=600))
    for name, res in results.items():
        assert all("exception" not in r for r in res), (name, [r.get("traceback") for r in res])
    return tmp


def test_full_dpo_starts_at_log_2_and_learns(runs):
    steps = _steps(runs / "single")
    assert len(steps) == 5
    # Step 1 trains at learning rate 0 (HF's warm-up starts there): steps 1 and 2 see the initial weights.
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-12) and steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert steps[2]["loss"] != pytest.approx(math.log(2), abs=1e-6)
    assert steps[2]["rewards/margins"] != 0


@pytest.mark.parametrize("name, reference", [("ring2", "single"), ("ulysses2", "single"), ("ring2_k2", "single_l4")])
def test_full_dpo_on_2_ranks_gives_one_process_steps(runs, name, reference):
    got, want = _steps(runs / name), _steps(runs / reference)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-10, abs=1e-10), (name, key, g, w)


def test_a_resumed_full_dpo_run_keeps_the_initial_reference(runs):
    got, want = _steps(runs / "resumed"), _steps(runs / "single")
    assert [s["step"] for s in got] == [1, 2, 3, 4, 5]
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-10, abs=1e-10), (key, g, w)
    from safetensors.torch import load_file

    weights = load_file(str(runs / "single" / "model" / "model.safetensors"))
    assert weights and not any("reference" in k for k in weights)


def test_a_full_reward_model_on_2_ranks_gives_one_process_steps_and_loads(runs):
    import torch
    from transformers import AutoModelForSequenceClassification

    got, want = _steps(runs / "rm_ring2"), _steps(runs / "rm_single")
    assert len(got) == len(want) == 4 and want[-1]["loss"] != want[0]["loss"]
    for g, w in zip(got, want):
        for key in RM_KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-10, abs=1e-10), (key, g, w)
    model = AutoModelForSequenceClassification.from_pretrained(str(runs / "rm_ring2" / "model"))
    assert model.config.num_labels == 1 and model.dtype == torch.float64
    from safetensors.torch import load_file

    saved = load_file(str(runs / "rm_ring2" / "model" / "model.safetensors"))
    assert torch.equal(model.score.weight, saved["score.weight"])
