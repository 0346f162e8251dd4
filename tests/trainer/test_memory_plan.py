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


# An 8B-shaped Llama in bf16: checkpoints of 8 GiB at 1M tokens; a stated budget by phase.
MARGIN = 1024  # fm_parallel.longcontext.memory.MARGIN_PER_TOKEN


def _shape():
    from fm_parallel.longcontext.memory import StepBudget

    lines = {"forward": (2 * GIB, 16 * 2**10), "loss_backward": (12 * GIB, 0.0), "layers_backward": (0.0, 40 * 2**10)}
    return dict(layers=32, hidden=4096, itemsize=2, static_bytes=20 * GIB, budget=StepBudget(lines))


def test_the_plan_takes_the_least_recompute_that_fits():
    from fm_parallel.longcontext.memory import plan_memory

    short = plan_memory(65536, **_shape(), device_budget=130 * GIB, host_budget=100 * GIB)
    assert (short.every, short.offload_layers, short.host_bytes) == (1, 0, 0)  # everything on the device
    # The loss's 12 GiB beside all 32 checkpoints of 0.5 GiB: 48 GiB, above the layers' 38; and the margin.
    assert (short.phase, short.device_bytes) == ("loss_backward", 48 * GIB + MARGIN * 65536)
    mid = plan_memory(524288, **_shape(), device_budget=130 * GIB, host_budget=100 * GIB)
    # 20 + 20 GiB, then the kept checkpoints below the last layer (4 GiB each): 23 kept, 9 on the host.
    assert (mid.every, mid.offload_layers, mid.phase) == (1, 9, "layers_backward")
    assert mid.device_bytes == (40 + 22 * 4) * GIB + MARGIN * 524288 and mid.host_bytes == 36 * GIB
    long = plan_memory(1 << 20, **_shape(), device_budget=130 * GIB, host_budget=100 * GIB)
    # Per layer: 32 x 8 GiB cannot fit in 130 + 100 GiB beside 60 GiB; one per 2 layers: 16, of which 8 on the
    # host; the last segment's backward holds the 7 kept below it and its other input.
    assert (long.every, long.offload_layers, long.phase) == (2, 16, "layers_backward")
    assert long.device_bytes == (60 + 7 * 8 + 1 * 8 + 1) * GIB and long.host_bytes == 64 * GIB


def test_the_plan_keeps_a_margin_per_token_in_every_phase():
    """The plan promises an upper bound; its lines, measured at two short lengths, miss by up to about
    0.75 KiB per token (measured, see ``MARGIN_PER_TOKEN``), so every phase's need carries 1 KiB more."""
    from fm_parallel.longcontext.memory import StepBudget, inputs_held

    budget = StepBudget({"forward": (1.0, 2.0), "loss_backward": (3.0, 0.0), "layers_backward": (0.0, 4.0)})
    for phase, (fixed, per_token) in budget.lines.items():
        got = StepBudget({phase: (fixed, per_token)}).need(10, 100.0, 32, 2, 5)
        assert got == (phase, fixed + (per_token + 1024) * 10 + inputs_held(phase, 32, 2, 5) * 100.0)
    assert MARGIN == 1024


@pytest.mark.parametrize("phase, every, offloaded, held", [
    ("forward", 3, 9, 2), ("loss_backward", 3, 9, 2), ("optimizer", 3, 9, 0),
    ("layers_backward", 3, 11, 2),  # all on the host: a segment's 2 other inputs
    ("layers_backward", 3, 9, 2),  # 2 kept: the last segment (2 layers) holds the one below it and 1 other input
    ("layers_backward", 3, 10, 2),  # 1 kept: the same as 2 kept (measured alike on the H100)
    ("layers_backward", 2, 7, 9),  # the H200's 1M run: 9 kept, the last holds the 8 below it and 1 other input
    ("layers_backward", 1, 0, 31),  # none offloaded, a checkpoint per layer: the 31 below the last
    ("layers_backward", 1, 32, 0),
    ("step", 3, 9, 4),  # a line not split by phase: every kept checkpoint and a segment's other inputs
])
def test_the_layer_inputs_each_phase_holds(phase, every, offloaded, held):
    from fm_parallel.longcontext.memory import inputs_held

    assert inputs_held(phase, 32, every, offloaded) == held


