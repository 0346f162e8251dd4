"""The trainer reads TRL's dataset formats as TRL does: for each format the tokens and the scored
positions of every record equal what TRL's own preprocessing gives (``SFTTrainer``, ``DPOTrainer``,
``RewardTrainer``, built on the same records with the same tokenizer: a tiny byte-level BPE with a
ChatML chat template, made here), packed rows keep documents apart and score what TRL scores, and a
record of no format names ``file:line`` and the formats accepted."""

import itertools
import json
import tempfile
import warnings

import pytest
import torch

from fm_parallel.trainer.data import DataError, load_tokenizer, sft_rows
from fm_parallel.formats import preference_sample, sft_document

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
warnings.filterwarnings("ignore")

# ChatML, as SmolLM2 and Qwen write it. MARKED wraps each assistant turn in {% generation %} (what
# transformers' assistant-token mask and TRL's assistant_only_loss read); PLAIN is the same template
# without the markers (SmolLM2's), where the trainer finds the assistant's tokens itself.
_TURN = "{{ '<|im_start|>' + message['role'] + '\\n' }}"
MARKED = ("{% for message in messages %}" + _TURN + "{% if message['role'] == 'assistant' %}{% generation %}"
          "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>\\n' }}"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PLAIN = ("{% for message in messages %}" + _TURN + "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "Six, as 3 doubled."}]
SFT_RECORDS = {
    "text": [{"text": "def f(x): return x + 1"}, {"text": "import os, sys"}, {"text": "class A: pass"}],
    "messages": [{"messages": CHAT}, {"messages": CHAT[1:3]}, {"messages": [{"role": "user", "content": "Hi"},
                                                                           {"role": "assistant", "content": "Hello."}]}],
    "prompt_completion": [{"prompt": "def f(x):", "completion": " return x + 1"},
                          {"prompt": "import os,", "completion": " sys"}],
    "chat_prompt_completion": [{"prompt": CHAT[:2], "completion": CHAT[2:3]},
                               {"prompt": CHAT[:4], "completion": CHAT[4:]}],
}


def make_tokenizer(folder, template=MARKED):
    """A byte-level BPE tokenizer (special tokens <|endoftext|> as BOS and EOS, <|im_start|>, <|im_end|>,
    <pad>) with a ChatML ``template``, saved to ``folder``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["def f(x): return x + 1", "import os, sys", "class A: pass", "What is 2 + 2? 4. Six, as 3 doubled.",
              "You are terse. Hello. user assistant system"]
    tok.train_from_iterator(corpus * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                 pad_token="<pad>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = template
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny_model(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def trl_args(config_cls, **extra):
    return config_cls(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, save_strategy="no", **extra)


def trl_sft(folder, records, **extra):
    """TRL's SFTTrainer preprocessing of ``records``: per record (input_ids, labels), unshifted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    trainer = trl.SFTTrainer(model=tiny_model(len(tok)), args=trl_args(trl.SFTConfig, max_length=None, **extra),
                             train_dataset=datasets.Dataset.from_list(records), processing_class=tok)
    return [(r["input_ids"], r["labels"]) for r in trainer.train_dataset]


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("kind", list(SFT_RECORDS))
@pytest.mark.parametrize("only", [True, False])
def test_sft_tokens_and_scored_positions_are_trls(folder, kind, only):
    records = SFT_RECORDS[kind]
    theirs = trl_sft(folder, records, assistant_only_loss=only and kind in ("messages", "chat_prompt_completion"),
                     completion_only_loss=only)
    tok = load_tokenizer(folder)
    for i, (record, (ids, labels)) in enumerate(zip(records, theirs)):
        ours, scored = sft_document(tok, record, f"r:{i}", assistant_only=only, completion_only=only)
        assert ours == ids, (kind, i)
        assert scored == [label != -100 for label in labels], (kind, i)
        if kind in ("messages", "chat_prompt_completion") and only:
            assert 0 < sum(scored) < len(scored)  # the assistant's tokens only: something and not everything


@pytest.mark.parametrize("kind", list(SFT_RECORDS))
def test_a_packed_row_is_trls_documents_side_by_side(folder, tmp_path, kind):
    """The row's tokens are TRL's records in order; position t predicts token t + 1 exactly where TRL
    scores token t + 1 inside the same record (TRL's padding-free packing never scores a record's first
    token); the mask is causal inside each record and nothing across records."""
    records = SFT_RECORDS[kind]
    theirs = trl_sft(folder, records, assistant_only_loss=kind in ("messages", "chat_prompt_completion"))
    row = next(sft_rows(512, load_tokenizer(folder), write(tmp_path / "d.jsonl", records)))
    n = sum(len(ids) for ids, _ in theirs)
    assert row.input_ids[:n].tolist() == sum((ids for ids, _ in theirs), [])
    want = sum(([*labels[1:], -100] for _, labels in theirs), [])
    assert row.labels[:n].tolist() == want
    assert (row.labels[n:] == -100).all()
    dense = row.mask.to_dense()[0, 0]
    starts = list(itertools.accumulate([0] + [len(ids) for ids, _ in theirs]))
    for a, b in zip(starts, starts[1:]):
        assert torch.equal(dense[a:b, a:b], torch.ones(b - a, b - a, dtype=torch.bool).tril())
        assert not dense[b:n, a:b].any()  # a later record never sees this one


def test_the_assistant_tokens_are_found_without_generation_markers(folder, tmp_path):
    """SmolLM2's template has no {% generation %}: the assistant's tokens found from the conversation's
    renderings are the ones the marked template marks."""
    plain = load_tokenizer(make_tokenizer(tmp_path / "plain", PLAIN))
    marked = load_tokenizer(folder)
    for i, record in enumerate(SFT_RECORDS["messages"] + SFT_RECORDS["chat_prompt_completion"]):
        assert sft_document(plain, record, f"r:{i}") == sft_document(marked, record, f"r:{i}")


def trl_preference(folder, records, trainer_cls, config_cls, columns):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = tiny_model(len(tok))
    if trainer_cls is trl.RewardTrainer:
        from transformers import LlamaConfig, LlamaForSequenceClassification

        model = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                                           num_hidden_layers=1, num_attention_heads=2,
                                                           num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id))
    path = tempfile.mkdtemp()
    model.save_pretrained(path)  # DPOTrainer builds its reference model from the policy's folder
    trainer = trainer_cls(model=path, args=trl_args(config_cls), train_dataset=datasets.Dataset.from_list(records),
                          processing_class=tok)
    return [[r[c] for c in columns] for r in trainer.train_dataset]


