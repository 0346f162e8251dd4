"""Checkpoints kept every k layers (the layers between recomputed from them) and the memory plan
(issue 33): the step is exact (losses and LoRA gradients equal to a checkpoint per layer), it keeps
``ceil(L / k)`` layer inputs instead of L, and the plan for a stated device and host budget picks the
least recompute that fits or refuses naming what the length needs."""

import math

import pytest
import torch

from fm_parallel import masks
from tests.helpers import tiny_lora_llama

pytest.importorskip("transformers")
pytest.importorskip("peft")
GIB = 2**30


def _model(layers: int, every: int | None, offload: int = 0, dtype: str = "float64"):
    if every is None:
        return tiny_lora_llama("--model.activation_checkpointing", "false", layers=layers, dtype=dtype)
    return tiny_lora_llama("--model.checkpoint_every", str(every), "--model.offload_layers", str(offload), layers=layers,
                           dtype=dtype)


def _step(model, n: int = 300):
    from fm_parallel.trainer.model import hidden

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (1, n), generator=g)
    mask = masks.document([100, 120, 80])
    h = hidden(model, ids, torch.arange(n).view(1, n), mask, None, "auto")
    logits = model.get_base_model().lm_head(h).double()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


@pytest.mark.parametrize("every, offload", [(2, 0), (3, 0), (2, -1), (5, 3)])
def test_a_checkpoint_every_k_layers_gives_the_per_layer_loss_and_gradients(every, offload):
    layers = 5
    want_loss, want = _step(_model(layers, None))
    got_loss, got = _step(_model(layers, every, offload))
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    assert set(got) == set(want) and len(got) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_only_every_kth_layer_input_is_kept(every):
    """All checkpoints offloaded: the host holds exactly ceil(L / k) inputs [1, n, hidden] (fp64)."""
    layers, n = 5, 300
    model = _model(layers, every, offload=-1)
    model.checkpoint_policy.reset()
    _step(model, n)
    assert model.checkpoint_policy.host_bytes == math.ceil(layers / every) * n * 32 * 8


def test_generation_and_no_grad_forwards_run_every_layer_once():
    """Outside autograd a segment runs its layers plainly: the same logits as the model without checkpoints."""
    from fm_parallel.trainer.model import hidden

    ids, n = torch.randint(0, 258, (1, 64), generator=torch.Generator().manual_seed(1)), 64
    with torch.no_grad():
        want = hidden(_model(4, None), ids, torch.arange(n).view(1, n), masks.causal(n), None, "auto")
        got = hidden(_model(4, 3), ids, torch.arange(n).view(1, n), masks.causal(n), None, "auto")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_checkpoint_every_is_validated(tmp_path):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    with pytest.raises(ValueError, match=r"model.checkpoint_every: expected 1..2 \(model.layers\), got 3"):
        train(load_config(["--model.layers", "2", "--model.checkpoint_every", "3", "--parallel.cp", "none",
                           "--output.dir", str(tmp_path)], environ={}))
    with pytest.raises(ValueError, match="checkpoint_every: expected a value >= 1, got 0"):
        load_config(["--model.checkpoint_every", "0"], environ={})


# An 8B-shaped Llama in bf16 at 1M tokens: checkpoints of 8 GiB, a stated budget.
SHAPE = dict(layers=32, hidden=4096, itemsize=2, fixed_bytes=20 * GIB, bytes_per_token=40 * 2**10)


def test_the_plan_takes_the_least_recompute_that_fits():
    from fm_parallel.trainer.memory import plan_memory

    short = plan_memory(65536, **SHAPE, device_budget=130 * GIB, host_budget=100 * GIB)
    assert (short.every, short.offload_layers, short.host_bytes) == (1, 0, 0)  # everything on the device
    mid = plan_memory(524288, **SHAPE, device_budget=130 * GIB, host_budget=100 * GIB)
    # 20 + 20 GiB, then 4 GiB checkpoints: 22 on the device, 10 on the host.
    assert (mid.every, mid.offload_layers) == (1, 10) and mid.device_bytes <= 130 * GIB and mid.host_bytes == 40 * GIB
    long = plan_memory(1 << 20, **SHAPE, device_budget=130 * GIB, host_budget=100 * GIB)
    # Per layer: 32 x 8 GiB cannot fit in 130 + 100 GiB beside 60 GiB; one per 2 layers: 16, of which 9 on the
    # host, 7 on the device, and the other input of the segment being recomputed.
    assert (long.every, long.offload_layers) == (2, 18)
    assert long.device_bytes == (60 + 7 * 8 + 1 * 8) * GIB and long.host_bytes == 72 * GIB