def test_the_plan_moves_as_the_measured_1m_runs_moved():
    """Three trainer runs of the same 1M config (8B shape, docs/long-context.md) peaked at 66.21 GiB
    (H100, every 3 layers, 1 of 11 checkpoints kept on the GPU), 66.2 (H100, every 3, 2 kept) and
    122.16 (H200, every 2, 9 of 16 kept). On one budget line, the plan's differences between those
    layouts are the measured ones: 0 GiB, then 56 (the old count of every kept checkpoint at the
    layers' backward gave 8 GiB between the first two)."""
    from fm_parallel.longcontext.memory import StepBudget, plan_memory

    shape = dict(layers=32, hidden=4096, itemsize=2, static_bytes=17.7 * GIB,
                 budget=StepBudget({"forward": (8 * GIB, 16 * 2**10), "loss_backward": (1 * GIB, 1 * 2**10),
                                    "layers_backward": (0.0, 32 * 2**10)}))

    def planned(every, offload_layers):
        return plan_memory(1 << 20, **shape, device_budget=1000 * GIB, host_budget=1000 * GIB, every=every,
                           offload_layers=offload_layers).device_bytes / GIB

    one, two, h200 = planned(3, 30), planned(3, 27), planned(2, 14)
    assert one == pytest.approx(two, abs=1e-6)
    assert h200 - one == pytest.approx(122.16 - 66.21, abs=0.1)


@pytest.mark.parametrize("per_kib, less_fixed_gib", [(32.51, 0.125), (32.01, 0.0)])  # two measurements, one session
def test_the_trainers_measured_line_plans_the_layouts_that_ran_at_1m_and_above_their_peaks(per_kib, less_fixed_gib):
    """The trainer's one-layer measurement of the 1M config on the H100 (2026-12-06), the layers'
    backward. With its input a leaf needing a gradient: 40 KiB per token, 17.87 GiB fixed with the
    other layers and the adapters (its plan printed 73.87 GiB for every 3 layers, 2 of 11 checkpoints
    kept). With the input's gradient dropped as a real layer's is (the plan's measurement now,
    ``launch/bench/one_layer_input.py``): 32.51 KiB per token and 0.125 GiB less fixed, and 32.01 at the
    same fixed in a second run. Without a margin that line predicts the layouts that ran 0.05-0.1 GiB
    above their peaks; with the plan's 1 KiB per token (1 GiB here) each is 0.6-1.1 GiB above its
    measured peak (66.21 GiB on the H100, every 3 layers; 122.16 on the H200, every 2 and 14
    offloaded; the leaf's line was 7.7 above), and with each GPU's budget (94% of 79.18 and of 139
    GiB; 75% of 125 GiB host) the plans are those layouts."""
    from fm_parallel.longcontext.memory import StepBudget, plan_memory

    fixed = 73.8735 * GIB - 16 * GIB - 40 * 2**10 * (1 << 20) - less_fixed_gib * GIB  # the printed plan, less 2 held inputs and the line
    shape = dict(layers=32, hidden=4096, itemsize=2, static_bytes=fixed,
                 budget=StepBudget({"forward": (0.0, 16 * 2**10), "layers_backward": (0.0, per_kib * 2**10)}))
    for (every, offloaded), measured in (((3, 27), 66.21), ((3, 30), 66.21), ((2, 14), 122.16)):
        planned = plan_memory(1 << 20, **shape, device_budget=1000 * GIB, host_budget=1000 * GIB, every=every,
                              offload_layers=offloaded).device_bytes / GIB
        assert measured + 0.6 < planned < measured + 1.2, (every, offloaded, planned)
    h100 = plan_memory(1 << 20, **shape, device_budget=0.94 * 79.18 * GIB, host_budget=0.75 * 125 * GIB)
    assert (h100.every, h100.offload_layers, h100.phase, h100.host_bytes) == (3, 27, "layers_backward", 72 * GIB)
    h200 = plan_memory(1 << 20, **shape, device_budget=0.94 * 139 * GIB, host_budget=0.75 * 125 * GIB)
    assert (h200.every, h200.offload_layers, h200.host_bytes) == (2, 14, 56 * GIB)