PREFERENCE = {
    "explicit": [{"prompt": "def f(x):", "chosen": " return x + 1", "rejected": " pass"},
                 {"prompt": "import", "chosen": " os, sys", "rejected": " sys"}],
    "implicit": [{"chosen": "What is 2 + 2? 4.", "rejected": "What is 2 + 2? Six."}],
    "chat_explicit": [{"prompt": CHAT[:2], "chosen": CHAT[2:3], "rejected": [{"role": "assistant", "content": "Six."}]}],
    "chat_implicit": [{"chosen": CHAT[:3], "rejected": CHAT[:2] + [{"role": "assistant", "content": "Six."}]}],
}


@pytest.mark.parametrize("kind", list(PREFERENCE))
def test_preference_tokens_are_trls_dpo_and_reward_trainers(folder, kind):
    records = PREFERENCE[kind]
    tok = load_tokenizer(folder)
    dpo = trl_preference(folder, records, trl.DPOTrainer, trl.DPOConfig, ("prompt_ids", "chosen_ids", "rejected_ids"))
    rm = trl_preference(folder, records, trl.RewardTrainer, trl.RewardConfig, ("chosen_ids", "rejected_ids"))
    for i, record in enumerate(records):
        prompt, (chosen, rejected), scores = preference_sample(tok, record, f"r:{i}")
        assert [prompt, chosen, rejected] == dpo[i]
        assert [prompt + chosen, prompt + rejected] == rm[i]  # the reward trainer scores each whole
        assert scores == [1.0, 0.0]


