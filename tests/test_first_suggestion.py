"""The first suggestion in a document whose full prompt is not prefilled: a narrow window answers
(sized from the measured prefill speed), the full prompt keeps prefilling in idle time without
being disturbed, and requests go back to it once it is warm (``specd.engine.cold_start``)."""

from __future__ import annotations

import re

import pytest

from engine_helpers import assert_lossless, make_engine
from specd.engine.cold_start import MIN_WINDOW, ColdStart, narrow_key
from specd.engine.types import CompletionRequest

URI = "file:///proj/long.py"


class SlowMachine(ColdStart):
    """A machine whose prefill costs ``ms_per_token`` whatever the engine measures: tiny models
    prefill far too fast for any window to be needed."""

    def __init__(self, budget_ms: int, ms_per_token: float):
        super().__init__(budget_ms)
        self.seed(ms_per_token)

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def long_document(sample_source: str) -> tuple[str, int]:
    text = sample_source * 3
    offset = text.index("\n", len(text) // 2) + 1
    return text[:offset] + "    " + text[offset:], offset + 4


def test_the_window_follows_the_measured_speed():
    cold = ColdStart(1000)
    assert cold.window(5000, 6000) is None  # nothing measured yet: no window is guessed
    cold.observe(200, 1.0)  # 5 ms a token: 200 tokens a second
    assert cold.affordable() == 200
    assert cold.window(150, 2000) is None  # what is left of the full prompt fits the budget
    window = cold.window(1500, 2000)
    assert window.tokens == 192 and window.full_pending == 1500  # a multiple of 64 within the budget
    assert cold.window(1500, 150) is None  # a window would not be shorter than the prompt
    cold.observe(100, 0.4)  # faster now (4 ms a token): the document keeps its window ...
    assert cold.window(1500, 2000, current=192).tokens == 192
    cold.observe(1000, 40.0)  # ... until the machine gets much slower; never under the floor
    assert cold.window(1500, 2000, current=192).tokens == MIN_WINDOW
    assert ColdStart(0).window(5000, 6000) is None  # first_suggestion_ms = 0: always the full prompt
    # A document answering from a window keeps it until what is left of its full prompt takes no
    # longer than an idle piece (here 30 tokens); one without a window takes the budget's prefill.
    steady = ColdStart(1000)
    steady.observe(200, 1.0)
    assert steady.affordable() == 200 and steady.piece_tokens() == 30
    assert steady.window(200, 2000) is None and steady.window(200, 2000, current=192).tokens == 192
    assert steady.window(30, 2000, current=192) is None
    small = ColdStart(1000)
    small.observe(100, 0.1)
    assert small.piece_tokens() == 150  # idle pieces of about 150 ms at the measured speed
    slow = ColdStart(1000)
    slow.observe(100, 5.0)  # 20 tokens a second: pieces of 3 tokens would be 150 ms; 4 at least
    assert slow.piece_tokens() == 4


def test_a_narrowed_builder_keeps_the_cursor_and_drops_far_context(llama_pair, sample_source):
    target, _ = llama_pair
    engine = make_engine(target, None)
    text, offset = long_document(sample_source)
    full = engine.prompts.build(text, offset, heal=False)
    narrow = engine.prompts.narrowed(64).build(text, offset, heal=False)
    assert len(narrow.ids) <= 64 + 8 < len(full.ids)
    assert full.prefix_start < narrow.prefix_start < offset  # the prefix nearer the cursor,
    assert offset < narrow.suffix_end < full.suffix_end  # the suffix too (where the family has one)
    assert narrow.ids[-1] == full.ids[-1] and narrow.indent == full.indent  # the same cursor


def test_a_cold_document_answers_from_a_window_while_its_full_prompt_prefills(llama_pair, sample_source):
    target, _ = llama_pair
    engine = make_engine(target, None)
    engine.cold = SlowMachine(1000, 10.0)  # 100 tokens a second: 1 s affords 100
    text, offset = long_document(sample_source)
    engine.open_document(URI, text)
    full_length = len(engine.build_prompt(URI, text, offset).ids)
    assert full_length > 300

    first = engine.complete(CompletionRequest(uri=URI, offset=offset, max_tokens=12))
    assert len(first.prompt_ids) <= MIN_WINDOW + 8  # the window, not the full prompt
    assert_lossless(engine, first, 12)  # the target's own greedy on the prompt it was given
    assert engine.stats()["first_suggestion"]["narrow_answers"] == 1
    assert engine.caches.peek(narrow_key(URI)) is not None

    # The next keystroke, still cold: the same window, its cache reused.
    text = text[:offset] + "x" + text[offset:]
    engine.update_document(URI, text, offset + 1)
    second = engine.complete(CompletionRequest(uri=URI, offset=offset + 1, max_tokens=12))
    assert len(second.prompt_ids) <= MIN_WINDOW + 8 and second.prefill_reused > 0
    assert_lossless(engine, second, 12)

    # Idle time prefills the full prompt in the document's own cache, which the window's
    # requests never touched; then requests answer from the full prompt again.
    while engine.prefill_pending(0.05):
        pass
    warm = engine.complete(CompletionRequest(uri=URI, offset=offset + 1, max_tokens=12))
    assert len(warm.prompt_ids) >= full_length and warm.prefill_computed <= 2
    assert_lossless(engine, warm, 12)
    assert engine.caches.peek(narrow_key(URI)) is None  # the window's cache is given back
    assert engine.stats()["first_suggestion"]["narrow_answers"] == 2


def test_while_typing_in_a_window_idle_time_brings_the_window_along_and_the_full_prompt_waits(
        llama_pair, sample_source):
    """A keystroke's request comes after the editor's debounce: idle prefill brings the window's
    cache to the cursor at once, and starts no piece of the full prompt (which no request can cut
    short) until the typing has paused for ``TYPING_GRACE_S``."""
    import time

    from specd.engine.idle import TYPING_GRACE_S

    engine, text, offset = answering_from_a_window(llama_pair, sample_source)
    full_before = len(engine.caches.peek(URI).target.ids) if engine.caches.peek(URI) is not None else 0

    text = text[:offset] + "x" + text[offset:]
    engine.update_document(URI, text, offset + 1)
    typed = time.monotonic()
    while time.monotonic() - typed < TYPING_GRACE_S / 2:
        assert engine.prefill_pending(0.01)  # work is left: the full prompt, later
    window = engine.caches.peek(narrow_key(URI))
    asked = engine.build_prompt(URI, text, offset + 1, window=window.window).ids[:-1]
    assert window.target.ids[:len(asked)] == asked  # the window is at the cursor already
    full = engine.caches.peek(URI)
    assert (len(full.target.ids) if full is not None else 0) == full_before  # the full prompt waited

    time.sleep(TYPING_GRACE_S)
    engine.prefill_pending(0.01)  # the typing paused: the full prompt's pieces go on
    assert len(engine.caches.peek(URI).target.ids) > full_before


@pytest.mark.parametrize("how", ["text sent with it", "first_suggestion_ms = 0"])
def test_one_shot_requests_and_a_zero_budget_wait_for_the_full_prompt(llama_pair, sample_source, how):
    target, _ = llama_pair
    engine = make_engine(target, None, first_suggestion_ms=0 if how == "first_suggestion_ms = 0" else 1000)
    engine.cold = SlowMachine(engine.options.first_suggestion_ms, 10.0)
    text, offset = long_document(sample_source)
    if how == "text sent with it":  # specd complete: nothing open, the text comes with the request
        result = engine.complete(CompletionRequest(uri=URI, text=text, offset=offset, max_tokens=4))
    else:
        engine.open_document(URI, text)
        result = engine.complete(CompletionRequest(uri=URI, offset=offset, max_tokens=4))
    assert len(result.prompt_ids) > 300
    assert engine.stats()["first_suggestion"]["narrow_answers"] == 0


def answering_from_a_window(llama_pair, sample_source):
    """An engine on a slow machine whose open document has answered once from a narrow window:
    (engine, text, cursor)."""
    target, _ = llama_pair
    engine = make_engine(target, None)
    engine.cold = SlowMachine(1000, 10.0)
    text, offset = long_document(sample_source)
    engine.open_document(URI, text)
    engine.complete(CompletionRequest(uri=URI, offset=offset, max_tokens=4))
    return engine, text, offset


def test_closing_a_document_drops_its_window(llama_pair, sample_source):
    engine, _, _ = answering_from_a_window(llama_pair, sample_source)
    assert engine.caches.peek(narrow_key(URI)) is not None
    engine.close_document(URI)
    assert engine.caches.peek(narrow_key(URI)) is None and engine.caches.peek(URI) is None


def test_through_the_daemon_a_cold_document_answers_narrow_then_full(tmp_path, tiny_root, sample_source):
    """The real daemon on the tiny pair, with a budget no prompt fits in (1 ms): the first
    ``complete`` on a document just opened answers from a window, idle time prefills the full
    prompt, and once the daemon is idle the next answers from it; ``status`` shows both."""
    from conftest import SHARED_DAEMON_CONFIG
    from daemon_helpers import DaemonProcess, daemon_idle, wait_for
    from specd.daemon.commands import format_status
    from tiny import make_tiny_pair

    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    config = {**SHARED_DAEMON_CONFIG, "model.target": target, "model.draft": draft, "model.device": "cpu",
              "engine.first_suggestion_ms": 1, "engine.time_budget_ms": 600_000}
    proc = DaemonProcess(tmp_path / "daemon", engine="real", config=config).start(timeout=120)
    try:
        text, offset = long_document(sample_source)
        with proc.client() as client:
            client.open_document(URI, text)
            first = client.complete(uri=URI, cursor={"offset": offset}, options={"max_tokens": 8})
            assert first["window_tokens"] == MIN_WINDOW and len(first["prompt_ids"]) <= MIN_WINDOW + 8
            wait_for(lambda: daemon_idle(proc.socket_path), timeout=60, message="the daemon idle")
            # Idle prefill runs in pieces until the full prompt is in: then a request needs less
            # than the budget affords (a token or two) and answers from it.
            def warm():
                result = client.complete(uri=URI, cursor={"offset": offset}, options={"max_tokens": 8})
                return result if result["window_tokens"] is None else None
            full = wait_for(warm, timeout=60, interval=0.5, message="an answer from the full prompt")
            assert len(full["prompt_ids"]) > 300 and full["prefill_computed"] <= 2
            status = client.status()
        about = status["engine"]["first_suggestion"]
        assert about["budget_ms"] == 1 and about["narrow_answers"] >= 1 and about["prefill_tokens_per_s"] > 0
        lines = format_status(status).splitlines()
        line = next(line for line in lines if line.startswith("cold docs"))
        assert "answered from a narrow window (last 64 tokens)" in line, line
        cache = next(line for line in lines if line.startswith("cache"))  # KV bytes per document
        assert f"largest: {URI} " in cache and " MiB (" in cache, cache

        # A cursor come to rest in another document just opened (the socket's focus): idle time
        # fills its window, then its full prompt, before any request there.
        other = "file:///proj/other.py"
        with proc.client() as client:
            client.open_document(other, text)
            assert client.focus("file:///proj/never-opened.py", {"offset": 0}) == {
                "uri": "file:///proj/never-opened.py", "focused": False}
            with pytest.raises(Exception, match="out_of_range|out of range"):
                client.focus(other, {"line": 10**6, "character": 0})
            line = text[:offset].count("\n")
            assert client.focus(other, {"line": line, "character": 4}) == {"uri": other, "focused": True}
            client.notify("focus", {"uri": other, "cursor": {"line": line, "character": 4}})  # as a hint: no answer
            client.notify("focus", {"uri": other, "cursor": "nowhere"})  # a bad one: logged, nothing to answer
            wait_for(lambda: daemon_idle(proc.socket_path), timeout=60, message="the daemon idle")
            status = client.status()
            assert status["documents"]["focus"] == {"received": 2, "not_open": 1}
            assert status["engine"]["first_suggestion"]["windows_prefilled_ahead"] >= 1
            cold = next(line for line in format_status(status).splitlines() if line.startswith("cold docs"))
            assert re.search(r"; [1-9]\d* prefilled at the cursor ahead$", cold), cold
            result = client.complete(uri=other, cursor={"offset": offset}, options={"max_tokens": 8})
            assert result["window_tokens"] is None and result["prefill_computed"] <= 2
    finally:
        proc.stop()


def test_a_focus_prefills_the_window_at_the_cursor_before_the_first_keystroke(llama_pair, sample_source):
    """The editor says where its cursor came to rest in a document just opened: idle time fills
    the narrow window there first, then the full prompt; the first keystroke's request reuses the
    window, prefilling only what the keystroke added."""
    target, _ = llama_pair
    engine = make_engine(target, None)
    engine.cold = SlowMachine(1000, 10.0)
    text, offset = long_document(sample_source)
    engine.open_document(URI, text)
    assert not engine.focus_document("file:///proj/not-open.py", 0)
    assert not engine.focus_document(URI, len(text) + 1)
    assert engine.focus_document(URI, offset)
    assert engine.prefill_pending(10.0)  # one slice: the window, the full prompt still to come
    narrow = engine.caches.peek(narrow_key(URI))
    assert narrow is not None and narrow.window == MIN_WINDOW and len(narrow.target.ids) > MIN_WINDOW // 2
    assert engine.caches.peek(URI) is None
    assert engine.stats()["first_suggestion"]["windows_prefilled_ahead"] == 1

    text = text[:offset] + "x" + text[offset:]
    engine.update_document(URI, text, offset + 1)
    first = engine.complete(CompletionRequest(uri=URI, offset=offset + 1, max_tokens=12))
    assert first.window_tokens == MIN_WINDOW and first.prefill_computed <= 4
    assert_lossless(engine, first, 12)

    while engine.prefill_pending(0.05):  # then the full prompt, in the document's own cache
        pass
    warm = engine.complete(CompletionRequest(uri=URI, offset=offset + 1, max_tokens=12))
    assert warm.window_tokens is None and warm.prefill_computed <= 2
    assert_lossless(engine, warm, 12)
    assert engine.stats()["first_suggestion"]["windows_prefilled_ahead"] == 1
