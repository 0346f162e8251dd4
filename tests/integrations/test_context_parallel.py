"""``context_parallel(Trainer)`` / ``context_parallel(FlashMaskDPOTrainer)`` with ``cp=`` on 2 and 4 gloo
ranks: per-step losses and LoRA gradients equal one process's plain ``Trainer`` /
``FlashMaskDPOTrainer`` on the same documents (1e-5), ring / Ulysses / hybrid x SFT packed documents
(``DataCollatorWithFlattening``) / DPO shared prompts (``FlashMaskCollator``), and DP x CP; the leak
guard (the same CP run with the row's mask replaced by a causal one differs, so the equality can
fail); a rank whose batch differs makes every rank raise the same error; the refusals by name.

The ranks of each world run all their cases in one spawn (a spawn costs more than a case here)."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.distributed.spawn import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")

STEPS = 3
TOL = 1e-5


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from fm_parallel.integrations import transformers as fm_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, attn_implementation=fm_hf.register())
    # init_lora_weights=False: B != 0, so every LoRA tensor has a gradient at the first step (and DPO's
    # policy differs from its reference there).
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))


def _documents(count=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 128, (int(n),), generator=g).tolist()} for n in torch.randint(5, 40, (count,), generator=g)]


def _pairs(count=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: torch.randint(4, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(6, 20), "chosen_ids": [3] + ids(3, 12), "rejected_ids": [3] + ids(3, 12)} for _ in range(count)]


def _grads_at_first_step(store):
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not store:  # the first step's gradients, after DDP's all-reduce
                store.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    return Grab()


def train(kind: str, cp=None, batch: int = 3, dataset=None, output_dir=None, resume=None, **extra) -> dict:
    """``kind`` "sft" (Trainer + flattening collator) or "dpo" (FlashMaskDPOTrainer); ``cp`` None: the
    plain trainer (the reference), else ``context_parallel(...)(cp=cp)``. Per-step losses, the first
    step's LoRA gradients and the local token counts the model saw."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from fm_parallel.integrations.context_parallel import context_parallel
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    model = _model()
    seen = []
    model.get_base_model().model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    grads = {}
    extra.setdefault("save_strategy", "no")
    args = TrainingArguments(output_dir=output_dir or tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=STEPS,
                             learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             per_device_eval_batch_size=3, **extra)
    common = dict(model=model, args=args, callbacks=[_grads_at_first_step(grads)])
    if kind == "sft":
        cls = Trainer if cp is None else context_parallel(Trainer)
        common.update(train_dataset=dataset or _documents(), data_collator=DataCollatorWithFlattening())
    else:
        cls = FlashMaskDPOTrainer if cp is None else context_parallel(FlashMaskDPOTrainer)
        common.update(train_dataset=dataset or _pairs(), beta=0.1)
    if kind == "sft":
        common["eval_dataset"] = _documents(12, seed=1)
    trainer = cls(**common) if cp is None else cls(**common, cp=cp)
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"losses": losses, "grads": {n: g.tolist() for n, g in grads.items()}, "seen": seen}
    if kind == "sft" and resume is None and "save_steps" not in extra:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]  # after training: 4 eval batches of 3 documents
    return result


