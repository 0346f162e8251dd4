"""Reward-model training through the Hugging Face ``Trainer`` (issue 52, item 3):
``FlashMaskRewardTrainer`` on shared-prompt rows (one prompt, K responses, our attention) against TRL's
``RewardTrainer`` on the same pairs unpacked (prompt + response per sequence, ``sdpa``): per-step
losses equal (float64, 1e-8) for the pair form (K = 2) and the K-wise form (K = 4, every ranked pair
of a sample, ties left out), LoRA (``task_type="SEQ_CLS"``) and full; ``context_parallel`` on 2 gloo
ranks (ring and Ulysses) equals one process; bad records and models are refused by name."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.distributed.spawn import run_cases

pytest.importorskip("transformers")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")

VOCAB = 64
STEPS = 3
TOL = 1e-8  # float64 losses compared as computed
LOGGED = 2e-7  # the Trainer's logged loss passes through a float32 accumulator: one float32 step of 0.6


def _model(finetune: str, attention: str | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from fm_parallel.integrations import transformers as fm_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, num_labels=1, pad_token_id=0,
                      attn_implementation=attention or fm_hf.register())
    model = LlamaForSequenceClassification(cfg).double()
    if finetune == "lora":
        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    return model


def _samples(k: int, count: int = 4, seed: int = 0) -> list[dict]:
    """``count`` samples of a prompt and ``k`` responses (token ids >= 1: 0 pads); K = 2 in the pair form,
    else ranked by scores (one tie in the first sample: that pair is left out)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    out = []
    for i in range(count):
        prompt, responses = ids(3, 9), [ids(2, 7) for _ in range(k)]
        if k == 2:
            out.append({"prompt_ids": prompt, "chosen_ids": responses[0], "rejected_ids": responses[1]})
        else:
            scores = torch.randperm(k, generator=g).tolist()
            if i == 0:
                scores[1] = scores[0]
            out.append({"prompt_ids": prompt, "response_ids": responses, "scores": scores})
    return out


def _unpacked(samples: list[dict]) -> list[dict]:
    """TRL's form: one (prompt + better, prompt + worse) pair per ranked pair."""
    from fm_parallel.preference import ranked_pairs

    pairs = []
    for s in samples:
        responses = s.get("response_ids") or [s["chosen_ids"], s["rejected_ids"]]
        scores = torch.tensor([s.get("scores", [1, 0])], dtype=torch.float64)
        for _, better, worse in zip(*ranked_pairs(scores)):
            pairs.append({"chosen_ids": s["prompt_ids"] + responses[better], "rejected_ids": s["prompt_ids"] + responses[worse]})
    return pairs


def _args(cls, batch: int, **extra):
    return cls(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=1e-2,
               lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
               save_strategy="no", **extra)


def ours(k: int, finetune: str, cp=None) -> dict:
    from transformers import TrainingArguments

    from fm_parallel.integrations.context_parallel import context_parallel
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer

    samples = _samples(k)
    cls = FlashMaskRewardTrainer if cp is None else context_parallel(FlashMaskRewardTrainer)
    extra = {} if cp is None else {"cp": cp}
    trainer = cls(model=_model(finetune), args=_args(TrainingArguments, len(samples)), train_dataset=samples,
                  eval_dataset=samples, **extra)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "accuracy": [h["accuracy"] for h in logs],
            "eval": trainer.evaluate()}


def trl(k: int, finetune: str) -> list[float]:
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from tests.integrations.test_cp_hf_inputs import _tokenizer

    pairs = _unpacked(_samples(k))
    model = _model(finetune, attention="sdpa")
    args = _args(RewardConfig, len(pairs), bf16=False, activation_checkpointing=False, max_length=None)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=_tokenizer("right"))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


CASES = [(2, "lora"), (4, "lora"), (2, "full"), (4, "full")]


@pytest.mark.parametrize("k, finetune", CASES, ids=[f"k{k}-{f}" for k, f in CASES])
def test_per_step_losses_equal_trls_reward_trainer_on_the_pairs_unpacked(k, finetune):
    pytest.importorskip("trl")
    os.environ.pop("WORLD_SIZE", None)
    got, want = ours(k, finetune), trl(k, finetune)
    assert len(got["losses"]) == len(want) == STEPS
    assert got["losses"] == pytest.approx(want, rel=LOGGED, abs=LOGGED), (got["losses"], want)
    assert want[-1] < want[0]  # it learns: the comparison is not of two constants
    assert set(got["eval"]) >= {"eval_loss", "eval_accuracy", "eval_margin", "eval_rewards/chosen", "eval_rewards/rejected"}


