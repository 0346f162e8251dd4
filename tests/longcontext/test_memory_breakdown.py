"""``fm_parallel.longcontext.memory_breakdown`` on the CPU: the trace replay on synthetic allocator
snapshots (the peak's event, what frees remove, frees awaiting another stream, frees of memory from
before the recording, which frame names a term) with exact byte counts, and ``static_terms`` on a tiny
peft LoRA model after an AdamW step against sums taken here."""

import pytest
import torch

from fm_parallel.longcontext.memory_breakdown import peak_breakdown, static_terms

MIB = 2**20
GIB = 2**30

OURS = "/work/repo/fm_parallel/longcontext/tiling.py"
BENCH = "/work/repo/launch/bench/max_context.py"
KERNEL = "/work/repo/kernels/triton/backend.py"
TORCH = "/venv/lib/python3.11/site-packages/torch/nn/functional.py"
PEFT = "/venv/lib/python3.11/site-packages/peft/tuners/lora/layer.py"
HF_KERNELS = "/venv/lib/python3.11/site-packages/kernels/layer.py"  # the PyPI `kernels` package: not ours


def frame(filename, name, line=1):
    return {"filename": filename, "name": name, "line": line}


def alloc(addr, mib, *frames):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "stream": 0, "frames": list(frames)}


def req(addr, mib):
    return {"action": "free_requested", "addr": addr, "size": mib * MIB, "stream": 0, "frames": []}


def done(addr, mib):
    return {"action": "free_completed", "addr": addr, "size": mib * MIB, "stream": 0, "frames": []}


def free(addr, mib):
    return [req(addr, mib), done(addr, mib)]


def snap(trace, device_index=0):
    traces = [[] for _ in range(device_index + 1)]
    traces[device_index] = trace
    return {"segments": [], "device_traces": traces}


def terms(out):
    return {t["where"]: (round(t["gib"] * GIB / MIB), t["count"]) for t in out["terms"]}


def test_the_peak_is_the_event_of_most_live_bytes_and_frees_remove():
    f = frame(OURS, "forward")
    trace = [
        alloc(1, 100, f),           # 0: 100
        alloc(2, 300, f),           # 1: 400
        *free(2, 300),              # 2, 3: 100
        alloc(3, 200, f),           # 4: 300
        alloc(4, 250, f),           # 5: 550  <- the peak
        *free(1, 100),              # 6, 7: 450
        alloc(5, 50, f),            # 8: 500
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": []},
    ]
    out = peak_breakdown(snap(trace), start_bytes=3 * GIB)
    assert out["peak_event"] == 5
    assert out["step_peak_gib"] * GIB == 550 * MIB
    assert out["peak_gib"] * GIB == 3 * GIB + 550 * MIB
    assert out["start_gib"] == 3.0
    # At the peak: 1 (100), 3 (200), 4 (250); 2 was freed before the peak and 5 came after.
    assert terms(out) == {"fm_parallel/longcontext/tiling.py:forward": (550, 3)}
    assert out["trace_truncated"] is False and out["unknown_freed_gib"] == 0
    assert out["events"] == len(trace)


def test_segments_do_not_count_and_the_first_of_equal_peaks_is_taken():
    f = frame(OURS, "forward")
    trace = [{"action": "segment_alloc", "addr": 0, "size": 4096 * MIB, "stream": 0, "frames": []},
             alloc(1, 100, f), *free(1, 100), alloc(2, 100, frame(TORCH, "linear")),
             {"action": "segment_free", "addr": 0, "size": 4096 * MIB, "stream": 0, "frames": []}]
    out = peak_breakdown(snap(trace), 0)
    assert out["peak_event"] == 1 and out["step_peak_gib"] * GIB == 100 * MIB
    assert terms(out) == {"fm_parallel/longcontext/tiling.py:forward": (100, 1)}


def test_terms_are_named_by_the_innermost_frame_of_ours_else_torch_else_unknown():
    trace = [
        # peft's code called from ours: the term is our innermost frame, not peft's
        alloc(1, 64, frame(PEFT, "forward"), frame(OURS, "tile_forward"), frame(BENCH, "_step")),
        alloc(2, 32, frame(TORCH, "linear"), frame(BENCH, "_step")),
        alloc(3, 16, frame(KERNEL, "flashmask_fwd"), frame(OURS, "attend")),
        alloc(4, 8, frame(TORCH, "linear"), frame(PEFT, "forward")),           # no frame of ours
        alloc(5, 4, frame(HF_KERNELS, "forward"), frame(TORCH, "linear")),     # an installed kernels/ is not ours
        alloc(6, 2),                                                            # no Python frame (autograd thread)
        alloc(7, 1, frame(PEFT, "forward"), frame(OURS, "tile_forward")),
    ]
    out = peak_breakdown(snap(trace), 0)
    assert terms(out) == {
        "fm_parallel/longcontext/tiling.py:tile_forward": (65, 2),
        "launch/bench/max_context.py:_step": (32, 1),
        "kernels/triton/backend.py:flashmask_fwd": (16, 1),
        "torch:torch/nn/functional.py:linear": (8, 1),
        "torch:kernels/layer.py:forward": (4, 1),
        "unknown": (2, 1),
    }
    assert [t["where"] for t in out["terms"]][:3] == ["fm_parallel/longcontext/tiling.py:tile_forward",
                                                     "launch/bench/max_context.py:_step",
                                                     "kernels/triton/backend.py:flashmask_fwd"]  # largest first
    tile = out["terms"][0]
    assert [(i["where"], round(i["gib"] * GIB / MIB)) for i in tile["inner"]] == [("peft/tuners/lora/layer.py:forward", 65)]


