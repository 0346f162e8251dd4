"""The trainer: config overrides, data packing, DPO mask isolation, loss parity across context-parallel
layouts, resume after a stop, and a checkpoint on SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fm_parallel.trainer.config import load_config
from fm_parallel.trainer.data import ByteTokenizer, dpo_rows, sft_rows
from tests.distributed.spawn import run_cases, run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]

TINY = ["--model.hidden_size", "64", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
        "--model.intermediate_size", "128", "--model.lora_rank", "4", "--data.seq_len", "256",
        "--training.steps", "4", "--training.warmup", "1", "--training.loss_chunk", "100", "--output.checkpoint_every", "0"]


def test_config_layers_file_environment_and_command_line(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[training]\nsteps = 7\nlr = 0.5\n[data]\nseq_len = 128\n')
    cfg = load_config(["--config", str(f), "--training.lr", "0.25", "--parallel.cp=ulysses"], environ={"FM_DATA__SEQ_LEN": "512"})
    assert (cfg.training.steps, cfg.training.lr, cfg.data.seq_len, cfg.parallel.cp) == (7, 0.25, 512, "ulysses")
    for argv, message in ((["--training.nope", "1"], "unknown key training.nope"), (["--training.steps", "x"], "training.steps: expected int"),
                          (["--parallel.cp", "star"], "parallel.cp: expected ring"), (["--data.objective", "rl"], "data.objective"),
                          (["--parallel.impl", "fa3"], "parallel.impl: expected cute, triton, torch or empty")):
        with pytest.raises(ValueError, match=message):
            load_config(argv, environ={})


def test_sft_rows_labels_stay_inside_documents():
    row = next(sft_rows(512, ByteTokenizer()))
    dense = row.mask.to_dense()[0, 0]
    for i in torch.nonzero(row.labels != -100).flatten().tolist():
        assert row.labels[i] == row.input_ids[i + 1] and row.sample[i] == row.sample[i + 1]
        assert dense[i + 1, i]  # the next token's row sees this one: same document
    # Positions whose next token starts a new document predict nothing.
    starts = torch.nonzero(row.sample[1:] != row.sample[:-1]).flatten()
    assert (row.labels[starts] == -100).all()


def test_dpo_mask_keeps_chosen_and_rejected_apart():
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.logprobs import token_logps as _token_logps
    from tests.helpers import tiny_llama

    row = next(dpo_rows(512, ByteTokenizer()))
    model = tiny_llama(fm_hf.register()).eval()
    model.resize_token_embeddings(ByteTokenizer.vocab_size)

    def chosen_logps(ids):
        logits = model(ids.view(1, -1), position_ids=torch.arange(512).view(1, -1), flashmask=row.mask).logits
        lp = _token_logps(logits.float(), row.labels.view(1, -1))[0]
        return lp[row.segment == 1]

    before = chosen_logps(row.input_ids)
    changed = row.input_ids.clone()
    rejected = row.segment == 2
    changed[rejected] = (changed[rejected] + 17) % 256
    assert torch.equal(chosen_logps(changed), before)  # chosen never sees rejected tokens
    rej = row.labels.clone()
    assert (rej[rejected] != -100).any()


def _train(rank, world, argv, out):
    from fm_parallel.trainer.loop import train

    cfg = load_config(argv + ["--output.dir", out], environ={})
    train(cfg)
    return {"ok": True}


def _losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# name -> (world, extra arguments): the one-process run and the layouts that must give its losses.
CP_RUNS = {"single": (1, ["--parallel.cp", "none"]), "ring2": (2, ["--parallel.cp", "ring"]),
           "ring4": (4, ["--parallel.cp", "ring", "--parallel.balance", "mask"]),
           "ulysses2": (2, ["--parallel.cp", "ulysses"]),
           # The long-context switches under CP: tiled layers, the first layer's checkpoint on the host.
           # Last in its spawn, after the untiled runs.
           "ring2_tiled": (2, ["--parallel.cp", "ring", "--model.tile_chunk", "100", "--model.offload_layers", "1"])}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """Every layout of both objectives, one spawn per world size (a run per case): {objective: {name: losses}}."""
    tmp = tmp_path_factory.mktemp("cp")
    runs = {"sft": {}, "dpo": {}, "rm": {}}
    for world in (1, 2, 4):
        cases = {f"{objective}/{name}": (_train, (TINY + ["--data.objective", objective] + extra, str(tmp / objective / name)))
                 for name, (w, extra) in CP_RUNS.items() if w == world for objective in runs}
        for key, results in run_cases(world, cases, timeout=600).items():
            objective, name = key.split("/")
            runs[objective][name] = [r.get("traceback") for r in results if "exception" in r] or _losses(tmp / objective / name)
    return runs


@pytest.mark.parametrize("objective", ["sft", "dpo", "rm"])
def test_context_parallel_losses_equal_one_process(cp_runs, objective):
    runs = cp_runs[objective]
    for name, losses in runs.items():  # a run that raised holds its ranks' tracebacks
        assert all(isinstance(x, float) for x in losses), (name, losses)
    for name in ("ring2", "ring4", "ulysses2", "ring2_tiled"):
        assert runs[name] == pytest.approx(runs["single"], rel=2e-5), (name, runs)


def test_resume_after_a_stop_reproduces_the_uninterrupted_run(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    # The uninterrupted run and the stopped one share a spawn; the resume gets a fresh one, as after a restart.
    done = run_cases(2, {"full": (_train, (TINY, full)), "stop": (_train, (TINY + ["--output.stop_after", "2"], part))}, timeout=600)
    for results in done.values():
        assert all("exception" not in r for r in results), [r.get("traceback") for r in results]
    with open(Path(part) / "metrics.jsonl", "a") as f:  # as if killed after logging a step past the checkpoint
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n")
    results = run_ranks(_train, 2, TINY + ["--resume"], part, timeout=300)
    assert all("exception" not in r for r in results), [r.get("traceback") for r in results]
    want, got = _losses(full), _losses(part)
    assert len(got) == 4
    assert got == pytest.approx(want, rel=1e-6)


def test_a_stop_says_how_far_it_got_and_how_to_go_on(tmp_path):
    """What the user reads when ``output.stop_after`` ends a run early: the steps done of the steps asked,
    the checkpoint written, and the flag that continues (it once said "step 0" after one step)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fm_parallel.launch", *TINY, "--parallel.cp", "none", "--output.dir", str(out),
           "--output.stop_after", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MASTER_PORT=str(29000 + os.getpid() % 500)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and (saved[0] / "complete").exists()
    line = next(line for line in proc.stdout.splitlines() if line.startswith("stopped after"))
    assert line == f"stopped after 1 of 4 steps; checkpoint {saved[0]}; continue with --resume"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_sigterm_writes_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fm_parallel.launch", *TINY, "--training.steps", "500", "--parallel.cp", "none", "--output.dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, MASTER_PORT=str(29000 + os.getpid() % 500)))
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    done = sorted((out / "checkpoints").glob("step_*"))
    assert done and (done[-1] / "complete").exists()
    assert len(metrics.read_text().splitlines()) < 500


