"""``fm_parallel.longcontext.long_context`` on a Hugging Face model under HF ``Trainer``: tiled layers
(attention per query chunk), checkpoints every k layers, applied before or after peft, train with the
plain model's per-step losses (1e-10) and LoRA weights (float64; 1e-6, HF's norms round to float32) on
one long document and on packed documents; what the components cannot do is refused with one clear
error."""

import tempfile
import warnings

import pytest
import torch

from tests.integrations.test_transformers import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
warnings.filterwarnings("ignore")


def _lora(model):
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)  # random B: gradients reach every factor
    return peft.get_peft_model(model, lora).double()  # peft makes float32 adapters: float64, as the base


def _train(model, data, batch: int):
    from transformers import Trainer, TrainingArguments

    from fm_parallel.integrations.collator import FlashMaskCollator

    # Plain SGD: the weights after 3 steps are the gradients' sums (AdamW's first steps are sign-like and
    # would turn rounding-level gradient differences near zero into lr-sized ones).
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=3, logging_steps=1,
                             learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=FlashMaskCollator())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}
    return losses, weights


def _documents(kind: str):
    g = torch.Generator().manual_seed(3)
    if kind == "one long document":
        return [{"input_ids": torch.randint(0, 128, (150,), generator=g).tolist()}] * 3
    return [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in (40, 25, 61, 33, 50, 19)]


@pytest.mark.parametrize("kind, batch", [("one long document", 1), ("packed documents", 2)])
@pytest.mark.parametrize("order", ["before peft", "after peft"])
def test_the_components_train_as_the_plain_model_under_hf_trainer(kind, batch, order):
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    name = fm_hf.register()
    data = _documents(kind)
    want_losses, want_weights = _train(_lora(tiny_llama(name)), data, batch)
    settings = dict(tile_chunk=16, attention_chunk=48, checkpoint_every=2)
    if order == "before peft":
        base = tiny_llama(name)
        policy = long_context(base, **settings)
        model = _lora(base)
    else:
        model = _lora(tiny_llama(name))
        policy = long_context(model, **settings)
    assert policy is not None and policy.host_bytes == 0
    got_losses, got_weights = _train(model, data, batch)
    assert len(got_losses) == 3 and got_losses == pytest.approx(want_losses, rel=1e-10, abs=0)  # HF logs them rounded
    # HF's LlamaRMSNorm computes in float32 even in a float64 model, so a rounding-level difference in
    # the gradient reaching a norm (sums in another order) can move one float32 ulp below it: measured
    # 4e-8 relative on the first layer's gradients (the top layer's agree to 5e-16). Not ours to remove.
    for k, v in want_weights.items():
        torch.testing.assert_close(got_weights[k], v, rtol=1e-6, atol=1e-8, msg=k)


def test_what_the_components_cannot_do_is_one_clear_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    with pytest.raises(ValueError, match=r"tile_chunk: expected no dropout in the model .*got \['Dropout\(p=0.1\)'\]"):
        model = peft.get_peft_model(tiny_llama(fm_hf.register()), peft.LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.1))
        long_context(model, tile_chunk=16)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"tile_chunk: expected no dropout .*attention_dropout > 0"):
        long_context(LlamaForCausalLM(cfg), tile_chunk=16)
    sliding = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1))
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"tile_chunk: expected full-attention layers only .*\['full_attention', "
                                         r"'sliding_attention'\]"):
        long_context(sliding, tile_chunk=16)
    for kwargs, message in ((dict(tile_chunk=-1), r"tile_chunk: expected an int >= 0, got -1"),
                            (dict(checkpoint_every=0), r"checkpoint_every: expected an int >= 1, got 0"),
                            (dict(offload_layers=-2), r"offload_layers: expected -1 \(all\) or an int >= 0, got -2"),
                            (dict(checkpointing=False, offload_layers=1), r"checkpointing: expected True"),
                            (dict(offload_layers=5), r"offload_layers: expected -1 \(all\) or 0..2, got 5")):
        with pytest.raises(ValueError, match=message):
            long_context(tiny_llama("sdpa"), **kwargs)
    with pytest.raises(ValueError, match=r"model: expected a decoder with `.model.layers`"):
        long_context(torch.nn.Linear(2, 2))


