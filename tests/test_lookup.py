"""The prompt-lookup index: pure functions, no model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specd.engine.lookup import NgramIndex, lookup

TOKENS = st.lists(st.integers(0, 6), max_size=60)


def test_finds_the_continuation_of_the_longest_latest_match():
    index = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert index.find([0, 2, 3], 3) == ([7, 8], 2)  # latest occurrence of (2, 3)
    assert index.find([1, 2, 3], 3) == ([4, 5, 9], 3)  # the 3-gram beats the later 2-gram
    assert index.find([6, 6], 3) == ([], 0)


def test_the_tail_itself_is_not_a_match():
    index = NgramIndex([5, 6, 7])
    assert index.find([5, 6, 7], 4) == ([], 0)


def test_priority_across_sources():
    current, other = NgramIndex([1, 2, 3]), NgramIndex([1, 2, 9, 9, 4, 1, 2, 4])
    match = lookup([1, 2], 2, [("lookup:current", current), ("lookup:open", other)])
    assert match.source == "lookup:current" and match.tokens == [3]
    match = lookup([9, 4, 1, 2], 2, [("lookup:current", current), ("lookup:open", other)])
    assert match.source == "lookup:open" and match.tokens == [4]


@settings(max_examples=200, deadline=None)
@given(first=TOKENS, second=TOKENS, keep=st.integers(0, 60))
def test_incremental_updates_equal_a_fresh_build(first, second, keep):
    index = NgramIndex(first)
    target = first[:keep] + second
    index.sync(target)
    fresh = NgramIndex(target)
    assert index.tokens == fresh.tokens
    assert index._ends == fresh._ends
    for cut in range(len(target) + 1):
        assert index.find(target[:cut], 4) == fresh.find(target[:cut], 4)


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, tail=st.lists(st.integers(0, 6), min_size=2, max_size=8))
def test_find_agrees_with_a_brute_force_search(tokens, tail):
    """Longest suffix match of length 2..5, most recent occurrence among equals."""
    expected = ([], 0)
    for n in range(min(5, len(tail)), 1, -1):
        ends = [e for e in range(n, len(tokens)) if tokens[e - n:e] == tail[-n:]]
        if ends:
            expected = (tokens[ends[-1]:ends[-1] + 3], n)
            break
    assert NgramIndex(tokens).find(tail, 3) == expected