@pytest.mark.parametrize("n, offload_layers, planned_gib, measured_gib", [
    (262144, 12, 73.135, 73.009), (524288, 24, 71.271, 71.143), (1 << 20, 27, 69.657, 68.11)])
def test_the_scripts_measured_lines_plan_what_ran(n, offload_layers, planned_gib, measured_gib):
    """``max_context.py``'s calibration of the 8B shape on the H100 (its lines by phase, kept in
    docs/benchmarks) planned on that GPU's budget (94% of 79.18 GiB, ``--host-gib 100``): at 256k and
    512k the loss's backward, which holds every kept checkpoint, sets the plan, and the plans are the
    ones that ran (a checkpoint per layer, 12 and 24 offloaded: 72.9 and 70.8 GiB without the margin,
    measured 73.0 and 71.1: 0.12 and 0.37 GiB under; with the margin's 1 KiB per token 73.1 and 71.3,
    above); at 1M the layers' backward, every 3 layers (68.7 without the margin, 69.7 with it,
    measured 68.1 with all 11 checkpoints on the host). Counting each phase's held inputs changed the
    first two not at all; at 1M it keeps 2 of the 11 on the GPU at the same predicted peak (the last
    segment holds the one below it and its one other input, as an offloaded segment holds its two
    others: the trainer's runs with 1 and 2 kept peaked alike), 16 GiB less pinned."""
    import json
    from pathlib import Path

    from fm_parallel.longcontext.memory import StepBudget, plan_memory

    cal = json.loads((Path(__file__).parents[2] / "docs/benchmarks/max_context_runs/8b_h100_1m_by_phase_calibration.json").read_text())
    budget = StepBudget({p: (v["fixed_gib"] * GIB, v["bytes_per_token"]) for p, v in cal["lines"].items()})
    plan = plan_memory(n, layers=32, hidden=4096, itemsize=2, static_bytes=15.0708 * GIB, budget=budget,
                       device_budget=0.94 * 79.18 * GIB, host_budget=100 * GIB)
    assert plan.offload_layers == offload_layers and plan.every == (1 if n < (1 << 20) else 3)
    assert plan.phase == ("loss_backward" if n < (1 << 20) else "layers_backward")
    assert plan.device_bytes / GIB == pytest.approx(planned_gib, abs=0.02)
    assert measured_gib < plan.device_bytes / GIB < measured_gib + 1.6  # above each step, by its margin's 1 KiB per token


def test_the_step_budget_fits_a_line_per_phase_and_plans_on_the_one_that_needs_the_most():
    """Two short steps where the loss sets the overall peak: one line through the overall peaks follows
    the loss (flat) and misses the layers' line at 1M; the budget keeps both and takes, at each length,
    the phase that needs the most (figures near the H100's 8B shape, docs/long-context.md)."""
    from fm_parallel.longcontext.memory import StepBudget

    def layers(n):
        return 1.5 * GIB + 36 * 2**10 * n

    peaks = {n: {"forward": 3 * GIB, "loss_backward": 9 * GIB + 4 * n, "layers_backward": layers(n)}
             for n in (65536, 131072)}
    budget = StepBudget.fit(peaks)

    def need(n):  # every checkpoint on the host, a checkpoint per layer: the lines alone
        return budget.need(n, n * 4096 * 2, 32, 1, 32)

    assert need(65536)[0] == "loss_backward" and need(131072)[0] == "loss_backward"
    phase, needed = need(1 << 20)
    assert phase == "layers_backward" and abs(needed - layers(1 << 20) - MARGIN * (1 << 20)) < 1
    (n1, u1), (n2, u2) = [(n, max(p.values())) for n, p in sorted(peaks.items())]
    overall = u1 + (u2 - u1) / (n2 - n1) * ((1 << 20) - n1)  # the one line the script used to fit
    assert layers(1 << 20) - overall > 20 * GIB  # what that line would have missed at 1M
    assert StepBudget.fit({2: {"a": 5.0}, 1: {"a": 7.0}}).lines == {"a": (7.0, 0.0)}  # a falling slope: flat


