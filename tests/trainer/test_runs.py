"""Run directories and checkpoints: never mixed, never resumed from damaged bytes, user errors in one
line; the adapter in peft format reproduces the trained model."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import run_ranks
from tests.helpers import TINY

pytest.importorskip("transformers")
pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]
def trainer(*args, env=None, timeout=300):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FM_")}
    environ.update(OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "fm_parallel.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=environ)


def assert_reported_by_a_rank(stderr, message, ranks):
    """A job of ``ranks`` ranks that refused with ``message``: the reason is printed (by rank 0, or by
    another rank when rank 0 did not reach it within fm_parallel.user_errors.PEER_GRACE_S), never more
    than once by one rank."""
    lines = [line for line in stderr.splitlines() if line.startswith("error") and message in line]
    assert lines and len(lines) == len(set(lines)) <= ranks, stderr[-3000:]


def assert_user_error(proc, message):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    proc = trainer(*TINY, "--output.dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_user_errors_are_one_line_without_traceback(tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[training\nsteps = 2\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "fine"}\n{oops\n')
    long_dpo = tmp_path / "dpo.jsonl"
    long_dpo.write_text(json.dumps({"prompt": "p" * 60, "chosen": "c" * 40, "rejected": "r" * 40}) + "\n")
    cases = [
        (["--data.objective", "dpo", "--data.path", str(long_dpo)], f"{long_dpo}:1: a DPO sample of 141 tokens"),
        (["--training.steps", "-1"], "training.steps: expected a value >= 1, got -1"),
        (["--config", str(bad_toml)], f"{bad_toml} is not valid TOML"),
        (["--model.path", str(tmp_path / "no_model")], "model.path: expected a local Hugging Face model folder"),
        (["--data.path", str(data)], f"{data}:3: expected one JSON object per line"),
        (["--data.tokenizer", str(tmp_path / "no_tok")], "data.tokenizer: expected a local Hugging Face tokenizer folder"),
        (["--parallel.cuda_graphs", "true"], "parallel.cuda_graphs: expected parallel.cp ring"),
    ]
    if not torch.cuda.is_available():  # CUDA graphs on a CPU run: refused before anything is built
        cases.append((["--parallel.cp", "ring", "--parallel.cuda_graphs", "true"], "parallel.cuda_graphs: expected a CUDA run"))
    # Independent refusals, two processes at a time (each is one interpreter's start; CI has 2 cores).
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda argv: trainer(*TINY, "--output.dir", str(tmp_path / "out"), *argv), [a for a, _ in cases]))
    for proc, (argv, message) in zip(procs, cases):
        assert_user_error(proc, message)
    assert not (tmp_path / "out").exists()  # nothing was written by a run that could not start


def test_user_error_is_printed_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29500 + os.getpid() % 400), "-m", "fm_parallel.launch", *TINY, "--training.grad_accum", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert_reported_by_a_rank(proc.stderr, "training.grad_accum: expected a value >= 1, got 0", ranks=2)


def test_a_directory_of_another_run_is_refused_unless_resuming_or_overwriting(finished_run, tmp_path):
    before = (finished_run / "metrics.jsonl").read_text()
    assert_user_error(trainer(*TINY, "--output.dir", str(finished_run)), "already holds a run")
    assert (finished_run / "metrics.jsonl").read_text() == before
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert_user_error(trainer(*TINY, "--output.dir", str(foreign), "--output.overwrite", "true"), "not a run's (notes.txt)")
    assert (foreign / "notes.txt").read_text() == "mine"
    assert_user_error(trainer(*TINY, "--output.dir", str(foreign / "notes.txt")), "expected a directory")
    from fm_parallel.trainer import runs
    from fm_parallel.trainer.config import load_config

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / ".gitkeep").write_text("")
    runs.check_run_dir(load_config(TINY + ["--output.dir", str(kept)], environ={}))  # a hidden file is not a run
    # Resuming with another model, adapter or row length names every difference.
    proc = trainer(*TINY, "--output.dir", str(finished_run), "--resume", "--model.lora_rank", "8", "--data.seq_len", "64")
    assert_user_error(proc, "model.lora_rank: 4 -> 8; data.seq_len: 128 -> 64")
    assert_user_error(trainer(*TINY, "--output.dir", str(tmp_path / "empty"), "--resume"), "expected a complete checkpoint under")


def test_overwrite_replaces_the_earlier_run(finished_run, tmp_path):
    out = tmp_path / "copy"
    import shutil

    shutil.copytree(finished_run, out)
    proc = trainer(*TINY, "--training.steps", "1", "--output.dir", str(out), "--output.overwrite", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]
    assert json.loads((out / "run.json").read_text())["training"]["steps"] == 1


def test_resume_says_where_and_refuses_a_damaged_checkpoint(finished_run, tmp_path):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(finished_run, out)
    proc = trainer(*TINY, "--training.steps", "3", "--training.reschedule", "true", "--output.dir", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} (2 steps done, 2 rows done)" in proc.stdout
    shards = sorted((out / "checkpoints" / "step_000003").glob("*.distcp"))
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the tensors
    shards[0].write_bytes(bytes(data))
    proc = trainer(*TINY, "--training.steps", "4", "--training.reschedule", "true", "--output.dir", str(out), "--resume")
    assert_user_error(proc, f"{shards[0]} does not match its checksum")
    (out / "checkpoints" / "step_000003" / "checksums.json").unlink()
    assert_user_error(trainer(*TINY, "--training.steps", "4", "--training.reschedule", "true", "--output.dir", str(out), "--resume"), "has no checksums.json")


def _inconsistent_progress(rank, world, out):
    from fm_parallel.trainer import runs
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.data import ByteTokenizer
    from fm_parallel.trainer.checkpoint import load as _load, save as _save
    from fm_parallel.trainer.model import build_model as _build_model

    cfg = load_config(TINY + ["--output.dir", out], environ={})
    model = _build_model(cfg, 258, torch.device("cpu"))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    # Checksums match (written with the checkpoint) but the counter cannot be what one step did.
    path = _save(cfg, model, optim, 0, 10**15, 1, ByteTokenizer())
    try:
        _load(path, model, optim, lambda: False)
    except runs.CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}


def test_a_progress_counter_out_of_bounds_is_refused(tmp_path):
    [result] = run_ranks(_inconsistent_progress, 1, str(tmp_path / "run"), timeout=200)
    assert "inconsistent progress (step 0, rows 1000000000000000" in (result.get("error") or ""), result


def test_the_peft_adapter_reproduces_the_trained_model(finished_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.export import convert_checkpoint

    adapter = finished_run / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "fm_parallel.json", "base_model_config.json"} <= {
        p.name for p in adapter.iterdir()}
    assert json.loads((adapter / "base_model_config.json").read_text())["hidden_size"] == 64
    info = json.loads((adapter / "fm_parallel.json").read_text())
    assert info["step"] == 2 and info["base_model"] == str((finished_run / "base_model").resolve())
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == info["base_model"] and config["r"] == 4
    assert info["if_moved"].startswith("PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('<where the base")

    # The trained model: the last checkpoint restored as --resume restores it.
    cfg = load_config(TINY + ["--output.dir", str(finished_run)], environ={})
    cfg.model.activation_checkpointing = False
    cfg.model.attention = "sdpa"  # the same attention kernel on both sides: the comparison is of weights
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from fm_parallel.trainer.model import build_model as _build_model

    trained = _build_model(cfg, 258, torch.device("cpu"))
    state = {"model": get_model_state_dict(trained, options=StateDictOptions(ignore_frozen_params=True))}
    dcp.load(state, checkpoint_id=str(finished_run / "checkpoints" / "step_000002"), no_dist=True)
    set_model_state_dict(trained, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    trained.eval()

    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(info["base_model"], attn_implementation="sdpa")
        loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
        got = loaded(input_ids=ids).logits
        assert torch.equal(got, want)
        lora = [n for n, p in loaded.named_parameters() if "lora_B" in n]
        assert lora and any(p.abs().sum() > 0 for n, p in loaded.named_parameters() if "lora_B" in n)  # trained, not zero

        # The converter writes the same adapter from a checkpoint.
        out = convert_checkpoint(finished_run, out=tmp_path / "converted")
        base2 = AutoModelForCausalLM.from_pretrained(info["base_model"], attn_implementation="sdpa")
        assert torch.equal(PeftModel.from_pretrained(base2, str(out)).eval()(input_ids=ids).logits, want)
    proc = subprocess.run([sys.executable, "-m", "fm_parallel.trainer.export", str(tmp_path / "nowhere")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error: run_dir: expected a trainer run directory" in proc.stderr


def test_a_stop_request_ends_checkpoint_verification(finished_run):
    from fm_parallel.trainer import runs

    path = runs.latest_checkpoint(finished_run)
    runs.verify_checkpoint(path)  # intact
    with pytest.raises(runs.StopRequested):
        runs.verify_checkpoint(path, stop=lambda: True)  # polled while hashing: a SIGTERM is honoured


@pytest.mark.parametrize("listing", ["[]", '{"a.pt": "abc"}', "{not json", '{"missing.pt": {"sha256": "0", "bytes": 1}}'])
def test_a_damaged_checksum_listing_is_refused(tmp_path, listing):
    from fm_parallel.trainer import runs

    ckpt = tmp_path / "step_000000"
    ckpt.mkdir()
    (ckpt / "a.pt").write_bytes(b"weights")
    (ckpt / runs.CHECKSUMS).write_text(listing)
    with pytest.raises(runs.CheckpointError, match="damaged|missing"):
        runs.verify_checkpoint(ckpt)
    runs.write_checksums(ckpt)
    runs.verify_checkpoint(ckpt)  # a rewritten listing verifies


def test_a_data_set_smaller_than_one_row_trains_through_the_command_line(tmp_path):
    """One 12-token record with 128-token rows hung the trainer (no row was ever complete); now every
    step trains on the padded row that holds it."""
    data = tmp_path / "tiny.jsonl"
    data.write_text('{"text": "hello world"}\n')
    out = tmp_path / "run"
    proc = trainer(*TINY, "--data.path", str(data), "--output.dir", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)  # 11 predicted tokens a step, not a NaN of 0/0
