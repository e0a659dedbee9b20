"""llama.cpp's KV memory made as documents need it and given back as they go.

A ``LlamaCppForward`` makes no context at load; its caches take sequences of contexts of a few
sequences (slabs), a new slab only when every slab made is full and the budget has room,
and a slab is freed once its last sequence is. When the budget has no room, the path asks the
cache store to evict its least recently used document (``CacheStore.reclaim``), not every
document; only with nothing left to evict does a new cache fail. ``CacheStore.stats`` lists the
documents holding the most KV bytes."""

from __future__ import annotations

import threading

import pytest

from specd.engine import caches
from specd.engine.caches import CacheStore, DocumentState, KVState
from specd.engine.forward.llamacpp import SLAB_SEQUENCES, SLABS_PER_BUDGET, LlamaCppForward
from specd.llamacpp.export import export_gguf
from tiny import make_tiny_pair

WINDOW = 256


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("slabs")
    target, _ = make_tiny_pair(root / "pair", "llama")
    out = root / "target.gguf"
    export_gguf(target, out)
    return out


def make_path(gguf, sequences: int) -> LlamaCppForward:
    """A path whose budget holds ``sequences`` windows."""
    probe = LlamaCppForward(gguf, budget_bytes=1, window=WINDOW)
    return LlamaCppForward(gguf, budget_bytes=probe.sequence_bytes * sequences, window=WINDOW)


class FakeModel:
    device = "cpu"


def state(path: LlamaCppForward) -> DocumentState:
    return DocumentState(KVState(FakeModel(), path), None)


def test_slabs_are_a_few_sequences_and_a_budget_fills_in_steps(gguf):
    assert make_path(gguf, 64).slab_size == SLAB_SEQUENCES
    assert make_path(gguf, 2 * SLABS_PER_BUDGET).slab_size == 2
    assert make_path(gguf, 3).slab_size == 1


def test_no_context_at_load_and_one_slab_for_the_first_caches(gguf):
    path = make_path(gguf, 2 * SLAB_SEQUENCES * SLABS_PER_BUDGET + 1)
    assert path.slab_size == SLAB_SEQUENCES
    assert path.cells == 0 and path.allocated_bytes == 0
    first = [path.new_cache() for _ in range(SLAB_SEQUENCES)]
    assert path.slabs_made == 1 and path.cells == SLAB_SEQUENCES * WINDOW
    assert len({id(cache.slab) for cache in first}) == 1
    more = [path.new_cache() for _ in range(path.sequences - SLAB_SEQUENCES)]
    # a new slab each time the others are full, the last one only as big as the budget has room for
    assert path.slabs_made == 2 * SLABS_PER_BUDGET + 1 and path.cells == path.sequences * WINDOW
    assert path.allocated_bytes == path.sequence_bytes * path.sequences
    assert f"{path.slabs_made} now" in path.description
    # each sequence runs on its own context's cells
    for cache in (first[0], more[-1]):
        logits = path.forward_ids([5, 6, 7], cache, last_only=True)
        assert logits.shape == (1, path.n_vocab) and cache.length == 3


def test_a_slab_goes_when_its_last_sequence_does_and_fuller_slabs_fill_first(gguf):
    path = make_path(gguf, 2 * SLAB_SEQUENCES * SLABS_PER_BUDGET)
    first = [path.new_cache() for _ in range(SLAB_SEQUENCES)]
    second = [path.new_cache() for _ in range(2)]
    assert path.slabs_made == 2 and path.in_use == SLAB_SEQUENCES + 2
    del first[0]  # a free sequence in the first slab: the next cache takes it, not the second's
    third = path.new_cache()
    assert third.slab is first[0].slab and path.slabs_made == 2
    first.append(third)
    del second  # the second slab empty: freed
    assert path.cells == SLAB_SEQUENCES * WINDOW and path.in_use == SLAB_SEQUENCES
    del first, third
    assert path.cells == 0 and path.in_use == 0


def test_a_cache_dropped_on_another_thread_during_a_call_is_given_back_after_it(gguf):
    path = make_path(gguf, 1)
    caches = [path.new_cache()]
    with path._calling():  # a forward running on the worker
        thread = threading.Thread(target=caches.clear)
        thread.start()
        thread.join()
        assert path.cells == WINDOW  # not touched while the call holds the context
    assert path.cells == 0


