"""Completions run step by step (``Engine.complete_steps``) and interleaved, as the daemon's
worker runs them: each output is the target's own greedy continuation and equals the same
request run alone, whatever ran between its steps (other documents, the same document's
stateless twin); time spent suspended is not charged to the time budget; the
text so far is always a prefix of the final text."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from engine_helpers import assert_lossless, make_engine
from specd.engine import CompletionRequest
from specd.engine.front.boundaries import NO_BOUNDARIES
from specd.engine.types import Progress, run_to_end

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(llama_pair):
    target, draft = llama_pair
    return make_engine(target, draft, fim_family="demo", prefix_tokens=2400, suffix_tokens=512)


def _requests(source: str) -> list[CompletionRequest]:
    """Cursors spread over the file, on three documents and stateless, one with a long prompt."""
    lines = source.splitlines(keepends=True)
    out = []
    for number, line in enumerate((5, 11, 17, 23, 29)):
        offset = sum(len(text) for text in lines[:line]) + len(lines[line]) // 2
        uri = None if number == 4 else f"file:///doc{number % 3}.py"
        out.append(CompletionRequest(uri=uri, text=source, offset=offset, max_tokens=MAX_TOKENS, **NO_BOUNDARIES))
    return out


def _interleave(engine, requests: list[CompletionRequest], order: random.Random) -> list:
    """Run every request's steps, picking the next one to step at random."""
    running = {number: engine.complete_steps(request) for number, request in enumerate(requests)}
    results: dict[int, object] = {}
    progress: dict[int, list[str]] = {number: [] for number in running}
    while running:
        number = order.choice(sorted(running))
        try:
            step = next(running[number])
        except StopIteration as done:
            results[number] = done.value
            del running[number]
        else:
            assert isinstance(step, Progress)
            progress[number].append(step.text())
    for number, texts in progress.items():
        assert all(results[number].text.startswith(text) for text in texts)
    return [results[number] for number in range(len(requests))]


def test_interleaved_completions_equal_each_run_alone(engine, sample_source):
    requests = _requests(sample_source)
    for seed in range(3):
        engine.caches.clear()
        mixed = _interleave(engine, requests, random.Random(seed))
        for request, result in zip(requests, mixed):
            engine.caches.clear()
            alone = engine.complete(request)
            assert result.token_ids == alone.token_ids, (seed, request.offset)
            assert_lossless(engine, result, MAX_TOKENS)


def test_a_document_keeps_its_cache_across_other_documents_steps(engine, sample_source):
    """Two keystrokes on one document with another document's steps in between: the second
    still reuses the first's prefix."""
    engine.caches.clear()
    first = CompletionRequest(uri="file:///a.py", text=sample_source, offset=400, max_tokens=8)
    other = CompletionRequest(uri="file:///b.py", text=sample_source[::-1], offset=300, max_tokens=8)
    typed = sample_source[:400] + "x" + sample_source[400:]
    second = CompletionRequest(uri="file:///a.py", text=typed, offset=401, max_tokens=8)
    steps_a, steps_b = engine.complete_steps(first), engine.complete_steps(other)
    for steps in itertools.cycle((steps_a, steps_b)):
        try:
            next(steps)
        except StopIteration:
            break
    run_to_end(steps_a if steps is steps_b else steps_b)
    result = engine.complete(second)
    assert result.prefill_reused > 0.8 * len(result.prompt_ids)


def test_time_suspended_is_not_charged_to_the_budget(engine, sample_source):
    """A 300 ms budget, suspended 0.4 s after each step: the completion still runs to its length."""
    request = CompletionRequest(text=sample_source, offset=500, max_tokens=6, time_budget_ms=300, **NO_BOUNDARIES)
    steps = engine.complete_steps(request)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
            break
        time.sleep(0.4)
    assert result.stop_reason == "max_tokens" and len(result.token_ids) == 6
    assert result.suspended_ms >= 0.4 * 1000 * (result.target_forwards - 1)
    assert result.total_ms - result.suspended_ms < 300 * 3


def test_a_superseded_completion_raises_at_its_next_step(engine, sample_source):
    """The daemon sets the cancel event of a superseded job; the job must leave before touching
    the document's cache again, whatever the newer job did to it meanwhile."""
    import threading

    from specd.engine.types import Cancelled

    engine.caches.clear()
    cancel = threading.Event()
    old = engine.complete_steps(CompletionRequest(uri="file:///s.py", text=sample_source, offset=600,
                                                  max_tokens=MAX_TOKENS, **NO_BOUNDARIES), cancel)
    next(old)
    cancel.set()
    newer = CompletionRequest(uri="file:///s.py", text=sample_source, offset=610, max_tokens=MAX_TOKENS,
                              **NO_BOUNDARIES)
    result = engine.complete(newer)
    with pytest.raises(Cancelled):
        next(old)
    assert_lossless(engine, result, MAX_TOKENS)
    again = engine.complete(newer)
    assert again.token_ids == result.token_ids
