"""The trainer's model and tokenizer through the trainer command (``fm_parallel.trainer.loop.main``, what
launch/train.py runs): a ``model.path`` folder's own tokenizer is the default, a vocabulary that cannot
hold the tokenizer's ids is refused by name before anything runs, and the adapter names the tokenizer."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

ARGS = ["--parallel.cp", "none", "--data.seq_len", "64", "--training.steps", "1", "--training.warmup", "0",
        "--training.loss_chunk", "64", "--model.lora_rank", "2", "--output.checkpoint_every", "0"]


def _tokenizer():
    """A small byte-level BPE tokenizer (288 ids: more than the byte tokenizer's 258), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x): return x + 1", "import os, sys", "class A: pass"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>")


def _model_folder(path, vocab_size: int, tokenizer=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _run(argv, capsys):
    """The trainer command in this process: (exit status, stdout, stderr)."""
    from fm_parallel.trainer.loop import main

    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_model_folders_own_tokenizer_is_the_default_and_the_adapter_names_it(tmp_path, capsys):
    tok = _tokenizer()
    model = _model_folder(tmp_path / "model", len(tok), tok)
    out = tmp_path / "run"
    code, _, err = _run(ARGS + ["--model.path", str(model), "--output.dir", str(out)], capsys)
    assert code in (0, None), err[-3000:]
    assert json.loads((out / "run.json").read_text())["data"]["tokenizer"] == str(model)
    info = json.loads((out / "adapter" / "fm_parallel.json").read_text())
    assert (info["tokenizer"], info["vocab_size"]) == (str(model), len(tok))  # not "bytes", not 258
    assert (out / "adapter" / "tokenizer.json").is_file()  # the tokenizer travels with the adapter

    # data.tokenizer, when given, wins over the model folder's (as in Hugging Face).
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.model import build_tokenizer

    other = tmp_path / "other_tok"
    _tokenizer().save_pretrained(other)
    cfg = load_config(["--model.path", str(model), "--data.tokenizer", str(other)], environ={})
    assert build_tokenizer(cfg).tok.name_or_path == str(other) and cfg.data.tokenizer == str(other)
    # A model folder without a tokenizer keeps the byte tokenizer.
    bare = _model_folder(tmp_path / "bare", 300)
    cfg = load_config(["--model.path", str(bare)], environ={})
    assert type(build_tokenizer(cfg)).__name__ == "ByteTokenizer" and cfg.data.tokenizer == ""


def test_a_vocabulary_too_small_for_the_tokenizer_is_refused_by_name(tmp_path, capsys):
    bytes_model = _model_folder(tmp_path / "vocab256", 256)
    code, _, err = _run(ARGS + ["--model.path", str(bytes_model), "--output.dir", str(tmp_path / "a")], capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "model.path: expected a model whose vocabulary holds the byte tokenizer's 258 ids" in line, line
    assert "vocab_size 256" in line and "data.tokenizer" in line, line
    tok = _tokenizer()
    small = _model_folder(tmp_path / "small", 200, tok)
    code, _, err = _run(ARGS + ["--model.path", str(small), "--output.dir", str(tmp_path / "b")], capsys)
    assert code == 2, err[-3000:]
    assert f"holds the tokenizer of {small}'s {len(tok)} ids, got vocab_size 200" in err, err[-3000:]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything was written


def test_a_model_folder_loads_without_a_deprecation_notice(tmp_path, capsys):
    """The trainer's ``model.path`` load and LoRA wrap (``trainer.model``) call today's transformers and
    peft APIs: no deprecation notice, neither a Python warning nor transformers' own log line (the
    load passed ``torch_dtype=``, which transformers 5 logs as deprecated, into every run's output)."""
    import logging
    import warnings

    notices = []

    class Collect(logging.Handler):
        def emit(self, record):
            notices.append(record.getMessage())

    logger = logging.getLogger("transformers")
    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code, _, err = _run(ARGS + ["--model.path", str(_model_folder(tmp_path / "model", 300)),
                                        "--output.dir", str(tmp_path / "run")], capsys)
    finally:
        logger.removeHandler(handler)
    assert code in (0, None), err[-3000:]
    notices += [str(w.message) for w in caught]
    assert not [n for n in notices if "deprecat" in n.lower()], notices


@pytest.mark.parametrize("key", ["offload_layers", "checkpoint_every"])
def test_a_layer_count_past_the_folders_layers_is_refused_before_the_run_directory(tmp_path, capsys, key):
    """``model.path`` a 1-layer folder with ``--model.<key> 3``: refused naming the folder's layer count,
    with nothing written (it used to be refused when the layers were wrapped, after run.json, so the
    corrected command was then refused as "already holds a run")."""
    folder = _model_folder(tmp_path / "model", 258)
    out = tmp_path / "run"
    code, _, err = _run([*ARGS, "--model.path", str(folder), f"--model.{key}", "3", "--output.dir", str(out)], capsys)
    assert code == 2, err
    want = "-1 (all) or 0..1" if key == "offload_layers" else "1..1"
    assert f"error: model.{key}: expected {want} (num_hidden_layers in {folder}/config.json), got 3" in err, err
    assert not out.exists()
    code, _, err = _run([*ARGS, "--model.path", str(folder), f"--model.{key}", "1", "--output.dir", str(out)], capsys)
    assert code == 0, err  # the corrected command runs in the same directory
