"""``fm_parallel.longcontext.long_context`` on a Hugging Face model under HF ``Trainer``: tiled layers
(attention per query chunk), checkpoints every k layers, applied before or after peft, train with the
plain model's per-step losses (1e-10) and LoRA weights (float64; 1e-6, HF's norms round to float32) on
one long document and on packed documents; what the components cannot do is refused with one clear
error."""

import tempfile
import warnings

import pytest
import torch

from tests.helpers import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
warnings.filterwarnings("ignore")


def _lora(model):
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)  # random B: gradients reach every factor
    return peft.get_peft_model(model, lora).double()  # peft makes float32 adapters: float64, as the base


def _train(model, data, batch: int, accumulate: int = 1, evaluate: bool = False):
    from transformers import Trainer, TrainingArguments

    from fm_parallel.integrations.collator import FlashMaskCollator

    # Plain SGD: the weights after 3 steps are the gradients' sums (AdamW's first steps are sign-like and
    # would turn rounding-level gradient differences near zero into lr-sized ones).
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=3, logging_steps=1,
                             learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, remove_unused_columns=False, disable_tqdm=True,
                             gradient_accumulation_steps=accumulate, per_device_eval_batch_size=1)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=FlashMaskCollator(),
                      eval_dataset=data[:2] if evaluate else None)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if evaluate:
        losses.append(trainer.evaluate()["eval_loss"])
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


def _cp_losses(cp_degree, tiled: bool, loss_chunk: int = 0, head_rows: list | None = None, mode: str = "ring") -> list[float]:
    """Per-step losses of LoRA on packed documents (``DataCollatorWithFlattening``); ``cp_degree`` None:
    the plain Trainer in one process; ``tiled``: the components applied; ``head_rows``: gets the most
    positions the LM head saw at once."""
    from transformers import DataCollatorWithFlattening, Trainer

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel
    from fm_parallel.longcontext import long_context
    from tests.integrations.test_cp_hf_inputs import _args, _examples, _model

    model = _model()
    if tiled:
        long_context(model, tile_chunk=8, attention_chunk=16, checkpoint_every=2, loss_chunk=loss_chunk)
    rows = _HeadRows(model.get_base_model())
    common = dict(model=model, args=_args(2), train_dataset=_examples(12), data_collator=DataCollatorWithFlattening())
    trainer = Trainer(**common) if cp_degree is None else context_parallel(Trainer)(**common, cp=ContextParallelConfig(degree=cp_degree, mode=mode))
    trainer.train()
    if head_rows is not None:
        head_rows.append(rows.most)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _cp_case(rank, world):
    import os

    from fm_parallel.longcontext import tiling

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29557")
    calls, apply = [], tiling.TiledLayer.apply
    tiling.TiledLayer.apply = staticmethod(lambda *a: (calls.append(1), apply(*a))[1])  # the tiled layers did run
    tiled = {"losses": _cp_losses(2, tiled=True), "tiled_calls": len(calls)}
    head_rows = []
    return {**tiled, "chunked_loss": _cp_losses(2, tiled=True, loss_chunk=3, head_rows=head_rows), "head_rows": head_rows,
            "ulysses": _cp_losses(2, tiled=True, loss_chunk=3, mode="ulysses")}


def test_the_components_under_cp_train_as_one_plain_process():
    """``context_parallel(Trainer)`` on 2 gloo ranks (ring), the components applied (and again with
    the chunked loss, the wrapper then asking the model for its shard's loss; and under Ulysses): one
    process's plain per-step losses."""
    import os

    from tests.distributed.spawn import run_cases

    results = run_cases(2, {"cp": (_cp_case, ())}, timeout=600)["cp"]
    os.environ.pop("WORLD_SIZE", None)  # (accelerate leaves one in os.environ)
    want = _cp_losses(None, tiled=False)
    for res in results:
        assert "exception" not in res, res
        assert len(res["losses"]) == 3 and res["losses"] == pytest.approx(want, rel=1e-5, abs=1e-5), (res, want)
        assert res["tiled_calls"] >= 3 * 2  # 3 steps x 2 layers, at least
        assert res["head_rows"] == [3]  # the chunked loss ran (the logits' path would give the head a whole shard)
        assert len(res["ulysses"]) == 3 and res["ulysses"] == pytest.approx(want, rel=1e-5, abs=1e-5), (res, want)
        assert len(res["chunked_loss"]) == 3 and res["chunked_loss"] == pytest.approx(want, rel=1e-5, abs=1e-5), (res, want)


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


class _HeadRows:
    """The most rows the LM head was given in one call (a forward hook)."""

    def __init__(self, model):
        self.most = 0
        model.get_output_embeddings().register_forward_hook(self)

    def __call__(self, module, args, out):
        self.most = max(self.most, args[0].shape[:-1].numel())


