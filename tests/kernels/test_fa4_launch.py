"""FA4 launches recorded once and replayed (fm_parallel.kernels.fa4.launches), against a stand-in for FA4's
interface module: functions with a ``compile_cache`` whose compiled kernels do their work outside
PyTorch's dispatcher (as FA4's do, through TVM FFI), allocating temporaries and views on the way as FA4
does. The replay must equal FA4's own path on new values, and anything it cannot map exactly must
leave the signature on FA4's path. The real interface runs on the H200 (tests/gpu/test_kernels.py,
verify_multi_gpu.py)."""

import sys
import types
from typing import NamedTuple

import pytest
import torch
from fm_parallel.kernels.fa4 import launches as fa4_launches
from torch.utils._python_dispatch import _disable_current_modes


class Aux(NamedTuple):
    tensors: tuple | list | None = None
    scalars: tuple | None = None


def _kernel(x, tmp, acc, out, scale, aux):
    """A 'compiled' kernel: accumulates into ``acc`` (so it must start at zero), writes ``out``."""
    with _disable_current_modes():
        tmp.copy_(x * scale)
        acc.add_(tmp)
        acc.add_(tmp)
        out.copy_((acc + aux.tensors[0]).T)  # out: the transposed view FA4 made of ours


def _make_interface(monkeypatch, *, python_op=False, stray=None):
    module = types.ModuleType("fake_fa4_interface")

    def fwd(x, out, bias, scale=0.5):
        tmp = torch.empty(x.shape)  # overwritten by the kernel
        acc = torch.zeros_like(x).T.T  # zero-filled, then a view of it is passed
        if python_op:
            out.mul_(1.0)  # a tensor operation outside the compiled kernels: cannot be replayed
        key = (x.dtype, tuple(x.shape) != ())
        if key not in fwd.compile_cache:
            fwd.compile_cache[key] = _kernel
        fwd.compile_cache[key](x.detach(), tmp, acc, out.transpose(0, 1), scale,
                               Aux([bias if stray is None else stray], None))

    fwd.compile_cache = {}
    module.fwd = fwd
    monkeypatch.setitem(sys.modules, "fake_fa4_interface", module)
    monkeypatch.setattr(fa4_launches, "INTERFACE", "fake_fa4_interface")
    monkeypatch.setattr(fa4_launches, "counters", fa4_launches.counters.__class__())
    return module


def _run(module, store, x, bias, keep=True, prepared=None):
    out = torch.empty(x.shape[1], x.shape[0])
    view = out.transpose(0, 1)  # FA4 is handed our output as a transposed view, as the FA4 backend does

    def prepare():  # as the FA4 backend makes the mask's block lists: any tensor work, outside the recording
        if prepared is not None:
            prepared.append(torch.full((4,), 3.0).amin())
        return (bias,) if keep else ()

    fa4_launches.launch(store, ("fwd", 0.5), (x, view), prepare, lambda made: module.fwd(x, view, bias))
    return out


def _want(x, bias):
    return (2 * 0.5 * x + bias).T


def test_a_recorded_launch_replays_on_new_values_as_fa4_would(monkeypatch):
    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    for step in range(4):  # FA4's path (compiles), recorded, replayed, replayed
        x = torch.randn(3, 4, requires_grad=True)
        torch.testing.assert_close(_run(module, store, x, bias), _want(x.detach(), bias), rtol=0, atol=0)
    assert fa4_launches.counters == {"recorded": 1, "replayed": 2}
    (record,) = store.values()
    allocs = [step for step in record.program if step[0] == "alloc"]
    assert [value for *_, value in allocs] == [None, 0]  # empty stays empty, zeros are zeroed again
    calls = [step for step in record.program if step[0] == "call"]
    assert len(calls) == 1 and calls[0][1] is _kernel


def test_what_the_mask_prepares_is_made_outside_the_recording_and_skipped_by_a_replay(monkeypatch):
    """The first call of a new mask builds its block lists (any tensor work) before FA4 runs: that must
    not count as FA4's work (a signature left on FA4's path), and a replay does not prepare again."""
    module = _make_interface(monkeypatch)
    store, bias, prepared = {}, torch.randn(3, 4), []
    for _ in range(4):
        x = torch.randn(3, 4)
        torch.testing.assert_close(_run(module, store, x, bias, prepared=prepared), _want(x, bias), rtol=0, atol=0)
    assert fa4_launches.counters == {"recorded": 1, "replayed": 2}
    assert len(prepared) == 2  # the first call and the recorded one


def test_the_replay_zero_fills_what_fa4_zeroed(monkeypatch):
    """Poisoned allocations: a replay that skipped the zero fill would add the poison into the output."""
    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    for _ in range(2):
        _run(module, store, torch.randn(3, 4), bias)
    real_empty_strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: real_empty_strided(*a, **k).fill_(1e6))
    x = torch.randn(3, 4)
    torch.testing.assert_close(_run(module, store, x, bias), _want(x, bias), rtol=0, atol=0)
    assert fa4_launches.counters["replayed"] == 1


