"""What one attention layer costs each context-parallel rank, measured on ONE GPU, and what that
predicts for P GPUs.

    python -m launch.bench.cp_layer_cost                                   # H200: P 2 4 8, N 128k-1M
    python -m launch.bench.run --suite cp --only cp-layer-cost            # the same, through the runner

CUDA only (``--device cpu`` is refused: use ring_cpu.py); its ring mechanics are tested on the CPU in
tests/test_launch.py (the Loopback transport through ``ring_attention_over``).

For every (mask family, N, P, balance) and every rank r of P, this process runs rank r's real ring
code (``fm_parallel.distributed.ring``: the prepared mask, transfer skipping, the local kernel per
received chunk, the lse merge, the backward's dK/dV return) with a one-process stand-in for the
transport (:class:`Loopback`: a received chunk is a device-to-device copy of the sender's tensor,
timed apart as "copy"). Per layer (forward + backward) it measures:

* kernel time per ring step (CUDA events around each launcher call, the layers queued behind a GPU
  sleep so that the events time the device, not the Python launchers between them: timed with an
  idle GPU, a 0.05 ms kernel read as its launcher's 0.3-0.5 ms) and in all (the profiler's device
  time: attention kernels, merges and accumulations, transfer stand-in copies);
* host time: the Python time of a layer launched while the GPU is kept busy (``torch.cuda._sleep``),
  so nothing waits for the GPU; a layer that synchronises shows up as host time >= the sleep, and is
  reported (``host_syncs``);
* before / after the prepared mask: "per call" prepares the mask in every layer (pair table, column
  masks, launch plans: what each call did before issue 20), "prepared" once per step. The per-call
  agreement collective is not in "per call" (one process has no peers); on NCCL it added an
  all-gather and a host synchronisation per layer.

The scaling model (written with its assumptions to ``--out/cp_scaling_model_<device>.json`` and
``.md``): per rank and ring step, the measured kernel time against the transfer time of the bytes
that step moves (K/V forward; K/V again and dK/dV back in the backward) at ``--link-gbs`` GB/s per
direction, each step overlapping its compute with the next step's transfer, as the ring posts them;
a layer ends when the slowest rank does, and never before rank 0's host time (a host-bound layer
makes the GPU wait). Predicted effective TF/GPU (visible pairs, 3.5 x forward FLOPs for forward +
backward) against the single-GPU kernel on the whole sequence, same process.

``--decoder-rest`` also times the rest of a LoRA-trained Llama-style decoder layer (:class:`DecoderRest`:
projections with adapters, norms, MLP; forward + backward) at N / P tokens on the same GPU, and reports
the ring's host time against the whole layer's device time and the whole layer's per-GPU efficiency
against one GPU running it over all N tokens (:func:`decoder_ratios`): the attention's host time only
slows training where it exceeds what the GPU has queued.

``--graphs`` also runs the host ranks' layers captured as CUDA graphs (``prepare(...,
cuda_graphs=True)``: the step's second layer captures, later ones replay): their host ms, the device
work the graphs add (copies into the static inputs, clones of the outputs) and the same model with
both (the "graphed" columns).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.cp_layer_cost")

from launch.bench.harness import DTYPES, check_device, spread

if TYPE_CHECKING:
    from fm_parallel.masks import FlashMask


def top_host(fn, calls: int, lines: int = 14, sort: str | tuple[str, ...] = "cumulative") -> str:
    """cProfile of ``calls`` calls of ``fn``: the top ``lines`` host functions by ``sort`` (one key, or
    several: one table per key from the same profile)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for key in (sort,) if isinstance(sort, str) else sort:
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(lines)
    return out.getvalue()


class Loopback:
    """Rank ``rank`` of ``world`` in one process: what the ring asks of :class:`RingComm`. A receive is
    a copy of the peer's tensor of the same role (its K / V, or stand-in gradients of the same shape).
    A device copy, so CUDA graphs capture it (``--graphs``), as they would NCCL's transfers."""

    capturable = True

    def __init__(self, rank: int, world: int, chunks: list[tuple[torch.Tensor, torch.Tensor]]):
        self.rank, self.world_size, self.chunks = rank, world, chunks

    def send_to(self, step: int) -> int:
        return (self.rank + step) % self.world_size

    def recv_from(self, step: int) -> int:
        return (self.rank - step) % self.world_size

    def exchange(self, sends, recvs):
        # A receive is the peer's key window (or its gradients): as many keys from the peer's tensor
        # (the values do not matter here, the bytes and shapes do).
        for i, (buf, peer) in enumerate(recvs):
            buf.copy_(self.chunks[peer][i % 2][:, :, : buf.shape[2]])
        return None

    def wait(self, pending) -> None:
        return None


