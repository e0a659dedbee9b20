"""A forward that fails part-way never leaves a broken cache.

A fault is injected after one decoder layer has run (its cache grew, the later layers' did not):
the KV state crops every layer back to what it held before the call and re-raises, so the next
completion on the same document works and is exactly the target's greedy output.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_lossless, make_engine, make_near_draft
from specd.engine import CompletionRequest, compat
from specd.engine.front.documents import edit_end
from specd.engine.forward.transformers import HFForward
from specd.engine.forward.lean import LeanForward
from specd.engine.caches import KVState
from specd.engine.speculation import planner

MAX_TOKENS = 12
FAULT_LAYER = 2  # of the tiny target's 4 (and the near draft's 4)


class Fault:
    """Raises ``error`` from decoder layer ``layer`` of ``model`` on its ``nth`` call from now,
    after the layer ran: the layers up to it hold the new tokens, the later ones do not."""

    def __init__(self, model, nth: int = 1, layer: int = FAULT_LAYER, error: type[BaseException] = RuntimeError):
        self.nth, self.error, self.calls = nth, error, 0
        # The HF path runs the layer modules (a forward hook sees them); the lean path runs
        # their weights through LeanForward._decoder_layer, wrapped here for the same model.
        self.handle = model.model.layers[layer].register_forward_hook(self._hook)
        self.original = LeanForward._decoder_layer
        fault = self

        def decoder_layer(lean, layer_state, x, *args):
            out = fault.original(lean, layer_state, x, *args)
            if lean.model is model and layer_state is lean.layers[layer]:
                fault._hook(None, None, None)
            return out

        LeanForward._decoder_layer = decoder_layer

    def _hook(self, module, args, output):
        self.calls += 1
        if self.calls == self.nth:
            raise self.error(f"injected fault (layer call {self.calls})")

    def __enter__(self) -> "Fault":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        LeanForward._decoder_layer = self.original


def assert_consistent(kv: KVState) -> None:
    assert kv.path.consistent(kv.cache, len(kv.ids))
    if isinstance(kv.path, HFForward):
        lengths = compat.layer_lengths(kv.cache)
        assert lengths == [len(kv.ids)] * len(lengths), (lengths, len(kv.ids))
        assert compat.cache_length(kv.cache) == len(kv.ids)


@pytest.fixture(scope="module")
def pair(llama_pair, tiny_root):
    target, _ = llama_pair
    return target, make_near_draft(target, tiny_root / "llama" / "near-draft")  # 4 layers too


@pytest.fixture(scope="module", params=["hf", "lean"])
def engine(pair, request):
    """Both forward paths: transformers' DynamicCache (crop every layer back) and the lean
    static cache (the length never moved)."""
    engine = make_engine(*pair, fast_forward=request.param == "lean")
    assert engine.paths["target"][0].name == request.param
    return engine


def request(uri: str, text: str, offset: int, **kw) -> CompletionRequest:
    # No lookup: every step drafts with the draft model (make_engine makes drafting free).
    return CompletionRequest(uri=uri, text=text, offset=offset, max_tokens=MAX_TOKENS,
                             stop_at_block_end=False, use_lookup=False, **kw)


def assert_recovered(engine, uri: str, text: str, offset: int) -> None:
    """The document's cached state is consistent, and the next completion there is lossless and
    equals a cold run."""
    state = engine.caches.get(uri)
    assert state is not None, "the document's state stays cached"
    for kv in (state.target, state.draft):
        assert_consistent(kv)
    warm = engine.complete(request(uri, text, offset))
    cold = engine.complete(request(uri, text, offset, kv_reuse=False))
    assert warm.token_ids == cold.token_ids
    assert_lossless(engine, warm, MAX_TOKENS)
    for kv in (state.target, state.draft):
        assert_consistent(kv)


# -- KVState alone -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_model(engine):
    return engine.pair.target


@pytest.fixture(scope="module")
def ids(engine, sample_source) -> list[int]:
    return engine.prompts.encode(sample_source)[:80]


@pytest.mark.parametrize("held", [0, 40])
@pytest.mark.parametrize("layer", [0, FAULT_LAYER, 3])
def test_failed_extend_crops_every_layer_back(target_model, ids, held, layer):
    kv = KVState(target_model)
    if held:
        kv.extend(ids[:held])
    with Fault(target_model, layer=layer), pytest.raises(RuntimeError, match="injected"):
        kv.extend(ids[held:held + 30])
    assert kv.ids == ids[:held]
    assert_consistent(kv)
    assert compat.layer_lengths(kv.cache) == [held] * 4
    # ... and holds the right keys and values: it continues exactly as a cache that never failed.
    logits = kv.extend(ids[held:])
    fresh = KVState(target_model)
    if held:
        fresh.extend(ids[:held])
    assert torch.allclose(logits, fresh.extend(ids[held:]), atol=1e-4)


def test_a_cache_that_cannot_be_restored_starts_empty(target_model, ids, monkeypatch):
    kv = KVState(target_model)
    kv.extend(ids[:40])

    def broken(cache, length):
        raise RuntimeError("cannot crop")

    monkeypatch.setattr(compat, "crop_layers", broken)
    with Fault(target_model), pytest.raises(RuntimeError, match="injected"):
        kv.extend(ids[40:60])
    assert kv.ids == []
    assert_consistent(kv)
    monkeypatch.undo()
    logits = kv.extend(ids)
    assert torch.allclose(logits, KVState(target_model).extend(ids), atol=1e-4)


def test_rollback_keeps_ids_and_cache_consistent(target_model, ids, monkeypatch):
    kv = KVState(target_model)
    kv.extend(ids[:60])
    kv.rollback(45)
    assert kv.ids == ids[:45]
    assert_consistent(kv)
    kv.rollback(50)  # longer than held: nothing to forget
    assert kv.ids == ids[:45]

    def broken(cache, length):
        raise RuntimeError("cannot crop")

    monkeypatch.setattr(compat, "crop_layers", broken)
    with pytest.raises(RuntimeError, match="cannot crop"):
        kv.rollback(20)
    assert kv.ids == []  # started over, never half-cropped
    assert_consistent(kv)


def test_prefill_resumes_after_a_failed_piece(target_model, ids):
    """What context warming does: a piece fails, the next call resumes where the cache is."""
    kv = KVState(target_model)
    with Fault(target_model, nth=3, error=torch.OutOfMemoryError), pytest.raises(torch.OutOfMemoryError):
        kv.prefill(ids, piece=16)
    assert kv.ids == ids[:32]
    assert_consistent(kv)
    assert kv.prefill(ids, piece=16)
    assert_consistent(kv)
    assert torch.allclose(kv.logits_after(ids + [ids[0]]), KVState(target_model).logits_after(ids + [ids[0]]),
                          atol=1e-4)


# -- the engine: each path that extends a cache -------------------------------------------------

def test_fault_in_a_requests_prefill(engine, sample_source):
    uri = "file:///fault-prefill.py"
    cursor = sample_source.index("    def low_stock")
    engine.complete(request(uri, sample_source, cursor))  # the document's state is cached
    assert sample_source.index("class ") < cursor
    edited = sample_source.replace("class ", "class  ", 1)  # early edit: a long re-prefill
    with Fault(engine.pair.target) as fault, pytest.raises(RuntimeError, match="injected"):
        engine.complete(request(uri, edited, cursor + 1))
    assert fault.calls == 1
    assert_recovered(engine, uri, edited, cursor + 1)


def test_fault_in_idle_prefill(engine, sample_source):
    """Idle prefill has no retry: out of memory on its second slice is only logged by the
    worker. The next request on the document must not inherit a broken cache."""
    uri = "file:///fault-idle.py"
    cursor = sample_source.index("    def low_stock")
    engine.open_document(uri, sample_source)
    typed = sample_source[:cursor] + "    def size(self):\n        " + sample_source[cursor:]
    engine.update_document(uri, typed)
    with Fault(engine.pair.target, nth=2, error=torch.OutOfMemoryError) as fault:
        with pytest.raises(torch.OutOfMemoryError):
            engine.prefill_pending(60.0)
    assert fault.calls == 2
    state = engine.caches.get(uri)
    assert len(state.target.ids) > 0, "the first slice stays"
    offset = edit_end(sample_source, typed)
    assert_recovered(engine, uri, typed, offset)
    engine.close_document(uri)


def test_fault_in_a_verify_forward(engine, sample_source):
    uri = "file:///fault-verify.py"
    cursor = sample_source.index("        return ranked[:count]")
    first = engine.complete(request(uri, sample_source, cursor))
    assert first.target_forwards >= 2
    # Same prompt: nothing to prefill, so the target's forwards are the decode's verify steps;
    # the second fails, after the first step's accepted tokens moved the cache on.
    with Fault(engine.pair.target, nth=2) as fault, pytest.raises(RuntimeError, match="injected"):
        engine.complete(request(uri, sample_source, cursor))
    assert fault.calls == 2
    assert len(engine.caches.get(uri).target.ids) > len(first.prompt_ids) - 1, "the fault hit mid-decode"
    assert_recovered(engine, uri, sample_source, cursor)


def test_fault_in_the_draft_models_extend(engine, sample_source):
    uri = "file:///fault-draft.py"
    cursor = sample_source.index("    def tagged")
    engine.complete(request(uri, sample_source, cursor))
    draft_before = engine.caches.get(uri).draft.forwards
    assert draft_before > 0, "the draft model drafts"
    with Fault(engine.pair.draft, nth=3) as fault, pytest.raises(RuntimeError, match="injected"):
        engine.complete(request(uri, sample_source, cursor))
    assert fault.calls == 3
    assert_recovered(engine, uri, sample_source, cursor)


def test_fault_in_a_token_tree_forward(engine, sample_source, monkeypatch):
    """A tree verify that fails mid-layer (the lean path; transformers' runs no trees, so its
    decode never gets there) leaves the document's cache as it was before the step. The rival
    drafts: the text holds its last lines twice (the earlier copy followed by a decoy), and
    another buffer holds them followed by what the target writes (as in test_engine_lossless)."""
    uri = "file:///fault-tree.py"
    text = sample_source[:2700] + sample_source[2900:3000] + "\n@@~~ decoy ~~@@\n" + sample_source[2700:3000]
    plain = dict(uri=uri, text=text, offset=len(text), max_tokens=MAX_TOKENS, stop_at_block_end=False,
                 use_draft_model=False)
    reference = engine.complete(CompletionRequest(**plain | {"use_lookup": False}))  # caches the document's state
    engine.open_document("file:///holds-the-answer.py", sample_source[2800:3000] + reference.text)
    trees = []
    original = KVState.extend_tree

    def failing(state, new_ids, parents, skip=0):
        trees.append(len(new_ids))
        with Fault(state.model, nth=1):
            return original(state, new_ids, parents, skip)

    monkeypatch.setattr(KVState, "extend_tree", failing)
    # The rivals part at the first generated token: the first step drafts whatever its width costs.
    monkeypatch.setattr(planner, "FIRST_TOKEN_SLACK", float("inf"))
    try:
        if engine.paths["target"][0].name == "hf":
            result = engine.complete(CompletionRequest(**plain))
            assert not trees and "tree" not in result.sources and result.token_ids == reference.token_ids
            return
        with pytest.raises(RuntimeError, match="injected"):
            engine.complete(CompletionRequest(**plain))
        assert trees, "a tree was verified"
        monkeypatch.setattr(KVState, "extend_tree", original)
        state = engine.caches.get(uri)
        assert_consistent(state.target)
        again = engine.complete(CompletionRequest(**plain))
        assert again.token_ids == reference.token_ids
        assert_lossless(engine, again, MAX_TOKENS)
        assert_consistent(state.target)
    finally:
        engine.close_document("file:///holds-the-answer.py")