def _case(fn):
    """The case's result, or the exception's text (each rank's, compared by the test)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"exception": f"{type(e).__name__}: {e}"}


def ranks(rank, world, cases, base=None):
    from fm_parallel.integrations import context_parallel as cpmod
    from fm_parallel.integrations.context_parallel import ContextParallelConfig
    from fm_parallel.masks import builders

    # The Trainer's accelerate reads the launch from the environment (torchrun's variables); the
    # process group spawn.py made is the one it then uses.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    out = {}
    for name, kind, mode, degree, batch in cases:
        balance = next((b for b in ("zigzag", "mask") if name.endswith("-" + b)), "contiguous")
        cfg = ContextParallelConfig(degree=degree, mode=mode, balance=balance)
        if name.startswith("leak"):
            # The leak guard: the row's mask replaced by one causal mask over the whole row (what
            # accelerate's CP and a batch ring do): documents / responses then see each other.
            real = cpmod.row_mask
            cpmod.row_mask = lambda inputs, causal=True: builders.causal(inputs["input_ids"].shape[1])
            try:
                out[name] = _case(lambda: train(kind, cfg, batch))
            finally:
                cpmod.row_mask = real
        elif name.startswith("resume"):
            # 3 steps saving at step 2, then a new trainer resumed from checkpoint-2 (HF's save / resume:
            # rank 0 writes the model, optimizer, scheduler; every rank its RNG state).
            where = os.path.join(base, name)
            full = _case(lambda: train(kind, cfg, batch, output_dir=where, save_strategy="steps", save_steps=2))
            again = _case(lambda: train(kind, cfg, batch, output_dir=where, resume=os.path.join(where, "checkpoint-2"),
                                        save_strategy="steps", save_steps=2))
            out[name] = {"full": full, "resumed": again}
        elif name.startswith("ga2"):
            out[name] = _case(lambda: train(kind, cfg, batch,
                                            gradient_accumulation_steps=2))
        elif name.startswith("bf16"):
            out[name] = _case(lambda: train(kind, cfg, batch, bf16=True))
        elif name.startswith("differs"):
            # Rank 1's dataset in another order: its batches differ from its group's.
            data = (_documents() if kind == "sft" else _pairs())
            data = data[::-1] if rank == 1 else data
            out[name] = _case(lambda: train(kind, cfg, batch, dataset=data))
        else:
            out[name] = _case(lambda: train(kind, cfg, batch))
    return out


CASES_2 = [("sft-ring", "sft", "ring", 2, 3), ("sft-ulysses-mask", "sft", "ulysses", 2, 3), ("dpo-ring-zigzag", "dpo", "ring", 2, 2),
           ("dpo-ulysses", "dpo", "ulysses", 2, 2), ("leak-sft-ring", "sft", "ring", 2, 3), ("leak-dpo-ulysses", "dpo", "ulysses", 2, 2),
           ("differs-sft-ring", "sft", "ring", 2, 3), ("ga2-sft-ring", "sft", "ring", 2, 3), ("bf16-sft-ulysses", "sft", "ulysses", 2, 3),
           ("resume-sft-ring", "sft", "ring", 2, 3)]
CASES_4 = [("sft-hybrid", "sft", "hybrid", 4, 3), ("dpo-hybrid", "dpo", "hybrid", 4, 2), ("sft-ring-dp2", "sft", "ring", 2, 3),
           ("differs-dpo-hybrid", "dpo", "hybrid", 4, 2)]


@pytest.fixture(scope="module")
def reference():
    """One process, the plain trainers: SFT with 3 and 6 documents per step (DP 2 x 3), DPO with 2 pairs."""
    os.environ.pop("WORLD_SIZE", None)
    return {("sft", 3): train("sft", None, 3), ("sft", 6): train("sft", None, 6), ("dpo", 2): train("dpo", None, 2),
            "ga2": train("sft", None, 3, gradient_accumulation_steps=2), "bf16": train("sft", None, 3, bf16=True)}


@pytest.fixture(scope="module")
def two():
    with tempfile.TemporaryDirectory() as base:  # the checkpoints of the resume case, shared by the ranks
        return run_ranks(ranks, 2, CASES_2, base, timeout=400)


@pytest.fixture(scope="module")
def four():
    return run_ranks(ranks, 4, CASES_4, timeout=400)


def _close(got: dict, want: dict) -> None:
    assert "exception" not in got, got
    assert len(got["losses"]) == STEPS and got["losses"] == pytest.approx(want["losses"], rel=TOL, abs=TOL), (got["losses"], want["losses"])
    if "eval_loss" in want:  # Trainer.evaluate() under CP: the same batches, the loss of the whole rows
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=TOL, abs=TOL), (got["eval_loss"], want["eval_loss"])
    assert set(got["grads"]) == set(want["grads"]) and want["grads"]
    for name, g in want["grads"].items():
        g, h = torch.tensor(g), torch.tensor(got["grads"][name])
        assert g.abs().max() > 0, name  # a gradient that exists (init_lora_weights=False)
        assert (h - g).abs().max() <= TOL * max(g.abs().max().item(), 1.0), name


@pytest.mark.parametrize("name", [c[0] for c in CASES_2 if c[0].startswith(("sft", "dpo"))])
def test_two_ranks_equal_one_process(two, reference, name):
    kind, batch = next((c[1], c[4]) for c in CASES_2 if c[0] == name)
    for res in two:
        _close(res[name], reference[(kind, batch)])
        # each rank's model saw its shard, not the row: half of a row padded to an even length
        assert res[name]["seen"] and max(res[name]["seen"]) < max(reference[(kind, batch)]["seen"]), res[name]["seen"]


@pytest.mark.parametrize("name", ["sft-hybrid", "dpo-hybrid", "sft-ring-dp2"])
def test_four_ranks_equal_one_process(four, reference, name):
    kind, batch = next((c[1], c[4]) for c in CASES_4 if c[0] == name)
    want = reference[("sft", 6)] if name.endswith("dp2") else reference[(kind, batch)]  # DP 2 x 3 documents = 6
    for res in four:
        _close(res[name], want)


def test_gradient_accumulation_bf16_autocast_and_resume_as_one_process(two, reference):
    for res in two:
        _close(res["ga2-sft-ring"], reference["ga2"])  # 2 micro-batches a step: the step's targets normalise both
        got, want = res["bf16-sft-ulysses"], reference["bf16"]
        assert "exception" not in got, got
        assert got["losses"] == pytest.approx(want["losses"], abs=2e-3), (got["losses"], want["losses"])  # bf16 rounding
        full, resumed = res["resume-sft-ring"]["full"], res["resume-sft-ring"]["resumed"]
        assert "exception" not in full and "exception" not in resumed, (full, resumed)
        assert full["losses"] == pytest.approx(reference[("sft", 3)]["losses"], rel=TOL, abs=TOL)
        # the resumed trainer logs step 3 only; it equals the uninterrupted run's step 3
        assert resumed["losses"][-1] == pytest.approx(full["losses"][-1], rel=TOL, abs=TOL), (resumed["losses"], full["losses"])


@pytest.mark.parametrize("name", ["leak-sft-ring", "leak-dpo-ulysses"])
def test_leak_guard_dropping_the_mask_changes_the_losses(two, reference, name):
    kind = name.split("-")[1]
    want = reference[(kind, 3 if kind == "sft" else 2)]["losses"]
    for res in two:
        got = res[name]
        assert "exception" not in got, got
        assert max(abs(a - b) for a, b in zip(got["losses"], want)) > 1e-3, (got["losses"], want)


def test_a_rank_whose_batch_differs_raises_the_same_error_on_every_rank(two, four):
    for results, name in ((two, "differs-sft-ring"), (four, "differs-dpo-hybrid")):
        errors = [res[name].get("exception") for res in results]
        assert all(errors) and len(set(errors)) == 1, errors
        assert errors[0].startswith("ValueError: batch: expected the same batch on every rank of a context-parallel group"), errors[0]
        assert "input_ids: expected the same value on every rank, got [same as rank 0, different" in errors[0], errors[0]


def test_refusals_name_the_argument():
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    os.environ.pop("WORLD_SIZE", None)
    cls = context_parallel(Trainer)
    assert context_parallel(Trainer) is cls and context_parallel(cls) is cls
    args = lambda **kw: TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], **kw)  # noqa: E731
    for cfg, message in [(dict(degree=0), "cp.degree: expected an int >= 1, got 0"),
                         (dict(mode="tree"), "cp.mode: expected one of"),
                         (dict(balance="even"), "cp.balance: expected one of"),
                         (dict(mode="ring", ulysses_degree=2), "cp.ulysses_degree: expected None for mode='ring'"),
                         (dict(degree=6, mode="hybrid", ulysses_degree=4), "cp.ulysses_degree: expected a divisor of cp.degree = 6")]:
        with pytest.raises(ValueError, match=message):
            ContextParallelConfig(**cfg)
    with pytest.raises(ValueError, match="cp.degree: expected a divisor of the 1 ranks"):
        cls(model=_model(), args=args(), cp=ContextParallelConfig(degree=2))
    with pytest.raises(ValueError, match="average_tokens_across_devices: expected True"):
        cls(model=_model(), args=args(average_tokens_across_devices=False), cp=ContextParallelConfig())
    with pytest.raises(ValueError, match="label_smoothing_factor: expected 0"):
        cls(model=_model(), args=args(label_smoothing_factor=0.1), cp=ContextParallelConfig())
    with pytest.raises(ValueError, match="compute_loss_func: expected None"):
        cls(model=_model(), args=args(), cp=ContextParallelConfig(), compute_loss_func=lambda *a, **k: 0)
    sdpa = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    with pytest.raises(ValueError, match="model: expected a model loaded with attn_implementation"):
        cls(model=sdpa, args=args(), cp=ContextParallelConfig())
    with pytest.raises(ValueError, match="trainer_class: expected a transformers.Trainer subclass"):
        context_parallel(dict)
