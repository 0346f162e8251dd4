"""One rank's ring layer captured as CUDA graphs once per step and replayed by every later layer.

A training step runs the ring once per layer (twice with activation checkpointing), forward and
backward, under one prepared mask: the same chunks, windows, kernels and transfers in the same
order, only the tensors' values differ. Launched eagerly, each layer pays the launchers' Python
(FA4's interface, the ring's own views, merges and sums, autograd): 4-7 ms per layer at 128k on the
H200, as much as the kernels' time at P = 8 (``docs/benchmarks/README.md``). Captured once, a
layer costs one graph replay plus the copies in and out.

Per phase (forward, backward) and signature (shapes, strides, dtypes, scale, backend, comm):

* call 1 runs eagerly. It compiles kernels, autotunes and builds the launch plans and FA4 block
  lists the prepared mask caches; those may synchronise with the device, which a capture cannot.
* call 2 copies its inputs into static tensors, captures the phase on a side stream (its own memory
  pool, ``thread_local`` capture mode: the NCCL watchdog's thread is not ours) and replays it.
* calls 3.. copy their inputs in, replay, and clone the outputs out (the next replay writes the same
  memory). Ring statistics counted during the capture are added again on every replay.

The price is device work the eager ring does not do: copying q / k / v (and out, lse, dO in the
backward) into the static tensors and cloning the results, about 1 ms per layer at 32k local tokens,
32 / 8 heads, D 128 (bf16), and the graphs' pools held for the step (the eager layer's peak
activations once per phase). It pays where the host is the bottleneck (P = 8 and up, short local
chunks) and costs where the device is (it was already hidden there): opt in per step,
``prepare(..., cuda_graphs=True)``. A capture that fails (a synchronising op inside it) logs a
warning and that phase runs eagerly for the rest of the step: slower, never wrong.

Graphs need a transport that can be captured: NCCL (device memory, stream-ordered) can; gloo's
host-staged transfers cannot, and :func:`fm_parallel.distributed.prepare` refuses the combination.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

__all__ = ["LayerGraphs"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Phase:
    calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    inputs: tuple[torch.Tensor, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()
    counted: object = None  # the statistics one run of the phase counts (added again per replay)
    failed: bool = False


class LayerGraphs:
    """The captured phases of one prepared mask (one step). ``counters``: calls run ``eager``,
    ``captures``, ``replays`` and ``failed`` captures, for tests and benchmarks."""

    def __init__(self):
        self._phases: dict[tuple, _Phase] = {}
        self.counters = {"eager": 0, "captures": 0, "replays": 0, "failed": 0}

    def run(self, phase: str, fn, inputs: tuple[torch.Tensor, ...], key: tuple, stats, new_stats):
        """``fn(*inputs, stats)`` (a tuple of CUDA tensors), eagerly, captured or replayed.

        Args:
            phase: a name for logs ("forward", "backward").
            fn: the phase; it must launch the same work for inputs of the same signature and return
                tensors it allocated (never one of its inputs).
            inputs: CUDA tensors; their shapes, strides and dtypes are part of the signature.
            key: the rest of the signature (scale, backend, comm, ...).
            stats: what the caller counts into (``None``: nothing); ``new_stats()`` makes an empty one
                (the capture counts into it, and each replay adds it to ``stats``).
        """
        signature = (phase, key) + tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs)
        state = self._phases.setdefault(signature, _Phase())
        state.calls += 1
        if state.failed or state.calls == 1:
            self.counters["eager"] += 1
            return fn(*inputs, stats)
        if state.graph is None:
            self._capture(state, phase, fn, inputs, new_stats())
            if state.failed:
                self.counters["eager"] += 1
                return fn(*inputs, stats)
        else:  # one call for every input (a Python copy_ each cost ~37 us on the H200 with the GPU busy)
            torch._foreach_copy_(list(state.inputs), list(inputs))
        state.graph.replay()
        self.counters["replays"] += 1
        _add(stats, state.counted)
        return tuple(t.clone() for t in state.outputs)

    def _capture(self, state: _Phase, phase: str, fn, inputs, counted) -> None:
        static = tuple(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x) for x in inputs)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device=inputs[0].device)
        stream.wait_stream(torch.cuda.current_stream())
        outputs = error = None
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = fn(*static, counted)
            except RuntimeError as e:  # an op that cannot be captured (a synchronisation, say)
                error = e
            finally:  # the stream leaves capture mode whatever happened (other errors propagate)
                try:
                    graph.capture_end()
                except RuntimeError as e:
                    error = error or e
        torch.cuda.current_stream().wait_stream(stream)
        if error is None and any(any(o is x for x in static) for o in outputs):
            error = RuntimeError("the phase returned one of its inputs")
        if error is not None:
            state.failed = True
            self.counters["failed"] += 1
            log.warning("CUDA graph capture of the ring's %s failed; this step runs it eagerly (%s)", phase,
                        str(error).splitlines()[0] if str(error) else type(error).__name__)
            return
        state.graph, state.inputs, state.outputs, state.counted = graph, static, tuple(outputs), counted
        self.counters["captures"] += 1


def _add(stats, counted) -> None:
    if stats is None or counted is None:
        return
    for field in dataclasses.fields(stats):
        setattr(stats, field.name, getattr(stats, field.name) + getattr(counted, field.name))