@pytest.mark.parametrize("record, message", [
    ({"body": "x"}, r'expected an SFT record of one of the formats \{"text": str\}; \{"messages": \[\{"role", "content"\}'),
    ({"prompt": "p"}, r"expected an SFT record .*got fields \{'prompt': 'a string'\}"),
    ({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}, r"expected an SFT record"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, r"a conversation without assistant tokens"),
    ({"messages": []}, r"expected an SFT record"),
])
def test_a_record_of_no_format_names_its_line_and_the_formats(folder, tmp_path, record, message):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.objectives import SFT

    path = write(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    with pytest.raises(DataError, match=rf"d.jsonl:2: {message}"):
        SFT(load_config([], environ={})).validate(path, load_tokenizer(folder))


def test_a_conversation_without_a_chat_template_is_refused_by_name(tmp_path):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.data import ByteTokenizer
    from fm_parallel.trainer.objectives import SFT

    path = write(tmp_path / "d.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"d.jsonl:1: a conversation \(a message list\) needs a tokenizer with a chat "
                                        r"template; the byte tokenizer has none"):
        SFT(load_config([], environ={})).validate(path, ByteTokenizer())


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_a_packed_dpo_row_scores_trls_tokens_in_trls_context(folder, tmp_path, layout):
    """Each response of the trainer's DPO row, read with the prompt it sees, is TRL's ``prompt_ids +
    chosen_ids`` (``rejected_ids``) token for token, at TRL's positions, and the scored targets are
    exactly TRL's response tokens, each predicted from the position before it."""
    from fm_parallel.trainer.data import dpo_rows

    forms = ("explicit", "chat_explicit")  # one form per TRL dataset (its columns' types)
    records = [r for f in forms for r in PREFERENCE[f]]
    trl_rows = [t for f in forms for t in trl_preference(folder, PREFERENCE[f], trl.DPOTrainer, trl.DPOConfig,
                                                         ("prompt_ids", "chosen_ids", "rejected_ids"))]
    row = next(dpo_rows(512, load_tokenizer(folder), write(tmp_path / "d.jsonl", records), layout))
    ids, seg, smp, pos, labels = (t.tolist() for t in (row.input_ids, row.segment, row.sample, row.positions, row.labels))
    dense = row.mask.to_dense()[0, 0]
    for i, (prompt, chosen, rejected) in enumerate(trl_rows):
        for s, response in ((1, chosen), (2, rejected)):
            last = max(t for t in range(len(ids)) if smp[t] == i and seg[t] == s)
            seen = [t for t in range(last + 1) if dense[last, t]]  # what the response's last token attends to
            assert [ids[t] for t in seen] == prompt + response, (layout, i, s)
            assert [pos[t] for t in seen] == list(range(len(prompt) + len(response)))
            targets = [labels[t] for t in seen[:-1] if labels[t] != -100]
            assert targets == response, (layout, i, s)


def test_a_packed_reward_row_holds_trls_sequences(folder, tmp_path):
    from fm_parallel.trainer.data import rm_rows

    forms = ("explicit", "chat_implicit")
    records = [r for f in forms for r in PREFERENCE[f]]
    theirs = [t for f in forms for t in trl_preference(folder, PREFERENCE[f], trl.RewardTrainer, trl.RewardConfig,
                                                       ("chosen_ids", "rejected_ids"))]
    row = next(rm_rows(512, load_tokenizer(folder), write(tmp_path / "r.jsonl", records)))
    ids, seg, smp, labels = (t.tolist() for t in (row.input_ids, row.segment, row.sample, row.labels))
    dense = row.mask.to_dense()[0, 0]
    for i, sequences in enumerate(theirs):
        for s, sequence in enumerate(sequences, 1):
            last = max(t for t in range(len(ids)) if smp[t] == i and seg[t] == s)
            assert [ids[t] for t in range(last + 1) if dense[last, t]] == sequence  # the reward read here: TRL's
            assert labels[last] == 1