def test_a_leaked_world_size_of_one_is_not_a_launch():
    """accelerate (HF Trainer, TRL) writes WORLD_SIZE=1, RANK=0 into os.environ once a process group
    exists; a trainer run later in that process, or a child process, must not wait for a rendezvous
    that no launcher set up (it failed with "MASTER_ADDR expected")."""
    import subprocess
    import sys

    code = ("import os; os.environ.update(WORLD_SIZE='1', RANK='0', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1', MASTER_PORT='29500'); "
            "os.environ.pop('MASTER_ADDR', None); "
            "from fm_parallel.trainer.parallel import init_distributed; init_distributed(5.0); "
            "import torch.distributed as d; print(d.get_world_size(), d.get_rank())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "0"]


def test_dpo_separate_layout_is_trls_and_gives_the_shared_layouts_losses(tmp_path):
    """data.dpo_layout = "separate" lays a sample out as TRL trains it ([prompt, chosen] and [prompt,
    rejected], two causal documents, the prompt computed twice); with one sample per row in both
    layouts the batches are the same samples, so the DPO losses must be equal step by step (what the
    end-to-end comparison of the two layouts relies on), and under CP too."""
    data = tmp_path / "dpo.jsonl"
    texts = [("Q%d: what is the color of the sky over the harbour at dawn? " % i, "Blue, then gold %d." % i * 3,
              "No idea at all %d." % i * 3) for i in range(4)]
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in texts))
    shared = next(dpo_rows(256, ByteTokenizer(), str(data), "shared"))
    separate = next(dpo_rows(256, ByteTokenizer(), str(data), "separate"))
    assert int(shared.sample.max()) == int(separate.sample.max()) == 0  # one sample per row in both layouts
    dense = separate.mask.to_dense()[0, 0]
    seq = torch.cumsum(torch.cat([torch.tensor([0]), (separate.segment[1:] == 0) & (separate.segment[:-1] != 0)]), 0)
    real = separate.sample >= 0
    same = (seq[:, None] == seq[None, :]) & real[:, None] & real[None, :]
    assert torch.equal(dense, same & torch.ones_like(dense).tril())  # two causal documents, nothing across
    # The same tokens are scored, with the same targets.
    for row in (shared, separate):
        assert sorted(row.labels[row.labels != -100].tolist()) == sorted(shared.labels[shared.labels != -100].tolist())
    args = TINY + ["--data.objective", "dpo", "--data.path", str(data), "--training.steps", "3"]
    runs = {}
    for world, layouts in ((1, {"shared": ["--parallel.cp", "none"],  # both one-process runs in one spawn
                                "separate": ["--parallel.cp", "none", "--data.dpo_layout", "separate"]}),
                           (2, {"separate_ring2": ["--parallel.cp", "ring", "--data.dpo_layout", "separate"]})):
        done = run_cases(world, {name: (_train, (args + extra, str(tmp_path / name))) for name, extra in layouts.items()}, timeout=600)
        for name, results in done.items():
            assert all("exception" not in r for r in results), [r.get("traceback") for r in results]
            runs[name] = _losses(tmp_path / name)
    assert runs["separate"] == pytest.approx(runs["shared"], rel=1e-5), runs
    assert runs["separate_ring2"] == pytest.approx(runs["shared"], rel=2e-5), runs