@pytest.mark.parametrize("peaks, message", [
    ({1: {"forward": 1.0}}, r"peaks: expected the peaks at 2 lengths, got \[1\]"),
    ({0: {"forward": 1.0}, 2: {"forward": 1.0}}, r"peaks: expected 2 distinct lengths >= 1, got 0 and 2"),
    ({1: {"forward": 1.0}, 2: {"loss_backward": 1.0}}, r"peaks: no phase measured at both lengths"),
])
def test_the_step_budget_refuses_what_it_cannot_fit(peaks, message):
    from fm_parallel.longcontext.memory import StepBudget

    with pytest.raises(ValueError, match=message):
        StepBudget.fit(peaks)


def test_the_one_layer_measurement_ends_each_phase_where_the_trainer_step_changes_phase(monkeypatch):
    """Through capacity.measure_one_layer on the CPU, the allocator stood in by a log: the forward ends
    before the backward, the loss's backward ends when the final hidden state's gradient is complete,
    before any of the decoder layer's gradients, and by then that hidden state is freed (held by the
    loss's graph only, as in the trainer's step, not by the measurement: it once held it through the
    layer's backward, 8 GiB of the 8B shape at 1M above the trainer's runs). The layer's input needs a
    gradient, as a real layer's does."""
    from fm_parallel.trainer import capacity, model as trainer_model
    from tests.helpers import track_final_hidden_states
    from fm_parallel.trainer.config import load_config
    from tests.helpers import TINY

    log = []
    clock = iter(range(1, 10**6))
    real_peaks = capacity.PhasePeaks

    def phase_peaks(device):
        peaks = real_peaks(read=lambda: float(next(clock)), reset=lambda: None, allocated=lambda: 0.0)
        real_end = peaks.end
        peaks.end = lambda phase: (log.append(phase), real_end(phase))
        return peaks

    made = track_final_hidden_states(monkeypatch)
    monkeypatch.setattr(capacity, "PhasePeaks", phase_peaks)
    real_build = trainer_model.build_model

    inputs = []  # per step: whether the layer's input needed a gradient and was a leaf, then that dx came
    held = []  # the layer's inputs, to see afterwards that none kept its gradient

    def layer_input(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        inputs.append((x.requires_grad, x.is_leaf))
        held.append(x)
        if x.requires_grad:
            x.register_hook(lambda g: inputs.append("dx"))

    def build(*a, **k):  # the layer's gradient: logged with whether the final hidden state is alive then
        model = real_build(*a, **k)
        for name, p in model.named_parameters():
            if p.requires_grad and ".layers.0." in name:
                p.register_hook(lambda g: log.append(("layer grad", made[-1]() is not None)))
        from fm_parallel.longcontext.memory import decoder_layers

        decoder_layers(model)[0].register_forward_pre_hook(layer_input, with_kwargs=True)
        return model

    monkeypatch.setattr(trainer_model, "build_model", build)
    cfg = load_config([*TINY, "--model.tile_chunk", "32"], environ={})
    got = capacity.measure_one_layer(cfg, torch.device("cpu"), 64, (64, 128))
    assert sorted(got["peaks"]) == [64, 128]
    assert all(list(p) == ["forward", "loss_backward", "layers_backward"] for p in got["peaks"].values())
    starts = [i for i, e in enumerate(log) if e == "forward"]
    assert len(starts) == 2
    for step in (log[:starts[1]], log[starts[1]:]):
        assert step[:2] == ["forward", "loss_backward"] and step[-1] == "layers_backward"
        assert step[2:-1] and all(e == ("layer grad", False) for e in step[2:-1])
    # As every real layer but the first: its input needs a gradient, so its backward makes dx (tiling.py
    # allocates it only then; without it the plan was one checkpoint's size short). Not a leaf, and
    # its gradient is not kept: as the layer below consumes dx (a leaf's .grad was 8 KiB per token
    # more than the real layers' at 1M, measured).
    assert inputs == [(True, False), "dx", (True, False), "dx"]
    assert all(x.grad is None for x in held)


def test_a_length_no_plan_fits_is_refused_naming_what_it_needs():
    from fm_parallel.longcontext.memory import MemoryPlanError, plan_memory

    with pytest.raises(MemoryPlanError, match=r"n: 4194304 tokens do not fit: the closest plan needs [\d.]+ GiB on the device "
                                              r"and [\d.]+ GiB of host memory, this machine gives 130.0 GiB and 100.0 GiB"):
        plan_memory(1 << 22, **_shape(), device_budget=130 * GIB, host_budget=100 * GIB)
    fixed = plan_memory(1 << 20, **_shape(), device_budget=1000 * GIB, host_budget=0, every=4, offload_layers=0)
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
    from fm_parallel.longcontext.memory import MemoryPlan, plan_shortfall

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
    from fm_parallel.longcontext.memory import MemoryPlan

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
    from tests.helpers import TINY

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


def test_the_one_layer_input_script_measures_each_variant_at_the_plans_lengths(monkeypatch, capsys):
    """``launch/bench/one_layer_input.py``, without a GPU's allocator: each variant is the layer input
    the measurement is given (the dropped gradient the plan's default), at the lengths the plan
    measures."""
    import inspect
    import json

    from fm_parallel.trainer import capacity
    from launch.bench import one_layer_input as script

    seen = []

    def measure(cfg, device, vocab_size, lengths, *, layer_input):
        out = layer_input(None, (), torch.ones(2))
        seen.append((lengths, out.requires_grad, out.is_leaf))
        assert vocab_size == 258  # the config's tokenizer (bytes), as the trainer plans with
        return {"static": GIB, "peaks": {n: {"layers_backward": n * 1024.0} for n in lengths}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test")
    monkeypatch.setattr(capacity, "measure_one_layer", measure)
    script.main(["--config", str(script.ROOT / "launch/configs/h200_8b_1m.toml")])
    assert seen == [((131072, 262144), True, False), ((131072, 262144), True, True), ((131072, 262144), False, True)]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in rows] == ["dropped", "leaf", "none"]
    assert rows[0]["lines"]["layers_backward"] == pytest.approx([0.0, 1.0])
    monkeypatch.undo()
    default = inspect.signature(capacity.measure_one_layer).parameters["layer_input"].default
    assert default is capacity.dropped_gradient_input is script.VARIANTS["dropped"]


def test_the_one_layer_input_script_measures_with_the_runs_tokenizer(monkeypatch, tmp_path, capsys):
    """A config with its own tokenizer: the one layer is measured with that vocabulary (the loss's
    chunks over it are in the lines), as the trainer's plan is, not the byte tokenizer's 258."""
    from fm_parallel.trainer import capacity
    from launch.bench import one_layer_input as script
    from tests.trainer.test_model import _tokenizer

    tok = _tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    config = (script.ROOT / "launch/configs/h200_8b_1m.toml").read_text()
    assert "\n[data]\n" in config
    (tmp_path / "run.toml").write_text(config.replace("\n[data]\n", f"\n[data]\ntokenizer = \"{tmp_path / 'tok'}\"\n"))
    vocab = []

    def measure(cfg, device, vocab_size, lengths, *, layer_input):
        vocab.append(vocab_size)
        return {"static": GIB, "peaks": {n: {"layers_backward": n * 1024.0} for n in lengths}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test")
    monkeypatch.setattr(capacity, "measure_one_layer", measure)
    script.main(["--config", str(tmp_path / "run.toml"), "--variants", "dropped"])
    assert vocab == [len(tok)] and len(tok) != 258