class StepTimer:
    """A backend whose launchers are timed per call with CUDA events (kernel time per ring step)."""

    def __init__(self, backend, record: bool):
        self.backend, self.record, self.events = backend, record, []

    def _timed(self, kind, fn, *args, **kwargs):
        if not self.record:
            return fn(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        self.events.append((kind, start, end))
        return out

    def forward(self, *args, **kwargs):
        return self._timed("fwd", self.backend.forward, *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._timed("bwd", self.backend.backward, *args, **kwargs)

    def step_ms(self) -> dict:
        torch.cuda.synchronize()
        out = {"fwd": [], "bwd": []}
        for kind, start, end in self.events:
            out[kind].append(start.elapsed_time(end))
        self.events.clear()
        return out


def build_masks(n: int) -> dict:
    from fm_parallel import masks

    lens = masks.sample_lengths(n, mean=min(2048, max(n // 8, 8)))
    window = min(2048, max(n // 16, 4))
    return {
        "docs": masks.document(lens),
        "dpo": masks.dpo(n // 2, n // 4, n - n // 2 - n // 4),
        "sliding_sinks": masks.sliding_window(n, window, sinks=8),
        "causal": masks.causal(n),
    }


def rank_layer(args, mask, plan, rank, q, k, v, dout, impl, per_call: bool, timer_record: bool, device, host_mask=None,
               graphs: bool = False):
    """One layer (forward + backward) of ``rank``'s ring on this process; returns the step timer.
    ``graphs``: the step's layers captured as CUDA graphs (the second call captures, later ones replay;
    ``layer.state["prepared"].graphs.counters`` says what ran)."""
    from fm_parallel import backends
    from fm_parallel.distributed.prepared import PreparedMask
    from fm_parallel.distributed.ring import RingStats, ring_attention_over

    world = plan.world_size
    chunks = [(plan.shard(k, r, 2), plan.shard(v, r, 2)) for r in range(world)]
    ql = plan.shard(q, rank, 2).detach().requires_grad_()
    kl, vl = (t.detach().requires_grad_() for t in chunks[rank])
    dl = plan.shard(dout, rank, 2)
    backend = StepTimer(backends.get(impl), timer_record)
    state = {"prepared": None}
    comm = Loopback(rank, world, chunks)  # one per rank: the graphs' signature holds the transport

    def layer():
        prepared = state["prepared"]
        if prepared is None or per_call:
            prepared = PreparedMask(mask, plan, rank, device, host_mask=host_mask, cuda_graphs=graphs)  # as prepare() makes it
            state["prepared"] = prepared
        stats = RingStats()
        out = ring_attention_over(ql, kl, vl, prepared, comm, backend, scale=1.0 / math.sqrt(q.shape[-1]), stats=stats)
        out.backward(dl)
        return stats

    layer.state = state
    return layer, backend


def profile_ms(fn, calls: int) -> dict:
    """Device time per call: everything, and the transfer stand-ins (device-to-device memcpy)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = copy = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.device_time_total <= 0:
            continue
        total += e.device_time_total / 1e3
        if "memcpy" in e.name.lower():
            copy += e.device_time_total / 1e3
    return {"total": total / calls, "copy": copy / calls}


def keep_gpu_busy(ms: float) -> None:
    """Queue a GPU sleep of about ``ms`` (the H200's SM clock is about 1.98 GHz): work launched after it
    queues behind it, so CUDA events around that work time the device and not the host's launches."""
    torch.cuda._sleep(int(ms * 1.98e6))


def host_ms(fn, calls: int, sleep_ms: float) -> tuple[float, bool, dict]:
    """Median host ms per call while the GPU is busy for ``sleep_ms`` first, True if a call waited for
    it, and min / median / max of the calls."""
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        keep_gpu_busy(sleep_ms)
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    stats = spread(times)
    return stats["median"], stats["median"] >= 0.8 * sleep_ms, stats


def queued(fn, calls: int, forget=None) -> bool:
    """Run ``fn`` ``calls`` times queued behind a GPU sleep longer than their host time (measured on one
    more call first, after which ``forget()`` drops what it recorded). True if the host stayed ahead of
    the GPU to the end (the events inside time the device only); False if the GPU caught up (the calls
    synchronise, or the sleep was short)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = 1e3 * (time.perf_counter() - t0)
    if forget is not None:
        forget()
    keep_gpu_busy(10.0 + 2.0 * one * calls)
    for _ in range(calls):
        fn()
    ahead = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return ahead


def single_gpu_ms(mask, q, k, v, dout, impl, reps: int) -> float:
    """Device ms of one forward + backward over the whole sequence (median of ``reps``, CUDA events,
    queued behind a GPU sleep like the ranks' steps)."""
    from fm_parallel import flashmask_attention

    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    events = []

    def step():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = flashmask_attention(qq, kk, vv, mask=mask, impl=impl)
        out.backward(dout)
        end.record()
        events.append((start, end))

    step()
    if not queued(step, reps, forget=events.clear):
        print("warning: the single-GPU layer caught the GPU up; its time includes host launches")
    return spread([s.elapsed_time(e) for s, e in events])["median"]


class DecoderRest(torch.nn.Module):
    """A Llama-style decoder layer without its attention core, LoRA-trained: RMSNorm, the q / k / v / o
    projections, RMSNorm, the SwiGLU MLP and both residual adds, base weights frozen, rank-``r``
    adapters on all seven projections (what ``peft`` adds for ``target_modules="all-linear"``). The
    attention core is stood in for by ``q + repeat(k + v)`` (elementwise), so every projection's
    backward runs; the core itself is what the ring measures. ``x``: ``[T, hidden]``."""

    def __init__(self, hidden: int, kv_dim: int, intermediate: int, rank: int, device, dtype):
        super().__init__()
        shapes = {"q": (hidden, hidden), "k": (kv_dim, hidden), "v": (kv_dim, hidden), "o": (hidden, hidden),
                  "gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
        self.base = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * s[1] ** -0.5,
                                                                  requires_grad=False) for n, s in shapes.items()})
        self.lora_a = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.randn(rank, s[1], device=device, dtype=dtype) * 0.01)
                                              for n, s in shapes.items()})
        self.lora_b = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s[0], rank, device=device, dtype=dtype))
                                              for n, s in shapes.items()})
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(hidden, device=device, dtype=dtype) for _ in range(2))
        for norm in self.norms:
            norm.weight.requires_grad_(False)
        self.repeat = hidden // kv_dim

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        return f.linear(x, self.base[name]) + f.linear(f.linear(x, self.lora_a[name]), self.lora_b[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norms[0](x)
        q, k, v = self.proj("q", h), self.proj("k", h), self.proj("v", h)
        x = x + self.proj("o", q + (k + v).repeat(1, self.repeat))
        h = self.norms[1](x)
        return x + self.proj("down", torch.nn.functional.silu(self.proj("gate", h)) * self.proj("up", h))


def decoder_rest_cost(tokens: int, args, device, dtype) -> dict:
    """Device and host ms of one :class:`DecoderRest` forward + backward at ``tokens`` local tokens
    (the hidden size is heads x head dim, as in Llama models; median of ``args.layers``)."""
    hidden, kv_dim = args.heads * args.head_dim, args.kv_heads * args.head_dim
    layer = DecoderRest(hidden, kv_dim, args.intermediate, args.lora_rank, device, dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=device, dtype=dtype)
    events = []

    def step():
        layer(x).backward(grad)

    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))

    step()
    queued(timed, args.layers, forget=events.clear)  # its extra first call ran on an idle GPU: not counted
    device_ms = spread([s.elapsed_time(e) for s, e in events])["median"]
    host, syncs, _ = host_ms(step, max(args.layers, 6), sleep_ms=max(50.0, 4 * device_ms))  # no events, as the ring's
    return {"tokens": tokens, "device_ms": device_ms, "host_ms": host, "host_syncs": syncs}


