"""Per-document KV-prefix reuse: a keystroke at the cursor re-prefills only the tokens from the
edit on, and the output equals a cold run."""

from __future__ import annotations

import pytest

from engine_helpers import assert_lossless, make_engine
from specd.engine import CompletionRequest
from specd.engine.caches import common_prefix

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def spm_engine(llama_pair):
    """Suffix-first layout (the demo family's), so typing only changes the prompt's tail."""
    target, draft = llama_pair
    return make_engine(target, draft, fim_family="demo", prefix_tokens=2400, suffix_tokens=512)


@pytest.fixture(scope="module")
def psm_engine(llama_pair):
    target, draft = llama_pair
    return make_engine(target, draft, fim_family="qwen", fim_layout="psm", prefix_tokens=1600, suffix_tokens=512)


@pytest.fixture(scope="module")
def anchored_engine(llama_pair):
    """A prefix-suffix-middle family in its default (anchored) layout."""
    target, draft = llama_pair
    return make_engine(target, draft, fim_family="qwen", prefix_tokens=1600, suffix_tokens=512)


def request(text: str, offset: int, uri: str = "file:///kv.py", **kw) -> CompletionRequest:
    return CompletionRequest(uri=uri, text=text, offset=offset, max_tokens=MAX_TOKENS,
                             stop_at_block_end=False, **kw)


def test_one_character_edit_prefills_only_from_the_edit(spm_engine, sample_source):
    text = sample_source * 2
    cursor = text.index("    def restock", len(sample_source)) + len("    def rest")
    first = spm_engine.complete(request(text, cursor))
    assert len(first.prompt_ids) >= 2000
    assert first.prefill_reused == 0 and first.prefill_computed == len(first.prompt_ids) - 1

    typed = text[:cursor] + "o" + text[cursor:]  # the user types one character at the cursor
    second = spm_engine.complete(request(typed, cursor + 1))
    unchanged = common_prefix(first.prompt_ids, second.prompt_ids)
    assert second.prefill_computed == len(second.prompt_ids) - 1 - unchanged
    assert second.prefill_reused == unchanged
    assert second.prefill_computed <= 8, "only the retokenized tail after the edit is prefilled"
    assert unchanged >= len(second.prompt_ids) - 9

    cold = spm_engine.complete(request(typed, cursor + 1, kv_reuse=False))
    assert cold.prefill_reused == 0
    assert cold.prompt_ids == second.prompt_ids
    assert second.token_ids == cold.token_ids
    assert_lossless(spm_engine, second, MAX_TOKENS)


def test_typing_a_line_keeps_the_window_start(spm_engine, sample_source):
    """Window starts move in coarse steps: a whole typed line reuses everything before it."""
    text = sample_source
    cursor = text.index("    def low_stock")
    line = "    def extra(self) -> int:\n"
    results = []
    for i in range(0, len(line) + 1, 7):
        partial = text[:cursor] + line[:i] + text[cursor:]
        results.append(spm_engine.complete(request(partial, cursor + i)))
    for before, after in zip(results, results[1:]):
        assert after.prefill_reused >= len(before.prompt_ids) - 8
        assert after.prefill_computed <= 12


def test_prefix_first_layout_still_equals_cold(psm_engine, sample_source):
    """PSM families re-prefill the suffix after an edit; output still equals a cold run."""
    text = sample_source
    cursor = text.index("    def tagged")
    psm_engine.complete(request(text, cursor))
    typed = text[:cursor] + "x" + text[cursor:]
    warm = psm_engine.complete(request(typed, cursor + 1))
    cold = psm_engine.complete(request(typed, cursor + 1, kv_reuse=False))
    assert warm.prefill_reused > 0
    assert warm.token_ids == cold.token_ids
    assert_lossless(psm_engine, warm, MAX_TOKENS)


