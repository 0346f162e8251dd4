"""Full-parameter training in the trainer (``model.finetune = "full"``, issue 52 item 2): every weight
trained, sharded with FSDP2 over every rank, composed with the CP layouts, on 1, 2 and 4 gloo ranks
with a float64 tiny Llama:

- per-step losses and every parameter after the run (the exported model) equal one process's (1e-10)
  for cp none over 2 ranks (data parallel), ring, Ulysses, hybrid 2 x 2 and ring 2 x dp 2, and with
  checkpoints every 2 and every 3 of 4 layers (one FSDP unit per checkpoint segment);
- each rank holds 1/world of a layer's weight (an FSDP2 ``DTensor`` shard);
- a run stopped after 2 steps on 4 ranks resumes on 2 and gives the uninterrupted run's next losses;
- the exported folder loads with ``AutoModelForCausalLM.from_pretrained`` and reproduces the last
  logged eval loss;
- what full training does not do yet is refused by name (the memory plan).
"""

import json
from pathlib import Path

import pytest
import torch

from fm_parallel.trainer.config import load_config
from tests.distributed.spawn import run_cases

pytest.importorskip("transformers")

TINY = ["--model.hidden_size", "32", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
        "--model.intermediate_size", "64", "--model.dtype", "float64", "--model.finetune", "full", "--data.seq_len", "128",
        "--training.steps", "4", "--training.warmup", "1", "--training.loss_chunk", "64", "--output.checkpoint_every", "0",
        "--eval.rows", "1", "--eval.every", "100"]
TOL = 1e-10


def _train(rank, world, argv, out):
    from fm_parallel.trainer.loop import train

    train(load_config(argv + ["--output.dir", out], environ={}))
    return {"ok": True}


def _shards(rank, world):
    """What a rank of a sharded model holds: each decoder weight a DTensor of 1/world of its rows."""
    from torch.distributed.tensor import DTensor

    from fm_parallel.trainer.model import build_model

    model = build_model(load_config(TINY + ["--parallel.cp", "none"], environ={}), 258, torch.device("cpu"))
    weight = model.get_base_model().model.layers[0].mlp.gate_proj.weight
    return {"dtensor": isinstance(weight, DTensor), "local": list(weight.to_local().shape), "global": list(weight.shape),
            "trainable": all(p.requires_grad for p in model.parameters())}


def _units(rank, world):
    """Which decoder layers share an FSDP unit with checkpoints every 2 of 4 layers."""
    from fm_parallel.trainer.model import build_model

    cfg = load_config(TINY + L4 + ["--parallel.cp", "none", "--model.checkpoint_every", "2"], environ={})
    layers = build_model(cfg, 258, torch.device("cpu")).get_base_model().model.layers
    state = [layer._get_fsdp_state() for layer in layers]
    return {"shared": [state[i] is state[i + 1] for i in range(3)]}


def _records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
    return [r["loss"] for r in _records(out) if "loss" in r]


def _weights(out) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(out) / "model" / "model.safetensors"))


# name -> (world, extra arguments); "single" and "single_ga2" are the one-process references
# (ga2: two rows a step, as two data-parallel ranks take).
RUNS = {"single": (1, ["--parallel.cp", "none"]), "single_ga2": (1, ["--parallel.cp", "none", "--training.grad_accum", "2"]),
        "dp2": (2, ["--parallel.cp", "none"]), "ring2": (2, ["--parallel.cp", "ring"]),
        "ulysses2": (2, ["--parallel.cp", "ulysses", "--parallel.balance", "contiguous"]),
        "hybrid4": (4, ["--parallel.cp", "hybrid", "--parallel.ulysses_degree", "2"]),
        "ring2_dp2": (4, ["--parallel.cp", "ring", "--parallel.cp_degree", "2"])}
# float32 (the CPU default): gloo has no PREMUL_SUM / AVG, which FSDP2 picks for float32 gradients unless
# told to sum (float64 takes the summing path anyway, so only this case catches it).
FP32 = ["--model.dtype", "float32"]
RUNS.update({"single_ga2_fp32": (1, ["--parallel.cp", "none", "--training.grad_accum", "2"] + FP32),
             "ring2_dp2_fp32": (4, ["--parallel.cp", "ring", "--parallel.cp_degree", "2"] + FP32)})
# Checkpoints every k of 4 layers: a segment is one FSDP unit (its first layer runs the others' forwards).
L4 = ["--model.layers", "4"]
RUNS.update({"single_l4": (1, ["--parallel.cp", "none"] + L4),
             "ring2_k2": (2, ["--parallel.cp", "ring", "--model.checkpoint_every", "2"] + L4),
             "ulysses2_k3": (2, ["--parallel.cp", "ulysses", "--model.checkpoint_every", "3"] + L4)})
SAME_AS = {"dp2": "single_ga2", "ring2": "single", "ulysses2": "single", "hybrid4": "single", "ring2_dp2": "single_ga2",
           "ring2_k2": "single_l4", "ulysses2_k3": "single_l4"}
