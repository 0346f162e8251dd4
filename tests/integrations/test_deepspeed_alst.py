"""DeepSpeed's ALST (Ulysses) through the HF ``Trainer`` as accelerate wires it
(``TrainingArguments(deepspeed=..., parallelism_config=ulysses_parallelism_config(2))``) with our
attention as the core attention, on 2 gloo ranks: per-step losses equal one process's plain
``Trainer`` (1e-5) for packed documents (``DataCollatorWithFlattening``'s restarting position_ids)
and for ``FlashMaskCollator`` prefix-LM rows (its ``flashmask`` rides along to the gathered
sequence); the leak guard: the same packed rows with position_ids that do not restart differ; the
recipe without ``use_cpu=True`` on a CPU is refused on every rank (it trained every row twice)."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.distributed.spawn import raised, run_ranks

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fm_parallel/torch_extensions"))

N = 128  # every row's length: gloo's all_gather in DeepSpeed's loader needs equal shapes


def _rows(kind: str) -> list[dict]:
    from tests.integrations.test_context_parallel import _documents

    docs = _documents()
    if kind == "prefix":  # prefix-LM documents: a mask position_ids cannot express
        docs = [{**d, "prefix_len": len(d["input_ids"]) // 3} for d in docs]
    return [{"docs": docs[i:i + 3]} for i in range(0, len(docs), 3)]


def _collate(kind: str):
    from transformers import DataCollatorWithFlattening

    from fm_parallel.integrations.collator import FlashMaskCollator

    if kind == "prefix":
        inner = FlashMaskCollator(seq_len=N, vocab_size=128)
        return lambda rows: inner([d for r in rows for d in r["docs"]])
    flat = DataCollatorWithFlattening()

    def collate(rows):
        b = flat([d for r in rows for d in r["docs"]])
        pad = N - b["input_ids"].shape[1]
        b["input_ids"] = torch.nn.functional.pad(b["input_ids"], (0, pad))
        b["labels"] = torch.nn.functional.pad(b["labels"], (0, pad), value=-100)
        b["position_ids"] = torch.cat([b["position_ids"], torch.arange(pad)[None]], 1)  # padding: a document of its own
        if kind == "leak":  # the packing dropped: one causal sequence over the row
            b["position_ids"] = torch.arange(N)[None]
        return b

    return collate


def train(kind: str, sp: int, use_cpu: bool = True) -> list[float]:
    from transformers import Trainer, TrainingArguments

    from fm_parallel.integrations.deepspeed import ulysses_parallelism_config
    from tests.integrations.test_context_parallel import _model

    extra = {}
    if sp > 1:
        extra = dict(deepspeed={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                "zero_optimization": {"stage": 1}, "bf16": {"enabled": False}},
                     parallelism_config=ulysses_parallelism_config(sp))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=3, learning_rate=1e-2,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=use_cpu, seed=0, disable_tqdm=True,
                             remove_unused_columns=False, **extra)
    trainer = Trainer(model=_model(), args=args, train_dataset=_rows(kind), data_collator=_collate(kind))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def alst(rank, world, kind):
    import deepspeed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")
    deepspeed.init_distributed(dist_backend="gloo")  # use_cpu=True: accelerate leaves deepspeed.comm to us
    if kind == "apart":  # the recipe without use_cpu=True on a CPU: accelerate runs each rank as one process
        return {kind: raised(lambda: train("packed", world, use_cpu=False))}
    return {kind: train(kind, world)}


@pytest.fixture(scope="module")
def results():
    # One ALST trainer per process: DeepSpeed sets up its SP groups and wraps the attention once per
    # process (a second trainer finds them set up, or wraps the wrapper).
    out = [{} for _ in range(2)]
    for kind in ("packed", "prefix", "leak", "apart"):
        for mine, res in zip(out, run_ranks(alst, 2, kind, timeout=500)):
            mine.update(res)
    return out


@pytest.mark.parametrize("kind", ["packed", "prefix"])
def test_alst_in_the_hf_trainer_equals_one_process(results, kind, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    want = train(kind, 1)
    for res in results:
        assert "exception" not in res, res.get("traceback")
        assert len(res[kind]) == 3 and res[kind] == pytest.approx(want, rel=1e-5, abs=1e-5), (res[kind], want)


def test_alst_leak_guard_without_the_packing_the_losses_differ(results, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    want = train("packed", 1)
    for res in results:
        assert "exception" not in res, res.get("traceback")
        assert max(abs(a - b) for a, b in zip(res["leak"], want)) > 1e-3, (res["leak"], want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU launch without use_cpu")
def test_alst_without_use_cpu_on_a_cpu_is_refused_on_every_rank(results):
    """Without ``use_cpu=True`` accelerate ran each CPU rank as a process of its own: its loader was not
    sharded, so DeepSpeed's Ulysses loader gathered each rank's copy of one batch and trained every row
    twice (losses of one process fed r0, r0, r1, r1; the epoch advancing 1/8 a step over 4 rows)."""
    errors = [res["apart"]["raised"] for res in results]
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert errors[0].startswith("ValueError: use_cpu: expected True when 2 ranks run on a machine without a GPU"), errors[0]