def test_anchored_layout_reprefills_only_the_typed_span(anchored_engine, psm_engine, sample_source):
    """Prefix-suffix-middle families: with the prefix ending at an anchor (the line start) and
    the typed text after the middle token, typing a line re-prefills a few tokens per request,
    where the standard layout re-prefills the whole suffix window; outputs equal cold runs."""
    assert anchored_engine.prompts.layout == "anchored" and psm_engine.prompts.layout == "psm"
    text = sample_source
    cursor = text.index("    def low_stock")
    line = "    def extra(self) -> int:\n        return len(self"
    computed = {"anchored": [], "psm": []}
    for name, engine in (("anchored", anchored_engine), ("psm", psm_engine)):
        for i in range(4, len(line) + 1, 6):
            partial = text[:cursor] + line[:i] + text[cursor:]
            result = engine.complete(request(partial, cursor + i, uri=f"file:///typing-{name}.py"))
            computed[name].append(result.prefill_computed)
        last = result
    warm = anchored_engine.complete(request(partial, cursor + i, uri="file:///typing-anchored.py"))
    assert max(computed["anchored"][1:]) <= 16
    assert sum(computed["anchored"][1:]) * 10 < sum(computed["psm"][1:])
    cold = anchored_engine.complete(request(partial, cursor + i, uri="file:///typing-anchored.py", kv_reuse=False))
    assert cold.prompt_ids == warm.prompt_ids and cold.token_ids == warm.token_ids
    assert_lossless(anchored_engine, warm, MAX_TOKENS)
    assert_lossless(psm_engine, last, MAX_TOKENS)


def test_cache_budget_evicts_least_recently_used(llama_pair, sample_source):
    target, draft = llama_pair
    engine = make_engine(target, draft, cache_budget_mb=1)
    for i in range(4):
        engine.complete(CompletionRequest(uri=f"file:///doc{i}.py", text=sample_source, offset=2000 + i,
                                          max_tokens=4))
    assert engine.caches.nbytes() <= 1024 * 1024 or len(engine.caches) == 1
    assert engine.caches.evictions > 0
    assert engine.caches.get("file:///doc3.py") is not None  # the newest survives


def test_out_of_memory_evicts_and_retries_once(llama_pair, sample_source, monkeypatch):
    import torch

    target, draft = llama_pair
    engine = make_engine(target, draft)
    engine.complete(CompletionRequest(uri="file:///a.py", text=sample_source, offset=500, max_tokens=4))
    real = engine._complete
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_complete", flaky)
    result = engine.complete(CompletionRequest(uri="file:///b.py", text=sample_source, offset=600, max_tokens=4))
    assert len(calls) == 2 and result.prompt_ids and result.stop_reason
    assert engine.caches.get("file:///a.py") is None  # evicted on the OOM path
    assert engine.oom_retries == 1

    def always(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine, "_complete", always)
    from specd.engine import EngineError

    with pytest.raises(EngineError, match="out of memory"):
        engine.complete(CompletionRequest(uri="file:///b.py", text=sample_source, offset=600, max_tokens=4))


def test_typing_through_a_suggestion_drafts_from_its_rest(spm_engine, sample_source):
    """The user types the first characters of the shown completion: its rest is proposed as the
    draft (source lookup:previous) and the output is still lossless. (A random model moves its
    prediction when text moves from after <|fim_middle|> into the prefix, so acceptance is
    asserted on the trained demo pair in test_demo_engine.py.)"""
    text = sample_source
    cursor = text.index("        return ranked[:count]")
    first = spm_engine.complete(request(text, cursor, use_draft_model=False))
    typed = spm_engine.pair.tokenizer.decode(first.token_ids[:3])[len(first.healed):]  # after the cursor
    assert typed and first.text.startswith(typed) and len(first.text) > len(typed)
    second = spm_engine.complete(request(text[:cursor] + typed + text[cursor:], cursor + len(typed),
                                         use_draft_model=False))
    assert_lossless(spm_engine, second, MAX_TOKENS)
    assert second.sources["lookup:previous"].proposed > 0