def graphed_cost(args, mask, plan, rank, q, k, v, dout, impl, device, host_mask, eager_device_ms: float) -> dict:
    """Rank ``rank``'s layer with the step's layers captured as CUDA graphs: host ms per layer, the
    device work the graphs add (copies into the static inputs, clones of the outputs: the profiler's
    total against the eager layer's ``eager_device_ms``) and the graphs' counters (captures that
    failed ran eagerly)."""
    layer, _ = rank_layer(args, mask, plan, rank, q, k, v, dout, impl, False, False, device, host_mask, graphs=True)
    layer()  # eager (the step's first layer)
    layer()  # captured, replayed
    device_total = profile_ms(layer, args.layers)["total"]
    host, syncs, spread_ms = host_ms(layer, max(args.layers, 6), sleep_ms=max(50.0, 4 * device_total))
    result = {"host_ms": host, "host_syncs": syncs, "host_ms_spread": spread_ms, "device_total_ms": device_total,
              "extra_device_ms": device_total - eager_device_ms,
              "counters": dict(layer.state["prepared"].graphs.counters)}
    if args.cprofile:
        result["host_top"] = top_host(layer, args.layers, lines=25, sort=("tottime", "cumulative"))
        print("graphed layer, rank", rank, "\n" + result["host_top"])
    return result


