"""The memory plan's one-layer measurement with the layer's input made three ways: its lines by phase.

    python -m launch.bench.one_layer_input --config launch/configs/h200_8b_1m.toml    # on a GPU

The trainer's plan (``model.memory_plan = "auto"``) measures a model of the run's shape with one decoder
layer (fm_parallel/trainer/capacity.py: ``measure_one_layer``) at the two lengths it would measure for
the config's ``data.seq_len``, then plans on a line per phase (``StepBudget``). Every real layer but the
first takes an input that needs a gradient; how the one layer's input is made decides what its backward
holds:

* ``dropped``: the plan's: the input needs a gradient, which is dropped as soon as it is made (as the
  layer below a real layer consumes its ``dx``);
* ``leaf``: a leaf needing a gradient (the plan's until 2026-12-06): its ``dx`` is also kept in ``.grad``;
* ``none``: needs no gradient, so no ``dx`` is made.

Prints one JSON line per variant: the static bytes, each phase's peak per length, and each phase's line
as ``[fixed GiB, KiB per token]`` (docs/long-context.md, the memory plan).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from fm_parallel.trainer import capacity
from fm_parallel.trainer.config import load_config
from fm_parallel.longcontext.memory import GIB, StepBudget
from fm_parallel.trainer.model import build_tokenizer

VARIANTS = {
    "dropped": capacity.dropped_gradient_input,
    "leaf": lambda module, args, out: out.detach().requires_grad_(),
    "none": lambda module, args, out: out.detach(),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the run's TOML config (its model, data and loss)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU: the lines are the CUDA allocator's peaks")
    cfg = load_config(["--config", args.config], environ={})
    vocab_size = build_tokenizer(cfg).vocab_size  # the run's, as the trainer plans with (the loss's chunks)
    lengths = capacity.measured_lengths(cfg, cfg.data.seq_len)
    for name in args.variants:
        got = capacity.measure_one_layer(cfg, torch.device("cuda"), vocab_size, lengths, layer_input=VARIANTS[name])
        lines = StepBudget.fit(got["peaks"]).lines
        row = {"variant": name, "config": args.config, "lengths": list(lengths),
               "device": torch.cuda.get_device_name(), "static_gib": got["static"] / GIB,
               "peaks_gib": {str(n): {p: v / GIB for p, v in ph.items()} for n, ph in got["peaks"].items()},
               "lines": {p: [fixed / GIB, per_token / 1024] for p, (fixed, per_token) in lines.items()}}
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
