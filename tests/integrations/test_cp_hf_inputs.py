"""``context_parallel(Trainer)`` with what Hugging Face users hand it (issue 56, items 0-3), on 2 gloo
ranks against one process's plain ``Trainer``:

- a world of ranks the Trainer does not run distributed (torchrun on a CPU without ``use_cpu=True``)
  is refused on every rank naming ``use_cpu``, for ``cp=`` and for ``FlashMaskDPOTrainer`` alone
  (it used to train each rank apart, silently, with no gradient sum);
- ``DataCollatorForLanguageModeling``'s padded rows (``attention_mask`` int64, and the same as int32,
  bool and float 0 / 1), right and left padding, one and two rows a batch: losses equal one process
  (int64 used to raise in the padding fold);
- ``evaluate()`` with batches that hold no target (a one-token document) equals one process's
  ``eval_loss``: such a batch is NaN and left out, not 0.0 averaged in;
- a model switched to ``sdpa`` after the trainer was built is refused at the next step.
"""

import os
import tempfile
import warnings

import pytest
import torch

from tests.distributed.spawn import raised, run_cases

pytest.importorskip("transformers")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")

VOCAB = 64
PAD = 0
STEPS = 3
TOL = 1e-5


def _tokenizer(side: str):
    """A word-level tokenizer over the ids' own names, with a pad token (what the LM collator pads with)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, **{str(i): i for i in range(1, VOCAB)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>")
    tok.padding_side = side
    return tok


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from fm_parallel.integrations import transformers as fm_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attn_implementation=fm_hf.register(),
                      pad_token_id=PAD)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))


def _examples(count: int, seed: int = 0, shortest: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(shortest, 20, (count,), generator=g)]


class _AsDtype:
    """The LM collator's batch with ``attention_mask`` cast to ``dtype`` (what other collators return)."""

    def __init__(self, collator, dtype):
        self.collator, self.dtype = collator, dtype

    def __call__(self, features):
        batch = self.collator(features)
        batch["attention_mask"] = batch["attention_mask"].to(self.dtype)
        return batch


def _args(batch: int, **extra):
    from transformers import TrainingArguments

    extra.setdefault("use_cpu", True)
    return TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, per_device_eval_batch_size=1,
                             max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
                             save_strategy="no", **extra)