def test_idle_prefill_prepares_the_cache_where_the_user_is_typing(llama_pair, sample_source):
    """After an edit, idle slices prefill both caches for a completion at the edit's end: the
    next request there computes no prompt tokens at all, and still equals a cold run."""
    from specd.engine.front.documents import edit_end

    assert edit_end("abcdef", "abXYcdef") == 4 and edit_end("abc", "abc!") == 4 and edit_end("abcd", "ad") == 1
    target, draft = llama_pair
    engine = make_engine(target, draft, fim_family="demo")
    uri = "file:///idle.py"
    cursor = sample_source.index("    def low_stock")
    engine.open_document(uri, sample_source)
    assert engine.prefill_pending(1.0) is False  # opening alone: nothing edited yet
    typed = sample_source[:cursor] + "    def size(self):\n        " + sample_source[cursor:]
    engine.update_document(uri, typed)
    slices = 0
    while engine.prefill_pending(0.001):  # tiny slices: resumes where the last one stopped
        slices += 1
    assert slices > 1
    offset = edit_end(sample_source, typed)  # an edit's end is ambiguous by repeated text ...
    assert abs(offset - (cursor + len("    def size(self):\n        "))) <= 8  # ... by a few characters here
    warm = engine.complete(CompletionRequest(uri=uri, offset=offset, max_tokens=MAX_TOKENS, stop_at_block_end=False))
    assert warm.prefill_computed == 0 and warm.prefill_reused == len(warm.prompt_ids) - 1
    cold = engine.complete(request(typed, offset, kv_reuse=False))
    assert warm.token_ids == cold.token_ids
    assert_lossless(engine, warm, MAX_TOKENS)


def test_idle_prefill_warms_the_cursor_the_daemon_knows_where_the_diff_is_ambiguous(llama_pair, sample_source):
    """Typing a space after spaces (indentation) or Enter before an empty line repeats the text
    around the edit, so its end cannot be told from the two texts. The daemon knows it from the
    ranged change and passes it (``update_document(cursor=...)``): idle prefill then warms the
    cache for the real cursor, and the request computes no prompt token."""
    from specd.engine.front.documents import edit_end

    target, draft = llama_pair
    engine = make_engine(target, draft, fim_family="demo")
    line_end = sample_source.index("\n\n", sample_source.index("    def low_stock"))  # a line, then an empty one
    before = sample_source
    typed = before[:line_end] + "\n" + before[line_end:]  # Enter at the end of the line
    cursor = line_end + 1
    assert edit_end(before, typed) != cursor  # the diff puts the edit after the repeated newlines
    computed = {}
    for known in (False, True):
        uri = f"file:///ambiguous-{known}.py"
        engine.open_document(uri, before)
        engine.update_document(uri, typed, cursor if known else None)
        while engine.prefill_pending(1.0):
            pass
        result = engine.complete(CompletionRequest(uri=uri, offset=cursor, max_tokens=MAX_TOKENS,
                                                   stop_at_block_end=False))
        computed[known] = result.prefill_computed
    assert computed[True] == 0 and computed[False] > 8, computed


def test_an_empty_prompt_is_an_engine_error(llama_pair):
    """A plain (no FIM) family with the cursor at offset 0 has nothing to condition on."""
    from specd.engine import EngineError

    target, draft = llama_pair
    engine = make_engine(target, draft, fim_family="plain")
    with pytest.raises(EngineError, match="empty prompt"):
        engine.complete(CompletionRequest(text="x = 1\n", offset=0, max_tokens=4))
    assert engine.complete(CompletionRequest(text="x = 1\n", offset=6, max_tokens=4)).prompt_ids


def test_prefill_in_pieces_resumes_and_keeps_the_common_prefix(llama_pair, sample_source):
    """The one prefill primitive: pieces under a deadline resume where they stopped, and a
    changed tail re-runs only from the first difference."""
    import time

    target, draft = llama_pair
    engine = make_engine(target, draft)
    ids = engine.prompts.encode(sample_source[:1500])
    state = engine._new_state()
    calls = 0
    while not state.prefill(ids, deadline=time.monotonic() - 1, piece=64):  # past deadline: one piece a call
        calls += 1
    assert calls >= len(ids) // 64 - 1
    assert state.target.ids == ids and state.draft.ids == ids
    forwards = state.target.forwards
    changed = ids[:-10] + ids[-5:]
    assert state.prefill(changed)
    assert state.target.ids == changed and state.target.forwards == forwards + 1


def test_releasing_the_models_frees_them_and_their_forward_paths(llama_pair):
    """Idle unload must give the memory back: nothing the engine keeps (forward paths with their
    transposed weight copies, caches, planner) may hold the models after ``release``. A loaded
    engine has frozen the heap (``settle_heap``: full collections skip the models); release
    unfreezes it, or a model in a reference cycle would never be freed."""
    import gc
    import weakref

    target, draft = llama_pair
    engine = make_engine(target, draft)
    assert gc.get_freeze_count() > 0
    engine.complete(request("def f(x):\n    return x\n", 13))
    models = [weakref.ref(engine.pair.target), weakref.ref(engine.pair.draft)]
    assert engine.paths["target"][0].copied_bytes > 0  # float32 on a CPU: the lean path with copies
    engine.release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert [ref() for ref in models] == [None, None]
    assert engine.stats()["forward"] is None
    engine.ensure_loaded()  # and it comes back
    assert set(engine.paths) == {"target", "draft"}
    assert engine.complete(request("def f(x):\n    return x\n", 13)).token_ids


