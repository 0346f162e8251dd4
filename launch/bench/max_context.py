"""Longest sequence at which one LoRA training step fits: FlashMask against SDPA with a dense mask and FlexAttention.

    python -m launch.bench.max_context --models 1b 8b                      # on the H200
    python -m launch.bench.max_context --models tiny --device cpu --max 8192  # mechanics check on a CPU

For each model shape (random weights, bf16 on GPU, LoRA rank 16 on the attention projections) and
each attention implementation, the length doubles from --start while a step fits, then bisects
between the last length that fit and the first that did not (to --granularity tokens). A step is one
forward + backward + AdamW step on one row of packed documents (mean length 2048) with the trainer's
memory switches: activation checkpoints (one per --checkpoint-every layers, those of the first
--offload layers in host memory; both planned by default, from one decoder layer measured as the
trainer's memory plan measures it, a length no plan fits refused before its step), sequence-tiled
per-token work, chunked loss. Every length tried is reported with peak memory, step time and tokens/s.

Writes docs/benchmarks/max_context.json and max_context.md (and a plot).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.max_context")

from launch.bench.harness import check_device, error_line

SHAPES = {
    "tiny": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, vocab=258),
    "1b": dict(hidden_size=2048, layers=16, heads=32, kv_heads=8, intermediate_size=8192, vocab=128256),
    "8b": dict(hidden_size=4096, layers=32, heads=32, kv_heads=8, intermediate_size=14336, vocab=128256),
}
IMPLS = ("flashmask", "sdpa_dense", "flex")
DOC_MEAN = 2048  # the packed documents' mean length (masks.sample_lengths)
LONGEST_DOC = DOC_MEAN * 7 // 4  # sample_lengths draws below 7/4 of the mean: the plan's worst case
SHORTEST_MEASURE = 4096  # the one-layer measurement halves its lengths down to this before giving up


def search_longest(fits, start: int, maximum: int, granularity: int) -> tuple[int, list[int]]:
    """Doubling from ``start`` while ``fits(n)``, then bisection: the longest fitting length (0 if even
    ``start`` fails) and every length tried, in order."""
    tried: list[int] = []

    def check(n):
        tried.append(n)
        return fits(n)

    if not check(start):
        return 0, tried
    good, bad = start, None
    while good * 2 <= maximum:
        if check(good * 2):
            good *= 2
        else:
            bad = good * 2
            break
    while bad is not None and bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        if check(mid):
            good = mid
        else:
            bad = mid
    return good, tried


def _config(shape: str, impl: str, args):
    from fm_parallel.trainer.config import Config

    s, cfg = SHAPES[shape], Config()
    m = cfg.model
    m.hidden_size, m.layers, m.heads, m.kv_heads, m.intermediate_size = (
        s["hidden_size"], s["layers"], s["heads"], s["kv_heads"], s["intermediate_size"])
    m.attention = {"flashmask": "flashmask", "sdpa_dense": "sdpa", "flex": "flex"}[impl]
    m.tile_chunk = args.tile_chunk
    m.attention_chunk = args.attention_chunk
    m.compile = args.compile
    m.lora_compute = args.lora_compute
    cfg.data.seq_len = args.max  # only sizes the rotary table
    cfg.parallel.cp = "none"
    cfg.training.loss_chunk = args.loss_chunk
    cfg.data.max_doc_tokens = LONGEST_DOC  # the plan measures the costliest mask of _step's documents
    return cfg


def _model(shape: str, impl: str, device, args):
    """The trainer's own model build (random weights, LoRA r16 on q/k/v/o, per-layer checkpointing)."""
    from fm_parallel.trainer.model import build_model

    return build_model(_config(shape, impl, args), SHAPES[shape]["vocab"], device)