def test_a_free_awaiting_another_stream_counts_until_it_completes():
    f = frame(OURS, "forward")
    trace = [
        alloc(1, 100, f),          # 0: 100 (by memory_allocated: 100)
        req(1, 100),               # 1: still 100 (record_stream: the copy stream still reads it); allocated 0
        alloc(2, 100, f),          # 2: 200 <- the peak; allocated 100
        done(1, 100),              # 3: 100
        alloc(3, 50, f),           # 4: 150; allocated 150
    ]
    out = peak_breakdown(snap(trace), 0)
    assert out["freed_at"] == "free_completed"
    assert out["peak_event"] == 2 and out["step_peak_gib"] * GIB == 200 * MIB
    assert out["awaiting_free_gib"] * GIB == 100 * MIB
    assert out["step_peak_allocated_gib"] * GIB == 150 * MIB
    assert terms(out) == {"fm_parallel/longcontext/tiling.py:forward": (200, 2)}


def test_without_free_completed_entries_the_request_frees():
    f = frame(OURS, "forward")
    trace = [alloc(1, 100, f), req(1, 100), alloc(2, 100, f), alloc(3, 10, f)]
    out = peak_breakdown(snap(trace), 0)
    assert out["freed_at"] == "free_requested"
    assert out["step_peak_gib"] * GIB == 110 * MIB and out["peak_event"] == 3
    assert terms(out) == {"fm_parallel/longcontext/tiling.py:forward": (110, 2)}
    assert out["awaiting_free_gib"] == 0


def test_frees_of_memory_from_before_the_recording_are_ignored():
    f = frame(OURS, "forward")
    trace = [
        *free(900, 500),           # allocated before recording (in start_bytes): not subtracted
        alloc(1, 100, f),          # 100
        alloc(2, 100, f),          # 200 <- peak
        *free(2, 100),
    ]
    out = peak_breakdown(snap(trace), start_bytes=1 * GIB)
    assert out["step_peak_gib"] * GIB == 200 * MIB and out["peak_event"] == 3
    assert out["peak_gib"] * GIB == GIB + 200 * MIB
    assert out["unknown_freed_gib"] * GIB == 500 * MIB
    assert out["trace_truncated"] is False  # 500 MiB freed of 1 GiB held before: possible without a gap
    assert terms(out) == {"fm_parallel/longcontext/tiling.py:forward": (200, 2)}


def test_a_trace_that_lost_entries_is_flagged():
    f = frame(OURS, "forward")
    # More freed of unknown addresses than existed before the recording: entries were dropped.
    out = peak_breakdown(snap([*free(900, 500), alloc(1, 10, f)]), start_bytes=100 * MIB)
    assert out["trace_truncated"] is True
    # A full ring buffer (as many entries as it keeps) lost its oldest.
    trace = [alloc(1, 10, f), alloc(2, 10, f), *free(1, 10)]
    assert peak_breakdown(snap(trace), 0, max_entries=4)["trace_truncated"] is True
    assert peak_breakdown(snap(trace), 0, max_entries=5)["trace_truncated"] is False


def test_the_device_index_picks_the_trace_and_oom_entries_are_reported():
    f = frame(OURS, "forward")
    trace = [alloc(1, 30, f), {"action": "oom", "addr": 0, "size": 2 * GIB, "device_free": 1 * GIB, "stream": 0,
                                "frames": [f]}]
    s = snap(trace, device_index=1)
    assert peak_breakdown(s, 0, device_index=0)["step_peak_gib"] == 0
    out = peak_breakdown(s, 0, device_index=1)
    assert out["step_peak_gib"] * GIB == 30 * MIB
    assert out["oom"] == [{"requested_gib": 2.0, "device_free_gib": 1.0}]