# The resume: 4 ranks (ring 2 x dp 2) stop after 2 steps; 2 ranks (dp 2) go on from that checkpoint.
STOP = ["--parallel.cp", "ring", "--parallel.cp_degree", "2", "--output.stop_after", "2"]
GO_ON = ["--parallel.cp", "none", "--output.resume", "true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    out = {}
    for world in (1, 2, 4):
        cases = {name: (_train, (TINY + extra, str(tmp / name))) for name, (w, extra) in RUNS.items() if w == world}
        if world == 4:
            cases["stop"] = (_train, (TINY + STOP, str(tmp / "resumed")))
        if world == 2:
            cases["shards"] = (_shards, ())
            cases["units"] = (_units, ())
        out.update(run_cases(world, cases, timeout=600))
    out.update(run_cases(2, {"go_on": (_train, (TINY + GO_ON, str(tmp / "resumed")))}, timeout=600))
    return tmp, out


def test_every_layout_gives_one_process_losses_and_weights(runs):
    tmp, results = runs
    for name in RUNS:
        assert all("exception" not in r for r in results[name]), (name, [r.get("traceback") for r in results[name]])
    for name, reference in SAME_AS.items():
        got, want = _losses(tmp / name), _losses(tmp / reference)
        assert len(got) == 4 and got == pytest.approx(want, rel=TOL, abs=TOL), (name, got, want)
        mine, theirs = _weights(tmp / name), _weights(tmp / reference)
        assert mine.keys() == theirs.keys() and len(mine) > 10
        for key, value in theirs.items():
            assert (mine[key] - value).abs().max() <= TOL * max(value.abs().max().item(), 1.0), (name, key)


def test_float32_sums_gradients_on_gloo_as_one_process(runs):
    tmp, results = runs
    assert all("exception" not in r for r in results["ring2_dp2_fp32"]), [r.get("traceback") for r in results["ring2_dp2_fp32"]]
    got, want = _losses(tmp / "ring2_dp2_fp32"), _losses(tmp / "single_ga2_fp32")
    assert len(got) == 4 and got == pytest.approx(want, rel=1e-5), (got, want)


def test_a_checkpoint_segment_is_one_fsdp_unit(runs):
    _, results = runs
    for r in results["units"]:
        assert r == {"shared": [True, False, True]}, r  # layers 0-1 and 2-3


def test_the_weights_move_and_each_rank_holds_its_shard(runs):
    tmp, results = runs
    losses = _losses(tmp / "single")
    assert losses[-1] < losses[0]
    for r in results["shards"]:
        assert r == {"dtensor": True, "local": [32, 32], "global": [64, 32], "trainable": True}, r


def test_a_run_stopped_on_4_ranks_resumes_on_2_with_the_same_losses(runs):
    tmp, results = runs
    for key in ("stop", "go_on"):
        assert all("exception" not in r for r in results[key]), (key, [r.get("traceback") for r in results[key]])
    got, want = _losses(tmp / "resumed"), _losses(tmp / "single_ga2")
    assert len(got) == 4 and got == pytest.approx(want, rel=TOL, abs=TOL), (got, want)


def test_the_export_loads_with_from_pretrained_and_gives_the_last_eval_loss(runs):
    from transformers import AutoModelForCausalLM

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.trainer.data import ByteTokenizer, sft_rows

    tmp, _ = runs
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "ring2" / "model"), attn_implementation=fm_hf.register())
    assert model.dtype == torch.float64
    row = next(sft_rows(128, ByteTokenizer()))  # the held-out row: the stream's first
    with torch.no_grad():
        logits = model(input_ids=row.input_ids.view(1, -1), position_ids=row.positions.view(1, -1), flashmask=row.mask).logits
    loss = torch.nn.functional.cross_entropy(logits[0], row.labels, ignore_index=-100)
    evals = [r["eval_loss"] for r in _records(tmp / "ring2") if "eval_loss" in r]
    assert evals and loss.item() == pytest.approx(evals[-1], rel=1e-9), (loss.item(), evals)


@pytest.mark.parametrize("extra, message", [
    (["--model.memory_plan", "auto"], "model.memory_plan: expected 'fixed' with model.finetune = 'full'"),
    (["--model.finetune", "lora", "--model.offload_optimizer", "true"], "model.offload_optimizer: expected model.finetune = 'full'"),
])
def test_what_full_training_does_not_do_yet_is_refused_by_name(tmp_path, extra, message):
    from fm_parallel.trainer.loop import train

    with pytest.raises(ValueError, match=message):
        train(load_config(TINY + ["--parallel.cp", "none", "--output.dir", str(tmp_path / "x")] + extra, environ={}))
    assert not (tmp_path / "x").exists()


def test_the_export_command_points_a_full_run_to_its_model_folder(runs):
    from fm_parallel.trainer.config import ConfigError
    from fm_parallel.trainer.export import convert_checkpoint

    tmp, _ = runs
    with pytest.raises(ConfigError, match=r"run_dir: expected a LoRA run .* got a model.finetune = 'full' run, .*step_000004/model"):
        convert_checkpoint(tmp / "single")
