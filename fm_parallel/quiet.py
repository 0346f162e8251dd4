"""The warnings our runs print that are known to be harmless, silenced by message in one place.

A user reads every warning as a bug. Each entry below names a message (a regular expression over the
start of the warning's text) and why it is harmless; nothing else is silenced, and everything the
trainer and the export do not print themselves keeps its warnings. ``silence_known_harmless()`` is
called by the trainer (``loop.train``) and the export command.

Warnings fixed at their cause instead: the process group bound to the rank's GPU before it exists
(``barrier(): using the device under current context``, ``Guessing device ID based on global rank``,
cuBLAS without a current context: ``trainer/parallel.py``), the group destroyed at exit
(``destroy_process_group() was not called``: ``loop.main``), torch's deprecated differentiable
all-reduce (``distributed/layout.py``).
"""

from __future__ import annotations

import warnings

__all__ = ["KNOWN_HARMLESS", "silence_known_harmless"]

KNOWN_HARMLESS: tuple[tuple[str, str], ...] = (
    (r".*is_gradient_checkpointing.*is deprecated",
     "transformers 5 renamed gradient to activation checkpointing and warns from its own internals (and peft's) "
     "each step; nothing of ours calls the old name"),
    (r"torch.distributed is disabled, unavailable or uninitialized",
     "the export converts a checkpoint in one process by design; torch.distributed.checkpoint says it assumes so"),
    (r"Argument aux_data .* cannot be converted to a JitArgument",
     "FA4's CuTe compile sees our FlashMask bounds (mask_mod's auxiliary tensors) as a Python object it does not "
     "specialise on; they are read at run time, and the CuTe backend's results are checked against float64"),
)


def silence_known_harmless() -> None:
    """Ignore exactly the warnings of :data:`KNOWN_HARMLESS`, by message."""
    for message, _reason in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message)