def _float64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, shift_labels=None, **kwargs):
    """HF's ``ForCausalLMLoss`` without its cast of the logits to float32 (which, in a float64 model,
    rounds the loss to float32: the chunked loss keeps float64, so the reference must too)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100, reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum())


@pytest.mark.parametrize("tiled", [False, True], ids=["loss only", "with tiled layers"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["mean loss", "num_items_in_batch"])
def test_the_chunked_loss_in_the_hf_forward_trains_as_the_models_own_loss(tiled, accumulate):
    """``long_context(loss_chunk=7)``: HF ``Trainer``'s per-step losses, eval loss and LoRA weights are
    the plain model's (float64), with and without gradient accumulation (HF then passes
    ``num_items_in_batch``), and the LM head never sees more than 7 positions at once (the plain
    model's sees the whole batch)."""
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    name = fm_hf.register()
    data = _documents("packed documents")
    plain = tiny_llama(name)
    plain.loss_function = _float64_causal_lm_loss
    plain_rows = _HeadRows(plain)
    want_losses, want_weights = _train(_lora(plain), data, 2, accumulate, evaluate=True)
    base = tiny_llama(name)
    rows = _HeadRows(base)
    long_context(base, loss_chunk=7, **(dict(tile_chunk=16, attention_chunk=48) if tiled else {}))
    got_losses, got_weights = _train(_lora(base), data, 2, accumulate, evaluate=True)
    assert len(got_losses) == 4 and got_losses[:3] == pytest.approx(want_losses[:3], rel=1e-10, abs=0)
    # After 3 steps: the weights (and so the eval loss) move by HF's float32 norms' rounding (see above).
    assert got_losses[3] == pytest.approx(want_losses[3], rel=1e-8, abs=0)
    for k, v in want_weights.items():
        torch.testing.assert_close(got_weights[k], v, rtol=1e-6, atol=1e-8, msg=k)
    assert 0 < rows.most <= 7 and plain_rows.most >= 60, (rows.most, plain_rows.most)


def test_the_chunked_loss_is_hfs_loss_and_leaves_generation_alone():
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    name = fm_hf.register()
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :9] = -100
    plain, ours = tiny_llama(name), tiny_llama(name)
    long_context(ours, loss_chunk=4, checkpointing=False)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()  # (HF views it)
    reference = tiny_llama(name)
    reference.loss_function = _float64_causal_lm_loss
    for kwargs in (dict(labels=labels), dict(labels=ids, shift_labels=shifted), dict(labels=labels, num_items_in_batch=torch.tensor(17))):
        got = ours(ids, **kwargs)
        assert got.logits is None and got.loss.dtype == torch.float64
        # HF's own loss casts the logits to float32: equal to its resolution, and to float64's without the cast.
        torch.testing.assert_close(got.loss, plain(ids, **kwargs).loss.double(), rtol=2e-7, atol=0)
        torch.testing.assert_close(got.loss, reference(ids, **kwargs).loss, rtol=1e-12, atol=0)
    assert ours(ids, shift_labels=shifted).loss is None  # as HF's: shift_labels without labels is no loss
    other = labels.masked_fill(labels == -100, 127)  # HF's ignore_index keyword: 127 ignored instead
    torch.testing.assert_close(ours(ids, labels=other, ignore_index=127).loss, reference(ids, labels=labels).loss,
                               rtol=1e-12, atol=0)
    torch.testing.assert_close(plain(ids, labels=other, ignore_index=127).loss.double(), reference(ids, labels=labels).loss,
                               rtol=2e-7, atol=0)
    # No labels: the model's own forward (logits), and generate() as before.
    torch.testing.assert_close(ours(ids).logits, plain(ids).logits, rtol=0, atol=0)
    plain.config.use_cache = ours.config.use_cache = True
    prompt = ids[:1, :5]
    assert torch.equal(ours.generate(prompt, max_new_tokens=6, do_sample=False),
                       plain.generate(prompt, max_new_tokens=6, do_sample=False))


