"""The memory plan as a public function (``fm_parallel.longcontext.plan_long_context``): stated device
and host memory and a stated step budget give a layout (a checkpoint every k layers, the first c on the
host) or a refusal naming the GiB the closest layout needs and the GiB given; the model's static
memory counts its parameters and, for the trainable ones, their gradients and AdamW states."""

import pytest

from tests.helpers import tiny_llama

peft = pytest.importorskip("peft")

GIB = 2**30


def _lora_model():
    model = tiny_llama("sdpa")  # float64: 2 layers, hidden 64
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).double()


def test_static_bytes_count_parameters_and_the_trainables_gradients_and_adamw_states():
    from fm_parallel.longcontext import static_bytes

    model = _lora_model()
    frozen = sum(p.numel() * 8 for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)
    assert trained > 0 and static_bytes(model) == frozen + 4 * trained  # weight, gradient, 2 moments
    assert static_bytes(model, optimizer_states=0) == frozen + 2 * trained
    full = tiny_llama("sdpa")
    assert static_bytes(full) == 4 * sum(p.numel() * 8 for p in full.parameters())
    with pytest.raises(ValueError, match=r"optimizer_states: expected an int >= 0, got -1"):
        static_bytes(model, optimizer_states=-1)


def _budget(fixed_gib: float, per_token: float):
    from fm_parallel.longcontext import StepBudget

    return StepBudget({"forward": (fixed_gib * GIB / 2, per_token / 2), "layers_backward": (fixed_gib * GIB, per_token)})


def test_stated_budgets_give_the_least_recompute_then_the_fewest_host_copies():
    from fm_parallel.longcontext import plan_long_context, static_bytes
    from fm_parallel.longcontext.memory import MARGIN_PER_TOKEN

    model = _lora_model()
    n = 2**21  # a checkpoint: n x 64 x 8 bytes = 1 GiB
    ckpt = n * 64 * 8
    budget = _budget(1.0, 0)
    static = static_bytes(model)
    margin = MARGIN_PER_TOKEN * n
    # Room for everything: a checkpoint per layer, all on the device (the forward holds both).
    plan = plan_long_context(model, n, budget, device_gib=100, host_gib=100)
    assert (plan.every, plan.offload_layers, plan.host_bytes) == (1, 0, 0)
    assert plan.device_bytes == int(static + 0.5 * GIB + margin / 2 + 2 * ckpt + margin / 2)  # the forward's line + 2 kept
    # One checkpoint fewer on the device: the first layer's on the host.
    tight = (plan.device_bytes - ckpt / 2) / GIB
    plan = plan_long_context(model, n, budget, device_gib=tight, host_gib=100)
    assert (plan.every, plan.offload_layers, plan.host_bytes) == (1, 1, ckpt)
    assert plan.device_bytes <= tight * GIB
    # No host memory for it: two layers per checkpoint instead (one kept, recomputed in the backward).
    plan = plan_long_context(model, n, budget, device_gib=tight, host_gib=0.5)
    assert (plan.every, plan.host_bytes) == (2, 0) and plan.device_bytes <= tight * GIB


def test_a_length_that_fits_nowhere_is_refused_naming_the_gib_needed_and_given():
    from fm_parallel.longcontext import MemoryPlanError, plan_long_context

    model = _lora_model()
    with pytest.raises(MemoryPlanError, match=r"n: 2097152 tokens do not fit: the closest plan needs [0-9.]+ GiB on the "
                                              r"device and [0-9.]+ GiB of host memory, this machine gives 1.0 GiB and "
                                              r"2.0 GiB \(2 layers, a checkpoint of 1.00 GiB each"):
        plan_long_context(model, 2**21, _budget(1.0, 0), device_gib=1, host_gib=2)
    assert issubclass(MemoryPlanError, ValueError)


def test_the_plans_arguments_are_checked_by_name():
    from fm_parallel.longcontext import measure_budget, plan_long_context

    model = _lora_model()
    for kwargs, message in ((dict(length=0), r"length: expected an int >= 1, got 0"),
                            (dict(budget={"forward": (0, 0)}), r"budget: expected a StepBudget \(measure_budget's\), got dict"),
                            (dict(device_gib=0), r"device_gib: expected a number of GiB > 0, got 0"),
                            (dict(host_gib="lots"), r"host_gib: expected a number of GiB > 0, got 'lots'")):
        args = dict(length=1024, budget=_budget(1.0, 100.0), device_gib=10, host_gib=10) | kwargs
        with pytest.raises(ValueError, match=message):
            plan_long_context(model, args.pop("length"), args.pop("budget"), **args)
    with pytest.raises(ValueError, match=r"model: expected it on a CUDA GPU \(the budget is read from the allocator's "
                                         r"peaks\), got cpu"):
        measure_budget(model, (1024, 2048))
    with pytest.raises(ValueError, match=r"lengths: expected 2 distinct token counts >= 1, got \(1024, 1024\)"):
        measure_budget(model, (1024, 1024))
