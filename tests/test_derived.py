"""The one cache primitive for derived data (fm_parallel/derived.py): identity and version keys, weak
lifetime, the per-forward entry limit, the off switch; and the backends' stores never keep a mask alive."""

import gc

import pytest
import torch

from fm_parallel import masks
from fm_parallel.derived import IdentityCache, caching, caching_enabled, derived_for_mask


def counting():
    calls = []
    return calls, lambda: calls.append(1) or len(calls)


def test_a_value_is_made_once_per_object_and_key():
    cache, (_, make) = IdentityCache("t"), counting()
    a, b = torch.zeros(3), torch.zeros(3)
    assert cache.get((a,), "k", make) == 1 and cache.get((a,), "k", make) == 1
    assert cache.get((b,), "k", make) == 2  # equal data, another object
    assert cache.get((a,), "other", make) == 3
    assert cache.get((a, None), "k", make) == 1  # None entries are ignored


def test_an_in_place_edit_is_a_miss_and_a_freed_object_drops_its_entry():
    cache, (_, make) = IdentityCache("t"), counting()
    mask = masks.causal(8)
    assert cache.get((mask,), "k", make) == 1
    mask.fme.add_(0)  # bumps the bounds' version
    assert cache.get((mask,), "k", make) == 2
    del mask
    gc.collect()
    assert len(cache) == 0


def test_entries_keeps_the_most_recent_object_tuples():
    cache, (_, make) = IdentityCache("t", entries=1), counting()
    a, b = torch.zeros(1), torch.zeros(1)
    assert cache.get((a,), "k", make) == 1
    assert cache.get((b,), "k", make) == 2
    assert cache.get((a,), "k", make) == 3  # evicted by b
    assert len(cache) == 1


def test_the_off_switch_recomputes_everything(monkeypatch):
    cache, (_, make) = IdentityCache("t"), counting()
    a = torch.zeros(1)
    with caching(False):
        assert not caching_enabled()
        assert [cache.get((a,), "k", make) for _ in range(2)] == [1, 2]
    assert caching_enabled()
    monkeypatch.setenv("FM_PARALLEL_CACHE", "0")
    assert [cache.get((a,), "k", make) for _ in range(2)] == [3, 4]
    with pytest.raises(ValueError, match="enabled: expected a bool"):
        with caching("no"):
            pass
    with pytest.raises(ValueError, match="entries: expected a positive int"):
        IdentityCache("t", entries=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_backends_store_fills_on_use_and_never_keeps_the_mask_alive(impl):
    from fm_parallel import backends

    store, backend = derived_for_mask(impl), backends.get(impl)
    store.clear()
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    mask, rows = masks.document([12, 20]), torch.arange(32)
    out, _ = backend.forward(q, k, v, mask, rows, 0.25, q_offset=0)  # consecutive rows: plans cached
    assert len(store) == 1
    with caching(False):  # the same result, nothing cached
        assert torch.allclose(backend.forward(q, k, v, mask, rows, 0.25, q_offset=0)[0], out, atol=1e-6)
    del mask
    gc.collect()
    assert len(store) == 0, "a value of the store holds the mask"