class Planner:
    """The memory plan of each length, from the model's shape and a measured budget, not from trial and
    error (``fm_parallel.longcontext.memory.plan_memory``). By default ``measure_layer`` measures one
    decoder layer as the trainer's plan does (``fm_parallel.trainer.capacity.measure_layer_budget`` at
    ``measured_lengths``): a line ``fixed + per_token * n`` per phase (``StepBudget``); with
    ``--calibrate``, ``calibrate`` fits those lines through two short steps' peaks of the whole model
    with every checkpoint on the host, phase by phase (how the figures in docs/long-context.md were made:
    below the tiled layer's chunks such steps overstate the per-token line, twice over at 16k and 32k).
    Each length is planned on the phase that needs the most there. ``every`` / ``offload``: None to
    plan, else fixed. Without a GPU nothing is planned (no device budget): the fixed values, or a
    checkpoint per layer and none offloaded."""

    def __init__(self, layers: int, hidden: int, itemsize: int, device_budget: float, host_budget: float,
                 every: int | None, offload: int | None):
        self.layers, self.hidden, self.itemsize = layers, hidden, itemsize
        self.device_budget, self.host_budget, self.every, self.offload = device_budget, host_budget, every, offload
        self.budget = None
        self.extra = 0.0  # bytes the measurement leaves out of the model's static memory

    def measure_layer(self, cfg, device, vocab_size: int, longest: int, *, measure=None) -> dict:
        """Measure one layer of ``cfg``'s model at ``capacity.measured_lengths(cfg, longest)`` (as the
        trainer would for a ``longest``-token step); lengths whose layer runs out of memory (SDPA's
        dense mask) are halved, down to ``SHORTEST_MEASURE``. ``measure``: as
        ``capacity.measure_one_layer``. Returns the report printed and kept in the results."""
        import gc

        from fm_parallel.trainer.capacity import measure_layer_budget, measured_lengths

        lengths, too_long = measured_lengths(cfg, longest), []
        while True:
            try:
                got = measure_layer_budget(cfg, device, vocab_size, lengths, measure=measure)
                break
            except Exception as e:  # noqa: BLE001 - out of memory: shorter lengths; anything else is raised
                if not _is_oom(e):
                    raise
                too_long.append(list(lengths))
                if lengths[0] // 2 < SHORTEST_MEASURE:
                    raise SystemExit(f"error: the memory plan's one-layer measurement ran out of memory at every "
                                     f"length down to {lengths[0]} and {lengths[1]} tokens; give --calibrate "
                                     f"lengths or fixed --offload and --checkpoint-every") from None
                lengths = (lengths[0] // 2, lengths[1] // 2)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        self.budget = got.budget
        # The script's static memory is measured on the whole model at each plan (no AdamW state before
        # the step: _step makes it); the other layers' adapter gradients, made during the layers'
        # backward, are not in it (the one layer's own are in its peaks).
        self.extra = (self.layers - 1) * got.adapter
        return {"calibration": got.where, "lengths": list(lengths), "ran_out_of_memory_at": too_long,
                "lines": self._lines()}

    def _lines(self) -> dict:
        return {phase: {"fixed_gib": fixed / 2**30, "bytes_per_token": per_token}
                for phase, (fixed, per_token) in self.budget.lines.items()}

    def calibrate(self, measured: dict[int, dict[str, float]]) -> dict:
        """``measured[n][phase]``: bytes above static of the step of ``n`` tokens."""
        from fm_parallel.longcontext.memory import StepBudget

        self.budget = StepBudget.fit(measured)
        self.extra = 0.0
        return {"calibration": [{"n": n, "used_gib": max(p.values()) / 2**30,
                                 "phases_gib": {k: v / 2**30 for k, v in p.items()}} for n, p in sorted(measured.items())],
                "lines": self._lines()}

    def plan(self, n: int, static: float):
        from fm_parallel.longcontext.memory import MemoryPlan, plan_memory

        if self.budget is None:
            return MemoryPlan(n, self.every or 1, self.offload or 0, 0, 0)
        return plan_memory(n, layers=self.layers, hidden=self.hidden, itemsize=self.itemsize,
                           static_bytes=static + self.extra, budget=self.budget, device_budget=self.device_budget,
                           host_budget=self.host_budget, every=self.every, offload_layers=self.offload)


def _step(model, impl: str, n: int, device, args, peaks=None) -> float:
    """One training step on a packed row of ``n`` tokens (documents of mean length 2048); its seconds.
    ``peaks``: a ``fm_parallel.trainer.capacity.PhasePeaks`` to record the step's phases in. The loss
    holds what the trainer's holds (``fm_parallel.trainer.capacity.measured_loss``)."""
    from fm_parallel import masks
    from fm_parallel.trainer.capacity import measured_loss

    host_mask = masks.document(masks.sample_lengths(n, DOC_MEAN))
    pairs = int(host_mask.visible_pairs().sum())
    mask = host_mask.to(device)
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(0, vocab, (1, n), device=device)
    labels = torch.roll(ids, -1, 1)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = measured_loss(model, ids, labels, mask, args.loss_chunk, "auto", peaks) / n
    if peaks is not None:
        peaks.end("forward")
    loss.backward()
    if peaks is not None:
        peaks.end("layers_backward")
    optim.step()
    optim.zero_grad(set_to_none=True)
    if peaks is not None:
        peaks.end("optimizer")
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    _step.last_pairs = pairs
    return seconds


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or "cudaerrormemoryallocation" in text


def _empty_host_cache() -> None:
    """Give cached pinned host blocks back: blocks of one length's size would pile up across lengths."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001 - a signature differing across torch versions; try the next
                continue


class _TimeUp(Exception):
    pass


def run(shape: str, impl: str, device, args) -> dict:
    import gc

    from fm_parallel.trainer.capacity import PhasePeaks
    from fm_parallel.trainer.flops import peak_tflops, step_flops
    from fm_parallel.longcontext.memory import (MemoryPlanError, checkpoint_layers, gpu_memory_budget,
                                            held_elsewhere_message, plan_shortfall)
    from fm_parallel.trainer.metrics import allocator_stats, compile_seconds, first_step_costs

    rows: list[dict] = []
    model = _model(shape, impl, device, args)
    s = SHAPES[shape]
    cuda = device.type == "cuda"
    device_budget = 0.0
    if cuda:
        device_budget, elsewhere = gpu_memory_budget(device, args.device_fraction)
        if elsewhere:
            print(f"warning: {held_elsewhere_message(elsewhere, device_budget)}, and the lengths that fit are this "
                  f"run's, not the GPU's", flush=True)
    planner = Planner(s["layers"], s["hidden_size"], 2 if cuda else 4, device_budget, args.host_gib * 2**30,
                      None if args.checkpoint_every == "auto" else int(args.checkpoint_every),
                      None if args.offload == "auto" else int(args.offload))
    began = time.perf_counter()

    def attempt(n: int, every: int, offload: int, warm_next: bool = False) -> dict:
        peaks = None
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            peaks = PhasePeaks(device)
        policy = checkpoint_layers(model.get_base_model(), offload, every)
        row = {"model": shape, "impl": impl, "n": n, "checkpoint_every": every, "offload_layers": offload,
               "compile": args.compile, "lora_compute": args.lora_compute,
               "device": torch.cuda.get_device_name(device) if cuda else device.type}
        compiled_since = compile_seconds()
        try:
            seconds = _step(model, impl, n, device, args, peaks)
            row.update(fits=True, step_s=seconds, tokens_per_s=n / seconds)
            if impl == "flashmask":  # the baselines differ in what they compute (dense N x N or block sparse)
                count = step_flops(model.get_base_model().config, n, _step.last_pairs, tiled=args.tile_chunk > 0,
                                   checkpoint_every=every)
                row.update(tflop=count.total / 1e12, tflops_per_s=count.total / seconds / 1e12)
                peak = peak_tflops(torch.cuda.get_device_name(device)) if cuda else None
                if peak:
                    row["mfu"] = row["tflops_per_s"] / peak
        except Exception as e:  # noqa: BLE001 - out of memory is the answer we look for; others are reported
            if not _is_oom(e):
                row["error"] = error_line(e)
            row["fits"] = False
        row["host_gib"] = policy.host_bytes / 2**30
        row.update(first_step_costs(policy, compiled_since))  # what a first step at this length pays, apart
        if cuda:
            peaks.finish()  # a step that failed: its running phase's peak
            row["peak_gib"] = peaks.overall / 2**30
            row["static_gib"] = peaks.static / 2**30
            row["phase_peaks_gib"] = {phase: b / 2**30 for phase, b in peaks.peaks.items()}
            row.update(allocator_stats(device), reserved_gib=peaks.reserved / 2**30)
            row["used"] = dict(peaks.peaks)
        model.zero_grad(set_to_none=True)
        if cuda and not warm_next:  # the next step is at another length: its pinned blocks would not be reused
            _empty_host_cache()
        return row

    calibration = None
    if cuda and (planner.every is None or planner.offload is None) and not args.calibrate:
        longest = max([*(args.lengths or [args.max]), args.profile or 0, args.memory_breakdown or 0])
        calibration = planner.measure_layer(_config(shape, impl, args), device, s["vocab"], longest)
        print(json.dumps({"model": shape, "impl": impl, **calibration}), flush=True)
    elif cuda and (planner.every is None or planner.offload is None):
        measured = {}
        for n in args.calibrate:
            row = attempt(n, 1, -1)
            if not row["fits"]:
                raise SystemExit(f"error: --calibrate: the {n}-token step with every checkpoint on the host did not fit "
                                 f"({row.get('error', 'out of memory')}); give shorter calibration lengths")
            measured[n] = row["used"]
        calibration = planner.calibrate(measured)
        print(json.dumps({"model": shape, "impl": impl, **calibration}), flush=True)

    profile = None
    if args.profile and cuda:  # first, so that a run cut by its time limit still has it
        plan = planner.plan(args.profile, torch.cuda.memory_allocated())
        checkpoint_layers(model.get_base_model(), plan.offload_layers, plan.every)
        _step(model, impl, args.profile, device, args)  # warm: compiles and pinned host buffers outside the profile
        profile = profile_step(lambda: _step(model, impl, args.profile, device, args), args.profile)
        profile.update(model=shape, impl=impl, checkpoint_every=plan.every, offload_layers=plan.offload_layers)
        print(json.dumps(profile), flush=True)
        (args.out / "max_context_profile.json").write_text(json.dumps(profile, indent=1))
        model.zero_grad(set_to_none=True)

    memory = None
    if args.memory_breakdown and cuda:  # like the profile: first, so that a run cut by its time limit still has it
        memory = memory_breakdown_step(model, shape, impl, planner, device, args)
        model.zero_grad(set_to_none=True)
        _empty_host_cache()

    def fits(n: int, warm_next: bool = False) -> bool:
        if time.perf_counter() - began > args.time_limit:
            raise _TimeUp
        static = torch.cuda.memory_allocated() if cuda else 0.0
        try:
            plan = planner.plan(n, static)
        except MemoryPlanError as e:  # refused before the step: nothing is allocated for it
            row = {"model": shape, "impl": impl, "n": n, "fits": False, "refused": str(e)}
        else:
            warm = bool(rows) and rows[-1]["n"] == n and rows[-1]["fits"]  # the step before ran this length
            row = attempt(n, plan.every, plan.offload_layers, warm_next)
            row["warm"] = warm
            if plan.device_bytes:
                row.update(planned_device_gib=plan.device_bytes / 2**30, planned_host_gib=plan.host_bytes / 2**30,
                           planned_phase=plan.phase)
                missed = plan_shortfall(plan, row["peak_gib"] * 2**30) if row.get("peak_gib") else None
                if missed:  # it fitted, with less room than planned: said, and kept in the row
                    row["plan_short_gib"] = row["peak_gib"] - row["planned_device_gib"]
                    print(f"warning: {impl} {shape}: {missed}", file=sys.stderr, flush=True)
        row.pop("used", None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out / "max_context.jsonl", "a") as f:  # survives a killed run
            f.write(json.dumps(row) + "\n")
        return row["fits"]

    stopped = None
    try:
        if args.lengths:
            for i, n in enumerate(args.lengths):
                fits(n, warm_next=args.lengths[i + 1:i + 2] == [n])  # a length given twice: the second step is warm
            longest = max([r["n"] for r in rows if r["fits"]], default=0)
        else:
            longest, _ = search_longest(fits, args.start, args.max, args.granularity)
    except _TimeUp:
        stopped = f"time limit {args.time_limit:.0f} s"
        longest = max([r["n"] for r in rows if r["fits"]], default=0)
    del model
    return {"model": shape, "impl": impl, "longest": longest, "stopped": stopped, "calibration": calibration,
            "tried": rows, "profile": profile, "memory": memory}


def memory_breakdown_step(model, shape: str, impl: str, planner: Planner, device, args) -> dict:
    """One step of ``args.memory_breakdown`` tokens (planned like the others, no warm step before it:
    at 1M one step is what we can afford) under the CUDA allocator's history
    (:mod:`fm_parallel.longcontext.memory_breakdown`): what its peak is made of, term by term, beside the
    plan's prediction and the static terms measured on the model. Written to max_context_memory.json.
    A step that fails still gives its breakdown of what filled the device until then: out of memory
    (``fits`` false, the failed request in ``oom``) or any other error (``fits`` None, the error line
    in ``error``, and in ``hint`` what to do when it is torch's known conflict with the recording)."""
    import gc

    from fm_parallel.longcontext.memory import MemoryPlanError, checkpoint_layers
    from fm_parallel.longcontext.memory_breakdown import (peak_breakdown, record, recordable_checkpoints,
                                                      recording_conflict, static_terms)

    n = args.memory_breakdown
    gc.collect()
    torch.cuda.empty_cache()
    try:
        plan = planner.plan(n, torch.cuda.memory_allocated(device))
    except MemoryPlanError as e:
        raise SystemExit(f"error: --memory-breakdown {n}: the memory plan refuses this length: {e}")
    policy = checkpoint_layers(model.get_base_model(), plan.offload_layers, plan.every)
    static = static_terms(model, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    error, seconds, fits = None, None, True
    with record(device) as rec, recordable_checkpoints(plan.every):
        try:
            seconds = _step(model, impl, n, device, args)
        except Exception as e:  # noqa: BLE001 - a failed step is an answer too (the trace shows what filled the device)
            error = error_line(e)
            fits = False if _is_oom(e) else None  # another failure says nothing about fitting
    out = {"model": shape, "impl": impl, "n": n, "checkpoint_every": plan.every, "offload_layers": plan.offload_layers,
           "device": torch.cuda.get_device_name(device), "fits": fits, "step_s": seconds,
           # every > 1: recorded with the recompute run to the end (recordable_checkpoints says why)
           "checkpoint_early_stop": plan.every <= 1,
           "planned_device_gib": plan.device_bytes / 2**30 if plan.device_bytes else None,
           "planned_host_gib": plan.host_bytes / 2**30 if plan.device_bytes else None,
           "host_gib": policy.host_bytes / 2**30,
           "max_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
           **peak_breakdown(rec.snapshot, rec.start_bytes, rec.device_index, max_entries=rec.max_entries),
           "static": static,
           # _step makes its AdamW per step: no state before the step (static has none); its state is
           # allocated in optim.step(), after the backward, and freed with the step.
           "optimizer": "made per step by _step (AdamW over the LoRA parameters): its state is allocated by "
                        "optim.step() inside the recorded step (a term under launch/bench/max_context.py:_step), "
                        "not held before it"}
    if error:
        out["error"] = error
        hint = recording_conflict(error, plan.every)
        if hint:  # the breakdown above is of the step until it failed, not of the whole step
            out["hint"] = hint
            print(f"error: --memory-breakdown {n}: {hint}", file=sys.stderr, flush=True)
    del rec  # the snapshot's Python objects (one per trace entry) can take GBs of host memory
    print(json.dumps(out), flush=True)
    (args.out / "max_context_memory.json").write_text(json.dumps(out, indent=1))
    return out


# Kernel names -> what they do, first match wins (CUDA time summed per kind in profile_step).
KINDS = (
    ("host <-> device copies", ("memcpy htod", "memcpy dtoh")),
    ("device copies", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "cutlass_kernel", "kernel_cutlass")),
    ("matmul", ("gemm", "nvjet", "xmma", "cublas", "sm90_", "cutlass")),
    ("norm / reductions", ("reduce", "norm", "softmax", "log_softmax", "nll", "cross_entropy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "cat", "index", "pow", "rsqrt", "mul", "add")),
)


def profile_step(step, n: int) -> dict:
    """One step under torch.profiler (after the run's own warm steps): its wall time and the CUDA time
    of its kernels by kind (:data:`KINDS`), the largest kernels named."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = step()
    by_kind: dict[str, float] = {}
    top = []
    from torch.autograd import DeviceType

    for e in prof.key_averages():
        # Device events only (kernels, copies): a CPU range (an op, an autograd Function, a runtime call
        # such as "Command Buffer Full") carries the device time of what it launched, counted twice.
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e6
        if t <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + t
        top.append((t, e.key[:120], e.count))
    top.sort(reverse=True)
    return {"n": n, "step_s": seconds, "cuda_s_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "cuda_s_total": sum(by_kind.values()),
            "top_kernels": [{"s": t, "name": k, "calls": c} for t, k, c in top[:25]]}


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(results):
        ok = sorted((t for t in r["tried"] if t["fits"]), key=lambda t: t["n"])
        bad = [t for t in r["tried"] if not t["fits"]]
        label = f"{r['model']} {r['impl']}"
        if ok and "peak_gib" in ok[0]:
            a.plot([t["n"] for t in ok], [t["peak_gib"] for t in ok], "o-", color=f"C{i}", label=label)
        a.plot([t["n"] for t in bad], [0.0] * len(bad), "x", color=f"C{i}", ms=9)
        b.plot([t["n"] for t in ok], [t["tokens_per_s"] for t in ok], "o-", color=f"C{i}", label=label)
    for ax, title in ((a, "peak GPU memory, GiB (x: did not fit)"), (b, "tokens / s of one LoRA step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def by_shape(results: list[dict]) -> list[dict]:
    """One row per (model shape, attention) that has a fitting length: the longest, the seconds of the
    first step there and of a warm one (None if no length was given twice), the device the rows name
    ("" before rows named it), and why the length is only a lower bound, if it is: the search stopped
    early, or no longer length was tried and failed (``lower_bound``: "" when a longer one failed).
    Shapes and implementations in the order of :data:`SHAPES` and :data:`IMPLS`."""
    known = [r for r in results if r["longest"] and r["model"] in SHAPES and r["impl"] in IMPLS]
    rows = []
    for r in sorted(known, key=lambda r: (list(SHAPES).index(r["model"]), IMPLS.index(r["impl"]))):
        at = [t for t in r["tried"] if t["n"] == r["longest"] and t["fits"]]
        first = next((t for t in at if not t.get("warm")), at[0])
        warm = [t["step_s"] for t in at if t.get("warm")]
        rows.append({"model": r["model"], "impl": r["impl"], "longest": r["longest"], "step_s": first["step_s"],
                     "warm_s": min(warm) if warm else None, "device": first.get("device", ""),
                     "lower_bound": f"search stopped: {r['stopped']}" if r.get("stopped") else
                     "" if any(not t["fits"] and t["n"] > r["longest"] for t in r["tried"]) else
                     "nothing longer tried"})
    return rows


def _plot_by_shape(rows: list[dict], path: Path, note: str = "") -> None:
    """The longest fitting length and the step time there against the model shape (:func:`by_shape`),
    one bar per attention implementation: the first step at that length, a warm step as a black dash
    where one ran; a length that is only a lower bound is hatched. ``note``: a line under the titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["model"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / max(len(impls), 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labelled = set()
    for r in rows:
        k, x = impls.index(r["impl"]), shapes.index(r["model"])
        pos = x - 0.4 + width * (k + 0.5)
        for ax, value, text in ((a, r["longest"], f"{r['longest'] // 1024}k"), (b, r["step_s"], f"{r['step_s']:.0f} s")):
            label = None if (ax, r["impl"]) in labelled else r["impl"]
            labelled.add((ax, r["impl"]))
            ax.bar(pos, value, width, color=f"C{k}", hatch="//" if r["lower_bound"] and ax is a else None, label=label)
            ax.annotate(text, (pos, value), ha="center", va="bottom", fontsize=7)
        if r["warm_s"] is not None:
            b.hlines(r["warm_s"], pos - width / 2, pos + width / 2, colors="black", linewidth=2,
                     label=None if "warm" in labelled else "warm step")
            labelled.add("warm")
            b.annotate(f"{r['warm_s']:.0f} s", (pos + width / 2, r["warm_s"]), ha="left", va="center", fontsize=7)
    a.set_yscale("log", base=2)
    a.set_title("longest LoRA step that fits, tokens (hatched: at least)")
    b.set_title("step time at that length, s (bar: first step there)")
    b.legend(fontsize=8)
    if note:
        import textwrap

        fig.text(0.5, 0.01, textwrap.fill(note, 160), ha="center", va="bottom", fontsize=8)
    for ax in (a, b):
        ax.set_xticks(range(len(shapes)), [s.upper() for s in shapes])
        ax.set_xlabel("model shape")
        ax.grid(alpha=0.3, axis="y")
    a.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.04 * (1 + len(note) // 160) if note else 0, 1, 1))
    fig.savefig(path, dpi=110)


def _report(results: list[dict], out: Path, cmd: str, note: str = "") -> None:
    (out / "max_context.json").write_text(json.dumps({"command": cmd, "results": results}, indent=1))
    lines = ["| model | attention | longest step that fits | peak GiB there | host GiB there | layers offloaded | checkpoint every | step s (one step) | tokens/s (one step) | lengths tried (x: did not fit, r: refused by the plan) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        at = [t for t in r["tried"] if t["n"] == r["longest"] and t["fits"]]
        t = at[0] if at else {}
        peak = f"{t['peak_gib']:.1f}" if "peak_gib" in t else "-"
        host = f"{t['host_gib']:.1f}" if t else "-"
        tried = ", ".join(f"{x['n'] // 1024}k{'' if x['fits'] else ' r' if 'refused' in x else ' x'}" for x in r["tried"])
        longest = f"{r['longest']}" + (f" (search stopped: {r['stopped']})" if r.get("stopped") else "")
        lines.append(f"| {r['model']} | {r['impl']} | {longest} | {peak} | {host} | {t.get('offload_layers', '-')} | "
                     f"{t.get('checkpoint_every', 1)} | {t['step_s']:.1f} | {t['tokens_per_s']:.0f} | {tried} |" if t else
                     f"| {r['model']} | {r['impl']} | {longest} | - | - | - | - | - | - | {tried} |")
    shapes = by_shape(results)
    lines += ["", "By model shape (`max_context_shapes.png`):", "",
              "| model | attention | longest step that fits | first step there, s | warm step, s | GPU |", "|---|---|---|---|---|---|"]
    for r in shapes:
        longest = f"{r['longest']}" + (f" (at least: {r['lower_bound']})" if r["lower_bound"] else "")
        warm = "-" if r["warm_s"] is None else f"{r['warm_s']:.1f}"
        lines.append(f"| {r['model']} | {r['impl']} | {longest} | {r['step_s']:.1f} | {warm} | {r['device'] or 'not recorded'} |")
    if note:
        lines += ["", note]
    _plot(results, out / "max_context.png")
    _plot_by_shape(shapes, out / "max_context_shapes.png", note)
    md = "\n".join(lines)
    (out / "max_context.md").write_text(f"# Longest LoRA step\n\n`{cmd}`\n\n{md}\n")
    print(md)


def merge(paths: list[Path], out: Path, cmd: str, note: str = "") -> None:
    """One table and plot from the per-length rows (``max_context.jsonl``) of several runs, grouped by
    model and attention; a group whose search was cut short says so in its ``stopped`` field when the
    run wrote one, else the lengths tried show where it ended."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                groups.setdefault((row["model"], row["impl"]), []).append(row)
    results = [{"model": m, "impl": i, "longest": max([r["n"] for r in rows if r["fits"]], default=0), "stopped": None,
                "tried": rows} for (m, i), rows in groups.items()]
    _report(results, out, cmd, note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--start", type=int, default=8192)
    parser.add_argument("--max", type=int, default=1 << 21)
    parser.add_argument("--granularity", type=int, default=16384)
    parser.add_argument("--loss-chunk", type=int, default=8192)
    parser.add_argument("--tile-chunk", type=int, default=16384, help="tokens per chunk of each layer's per-token work (0: off)")
    parser.add_argument("--attention-chunk", type=int, default=65536,
                        help="query rows per FlashMask attention call inside a tiled layer (0: the whole sequence)")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="the tiled layers' per-token parts through torch.compile (model.compile; auto: on a GPU)")
    parser.add_argument("--lora-compute", default="base", choices=("base", "float32"),
                        help="dtype of the LoRA products (model.lora_compute): base (bf16 on a GPU) or float32 (peft's default)")
    parser.add_argument("--profile", type=int, default=None, metavar="N",
                        help="first, profile one step of N tokens (planned like the others, after one warm step): CUDA "
                             "time by kind of kernel, written to max_context_profile.json")
    parser.add_argument("--memory-breakdown", type=int, default=None, metavar="N",
                        help="first (after --profile), one step of N tokens (planned like the others, no warm step) "
                             "under the CUDA allocator's history: its peak memory term by term (the line of ours "
                             "that allocated it) beside the plan and the weights / adapters measured, written to "
                             "max_context_memory.json; needs a CUDA --device")
    parser.add_argument("--offload", default="auto",
                        help="layers whose checkpoint lives on the host: auto (planned: just enough to fit), -1 (all) or a count")
    parser.add_argument("--checkpoint-every", default="auto",
                        help="layers per checkpoint: auto (planned: the least recompute that fits) or a count")
    parser.add_argument("--calibrate", nargs=2, type=int, default=None, metavar=("N1", "N2"),
                        help="measure the memory plan's budget with two steps of the whole model at these lengths "
                             "(every checkpoint on the host), as the figures in docs/long-context.md were made; default: "
                             "one decoder layer measured as the trainer's plan measures it (at 131072 and 262144 "
                             "tokens with the default chunks; shorter for shorter lengths)")
    parser.add_argument("--lengths", nargs="+", type=int, default=None,
                        help="try exactly these lengths, each planned directly (no doubling search); a length "
                             "given twice in a row runs a second, warm step (pinned host buffers and compiled "
                             "graphs reused)")
    parser.add_argument("--device-fraction", type=float, default=0.94, help="device memory the memory plan aims under")
    parser.add_argument("--host-gib", type=float, default=96.0, help="host memory the offloaded checkpoints may take")
    parser.add_argument("--time-limit", type=float, default=1e9, help="seconds per (model, attention) search; stops early")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--note", default="", help="with --merge: a line under the plots and the table (where and "
                                                    "when the merged rows ran, say)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="no run: combine the max_context.jsonl rows of earlier runs into one table and plot")
    args = parser.parse_args()
    for name in ("offload", "checkpoint_every"):
        value = getattr(args, name)
        if value != "auto" and not value.lstrip("-").isdigit():
            parser.error(f"--{name.replace('_', '-')}: expected auto or an integer, got {value!r}")
    if args.memory_breakdown is not None and args.memory_breakdown <= 0:
        parser.error(f"--memory-breakdown: expected a positive number of tokens, got {args.memory_breakdown}")
    if not args.merge:
        check_device(parser, args.device, "on a CPU pass --device cpu (a mechanics check: --models tiny --max 8192)")
    if args.memory_breakdown is not None and not args.merge and not args.device.startswith("cuda"):
        parser.error(f"--memory-breakdown: needs a CUDA --device (it reads the CUDA allocator's history), got --device {args.device}")
    cmd = "python -m launch.bench.max_context " + " ".join(sys.argv[1:])
    if args.merge:
        args.out.mkdir(parents=True, exist_ok=True)
        merge(args.merge, args.out, cmd, args.note)
        return
    from fm_parallel.longcontext.memory import prefer_expandable_segments

    if args.device.startswith("cuda") and prefer_expandable_segments():  # as the trainer does, before CUDA starts
        print("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set as the trainer sets it)", flush=True)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "max_context.jsonl").unlink(missing_ok=True)
    results = []
    for m in args.models:
        for i in args.impls:
            results.append(run(m, i, device, args))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "max_context.partial.json").write_text(json.dumps(results, indent=1))
    _report(results, args.out, cmd)


if __name__ == "__main__":
    main()