def predict(steps: list[dict], bytes_in: list[list[int]], serial_ms: list[float], link_gbs: float) -> float:
    """Modelled ms of one layer, following the ring's order of work (``fm_parallel/distributed/ring.py``).

    Per rank and phase (forward, backward): the ring posts step s + 1's transfer before it computes
    step s (the own chunk is step 0), so step s costs max(its kernels, step s + 1's transfer); a rank
    that sees its own keys waits for no transfer before its first kernel. In the backward each used
    chunk's dK / dV go back to the chunk's owner on the other direction of the full-duplex link while
    the later steps compute; the part of the last such return that outlasts the steps after it is
    exposed. The backward's K / V move again, like the forward's. ``serial_ms[r]``: rank r's other
    device work (merges, sums). The layer ends with the slowest rank. ``steps[r][phase][s]``: kernel ms
    of step s (0 = own chunk); ``bytes_in[r][s]``: bytes rank r receives in step s (the key window it
    sees, K and V; its dK / dV return is the same size)."""
    worst = 0.0
    for r, rank_steps in enumerate(steps):
        world = len(bytes_in[r])
        xfer = [b / (link_gbs * 1e6) for b in bytes_in[r]]  # ms (1 GB/s = 1e6 bytes per ms)
        total = serial_ms[r]
        for phase in ("fwd", "bwd"):
            c = rank_steps[phase]
            total += sum(max(c[s], xfer[s + 1] if s + 1 < world else 0.0) for s in range(world))
        returned = [s for s in range(1, world) if bytes_in[r][s]]
        if returned:
            last = returned[-1]
            total += max(0.0, xfer[last] - sum(rank_steps["bwd"][last + 1:]))
        worst = max(worst, total)
    return worst


def decoder_ratios(row: dict) -> tuple[float, float]:
    """Per-GPU efficiency of a whole decoder layer under CP against one GPU running that layer at all N
    tokens, eager and graphed (nan where graphs were not timed). One GPU's layer = its attention
    (measured) + P x a rank's rest of the layer (linear in tokens); a CP layer = max(device: modelled
    attention + the rest; host: the attention's + the rest's), the host hidden while below."""
    d, p = row["decoder"], row["p"]
    rest, rest_host = d["rest_device_ms"], d["rest"]["host_ms"]
    ideal = (row["single_gpu_ms"] + p * rest) / p
    eager = ideal / max(row["predicted_device_ms"] + rest, row["ranks"][0]["host_ms"] + rest_host)
    g = row["ranks"][0].get("graphed")
    graphed = ideal / max(g["predicted_device_ms"] + rest, g["host_ms"] + rest_host) if g else float("nan")
    return eager, graphed