def train_padded(cp_degree: int | None, side: str, dtype: str, batch: int) -> list[float]:
    """Per-step losses of LoRA on ``DataCollatorForLanguageModeling(mlm=False)`` rows (``side`` padding,
    ``attention_mask`` as ``dtype``); ``cp_degree`` None: the plain Trainer."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    collator = _AsDtype(DataCollatorForLanguageModeling(_tokenizer(side), mlm=False), getattr(torch, dtype))
    common = dict(model=_model(), args=_args(batch), train_dataset=_examples(12), data_collator=collator)
    trainer = Trainer(**common) if cp_degree is None else context_parallel(Trainer)(**common, cp=ContextParallelConfig(degree=cp_degree))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def evaluate_without_targets(cp_degree: int | None) -> float:
    """``eval_loss`` over documents one per batch, two of them a single token (no target: NaN batches)."""
    from transformers import DataCollatorWithFlattening, Trainer

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    docs = _examples(4, seed=1)
    docs = [docs[0], {"input_ids": [5]}, docs[1], {"input_ids": [7]}]  # 4 eval batches of one document each
    common = dict(model=_model(), args=_args(1), eval_dataset=docs, data_collator=DataCollatorWithFlattening())
    trainer = Trainer(**common) if cp_degree is None else context_parallel(Trainer)(**common, cp=ContextParallelConfig(degree=cp_degree))
    return trainer.evaluate()["eval_loss"]


def _apart_cp():
    from transformers import Trainer

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    context_parallel(Trainer)(model=_model(), args=_args(2, use_cpu=False), train_dataset=_examples(4),
                              cp=ContextParallelConfig(degree=2))


def _apart_dpo():
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    FlashMaskDPOTrainer(model=_model(), args=_args(1, use_cpu=False), train_dataset=[])


def _switched_to_sdpa():
    from transformers import DataCollatorWithFlattening, Trainer

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    model = _model()
    trainer = context_parallel(Trainer)(model=model, args=_args(2), train_dataset=_examples(8),
                                        data_collator=DataCollatorWithFlattening(), cp=ContextParallelConfig(degree=2))
    model.get_base_model().config._attn_implementation = "sdpa"  # after the trainer's own check at construction
    trainer.train()


PADDED = [("right", "int64", 2), ("left", "int64", 2), ("right", "int64", 1), ("left", "int32", 2), ("right", "bool", 2),
          ("left", "float32", 1)]


def _env(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")


def _padded_case(rank, world, side, dtype, batch):
    _env(rank, world)
    return {"losses": train_padded(2, side, dtype, batch)}


def _eval_case(rank, world):
    _env(rank, world)
    return {"eval_loss": evaluate_without_targets(2)}


def _refusal_case(rank, world, which):
    _env(rank, world)
    return raised({"cp": _apart_cp, "dpo": _apart_dpo, "sdpa": _switched_to_sdpa}[which])


@pytest.fixture(scope="module")
def two():
    cases = {f"pad-{s}-{d}-{b}": (_padded_case, (s, d, b)) for s, d, b in PADDED}
    cases.update({"eval": (_eval_case, ()), "apart-cp": (_refusal_case, ("cp",)), "apart-dpo": (_refusal_case, ("dpo",)),
                  "sdpa": (_refusal_case, ("sdpa",))})
    return run_cases(2, cases, timeout=600)


@pytest.fixture(scope="module")
def one():
    os.environ.pop("WORLD_SIZE", None)  # (accelerate leaves one in os.environ)
    out = {f"pad-{s}-{d}-{b}": train_padded(None, s, d, b) for s, d, b in PADDED}
    out["eval"] = evaluate_without_targets(None)
    return out


@pytest.mark.parametrize("side, dtype, batch", PADDED, ids=[f"{s}-{d}-{b}row" for s, d, b in PADDED])
def test_hf_padding_masks_of_every_dtype_train_as_one_process(two, one, side, dtype, batch):
    key = f"pad-{side}-{dtype}-{batch}"
    for res in two[key]:
        assert "exception" not in res, res
        assert len(res["losses"]) == STEPS and res["losses"] == pytest.approx(one[key], rel=TOL, abs=TOL), (res, one[key])


def test_the_padding_fold_reads_hf_masks_and_refuses_other_values():
    """In-process: one process (``degree=1``) runs the same fold, so the int64 crash is caught here too."""
    from fm_parallel.integrations.transformers import padding_keep

    want = torch.tensor([[False, True, True], [True, True, True]])
    for dtype in (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.bool):
        assert torch.equal(padding_keep(want.to(dtype)), want), dtype
    with pytest.raises(ValueError, match="attention_mask: expected a 2-D padding mask of 1 .token. and 0 .padding."):
        padding_keep(torch.tensor([[0.0, float("-inf")]]))  # an additive mask is not a padding mask
    assert train_padded(1, "left", "int64", 2) == pytest.approx(train_padded(None, "left", "int64", 2), rel=TOL, abs=TOL)


def test_evaluation_batches_without_targets_count_as_in_one_process(two, one):
    assert one["eval"] == one["eval"]  # the reference is a number: the NaN batches are left out there
    for res in two["eval"]:
        assert "exception" not in res, res
        assert res["eval_loss"] == pytest.approx(one["eval"], rel=TOL, abs=TOL), (res, one["eval"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch without use_cpu")
@pytest.mark.parametrize("which", ["apart-cp", "apart-dpo"])
def test_ranks_the_trainer_would_run_apart_are_refused_on_every_rank(two, which):
    errors = [res["raised"] for res in two[which]]
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert errors[0].startswith("ValueError: use_cpu: expected True when 2 ranks run on a machine without a GPU"), errors[0]


def test_a_model_switched_to_sdpa_after_the_trainer_was_built_is_refused_at_its_step(two):
    for res in two["sdpa"]:
        assert res["raised"] is not None and "attn_implementation 'sdpa'" in res["raised"], res


@pytest.mark.parametrize("field, value", [("ulysses_degree", 0), ("ulysses_degree", -2), ("ulysses_degree", True),
                                          ("ulysses_degree", 2.0), ("ulysses_degree", "2"), ("degree", "2"),
                                          ("degree", 2.0), ("mode", ["ring"]), ("balance", None), ("impl", "flash")])
def test_every_config_field_is_refused_by_name(field, value):
    """Each field's wrong type or value is a ValueError naming ``cp.<field>`` (``ulysses_degree=0`` once
    became 2 silently; ``"2"`` was a TypeError)."""
    from fm_parallel.integrations.context_parallel import ContextParallelConfig

    base = dict(degree=4, mode="hybrid") if field == "ulysses_degree" else {}
    with pytest.raises(ValueError, match=rf"^cp\.{field}: expected .*, got {value!r}".replace("[", r"\[").replace("]", r"\]")):
        ContextParallelConfig(**{**base, field: value})


SFT_WITHOUT_USE_CPU = '''
import sys
sys.path.insert(0, sys.argv[1])
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer
from hf_trainer_cp import documents, tiny_llama
from trl_sft_cp import tiny_tokenizer
from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

model = tiny_llama(None)
args = SFTConfig(output_dir=sys.argv[2], padding_free=True, max_length=None, bf16=False, max_steps=2, report_to=[],
                 per_device_train_batch_size=3)  # as the new user wrote it: no use_cpu
try:
    context_parallel(SFTTrainer)(model=model, args=args, processing_class=tiny_tokenizer(128),
                                 train_dataset=Dataset.from_list(documents()),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                                 cp=ContextParallelConfig(degree=2, mode="ring")).train()
except ValueError as e:
    # Each rank records its refusal in a file and waits (at most 60 s) for its peer's: torchrun stops
    # every rank as soon as one exits, so a rank slower to reach the check (a loaded machine) would be
    # stopped before it could show that it refuses too.
    import os, pathlib, time
    out = pathlib.Path(sys.argv[2]).parent
    (out / f"refused-{os.environ['RANK']}.txt").write_text(str(e))
    deadline = time.time() + 60
    while len(list(out.glob("refused-*.txt"))) < int(os.environ["WORLD_SIZE"]) and time.time() < deadline:
        time.sleep(0.1)
    raise SystemExit(2)
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch without use_cpu")
def test_torchrun_sft_trainer_without_use_cpu_is_refused_on_every_rank(tmp_path):
    """The new user's run (issue 56.0) through the engines they used: ``torchrun --nproc_per_node 2``, TRL's
    ``SFTTrainer`` with ``padding_free=True`` and LoRA, ``cp=`` ring, no ``use_cpu``. It used to exit 0
    with each rank training apart; now both ranks refuse naming ``use_cpu``."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("trl")
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "sft.py"
    script.write_text(SFT_WITHOUT_USE_CPU)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    logs = tmp_path / "logs"  # each rank's stdout and stderr in a file of its own (torchrun --redirects 3)
    proc = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                           "--log-dir", str(logs), "--redirects", "3",
                           str(script), str(root / "launch" / "examples"), str(tmp_path / "out")],
                          cwd=root, capture_output=True, text=True, timeout=300, env=env)
    refused = {p.name: p.read_text() for p in tmp_path.glob("refused-*.txt")}
    expected = "use_cpu: expected True when 2 ranks"
    if proc.returncode == 0 or sorted(refused) != ["refused-0.txt", "refused-1.txt"] or \
            not all(text.startswith(expected) for text in refused.values()):
        ranks = "\n".join(f"--- {p.relative_to(logs)}\n{p.read_text()[-3000:]}" for p in sorted(logs.rglob("*.log")))
        pytest.fail(f"exit {proc.returncode}, refusals {refused}\n{ranks}\n--- torchrun\n{proc.stderr[-2000:]}")