@pytest.mark.parametrize("k, finetune", CASES[:2], ids=["k2", "k4"])
def test_one_float64_loss_and_its_gradients_equal_trls(k, finetune):
    """The first step's loss and every trainable gradient, as computed (no float32 log in between)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import TrainingArguments
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    from fm_parallel.integrations.collator import FlashMaskCollator
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer
    from tests.integrations.test_cp_hf_inputs import _tokenizer

    os.environ.pop("WORLD_SIZE", None)
    samples, pairs = _samples(k), _unpacked(_samples(k))
    mine, theirs = _model(finetune), _model(finetune, attention="sdpa")
    ours_ = FlashMaskRewardTrainer(model=mine, args=_args(TrainingArguments, len(samples)))
    trl_ = RewardTrainer(model=theirs, args=_args(RewardConfig, len(pairs), bf16=False, activation_checkpointing=False,
                                                  max_length=None),
                         train_dataset=Dataset.from_list(pairs), processing_class=_tokenizer("right"))
    a = ours_.compute_loss(mine, FlashMaskCollator(preference=True)(samples))
    b = trl_.compute_loss(theirs, DataCollatorForPreference(pad_token_id=0)(pairs))
    assert a.dtype == torch.float64 and a.item() == pytest.approx(b.item(), rel=1e-12, abs=1e-12)
    a.backward(), b.backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, p in mine.named_parameters():
        if p.requires_grad:
            g = theirs_grads[name].grad
            # Llama's RMSNorm runs in float32 even on a float64 model: a prompt token's gradient, summed over
            # its responses before that norm's backward here and after it in TRL's copies, rounds apart at
            # ~1e-8 in the layers below the last norm (the last layer's gradients agree to 1e-15).
            assert (p.grad - g).abs().max() <= 1e-6 * g.abs().max(), (name, (p.grad - g).abs().max(), g.abs().max())


def test_the_pooled_reward_is_the_classifiers_own_on_the_response_alone():
    """The reward read at a response's last token of the packed row equals the sequence classifier's own
    output on prompt + response alone (what AutoModelForSequenceClassification serves after export)."""
    from fm_parallel.integrations.collator import FlashMaskCollator
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer

    model = _model("full").eval()
    samples = _samples(4, count=2)
    batch = FlashMaskCollator(preference=True)(samples)
    seen = []
    hook = model.score.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], flashmask=batch["flashmask"])
    hook.remove()
    from fm_parallel import logprobs
    from fm_parallel.integrations.collator import response_ends

    table = logprobs.response_sums(seen[0].squeeze(-1), batch["fm_segment"], batch["fm_sample"], samples=2, responses=4,
                                   scored=response_ends(batch["fm_segment"], batch["fm_sample"]))
    for s, sample in enumerate(samples):
        for r, response in enumerate(sample["response_ids"]):
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([sample["prompt_ids"] + response])).logits[0, 0]
            assert table[s, r].item() == pytest.approx(alone.item(), rel=1e-10, abs=1e-10)
    assert FlashMaskRewardTrainer  # the trainer reads the same table (reward_step)


def _cp_case(rank, world, mode, k, finetune):
    from fm_parallel.integrations.context_parallel import ContextParallelConfig

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29558")
    out = ours(k, finetune, cp=ContextParallelConfig(degree=2, mode=mode))
    return {"losses": out["losses"], "eval_loss": out["eval"]["eval_loss"]}


CP_CASES = [("ring", 4, "lora"), ("ulysses", 2, "full")]


@pytest.fixture(scope="module")
def two():
    return run_cases(2, {f"{m}-{k}-{f}": (_cp_case, (m, k, f)) for m, k, f in CP_CASES}, timeout=600)


@pytest.mark.parametrize("mode, k, finetune", CP_CASES, ids=[f"{m}-k{k}-{f}" for m, k, f in CP_CASES])
def test_context_parallel_ranks_equal_one_process(two, mode, k, finetune):
    os.environ.pop("WORLD_SIZE", None)
    want = ours(k, finetune)
    for res in two[f"{mode}-{k}-{finetune}"]:
        assert "exception" not in res, res
        assert res["losses"] == pytest.approx(want["losses"], rel=1e-7, abs=1e-7), (res, want["losses"])
        assert res["eval_loss"] == pytest.approx(want["eval"]["eval_loss"], rel=1e-7, abs=1e-7)


@pytest.mark.parametrize("example, message", [
    ({"prompt_ids": [1, 2], "response_ids": [[3, 4]], "scores": [1.0]}, "expected at least two responses with different scores"),
    ({"prompt_ids": [1, 2], "response_ids": [[3], [4]], "scores": [2, 2]}, "expected at least two responses with different scores"),
    ({"prompt_ids": [1, 2], "response_ids": [[3], []], "scores": [1, 0]}, "expected non-empty responses"),
    ({"prompt_ids": [1, 2], "response_ids": [[3], [4]], "scores": [1]}, "expected 2 scores"),
    ({"prompt_ids": [1, 2], "response_ids": [[3], [4]], "scores": [1, float("nan")]}, "expected a list of finite numbers"),
    ({"prompt_ids": [1], "chosen_ids": [3], "rejected_ids": [4], "scores": [1, 0]}, "got also \\['scores'\\]"),
])
def test_bad_examples_are_refused_by_field(example, message):
    from fm_parallel.integrations.collator import FlashMaskCollator

    with pytest.raises(ValueError, match=message):
        FlashMaskCollator(preference=True)([example])


def test_a_model_without_a_one_output_score_head_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer

    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, attn_implementation=fm_hf.register())
    for model, got in ((LlamaForCausalLM(LlamaConfig(**cfg)), "no score head"),
                       (LlamaForSequenceClassification(LlamaConfig(**cfg, num_labels=2)), "a score head of 2 outputs")):
        with pytest.raises(ValueError, match=f"model: expected a sequence classifier with one label.*{got}"):
            FlashMaskRewardTrainer(model=model, args=_args(TrainingArguments, 2))
