"""The FlashMask data collator: shared-prompt preference rows and prefix-LM documents packed with their
mask, equal to each sample run alone; a DPO recipe's log-probabilities; HF Trainer runs with it."""

import tempfile
import warnings

import pytest
import torch

from tests.helpers import tiny_llama

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")


def tokens(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models():
    from fm_parallel.integrations import transformers as fm_hf

    return tiny_llama(fm_hf.register()).eval(), tiny_llama("sdpa").eval()


def test_shared_prompt_preference_rows_give_each_pair_its_own_log_probs(models):
    from fm_parallel.integrations.collator import FlashMaskCollator, response_logps

    ours, ref = models
    samples = [{"prompt_ids": tokens(9, 3 * i), "chosen_ids": tokens(5 + i, 3 * i + 1), "rejected_ids": tokens(7, 3 * i + 2)}
               for i in range(5)]
    batch = FlashMaskCollator(seq_len=64, preference=True)(samples)
    assert batch["input_ids"].shape == (3, 64) and batch["flashmask"].batch == 3  # 21-23 tokens each: 2 per row
    with torch.no_grad():
        got = response_logps(ours(**{k: batch[k] for k in ("input_ids", "position_ids", "flashmask")}, use_cache=False).logits, batch)
    want = []
    for s in samples:  # the TRL layout: prompt + response as separate rows, the prompt computed twice
        row = []
        for key in ("chosen_ids", "rejected_ids"):
            ids = torch.tensor([s["prompt_ids"] + s[key]])
            logp = torch.log_softmax(ref(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            row.append(logp[len(s["prompt_ids"]):].sum())  # response tokens after its first
        want.append(torch.stack(row))
    torch.testing.assert_close(got, torch.stack(want).to(got.dtype), rtol=0, atol=1e-10)


def test_reward_model_rows_take_any_number_of_responses(models):
    from fm_parallel.integrations.collator import FlashMaskCollator, response_logps

    ours, _ = models
    sample = {"prompt_ids": tokens(6, 0), "response_ids": [tokens(4, 1), tokens(5, 2), tokens(3, 3), tokens(6, 4)]}
    batch = FlashMaskCollator(preference=True)([sample, sample])
    assert batch["input_ids"].shape == (1, 48)
    with torch.no_grad():
        logps = response_logps(ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    flashmask=batch["flashmask"], use_cache=False).logits, batch, responses=4)
    assert logps.shape == (2, 4)
    torch.testing.assert_close(logps[0], logps[1], rtol=0, atol=1e-12)  # two copies, kept apart by the mask


def test_response_logps_reads_the_batchs_layout_and_refuses_a_contradicting_count(models):
    """Four responses per sample, read with no count: each equals its prompt + response alone (sdpa).
    Before, the default responses=2 took sample 1's "chosen" from sample 0's third response (issue 35.3)."""
    from fm_parallel.integrations.collator import FlashMaskCollator, response_logps

    ours, ref = models
    samples = [{"prompt_ids": tokens(5 + s, 10 * s), "response_ids": [tokens(3 + r, 10 * s + r + 1) for r in range(4)]}
               for s in range(3)]
    batch = FlashMaskCollator(seq_len=40, preference=True)(samples)  # 23-28 tokens a sample: one per row, three rows
    with torch.no_grad():
        logits = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"], flashmask=batch["flashmask"]).logits
        got = response_logps(logits, batch)
        want = []
        for s in samples:
            row = []
            for resp in s["response_ids"]:
                ids = torch.tensor([s["prompt_ids"] + resp])
                logp = torch.log_softmax(ref(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
                row.append(logp[len(s["prompt_ids"]):].sum())
            want.append(torch.stack(row))
    torch.testing.assert_close(got, torch.stack(want).to(got.dtype), rtol=0, atol=1e-10)
    assert response_logps(logits, batch, responses=4).shape == (3, 4)
    for wrong in (2, 3, 5):
        with pytest.raises(ValueError, match=rf"responses: expected 4 \(the batch's layout.*got {wrong}"):
            response_logps(logits, batch, responses=wrong)
    # A layout edited by hand so that sample 0 lacks its last response: refused, not read as log p = 0.
    edited = dict(batch, fm_segment=torch.where(batch["fm_segment"] == 4, 3, batch["fm_segment"]))
    edited["fm_segment"][1:] = batch["fm_segment"][1:]
    with pytest.raises(ValueError, match="fm_segment: expected every sample to hold responses 1..4, got row 0 sample 0 without response 4"):
        response_logps(logits, edited)
    with pytest.raises(ValueError, match="batch: expected a FlashMaskCollator preference batch"):
        response_logps(logits, FlashMaskCollator()([{"input_ids": [5, 6, 7]}]))
    with pytest.raises(ValueError, match="labels: expected token ids < the logits' vocabulary size 100, got"):
        response_logps(logits[..., :100], batch)


def test_the_documents_own_labels_are_honoured():
    """Completion-only SFT: an example's labels (-100 or the token) mark what is scored; before, the
    collator replaced them with every token after the first."""
    from fm_parallel.integrations.collator import FlashMaskCollator

    batch = FlashMaskCollator()([{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, -100, 8, 9]},
                                 {"input_ids": [4, 3, 2], "prefix_len": 1}])
    assert batch["labels"].tolist() == [[-100, -100, -100, 8, 9, -100, 3, 2]]
    with pytest.raises(ValueError, match=r"examples\[0\]\['labels'\]: expected -100 or the input id .* got 6 at index 0"):
        FlashMaskCollator()([{"input_ids": [5, 6, 7], "labels": [6, 7, -100]}])  # shifted labels: refused
    with pytest.raises(ValueError, match=r"examples\[0\]\['labels'\]: expected 3 labels"):
        FlashMaskCollator()([{"input_ids": [5, 6, 7], "labels": [5, 6]}])


def test_prefix_lm_documents_equal_each_document_alone(models):
    from fm_parallel import masks
    from fm_parallel.integrations.collator import FlashMaskCollator

    ours, _ = models
    docs = [{"input_ids": tokens(11, 7), "prefix_len": 4}, {"input_ids": tokens(8, 8)}, {"input_ids": tokens(13, 9), "prefix_len": 13}]
    batch = FlashMaskCollator(seq_len=40, pad_token_id=1)(docs)
    assert batch["labels"][0, :4].eq(-100).all() and batch["labels"][0, 4] != -100 and (batch["input_ids"][0, 32:] == 1).all()
    with torch.no_grad():
        got = ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"], flashmask=batch["flashmask"]).logits
        start = 0
        for d in docs:
            n, p = len(d["input_ids"]), d.get("prefix_len", 0)
            alone = ours(torch.tensor([d["input_ids"]]), flashmask=masks.prefix_lm(n, p)).logits
            torch.testing.assert_close(got[0, start : start + n], alone[0], rtol=0, atol=1e-12)
            start += n


def test_hf_trainer_trains_with_the_collator():
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.collator import FlashMaskCollator

    model = get_peft_model(tiny_llama(fm_hf.register()).float(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    data = [{"input_ids": tokens(12 + i, i), "prefix_len": i % 5} for i in range(8)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=FlashMaskCollator(seq_len=64))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)


@pytest.mark.parametrize("examples, message", [
    ([], "examples: expected a non-empty list"),
    ([{"text": "hi"}], r"examples\[0\]: expected 'input_ids' or 'prompt_ids'"),
    ([{"input_ids": "abc"}], r"examples\[0\]\['input_ids'\]: expected a list of token ids"),
    ([{"input_ids": []}], "expected at least one token"),
    ([{"input_ids": [1, 2], "prefix_len": 3}], r"prefix_len'\]: expected an int in \[0, 2\], got 3"),
    ([{"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [2]}], "expected non-empty responses"),
    ([{"input_ids": [1, 2]}, {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}], "one kind per batch"),
    ([{"input_ids": list(range(70))}], r"70 tokens do not fit seq_len = 64"),
    # Negative ids used to become labels and embedding indices (issue 35.3), in every id field.
    ([{"input_ids": [1, -5, 3]}], r"examples\[0\]\['input_ids'\]: expected token ids >= 0, got -5 at index 1"),
    ([{"prompt_ids": [-1, 2], "chosen_ids": [2], "rejected_ids": [3]}], r"\['prompt_ids'\]: expected token ids >= 0, got -1 at index 0"),
    ([{"prompt_ids": [1], "chosen_ids": [2, -100], "rejected_ids": [3]}], r"\['chosen_ids'\]: expected token ids >= 0, got -100"),
    ([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [-3]}], r"\['rejected_ids'\]: expected token ids >= 0, got -3"),
    ([{"prompt_ids": [1], "response_ids": [[2], [3, -4]]}], r"\['response_ids'\]\[1\]: expected token ids >= 0, got -4 at index 1"),
    # Fields of another form, dropped silently before.
    ([{"prompt_ids": [1], "input_ids": [1, 2], "chosen_ids": [2], "rejected_ids": [3]}], r"got also \['input_ids'\]"),
    ([{"prompt_ids": [1], "response_ids": [[2], [3]], "chosen_ids": [2]}], r"got also \['chosen_ids'\]"),
    ([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "labels": [1, 2]}], r"got also \['labels'\]"),
    # One response count per batch: [samples, k] log-probs have one k.
    ([{"prompt_ids": [1], "response_ids": [[2], [3]]}, {"prompt_ids": [1], "response_ids": [[2], [3], [4]]}],
     r"examples\[1\]: expected 2 responses like examples\[0\] \(one response count per batch\), got 3"),
])
def test_bad_examples_are_named(examples, message):
    from fm_parallel.integrations.collator import FlashMaskCollator

    with pytest.raises(ValueError, match=message):
        FlashMaskCollator(seq_len=64, preference=True)(examples)
    with pytest.raises(ValueError, match="seq_len: expected None or an int >= 2"):
        FlashMaskCollator(seq_len=0)


def test_ids_past_the_vocabulary_are_named_when_it_is_known():
    from fm_parallel.integrations.collator import FlashMaskCollator

    collator = FlashMaskCollator(vocab_size=128, preference=True)
    assert collator([{"input_ids": [0, 127]}])["input_ids"].tolist() == [[0, 127]]
    with pytest.raises(ValueError, match=r"\['response_ids'\]\[0\]: expected token ids in \[0, 128\), got 128 at index 1"):
        collator([{"prompt_ids": [1], "response_ids": [[2, 128], [3]]}])
    with pytest.raises(ValueError, match=r"pad_token_id: expected an int in \[0, 128\), got 128"):
        FlashMaskCollator(pad_token_id=128, vocab_size=128)
    with pytest.raises(ValueError, match="vocab_size: expected None or an int >= 1, got 0"):
        FlashMaskCollator(vocab_size=0)


def test_response_sums_take_a_shards_part_and_refuse_a_smaller_table():
    """The trainer's form (shifted targets, a context-parallel shard): the table is sized by the row, a
    shard may lack samples, but a position naming a response or sample outside the table raises
    (it would have landed in a neighbour's slot)."""
    from fm_parallel.logprobs import response_sums, token_logps

    segment = torch.tensor([[0, 1, 1, 2, 3, 3, -1]])
    sample = torch.tensor([[0, 0, 0, 0, 0, 0, -1]])
    per_token = torch.tensor([[0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 0.0]])
    scored = segment > 0
    got = response_sums(per_token, segment, sample, samples=2, responses=3, scored=scored)
    assert got.tolist() == [[3.0, 4.0, 24.0], [0.0, 0.0, 0.0]]  # sample 1 lives on another shard
    with pytest.raises(ValueError, match=r"responses: expected at least 3 \(fm_segment holds response 3\), got 2"):
        response_sums(per_token, segment, sample, samples=1, responses=2, scored=scored)
    with pytest.raises(ValueError, match=r"samples: expected at least 1 \(fm_sample holds sample 0\), got 0|samples: expected an int >= 1"):
        response_sums(per_token, segment, sample, samples=0, responses=3, scored=scored)
    with pytest.raises(ValueError, match="labels: expected scored tokens only inside responses"):
        response_sums(per_token, segment, sample, samples=1, responses=3, scored=segment >= 0)
    with pytest.raises(ValueError, match="labels: expected token ids < the logits' vocabulary size 5, got 5"):
        token_logps(torch.zeros(1, 2, 5), torch.tensor([[5, -100]]))