def test_the_chunked_loss_refuses_models_it_would_get_wrong():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    with pytest.raises(ValueError, match=r"loss_chunk: expected an int >= 0, got -1"):
        long_context(tiny_llama("sdpa"), loss_chunk=-1)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, num_labels=1, pad_token_id=0)
    with pytest.raises(ValueError, match=r"loss_chunk: expected a causal LM with an output head .*got "
                                         r"LlamaForSequenceClassification"):
        long_context(LlamaForSequenceClassification(cfg), loss_chunk=8)
    capped = tiny_llama(fm_hf.register())
    capped.config.final_logit_softcapping = 30.0
    forward = capped.forward
    with pytest.raises(ValueError, match=r"loss_chunk: expected a model whose logits are its head's output, got "
                                         r"LlamaForCausalLM with \{'final_logit_softcapping': 30.0\}"):
        long_context(capped, loss_chunk=8, tile_chunk=16)
    assert capped.forward == forward and type(capped.model.layers[0]).__name__ == "LlamaDecoderLayer"  # left as it was
    routed = tiny_llama(fm_hf.register())
    routed.config.output_router_logits = True  # a mixture of experts adds its router's loss to HF's loss
    with pytest.raises(ValueError, match=r"loss_chunk: expected a model without a router's auxiliary loss"):
        long_context(routed, loss_chunk=8)
    ours = tiny_llama(fm_hf.register())
    long_context(ours, loss_chunk=8, checkpointing=False)
    with pytest.raises(ValueError, match=r"output_router_logits: expected False with long_context\(loss_chunk=...\)"):
        ours(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long), output_router_logits=True)


def test_the_components_under_the_dpo_trainer_train_as_the_plain_model():
    """``FlashMaskDPOTrainer`` (shared-prompt rows, LoRA; the reference is the adapter disabled) with
    tiled layers over attention chunks that cut the prompt from its responses: TRL's six metrics and
    the losses of the plain model, step by step."""
    pytest.importorskip("datasets")
    from datasets import Dataset
    from transformers import TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer
    from fm_parallel.longcontext import long_context
    from tests.integrations.test_dpo import common_args, logged, lora, pairs

    def train(tiled: bool):
        base = tiny_llama(fm_hf.register())
        if tiled:
            long_context(base, tile_chunk=4, attention_chunk=8, checkpoint_every=2)
        trainer = FlashMaskDPOTrainer(model=lora(base), args=TrainingArguments(**common_args()), beta=0.1,
                                      train_dataset=Dataset.from_list(pairs()))
        trainer.train()
        return logged(trainer)

    from fm_parallel.longcontext import tiling

    calls, apply = [], tiling.TiledLayer.apply
    tiling.TiledLayer.apply = staticmethod(lambda *a: (calls.append(1), apply(*a))[1])
    try:
        got = train(True)
    finally:
        tiling.TiledLayer.apply = apply
    want = train(False)
    assert len(got) == 3 and len(calls) >= 3 * 2  # the tiled layers ran: 3 steps x 2 layers, at least
    for g, w in zip(got, want):
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (key, got, want)


def test_the_components_train_every_weight_as_the_plain_model():
    """Full fine-tuning (no peft, every weight trained) under HF ``Trainer`` with tiled layers, k-layer
    checkpoints and the chunked loss: the plain model's per-step losses and weights after 3 SGD steps."""
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    name = fm_hf.register()
    data = _documents("packed documents")

    def run(components: bool):
        model = tiny_llama(name)
        if components:
            long_context(model, tile_chunk=16, attention_chunk=48, checkpoint_every=2, loss_chunk=7)
        else:
            model.loss_function = _float64_causal_lm_loss
        losses, _ = _train(model, data, 2)
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}

    (got, got_weights), (want, want_weights) = run(True), run(False)
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-10, abs=0)
    assert want_weights.keys() == got_weights.keys() and len(want_weights) > 10
    for k, v in want_weights.items():  # (1e-6: HF's float32 norms, as above)
        torch.testing.assert_close(got_weights[k], v, rtol=1e-6, atol=1e-8, msg=k)
    assert any((want_weights[k] - tiny_llama(name).state_dict()[k]).abs().max() > 1e-4 for k in want_weights)  # it trained


def test_long_context_applied_again_takes_the_new_settings():
    """The plan's workflow applies long_context a second time with its layout: the new tiles (and no
    tiles) replace the old ones instead of the first wrapping being kept (it was: the checkpoint
    wrapper re-wrapped the first tiled forward), and the losses stay the plain model's."""
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context, tiling

    name = fm_hf.register()
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    want = tiny_llama(name)(ids, labels=ids).loss
    model = tiny_llama(name)
    tiles, apply = [], tiling.TiledLayer.apply
    tiling.TiledLayer.apply = staticmethod(lambda call, *a: (tiles.append(call.tile), apply(call, *a))[1])
    try:
        for settings, expected in ((dict(tile_chunk=16), {16}), (dict(tile_chunk=8, checkpoint_every=2), {8}),
                                   (dict(tile_chunk=0, offload_layers=1), set()), (dict(tile_chunk=32), {32})):
            long_context(model, **settings)
            tiles.clear()
            loss = model(ids, labels=ids).loss
            loss.backward()
            assert set(tiles) == expected, (settings, tiles)
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    finally:
        tiling.TiledLayer.apply = apply