def test_an_address_reused_after_its_free_is_a_new_allocation():
    trace = [alloc(1, 100, frame(TORCH, "linear")), *free(1, 100), alloc(1, 40, frame(OURS, "forward")),
             alloc(2, 20, frame(OURS, "forward"))]
    out = peak_breakdown(snap(trace), 0)
    assert out["step_peak_gib"] * GIB == 100 * MIB and out["peak_event"] == 0
    assert terms(out) == {"torch:torch/nn/functional.py:linear": (100, 1)}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_static_terms_count_weights_adapters_grads_and_adamw_state():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.helpers import tiny_lora_llama

    model = tiny_lora_llama(layers=2, dtype="float32")
    params = {id(p): p for p in model.parameters()}.values()
    frozen = [p for p in params if not p.requires_grad]
    lora = [p for p in params if p.requires_grad]
    assert frozen and lora

    before = static_terms(model)
    assert before["frozen_params_gib"] * GIB == _nbytes(frozen)
    assert before["trainable_params_gib"] * GIB == _nbytes(lora)
    assert before["grads_gib"] == 0 and before["optimizer_state_gib"] == 0

    optim = torch.optim.AdamW(lora, lr=1e-3)
    ids = torch.randint(0, 258, (1, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.float().square().mean().backward()
    optim.step()
    after = static_terms(model, optim)
    state = [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert len(optim.state) == len(lora) and len(state) == 3 * len(lora)  # exp_avg, exp_avg_sq, step
    assert after["grads_gib"] * GIB == _nbytes(p.grad for p in lora)
    assert after["optimizer_state_gib"] * GIB == _nbytes(state)
    buffers = {b.untyped_storage().data_ptr(): b for b in model.buffers()}.values()
    assert after["buffers_gib"] * GIB == _nbytes(buffers)
    assert after["total_gib"] * GIB == (_nbytes(frozen) + _nbytes(lora) + _nbytes(p.grad for p in lora)
                                        + _nbytes(state) + _nbytes(buffers))
    # Only one device's tensors when asked (all of these are on the CPU).
    assert static_terms(model, optim, device="meta")["total_gib"] == 0


def test_static_terms_count_a_shared_storage_once():
    lin = torch.nn.Linear(8, 8, bias=False)
    tied = torch.nn.Sequential(lin, torch.nn.Linear(8, 8, bias=False))
    tied[1].weight = lin.weight  # tied: one Parameter
    view = torch.nn.Module()
    big = torch.zeros(64)
    view.register_buffer("a", big[:32])
    view.register_buffer("b", big[32:])  # two views of one storage: the storage (256 bytes) once
    out = static_terms(tied)
    assert out["trainable_params_gib"] * GIB == 8 * 8 * 4
    assert static_terms(view)["buffers_gib"] * GIB == 64 * 4


def test_record_needs_cuda_and_the_history_api_takes_our_keywords():
    import inspect

    from fm_parallel.longcontext.memory_breakdown import record

    with pytest.raises(ValueError, match="needs a CUDA device"):
        with record("cpu"):
            pass
    # The keywords record() passes (torch 2.13 here; the GPU image's 2.11 has the same signature).
    names = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "context", "stacks", "max_entries", "clear_history"} <= set(names)
    assert "device" in inspect.signature(torch.cuda.memory._snapshot).parameters


def test_torchs_recording_conflict_is_named_only_where_it_applies():
    from fm_parallel.longcontext.memory_breakdown import recording_conflict

    # The error line the H200 gave at 64k and 1M (compiled per-token parts) and the H100 at 1M (eager).
    line = "SystemError: <built-in method apply of FunctionMeta object at 0x1762e130> returned NULL without setting an exception"
    hint = recording_conflict(line, checkpoint_every=2)
    assert "pytorch/pytorch#179536" in hint and "every 2 layers" in hint and "checkpoint per layer" in hint
    assert "--compile off" not in hint  # measured: eager per-token parts fail the same way
    assert recording_conflict(line, checkpoint_every=1) is None  # not the known conflict
    assert recording_conflict("OutOfMemoryError: CUDA out of memory", checkpoint_every=2) is None


def test_a_recorded_step_with_segments_runs_each_recompute_to_the_end():
    """torch's early stop raises from inside the hook that saves a tensor (the exception its recording
    loses); a recorded step with k > 1 layers per checkpoint turns it off, one with a checkpoint per
    layer keeps it."""
    import torch.utils.checkpoint as tc

    from fm_parallel.longcontext.memory_breakdown import recordable_checkpoints

    def runs_of_the_tail() -> int:
        tail = []
        x = torch.ones(3, requires_grad=True)

        def f(t):
            z = t.sin().cos()  # the last tensor saved
            tail.append(1)  # after it: the forward runs it, an early-stopped recompute does not
            return z * 2

        tc.checkpoint(f, x, use_reentrant=False).sum().backward()
        return len(tail)

    assert runs_of_the_tail() == 1
    with recordable_checkpoints(1):
        assert runs_of_the_tail() == 1
    with recordable_checkpoints(2):
        assert runs_of_the_tail() == 2
    assert runs_of_the_tail() == 1