def test_a_new_signature_records_again(monkeypatch):
    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    for _ in range(3):
        _run(module, store, torch.randn(3, 4), bias)
    x = torch.randn(3, 4, dtype=torch.float64)  # another dtype: another signature (and compile)
    for _ in range(3):
        torch.testing.assert_close(_run(module, store, x.float().double(), bias), _want(x, bias).float(),
                                   rtol=1e-6, atol=1e-6)
    assert len(store) == 2 and fa4_launches.counters["recorded"] == 2


@pytest.mark.parametrize("problem", ["python_op", "stray_tensor", "keep_missing"])
def test_what_cannot_be_replayed_stays_on_fa4s_path_and_right(monkeypatch, problem):
    stray = torch.randn(3, 4)
    module = _make_interface(monkeypatch, python_op=problem == "python_op",
                             stray=stray if problem == "stray_tensor" else None)
    store, bias = {}, torch.randn(3, 4)
    for _ in range(4):
        x = torch.randn(3, 4)
        got = _run(module, store, x, bias, keep=problem != "keep_missing")
        torch.testing.assert_close(got, _want(x, stray if problem == "stray_tensor" else bias), rtol=0, atol=0)
    assert fa4_launches.counters["refused"] == 1 and "replayed" not in fa4_launches.counters
    why = {"python_op": "refused: aten.mul_.Tensor inside FA4's call", "stray_tensor": "refused: a tensor of unknown origin",
           "keep_missing": "refused: a tensor of unknown origin"}[problem]
    assert fa4_launches.counters[why] == 1, dict(fa4_launches.counters)
    (record,) = store.values()
    assert record.refused and record.program is None


def test_a_signature_seen_once_is_not_recorded_and_a_compile_is_recorded_again(monkeypatch):
    """A one-off call (a decoding step) runs FA4's path alone; a second call that compiles (here: the
    first call compiled another kernel) is not a faithful program and is recorded on the next one."""
    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    _run(module, store, torch.randn(3, 4), bias)
    assert not fa4_launches.counters and not next(iter(store.values())).program
    module.fwd.compile_cache.clear()  # as if the second call met a kernel not compiled yet
    for _ in range(3):
        x = torch.randn(3, 4)
        torch.testing.assert_close(_run(module, store, x, bias), _want(x, bias), rtol=0, atol=0)
    assert fa4_launches.counters == {"retried": 1, "recorded": 1, "replayed": 1}


def test_switched_off_every_call_takes_fa4s_path(monkeypatch):
    module = _make_interface(monkeypatch)
    monkeypatch.setattr(fa4_launches, "ENABLED", False)
    store, bias = {}, torch.randn(3, 4)
    for _ in range(3):
        x = torch.randn(3, 4)
        torch.testing.assert_close(_run(module, store, x, bias), _want(x, bias), rtol=0, atol=0)
    assert not store and not fa4_launches.counters


def test_the_signature_sees_shape_strides_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    a, b = base[:32], base[1:33]  # same shape and stride, 2 bytes apart: FA4 would copy the misaligned one
    assert fa4_launches.signature([a]) != fa4_launches.signature([b])
    assert fa4_launches.signature([a, None]) != fa4_launches.signature([a.view(4, 8)])
    assert fa4_launches.signature([a]) == fa4_launches.signature([base[8:40]])  # 16 bytes on: the same


def _fa4_on_gpu() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _fa4_on_gpu(), reason="needs a Hopper GPU and flash-attn-4 (the [cute] extra); CPU: the stand-in above")
@pytest.mark.parametrize("family", ["sliding_window", "causal", "packed_docs", "docs_row_window"])
def test_replayed_fa4_launches_equal_fa4s_own_path_on_the_gpu(monkeypatch, family):
    """Through the backend's launchers, the same mask on new values each call: forward bitwise equal
    to FA4's own path, gradients within the atomics' reordering; later calls replayed, none refused.
    Covers the block-sparse path (whole rows, and a ring-like row window with a q offset), FA4's
    causal kernel and its varlen kernel (packed causal documents, known from the host mask)."""
    from fm_parallel.kernels.fa4 import backend as cute

    from fm_parallel import masks

    monkeypatch.setattr(fa4_launches, "counters", fa4_launches.counters.__class__())
    n, device = 2048, torch.device("cuda")
    host = {"sliding_window": masks.sliding_window(n, 300, sinks=4), "causal": masks.causal(n),
            "packed_docs": masks.document([700, 900, 448]), "docs_row_window": masks.document([700, 900, 448])}[family]
    mask = host.to(device)
    rows = slice(640, 1536) if family == "docs_row_window" else slice(0, n)
    positions = torch.arange(rows.start, rows.stop, device=device)
    q_offset = rows.start
    torch.manual_seed(0)
    for call in range(4):
        q = torch.randn(1, 8, rows.stop - rows.start, 128, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, n, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        results = {}
        for enabled in (True, False):  # recorded first: the new mask's block lists are built in that call
            monkeypatch.setattr(fa4_launches, "ENABLED", enabled)
            out, lse = cute.cute_fwd(q, k, v, mask, positions, 0.088, q_offset=q_offset)
            grads = cute.cute_bwd(q, k, v, out, lse, dout, mask, positions, 0.088, q_offset=q_offset)
            results[enabled] = (out, lse, *grads)
        torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0, msg=f"out, call {call}")
        torch.testing.assert_close(results[True][1], results[False][1], rtol=0, atol=0, msg=f"lse, call {call}")
        for name, got, want in zip(("dq", "dk", "dv"), results[True][2:], results[False][2:]):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item(),
                                       msg=f"{name}, call {call}")
    assert fa4_launches.counters["replayed"] >= 4 and not fa4_launches.counters["refused"], dict(fa4_launches.counters)
    assert fa4_launches.counters["recorded"] == 2  # forward and backward, once each