def write_results(args, gpu: str, impl: str, rows: list[dict]) -> None:
    """``--out/cp_scaling_model_<device>.json`` and ``.md``: the rows so far and the model's assumptions."""
    args.out.mkdir(parents=True, exist_ok=True)
    assumptions = {
        "link_gbs_per_direction": args.link_gbs,
        "link_note": "assumed, not measured: one GPU has no peer; NVLink 4 on H200 SXM is 450 GB/s per direction "
                     "nominal, p2p copies reach roughly 350-390 GB/s in published nccl-tests",
        "overlap": "each ring step's compute overlaps the next step's transfer (the ring posts step s+1 before computing "
                   "step s, the own chunk being step 0, so the first transfer hides behind the own chunk's kernels); the "
                   "backward's dK/dV return runs on the opposite direction of the full-duplex link behind the later "
                   "steps, the last return's remainder exposed (since 2026-12-04; before, the first transfer of each "
                   "phase was counted exposed on top)",
        "bytes": "each step moves the key window the receiving rank sees (K and V; since 2026-12-04; before, whole "
                 "N / P chunks, though key windows travel since the 2026-12-03 sessions)",
        "skew": "a layer ends when the slowest rank ends (per-rank totals from each rank's own measured steps)",
        "host": "host time is hidden when below the layer's device time (measured per layer with the GPU kept busy); "
                "a layer is max(modelled device time, rank 0's host time): above it the GPU waits for the launches "
                "(since 2026-12-03, sixth session; earlier tables modelled the device alone)",
        "not_modelled": "NCCL launch latency per transfer (~10-20 us), contention of several rings on one NVSwitch, "
                        "the per-step agreement all-gather (once per step, not per layer)",
    }
    if args.decoder_rest:
        assumptions["decoder_layer"] = (
            f"--decoder-rest: the rest of a Llama-style decoder layer (hidden {args.heads * args.head_dim}, MLP "
            f"{args.intermediate}, q / k / v / o / gate / up / down frozen with rank-{args.lora_rank} LoRA adapters, two "
            f"RMSNorms), forward + backward measured on this GPU at min(N / P, {args.rest_max_tokens}) tokens and scaled "
            "linearly in tokens; a layer's device time = the modelled CP attention + that; 'CP host / layer' = rank 0's "
            "attention host ms over it (the rest's own host ms is in the JSON)")
    stem = f"cp_scaling_model_{gpu.replace(' ', '_').lower()}"
    cmd = "python -m launch.bench.cp_layer_cost " + " ".join(sys.argv[1:])
    (args.out / f"{stem}.json").write_text(json.dumps({"command": cmd, "device": gpu, "kernel": impl,
                                                        "assumptions": assumptions, "rows": rows}, indent=1))
    lines = [f"# CP per-layer cost on one {gpu}, and the scaling it predicts", "", f"`{cmd}`", "",
             "| mask | N | P | balance | device ms/rank (max) | host ms (rank 0) | host/device | per-call prep ms | "
             "predicted layer ms | 1-GPU ms | TF/GPU | 1-GPU TF | ratio | graphed: device ms (rank 0), host ms, host/device, ratio |"
             + (" decoder layer device ms | CP host / layer (eager, graphed) | decoder layer ratio (eager, graphed) |"
                if args.decoder_rest else ""),
             "|" + "---|" * (17 if args.decoder_rest else 14)]
    for r in rows:
        lines.append(f"| {r['mask']} | {r['n']} | {r['p']} | {r['balance']} | {max(r['device_ms_per_rank']):.2f} | "
                     f"{r['ranks'][0].get('host_ms', float('nan')):.2f} | {r['host_over_kernel_rank0']:.1%} | "
                     f"{r['ranks'][0].get('per_call_wall_ms', float('nan')):.2f} | {r['predicted_layer_ms']:.2f} | "
                     f"{r['single_gpu_ms']:.2f} | {r['predicted_tf_per_gpu']:.0f} | {r['single_gpu_tf']:.0f} | {r['ratio']:.2f} | "
                     + (f"{g['device_ms']:.2f}, {g['host_ms']:.2f}, {g['host_over_device']:.1%}, {g['ratio']:.2f} |"
                        if (g := r['ranks'][0].get('graphed')) else "- |")
                     + (f" {d['layer_device_ms']:.2f} | {d['cp_host_share']:.1%}, "
                        f"{d.get('cp_host_share_graphed', float('nan')):.1%} | "
                        "{:.2f}, {:.2f} |".format(*decoder_ratios(r)).replace("nan%", "-").replace("nan", "-")
                        if (d := r.get("decoder")) else (" - | - | - |" if args.decoder_rest else "")))
    lines += ["", "Assumptions:", ""] + [f"- {k}: {v}" for k, v in assumptions.items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None, *, check_device_here: bool = False) -> argparse.Namespace:
    """The command line (``argv``: default ``sys.argv[1:]``); the defaults are the documented H200 run.
    ``check_device_here``: a CUDA ``--device`` on a machine without one is a usage error (``main``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ns", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--ps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--masks", nargs="+", default=["docs", "sliding_sinks", "dpo", "causal"])
    parser.add_argument("--quadratic-max-n", type=int, default=131072,
                        help="largest N for masks whose work grows as N^2 (dpo, causal)")
    parser.add_argument("--balances", nargs="+", default=["mask"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--layers", type=int, default=4, help="layers timed per measurement (after one warm-up)")
    parser.add_argument("--host-ranks", type=int, default=1, help="ranks whose host time is measured (rank 0 ..)")
    parser.add_argument("--link-gbs", type=float, default=350.0,
                        help="assumed p2p bandwidth per direction between two GPUs, GB/s (not measurable on one GPU)")
    parser.add_argument("--cprofile", action="store_true", help="print rank 0's top host functions per configuration")
    parser.add_argument("--graphs", action="store_true",
                        help="also time the host ranks' layers captured as CUDA graphs (prepare(..., cuda_graphs=True))")
    parser.add_argument("--decoder-rest", action="store_true",
                        help="also time a LoRA-trained Llama-style decoder layer without its attention core at N / P "
                             "tokens (DecoderRest), for the CP host time's share of a whole layer")
    parser.add_argument("--intermediate", type=int, default=14336, help="--decoder-rest: the MLP's width (Llama-3-8B's)")
    parser.add_argument("--lora-rank", type=int, default=16, help="--decoder-rest: the adapters' rank")
    parser.add_argument("--rest-max-tokens", type=int, default=32768,
                        help="--decoder-rest: timed at min(N / P, this) tokens and scaled linearly in tokens above it "
                             "(its GEMMs are linear in tokens; a 1M / 2 layer's MLP activations would not fit beside the ring's)")
    parser.add_argument("--fa4-python", action="store_true",
                        help="every FA4 call through FA4's own Python (fm_parallel.kernels.fa4.launches off), to measure "
                             "what the recorded launches save")
    parser.add_argument("--max-seconds", type=float, default=480.0, help="stop starting new configurations after this")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args(argv)
    if check_device_here:
        check_device(parser, args.device, "it times CUDA kernels (on a CPU: python -m launch.bench.ring_cpu)")
    return args


@dataclass
class Case:
    """One mask family at one N on the GPU: the inputs every (P, balance) of it is measured on, and the
    single-GPU layer they are compared with. ``mask_cpu``: where the loader builds it (the ranks'
    prepared masks read their column masks from it, as the trainer's do)."""

    name: str
    n: int
    mask_cpu: FlashMask
    mask: FlashMask
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    pairs: int  # visible (query, key) pairs
    flops: float  # effective forward + backward FLOPs (3.5 x the forward's)
    one: float  # single-GPU device ms of the whole sequence's forward + backward


def make_case(args, name: str, mask_cpu, n: int, device, dtype, impl: str) -> Case:
    """The family's inputs (seeded: the same on every run) and its single-GPU layer time."""
    mask = mask_cpu.to(device)
    torch.manual_seed(0)
    q = torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, args.kv_heads, n, args.head_dim, device=device, dtype=dtype)
    v = torch.randn(1, args.kv_heads, n, args.head_dim, device=device, dtype=dtype)
    dout = torch.randn_like(q)
    pairs = int(mask_cpu.visible_pairs().sum())
    flops = 4 * args.heads * args.head_dim * pairs * 3.5
    one = single_gpu_ms(mask, q, k, v, dout, impl, reps=3)
    return Case(name, n, mask_cpu, mask, q, k, v, dout, pairs, flops, one)