def test_finished_workspace_indexing_freezes_what_it_built(llama_pair):
    """The workspace's indexes live as long as the engine: once idle time has indexed the
    pending files, they are frozen too (full collections skip them), as the models were at load."""
    import gc

    engine = make_engine(*llama_pair)
    engine.set_corpus_file("lib/util.py", "def helper(x):\n    return x + 1\n" * 200)
    frozen = gc.get_freeze_count()
    while engine.index_pending_corpus(0.05):
        pass
    assert gc.get_freeze_count() > frozen
    assert not engine.index_pending_corpus(0.05)  # nothing pending: no further settling


def test_a_completion_is_remembered_and_drafts_the_next_request(spm_engine, sample_source):
    """Each completion is indexed for lookup on its document (``lookup:suggested``, the last
    ``SUGGESTIONS_KEPT``): a keystroke later the target mostly rewrites it, also when the user
    typed something else than it said. Here the same request comes again with the typing-through
    continuation forgotten (it would propose the same tokens as ``lookup:previous``): the old
    completion is proposed from the index, stands, and the output stays lossless."""
    from specd.engine.caches import SUGGESTIONS_KEPT

    uri = "file:///remembered.py"
    text = sample_source
    cursor = text.index("        return ranked[:count]")
    first = spm_engine.complete(request(text, cursor, uri=uri, use_draft_model=False))
    state = spm_engine.caches.get(uri)
    assert state.suggestions[0].tokens.tolist()[-len(first.token_ids):] == first.token_ids
    state.last_completion = ""
    second = spm_engine.complete(request(text, cursor, uri=uri, use_draft_model=False))
    assert_lossless(spm_engine, second, MAX_TOKENS)
    assert second.token_ids == first.token_ids
    assert "lookup:previous" not in second.sources
    assert second.sources["lookup:suggested"].accepted > 0
    for extra in range(SUGGESTIONS_KEPT + 1):
        spm_engine.complete(request(text[:cursor] + "x" * extra, cursor + extra, uri=uri, use_draft_model=False))
    assert len(spm_engine.caches.get(uri).suggestions) == SUGGESTIONS_KEPT


def test_common_prefix_of_token_sequences_of_any_kind():
    """Lists, tuples and arrays in any mix; the first difference anywhere, found by halving."""
    import random
    from array import array

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 300))]
        b = a[:rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for x, y in ((a, b), (b, a), (tuple(a), b), (array("i", a), b), (a, array("i", b))):
            assert common_prefix(x, y) == expected


def test_a_request_cancelled_after_its_prefill_leaves_the_kv_to_the_next(spm_engine, sample_source):
    """A cold document's prefill is the costly part: a request cancelled (superseded, timed out
    at the client) right after it must not throw it away."""
    import threading

    from specd.engine.types import Cancelled

    uri = "file:///cancelled.py"
    offset = len(sample_source) // 2
    cancel = threading.Event()
    steps = spm_engine.complete_steps(request(sample_source, offset, uri=uri), cancel)
    next(steps)  # the prefill
    cancel.set()
    with pytest.raises(Cancelled):
        next(steps)
    again = spm_engine.complete(request(sample_source, offset, uri=uri))
    assert again.prefill_computed <= 1 and again.prefill_reused >= len(again.prompt_ids) - 2
    assert_lossless(spm_engine, again, MAX_TOKENS)


def test_a_request_dropped_after_its_prefill_leaves_the_kv_to_the_next(spm_engine, sample_source):
    """The same when the caller drops the request between steps (its generator closed)."""
    uri = "file:///dropped.py"
    offset = len(sample_source) // 3
    steps = spm_engine.complete_steps(request(sample_source, offset, uri=uri))
    next(steps)  # the prefill
    steps.close()
    again = spm_engine.complete(request(sample_source, offset, uri=uri))
    assert again.prefill_computed <= 1 and again.prefill_reused >= len(again.prompt_ids) - 2