def test_the_environment_switches_the_replay_off():
    import subprocess

    code = "from fm_parallel.kernels.fa4 import launches; print(launches.ENABLED)"
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in __import__("os").environ.items() if k != "FM_PARALLEL_FA4_LAUNCH"}
        if value is not None:
            env["FM_PARALLEL_FA4_LAUNCH"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, out.stderr


def test_threads_record_one_at_a_time_and_leave_fa4s_caches_as_they_were(monkeypatch):
    """Two threads calling FA4 through the replay at once: every result right, at most one recording at
    a time (the other thread's call takes FA4's path meanwhile), and the interface's compile caches are
    the original objects afterwards (two recordings swapping them would leave a proxy behind)."""
    import threading

    module = _make_interface(monkeypatch)
    cache = module.fwd.compile_cache
    bias = torch.randn(3, 4)
    errors = []

    def worker(seed):
        store, gen = {}, torch.Generator().manual_seed(seed)
        try:
            for _ in range(30):
                x = torch.randn(3, 4, generator=gen)
                torch.testing.assert_close(_run(module, store, x, bias), _want(x, bias), rtol=0, atol=0)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert module.fwd.compile_cache is cache and not fa4_launches._recording.locked()
    assert fa4_launches.counters["recorded"] >= 1 and fa4_launches.counters["replayed"] >= 1


def test_a_call_meeting_another_recording_takes_fa4s_path(monkeypatch):
    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    _run(module, store, torch.randn(3, 4), bias)  # first call: FA4's path
    with fa4_launches._recording:  # another thread is recording
        x = torch.randn(3, 4)
        torch.testing.assert_close(_run(module, store, x, bias), _want(x, bias), rtol=0, atol=0)
    assert not fa4_launches.counters
    _run(module, store, torch.randn(3, 4), bias)
    assert fa4_launches.counters == {"recorded": 1}


def test_a_call_without_a_stable_key_takes_fa4s_path_and_records_nothing(monkeypatch):
    """Zigzag shards' arbitrary rows: block lists made per call, no key (the FA4 backend passes None)."""
    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    for _ in range(3):
        x = torch.randn(3, 4)
        out = torch.empty(4, 3)
        view = out.transpose(0, 1)
        fa4_launches.launch(store, None, (x, view), lambda: (bias,), lambda made: module.fwd(x, view, bias))
        torch.testing.assert_close(out, _want(x, bias), rtol=0, atol=0)
    assert not store and not fa4_launches.counters


@pytest.mark.parametrize("calls", [1, 2, 4])  # FA4's path, + the recording, + replays
def test_a_launch_frees_its_tensors_on_return_without_the_cyclic_gc(monkeypatch, calls):
    """Seen on the H200: recursive nested helpers sat in reference cycles holding every replayed call's
    inputs and temporaries until Python's GC ran, so the trainer's 16 layers' attention outputs and
    backward temporaries were alive at once (20.7 GiB peak against 6.4 GiB without the replay, 1B at 32k).
    With the cyclic GC off, nothing of a call may outlive it."""
    import gc
    import weakref

    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    gc.collect()
    gc.disable()
    try:
        alive = []
        for _ in range(calls):
            x = torch.randn(3, 4)
            out = _run(module, store, x, bias)
            torch.testing.assert_close(out, _want(x, bias), rtol=0, atol=0)
            alive += [weakref.ref(x), weakref.ref(out)]
            del x, out
        assert [r for r in alive if r() is not None] == []
    finally:
        gc.enable()
    assert fa4_launches.counters["replayed"] == max(calls - 2, 0)


def test_temporaries_of_a_replay_are_freed_on_return(monkeypatch):
    """The replay's own allocations (FA4's temporaries) die with the call, cyclic GC off."""
    import gc

    from tests.helpers import track_returns

    module = _make_interface(monkeypatch)
    store, bias = {}, torch.randn(3, 4)
    for _ in range(2):
        _run(module, store, torch.randn(3, 4), bias)
    made = track_returns(monkeypatch, torch, "empty_strided")
    gc.collect()
    gc.disable()
    try:
        _run(module, store, torch.randn(3, 4), bias)
        assert made and [r for r in made if r() is not None] == []
    finally:
        gc.enable()
    assert fa4_launches.counters["replayed"] == 1