# ------------------------------------------------------------------------------------ measuring
def per_step_ms(steps: dict, table, r: int, p: int, layers: int) -> dict:
    """Rank ``r``'s kernel ms per ring step (index = step, 0 = its own chunk; 0.0 where it sees none of
    that step's keys), averaged over ``layers``, from the timer's per-call events ``steps[kind]``, which
    list each layer's launches in step order."""
    per_step = {}
    for kind in ("fwd", "bwd"):
        seen = [s for s in range(p) if table[r, (r - s) % p] > 0]
        vals = steps[kind]
        per_layer = len(seen)
        avg = [sum(vals[i::per_layer]) / layers for i in range(per_layer)] if per_layer else []
        full = [0.0] * p
        for s, ms in zip(seen, avg):
            full[s] = ms
        per_step[kind] = full
    return per_step


def host_timings(args, case: Case, plan, r: int, impl: str, device, layer, timer, device_total_ms: float) -> dict:
    """Rank ``r``'s host side: host ms of a layer launched behind a busy GPU (``device_total_ms``: its
    measured device time, which sizes the sleep), the per-call preparation against the prepared mask
    (wall ms), and with ``--graphs`` the captured layers; in that order, the keys as the JSON has them."""
    out = {}
    timer.record = False  # training records no events: time the launches alone (since 2026-12-04)
    out["host_ms"], out["host_syncs"], out["host_ms_spread"] = host_ms(layer, max(args.layers, 6),
                                                                       sleep_ms=max(50.0, 4 * device_total_ms))
    timer.record = True
    if args.cprofile:
        out["host_top"] = top_host(layer, args.layers, lines=30, sort=("tottime", "cumulative"))
        print(out["host_top"])
    before, _ = rank_layer(args, case.mask, plan, r, case.q, case.k, case.v, case.dout, impl, True, False, device,
                           case.mask_cpu)
    before()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.layers):
        before()
    torch.cuda.synchronize()
    out["per_call_wall_ms"] = 1e3 * (time.perf_counter() - t0) / args.layers
    t0 = time.perf_counter()
    for _ in range(args.layers):
        layer()
    torch.cuda.synchronize()
    out["prepared_wall_ms"] = 1e3 * (time.perf_counter() - t0) / args.layers
    if args.graphs:
        out["graphed"] = graphed_cost(args, case.mask, plan, r, case.q, case.k, case.v, case.dout, impl, device,
                                      case.mask_cpu, device_total_ms)
    return out


def measure_rank(args, case: Case, plan, table, r: int, impl: str, device, per_key: int) -> tuple[dict, list[int]]:
    """Rank ``r``'s layer on this GPU: its kernel ms per ring step, device ms, and for the first
    ``--host-ranks`` ranks its host side (:func:`host_timings`); and the bytes it receives per step
    (the key window it sees, K and V; what post_kv sends), from its prepared mask."""
    p = plan.world_size
    layer, timer = rank_layer(args, case.mask, plan, r, case.q, case.k, case.v, case.dout, impl, False, True, device,
                              case.mask_cpu)
    layer()  # warm-up: prepares, builds plans (and compiles)
    timer.step_ms()
    host_ahead = queued(layer, args.layers, forget=timer.events.clear)
    steps = timer.step_ms()
    if not host_ahead:
        print(f"warning: rank {r}'s layers caught the GPU up; its step times include host launches")
    entry = {"rank": r, "step_ms": per_step_ms(steps, table, r, p, args.layers), "steps_host_ahead": host_ahead,
             "device_ms": profile_ms(layer, args.layers)}
    if r < args.host_ranks:
        entry.update(host_timings(args, case, plan, r, impl, device, layer, timer, entry["device_ms"]["total"]))
    windows = [layer.state["prepared"].key_window((r - s) % p) for s in range(p)]
    bytes_in = [0] + [per_key * (windows[s][1] - windows[s][0]) if table[r, (r - s) % p] > 0 else 0 for s in range(1, p)]
    return entry, bytes_in