def _cp_losses(cp_degree, tiled: bool) -> list[float]:
    """Per-step losses of LoRA on packed documents (``DataCollatorWithFlattening``); ``cp_degree`` None:
    the plain Trainer in one process; ``tiled``: the components applied."""
    from transformers import DataCollatorWithFlattening, Trainer

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel
    from fm_parallel.longcontext import long_context
    from tests.integrations.test_cp_hf_inputs import _args, _examples, _model

    model = _model()
    if tiled:
        long_context(model, tile_chunk=8, attention_chunk=16, checkpoint_every=2)
    common = dict(model=model, args=_args(2), train_dataset=_examples(12), data_collator=DataCollatorWithFlattening())
    trainer = Trainer(**common) if cp_degree is None else context_parallel(Trainer)(**common, cp=ContextParallelConfig(degree=cp_degree))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _cp_case(rank, world):
    import os

    from fm_parallel.longcontext import tiling

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29557")
    calls, apply = [], tiling.TiledLayer.apply
    tiling.TiledLayer.apply = staticmethod(lambda *a: (calls.append(1), apply(*a))[1])  # the tiled layers did run
    return {"losses": _cp_losses(2, tiled=True), "tiled_calls": len(calls)}


def test_the_components_under_cp_train_as_one_plain_process():
    """``context_parallel(Trainer)`` on 2 gloo ranks (ring), the components applied: one process's
    plain per-step losses."""
    import os

    from tests.distributed.spawn import run_cases

    results = run_cases(2, {"cp": (_cp_case, ())}, timeout=600)["cp"]
    os.environ.pop("WORLD_SIZE", None)  # (accelerate leaves one in os.environ)
    want = _cp_losses(None, tiled=False)
    for res in results:
        assert "exception" not in res, res
        assert len(res["losses"]) == 3 and res["losses"] == pytest.approx(want, rel=1e-5, abs=1e-5), (res, want)
        assert res["tiled_calls"] >= 3 * 2  # 3 steps x 2 layers, at least


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_components_under_trls_sft_trainer_train_as_the_plain_model(bf16):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context
    from tests.integrations.test_trainers import trl_losses

    # TRL's SFTTrainer, padding-free rows, LoRA from peft_config; the components applied before TRL wraps the model.
    tiled = lambda model: long_context(model, tile_chunk=8, attention_chunk=16, checkpoint_every=2)  # noqa: E731
    got, want = trl_losses(fm_hf.register(), True, bf16, prepare=tiled), trl_losses(fm_hf.register(), True, bf16)
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5 if not bf16 else 2e-3), (got, want)


def test_the_trainers_tiled_layers_train_adapters_without_k_proj(tmp_path, capsys):
    """The same bug through the trainer's command: LoRA on q_proj / v_proj only (the first layer's keys
    have no trainable path) with tiled layers crashed in the backward; now the untiled run's losses."""
    import json

    from tests.trainer.test_model import _run

    argv = ["--model.hidden_size", "32", "--model.layers", "2", "--model.heads", "2", "--model.kv_heads", "1",
            "--model.intermediate_size", "64", "--model.lora_rank", "2", "--model.lora_targets", "q_proj,v_proj",
            "--model.dtype", "float64", "--data.seq_len", "128", "--training.steps", "2", "--training.warmup", "0",
            "--parallel.cp", "none", "--output.checkpoint_every", "0"]
    losses = {}
    for tile in ("0", "16"):
        out = tmp_path / f"tile{tile}"
        code, _, err = _run([*argv, "--model.tile_chunk", tile, "--output.dir", str(out)], capsys)
        assert code == 0, err
        losses[tile] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["16"]) == 2 and losses["16"] == pytest.approx(losses["0"], rel=1e-9)
