"""What a LoRA training step computes, in FLOPs, for the throughput the trainer prints (model TFLOP/s
and the share of the GPU's dense bf16 peak, MFU).

Counted: every matrix product the step runs, recompute included (the issue's "hardware" count), for
the frozen base and LoRA alike: a decoder layer's projections and MLP once per pass over them (a
frozen weight's backward computes the input's gradient only: one pass), the LM head's, and attention
over the mask's visible (query, key) pairs: ``4 * pairs * head_dim`` per head forward, 2.5 times
that backward. Elementwise work (norms, rotary, activations, the loss) is not counted.

Passes of a step with per-layer checkpoints: forward, recomputed forward, backward (3). A tiled layer
(:mod:`.tiling`) runs its query and key projections 4 times (forward, the backward's recompute for
attention, the recompute that is differentiated, backward) and its output part 3 times; a checkpoint
every k > 1 layers adds one forward of every layer. The LM head: forward, recompute, backward.

    count = step_flops(model_config, tokens, visible_pairs, tiled=True, checkpoint_every=1)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepFlops", "step_flops", "rows_flops", "peak_tflops", "PEAK_BF16_TFLOPS"]

# Dense bf16 tensor-core peak by device name (vendor datasheets, SXM parts): the MFU denominator.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step: ``linear`` (projections, MLP, LM head) and ``attention``; ``total``."""

    linear: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.attention


def step_flops(config, tokens: int, visible_pairs: int, *, tiled: bool, checkpoint_every: int = 1,
               checkpointing: bool = True) -> StepFlops:
    """FLOPs of a LoRA step over ``tokens`` tokens (all rows of the step) whose masks have
    ``visible_pairs`` visible (query, key) pairs per head, for a Hugging Face decoder ``config``
    (its text config: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, vocab_size)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or hidden // hq
    query = 2 * hidden * hq * d
    keys = 2 * 2 * hidden * hkv * d
    output = 2 * (hq * d * hidden + 3 * hidden * inter)
    extra = 1 if checkpointing and checkpoint_every > 1 else 0
    if tiled:
        per_token = (query + keys) * (4 + extra) + output * (3 + extra)
    else:
        passes = (3 if checkpointing else 2) + extra
        per_token = (query + keys + output) * passes
    head = 2 * hidden * c.vocab_size * 3
    attention_passes = (2 if checkpointing or tiled else 1) + extra  # forwards
    attention = layers * hq * 4 * d * visible_pairs * (attention_passes + 2.5)
    return StepFlops(linear=float(tokens) * (layers * per_token + head), attention=float(attention))


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (``torch.cuda.get_device_name``), or None."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def rows_flops(cfg, model_config, rows) -> float:
    """FLOPs of a trainer step over ``rows`` (the step's packed rows, all ranks'), as the run's
    configuration ``cfg`` runs them (tiled or not, a checkpoint every k layers)."""
    tokens = sum(int(r.input_ids.numel()) for r in rows)
    pairs = sum(int(r.mask.visible_pairs().sum()) for r in rows)
    m = cfg.model
    return step_flops(model_config, tokens, pairs, tiled=m.tile_chunk > 0, checkpoint_every=m.checkpoint_every,
                      checkpointing=m.activation_checkpointing).total