def decoder_share(args, rest_costs: dict, n: int, p: int, pred_device: float, host: float, device, dtype) -> dict:
    """``--decoder-rest``: the rest of the decoder layer at ``n / p`` tokens (timed once per token count,
    kept in ``rest_costs``) and the CP attention's host ms against the whole layer's device ms."""
    tokens = min(n // p, args.rest_max_tokens)
    if tokens not in rest_costs:
        rest_costs[tokens] = decoder_rest_cost(tokens, args, device, dtype)
    rest = rest_costs[tokens]
    rest_device = rest["device_ms"] * (n // p) / tokens  # its GEMMs: linear in tokens
    layer_device = pred_device + rest_device
    return {"rest": rest, "rest_device_ms": rest_device, "layer_device_ms": layer_device,
            # the CP attention's host time against the whole decoder layer's device time
            "cp_host_share": host / layer_device,
            "layer_host_ms": host + rest["host_ms"]}


def model_graphed(args, graphed: dict, per_rank: list[dict], bytes_in, device_ms: list[float], serial: list[float],
                  flops: float, p: int, tf_one: float, decoder: dict | None) -> None:
    """Rank 0's graphed layer into the scaling model, in place: its device ms (the copies in and out
    are device work the eager layer does not do), the predicted layer and ratio, and its share of the
    decoder layer."""
    graphed["device_ms"] = device_ms[0] + graphed["extra_device_ms"]
    graphed["host_over_device"] = graphed["host_ms"] / graphed["device_ms"]
    # every rank pays copies like rank 0's (measured on rank 0 only)
    serial_g = [x + graphed["extra_device_ms"] for x in serial]
    graphed["predicted_device_ms"] = predict([e["step_ms"] for e in per_rank], bytes_in, serial_g, args.link_gbs)
    graphed["predicted_layer_ms"] = max(graphed["predicted_device_ms"], graphed["host_ms"])
    graphed["ratio"] = flops / p / (graphed["predicted_layer_ms"] * 1e-3) / 1e12 / tf_one
    if decoder is not None:
        decoder["cp_host_share_graphed"] = graphed["host_ms"] / (graphed["predicted_device_ms"] + decoder["rest_device_ms"])


def measure_configuration(args, case: Case, p: int, balance: str, impl: str, device, dtype, rest_costs: dict) -> dict:
    """One (mask, N, P, balance): every rank's layer measured on this GPU, then the scaling model's row."""
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.sharding import pair_counts

    from fm_parallel.kernels.fa4 import launches as fa4_launches

    plan = shard(case.mask_cpu, p, balance)
    table = pair_counts(case.mask_cpu, plan.positions)
    per_key = 2 * args.kv_heads * args.head_dim * case.q.element_size()  # one key's K and V rows
    chunk_bytes = per_key * (case.n // p)
    per_rank, bytes_in = [], []
    for r in range(p):
        entry, received = measure_rank(args, case, plan, table, r, impl, device, per_key)
        per_rank.append(entry)
        bytes_in.append(received)
    kernel = [sum(e["step_ms"]["fwd"]) + sum(e["step_ms"]["bwd"]) for e in per_rank]
    device_ms = [e["device_ms"]["total"] - e["device_ms"]["copy"] for e in per_rank]  # without stand-ins
    serial = [max(0.0, d - kk) for d, kk in zip(device_ms, kernel)]
    pred_device = predict([e["step_ms"] for e in per_rank], bytes_in, serial, args.link_gbs)
    host = per_rank[0].get("host_ms", float("nan"))
    # A layer whose launches take longer than its device work is host-bound: the GPU waits.
    pred_total = max(pred_device, host) if host == host else pred_device
    tf_gpu = case.flops / p / (pred_total * 1e-3) / 1e12
    tf_one = case.flops / (case.one * 1e-3) / 1e12
    decoder = decoder_share(args, rest_costs, case.n, p, pred_device, host, device, dtype) if args.decoder_rest else None
    graphed = per_rank[0].get("graphed")
    if graphed is not None:
        model_graphed(args, graphed, per_rank, bytes_in, device_ms, serial, case.flops, p, tf_one, decoder)
    return {"mask": case.name, "n": case.n, "p": p, "balance": balance, "kernel": impl,
            "visible_pairs": case.pairs, "ranks": per_rank, "kernel_ms_per_rank": kernel,
            "device_ms_per_rank": device_ms, "chunk_bytes": chunk_bytes, "bytes_in": bytes_in,
            "transfers_per_rank": [sum(1 for b in bi if b) for bi in bytes_in],
            "predicted_layer_ms": pred_total, "predicted_device_ms": pred_device, "single_gpu_ms": case.one,
            "predicted_tf_per_gpu": tf_gpu, "single_gpu_tf": tf_one, "ratio": tf_gpu / tf_one,
            "host_over_kernel_rank0": host / device_ms[0] if device_ms[0] else None, "decoder": decoder,
            "fa4_launch": dict(fa4_launches.counters, enabled=fa4_launches.ENABLED)}


def measure_all(args, device, dtype, impl: str, gpu: str) -> list[dict]:
    """Every (N, mask, P, balance) of the command line in order, until ``--max-seconds``; the results
    are written after every row, so a call cut short keeps what it measured."""
    began = time.perf_counter()
    rows = []
    rest_costs: dict[int, dict] = {}  # --decoder-rest, by timed token count
    for n in args.ns:
        families = build_masks(n)
        for mask_name in args.masks:
            if time.perf_counter() - began > args.max_seconds:
                print(f"stopping: --max-seconds {args.max_seconds:g} reached before {mask_name} at N={n}")
                break
            if mask_name in ("dpo", "causal") and n > args.quadratic_max_n:
                continue
            case = make_case(args, mask_name, families[mask_name], n, device, dtype, impl)
            for p in args.ps:
                for balance in args.balances:
                    if n % (2 * p if balance == "zigzag" else p):
                        continue
                    rows.append(measure_configuration(args, case, p, balance, impl, device, dtype, rest_costs))
                    write_results(args, gpu, impl, rows)
                    print_row(rows[-1])
            del case  # the family's tensors, before the next family's are made
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- reporting
def print_header(args, gpu: str, impl: str) -> None:
    """The run's settings and the table's column names (one line per configuration follows)."""
    print(f"{gpu}: kernel={impl} H={args.heads}/{args.kv_heads} D={args.head_dim} {args.dtype}, link {args.link_gbs:g} GB/s (assumed)")
    print(f"{'mask':14s} {'N':>8s} {'P':>2s} {'balance':10s} {'kernel/rank ms':>15s} {'host ms':>8s} {'host/kernel':>11s} "
          f"{'per-call ms':>11s} {'pred ms':>8s} {'1-GPU ms':>9s} {'TF/GPU':>7s} {'1-GPU TF':>8s} {'ratio':>6s}")


def print_row(row: dict) -> None:
    """One configuration's line of the table (and its decoder-layer and graphed lines where measured)."""
    rank0 = row["ranks"][0]
    print(f"{row['mask']:14s} {row['n']:8d} {row['p']:2d} {row['balance']:10s} {max(row['device_ms_per_rank']):15.2f} "
          f"{rank0.get('host_ms', float('nan')):8.2f} {row['host_over_kernel_rank0']:11.1%} "
          f"{rank0.get('per_call_wall_ms', float('nan')):11.2f} {row['predicted_layer_ms']:8.2f} {row['single_gpu_ms']:9.2f} "
          f"{row['predicted_tf_per_gpu']:7.0f} {row['single_gpu_tf']:8.0f} {row['ratio']:6.2f}", flush=True)
    decoder = row["decoder"]
    if decoder is not None:
        print(f"{'  decoder layer':14s} rest of the layer {decoder['rest_device_ms']:.2f} ms device "
              f"({decoder['rest']['tokens']} tokens timed), CP host {decoder['cp_host_share']:.1%} of the "
              f"layer's device time" + (f", graphed {decoder['cp_host_share_graphed']:.1%}"
                                        if "cp_host_share_graphed" in decoder else ""), flush=True)
    graphed = rank0.get("graphed")
    if graphed is not None:
        print(f"{'  graphed':14s} {'':8s} {'':2s} {'':10s} {graphed['device_ms']:15.2f} {graphed['host_ms']:8.2f} "
              f"{graphed['host_over_device']:11.1%} {'':11s} {graphed['predicted_layer_ms']:8.2f} {'':9s} "
              f"{'':7s} {'':8s} {graphed['ratio']:6.2f}  {graphed['counters']}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Parse, refuse a non-CUDA device, measure every configuration (:func:`measure_all`), report."""
    args = parse_args(argv, check_device_here=True)
    from fm_parallel import backends

    from fm_parallel.kernels.fa4 import launches as fa4_launches

    fa4_launches.ENABLED = not args.fa4_python
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("cp_layer_cost.py times CUDA kernels; --device cpu is not supported (use ring_cpu.py)")
    dtype = DTYPES[args.dtype]
    impl = backends.resolve(args.impl, device, dtype, args.head_dim, chunked=True)
    gpu = torch.cuda.get_device_name(device)
    print_header(args, gpu, impl)
    rows = measure_all(args, device, dtype, impl, gpu)
    write_results(args, gpu, impl, rows)
    print(f"wrote {args.out}/cp_scaling_model_*.json and .md")


if __name__ == "__main__":
    main()