def test_the_plan_holds_the_measured_1m_run():
    """The H100 run at 1M (docs/long-context.md): 27.2 GiB fixed with the weights, 24108 bytes per
    token (packed documents), a checkpoint every 3 layers with 9 of 11 on the host peaked at 66.2 GiB.
    The plan for that layout is above the measurement (never a plan that does not fit), and on that
    GPU's budget (74.4 GiB, 94.4 GiB host) the plan fits 1M: every 3 layers, all 11 on the host."""
    from fm_parallel.trainer.memory import plan_memory

    shape = dict(layers=32, hidden=4096, itemsize=2, fixed_bytes=27.2 * GIB, bytes_per_token=24108)
    run = plan_memory(1 << 20, **shape, device_budget=1000 * GIB, host_budget=1000 * GIB, every=3, offload_layers=27)
    assert 66.2 * GIB <= run.device_bytes <= 85 * GIB and run.host_bytes == 72 * GIB
    h100 = plan_memory(1 << 20, **shape, device_budget=74.4 * GIB, host_budget=94.4 * GIB)
    assert (h100.every, h100.offload_layers) == (3, -1) and h100.device_bytes <= 74.4 * GIB


def test_a_length_no_plan_fits_is_refused_naming_what_it_needs():
    from fm_parallel.trainer.memory import MemoryPlanError, plan_memory

    with pytest.raises(MemoryPlanError, match=r"n: 4194304 tokens do not fit: the closest plan needs [\d.]+ GiB on the device "
                                              r"and [\d.]+ GiB of host memory, this machine gives 130.0 GiB and 100.0 GiB"):
        plan_memory(1 << 22, **SHAPE, device_budget=130 * GIB, host_budget=100 * GIB)
    fixed = plan_memory(1 << 20, **SHAPE, device_budget=1000 * GIB, host_budget=0, every=4, offload_layers=0)
    assert (fixed.every, fixed.offload_layers) == (4, 0)


def test_the_trainer_command_with_a_checkpoint_every_2_layers_trains_the_same_losses(tmp_path):
    """Through the trainer's own entry (what launch/train.py runs): the key reaches the model build."""
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    args = ["--model.hidden_size", "64", "--model.layers", "4", "--model.intermediate_size", "128", "--data.seq_len", "512",
            "--training.steps", "2", "--parallel.cp", "none", "--output.checkpoint_every", "0"]
    plain = train(load_config(args + ["--output.dir", str(tmp_path / "a")], environ={}))
    every = train(load_config(args + ["--output.dir", str(tmp_path / "b"), "--model.checkpoint_every", "2",
                                      "--model.offload_layers", "-1"], environ={}))
    assert (every["first_loss"], every["final_loss"]) == (plain["first_loss"], plain["final_loss"])
    import json

    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["host_gib"] * GIB == 2 * 512 * 64 * 4  # ceil(4 / 2) layer inputs [1, 512, 64] fp32, not 4


def test_a_step_above_its_plan_is_named_with_the_amount():
    from fm_parallel.trainer.memory import MemoryPlan, plan_shortfall

    plan = MemoryPlan(1 << 20, 3, -1, int(66.5 * GIB), 88 * GIB)
    assert plan_shortfall(plan, 66.5 * GIB) is None and plan_shortfall(None, 1e12) is None
    assert plan_shortfall(MemoryPlan(8, 1, 0, 0, 0), 1e12) is None  # nothing predicted (no GPU)
    line = plan_shortfall(plan, 76.1 * GIB)
    assert line.startswith("memory plan missed: the step peaked at 76.1 GiB on the device, 9.6 GiB above the plan's 66.5 GiB")
    assert "1048576 tokens" in line and "every 3" in line and "model.device_memory_gib" in line


def _train_with_a_plan(rank, world, argv, out, device_bytes):
    """The trainer with ``plan_run`` standing in for the GPU's plan (the CPU plans nothing): its
    printed lines (rank 0's progress notes among them)."""
    import contextlib
    import io

    import fm_parallel.trainer.loop as loop
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.memory import MemoryPlan

    loop.plan_run = lambda cfg, *a, **k: MemoryPlan(cfg.data.seq_len, 1, 0, device_bytes, 0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        loop.train(load_config(argv + ["--output.dir", out], environ={}))
    return {"printed": printed.getvalue()}


@pytest.mark.parametrize("room", ["short", "enough"])
def test_the_trainer_says_once_when_a_step_peaks_above_its_plan(tmp_path, room):
    """Every step's record carries the plan's prediction beside the measured peak; a step above it is
    said once, on rank 0, naming both (a promise broken silently is the worst kind)."""
    import json

    from tests.distributed.spawn import run_ranks
    from tests.trainer.test_runs import TINY

    device_bytes = 1 if room == "short" else 1 << 50  # the CPU's peak resident set stands in for the GPU's peak
    out = str(tmp_path / "run")
    (result,) = run_ranks(_train_with_a_plan, 1, TINY + ["--training.steps", "3"], out, device_bytes, timeout=300)
    assert "exception" not in result, result.get("traceback")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["planned_gib"] for r in records if "loss" in r] == [device_bytes / GIB] * 3
    said = [line for line in result["printed"].splitlines() if "memory plan missed" in line]
    assert len(said) == (1 if room == "short" else 0), result["printed"]
    if said:
        assert said[0].startswith("warning: memory plan missed: the step peaked at")