def test_a_full_budget_evicts_the_least_recently_used_document_only(gguf):
    path = make_path(gguf, 3)
    store = CacheStore(budget_bytes=10 * path.sequence_bytes)
    for name in ("a", "b", "c"):
        store.put(name, state(path))
    store.get("a")  # "b" is now the least recently used
    assert path.cells == 3 * WINDOW  # the 3 sequences the budget holds, one a slab
    fresh = state(path)
    assert set(store._docs) == {"c", "a"} and store.evictions == store.reclaimed == 1
    assert path.cells == 3 * WINDOW and path.slabs_made == 4  # "b"'s slab went, "d"'s came
    store.put("d", fresh)
    assert set(store._docs) == {"c", "a", "d"}


def test_a_document_held_by_a_request_in_flight_frees_nothing_so_the_next_goes_too(gguf):
    path = make_path(gguf, 2)
    store = CacheStore(budget_bytes=10 * path.sequence_bytes)
    in_flight = state(path)
    store.put("busy", in_flight)
    store.put("idle", state(path))
    state(path)  # "busy" leaves the store but its request still holds it; "idle" goes too
    assert len(store) == 0 and store.reclaimed == 2
    assert in_flight.target.cache.slab.ctx is not None  # still usable by its request
    assert path.forward_ids([3, 4], in_flight.target.cache, last_only=True).shape == (1, path.n_vocab)


def test_with_nothing_left_to_evict_a_new_cache_is_out_of_memory(gguf):
    path = make_path(gguf, 1)
    store = CacheStore(budget_bytes=10 * path.sequence_bytes)
    held = state(path)
    store.put("held", held)
    with pytest.raises(MemoryError, match="out of memory"):
        state(path)
    assert store.reclaimed == 1 and len(store) == 0


class SizedPath:
    """A forward path whose caches are a byte count, for the store's own accounting."""

    def __init__(self):
        self.reclaimers = []

    def new_cache(self):
        return {"bytes": 0}

    @staticmethod
    def nbytes(cache):
        return cache["bytes"]

    def add_reclaimer(self, reclaim):
        self.reclaimers.append(reclaim)


def sized(path: SizedPath, size: int, tokens: int = 0) -> DocumentState:
    doc = state(path)
    doc.target.cache["bytes"] = size
    doc.target.ids = list(range(tokens))
    return doc


def test_closed_documents_caches_trim_the_heap_once_enough_went(monkeypatch):
    """glibc keeps freed heap memory: after closes and evictions over the budget of
    ``TRIM_AFTER_DROPPED_BYTES`` the store trims it; a forward path's pool reclaiming a slot
    (which the next cache reuses whole) does not count."""
    trims = []
    monkeypatch.setattr(caches, "_TRIM", lambda pad: trims.append(pad) or 1)
    path = SizedPath()
    store = CacheStore(budget_bytes=1 << 40)
    half = caches.TRIM_AFTER_DROPPED_BYTES // 2
    for name in "abcd":
        store.put(name, sized(path, half))
    store.reclaim()  # "a": an eviction
    store.drop("b")
    assert trims == [] and store.dropped == half
    store.drop("nothing")
    store.drop("c")
    assert trims == [0] and store.dropped == 0 and store.stats()["heap_trims"] == 1
    store.clear()  # "d"
    assert trims == [0] and store.dropped == half
    store.budget_bytes = half  # "e" and "f" fit no more: the older goes, and counts
    store.put("e", sized(path, half))
    store.put("f", sized(path, half))
    store.enforce_budget(keep="f")
    assert trims == [0, 0] and store.dropped == 0 and store.evictions == 2


def test_the_store_lists_its_largest_documents_by_kv_bytes():
    path = SizedPath()
    store = CacheStore(budget_bytes=1 << 30)
    for i, size in enumerate((300, 100, 200)):
        store.put(f"file:///{i}.py", sized(path, size, tokens=i + 1))
    stats = store.stats(largest=2)
    assert stats["documents"] == 3 and stats["bytes"] == 600 and stats["budget_bytes"] == 1 << 30
    assert stats["largest"] == [{"document": "file:///0.py", "bytes": 300, "tokens": 1},
                                {"document": "file:///2.py", "bytes": 200, "tokens": 3}]
    assert stats["evictions"] == stats["reclaimed"] == 0
    assert path.reclaimers and store.reclaim() and store.stats()["reclaimed"] == 1
    assert [d["document"] for d in store.stats()["largest"]] == ["file:///2.py", "file:///1.py"]
