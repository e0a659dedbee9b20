"""The prompt-lookup index: pure functions, no model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.engine.lookup import NgramIndex, candidates, lookup

TOKENS = st.lists(st.integers(0, 6), max_size=60)


def find(index: NgramIndex, tail, k: int, periodic: bool = False):
    """(continuation, n) of the index's match of ``tail``, as ``lookup`` takes it; ([], 0) when none."""
    end, n = index.locate(tail)
    return (index.continuation(end, k, periodic), n) if n else ([], 0)


def test_finds_the_continuation_of_the_longest_latest_match():
    index = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert find(index, [0, 2, 3], 3) == ([7, 8], 2)  # latest occurrence of (2, 3)
    assert find(index, [1, 2, 3], 3) == ([4, 5, 9], 3)  # the 3-gram beats the later 2-gram
    assert find(index, [6, 6], 3) == ([], 0)


def test_the_tail_itself_is_not_a_match():
    index = NgramIndex([5, 6, 7])
    assert find(index, [5, 6, 7], 4) == ([], 0)


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
    assert index._last == fresh._last and index._prev == fresh._prev
    for cut in range(len(target) + 1):
        assert find(index, target[:cut], 4) == find(fresh, target[:cut], 4)


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
    assert find(NgramIndex(tokens), tail, 3) == expected


def test_a_periodic_match_runs_past_the_end_of_the_context():
    """In the context being written, a run like ``0 0 0`` or ``'s', 's',`` matches a token or
    three back; the proposal copies on from what it proposes (as LZ77 copies overlap) instead of
    stopping at the tail. Only the index that holds the tail itself may do this."""
    run = [7, 1, 2, 3, 1, 2, 3, 1, 2]
    index = NgramIndex(run)
    assert find(index, run, 7) == ([3, 1, 2], 5)
    assert find(index, run, 7, periodic=True) == ([3, 1, 2, 3, 1, 2, 3], 5)
    zeros = [4, 0, 0, 0]
    assert find(NgramIndex(zeros), zeros, 5, periodic=True) == ([0, 0, 0, 0, 0], 2)
    other = NgramIndex([9, 9, 1, 2, 3])  # another document: its end is the end of what it knows
    match = lookup(run, 7, [("lookup:current", NgramIndex([5])), ("lookup:open", other)], holding_tail=index)
    assert match.tokens == [3] and match.source == "lookup:open"
    match = lookup(run, 7, [("lookup:current", index), ("lookup:open", other)], holding_tail=index)
    assert match.tokens == [3, 1, 2, 3, 1, 2, 3] and match.source == "lookup:current"


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=40), k=st.integers(1, 12))
def test_a_periodic_proposal_continues_the_period_of_its_match(tokens, k):
    """What runs past the end repeats the text d tokens back, d the distance to the match."""
    index = NgramIndex(tokens)
    plain, n = find(index, tokens, k)
    proposal, n_periodic = find(index, tokens, k, periodic=True)
    assert n_periodic == n and proposal[:len(plain)] == plain
    if not plain:
        assert proposal == []
        return
    assert len(proposal) == k
    written = tokens + proposal
    period = next(d for d in range(1, len(tokens)) if tokens[len(tokens) - d:len(tokens) - d + len(plain)] == plain
                  and tokens[len(tokens) - d - n:len(tokens) - d] == tokens[len(tokens) - n:])
    assert all(written[i] == written[i - period] for i in range(len(tokens), len(written)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=2, max_size=8))
def test_candidates_rank_every_sources_match_as_lookup_does(sources, tail):
    """``candidates`` (the drafts a token tree verifies side by side): one per source that
    matches, the best first, and that first is what ``lookup`` proposes."""
    indexes = [(f"s{i}", NgramIndex(tokens)) for i, tokens in enumerate(sources)]
    found = candidates(tail, 6, indexes)
    best = lookup(tail, 6, indexes)
    assert (best is None) == (not found)
    if best is not None:
        assert found[0] == best
    assert len({m.source for m in found}) == len(found)
    assert [m.ngram for m in found] == sorted((m.ngram for m in found), reverse=True)
    for match in found:
        index = dict(indexes)[match.source]
        end, n = index.locate(tail)
        assert n == match.ngram and match.tokens == index.continuation(end, 6)


def test_indexing_leaves_nothing_for_the_garbage_collector_to_walk():
    """An index holds ints and arrays only (bigram keys are ints, not tuples): building one over
    thousands of tokens adds a handful of objects the cyclic collector tracks, not one per token
    (the daemon's full collections walk every tracked object that is not frozen)."""
    import gc

    tokens = [(i * 7919) % 5000 for i in range(20000)]
    gc.collect()
    before = len(gc.get_objects())
    index = NgramIndex(tokens)
    index.extend(tokens[:3000])
    index.truncate(21000)
    assert index.locate(tokens[100:110]) != (-1, 0)
    assert len(gc.get_objects()) - before < 50


@pytest.mark.parametrize("seed", range(6))
def test_slices_chained_at_once_equal_token_by_token(monkeypatch, seed):
    """Idle indexing's large extends and truncates (numpy) leave exactly the index the
    per-token loop builds: the same last positions and chains, after any mix of both."""
    from specd.engine import lookup as lookup_module

    rng = random.Random(seed)
    vocab = rng.choice([3, 20, 5000])  # few bigrams (long chains) to many
    at_once, one_by_one = NgramIndex(), NgramIndex()
    for _ in range(12):
        if len(at_once) and rng.random() < 0.4:
            length = rng.randrange(len(at_once) + 1)
            monkeypatch.setattr(lookup_module, "VECTORIZED_FROM", 1)
            at_once.truncate(length)
            monkeypatch.setattr(lookup_module, "VECTORIZED_FROM", 1 << 30)
            one_by_one.truncate(length)
        else:
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 700, 3000]))]
            monkeypatch.setattr(lookup_module, "VECTORIZED_FROM", 1)
            at_once.extend(new)
            monkeypatch.setattr(lookup_module, "VECTORIZED_FROM", 1 << 30)
            one_by_one.extend(new)
        assert at_once.tokens == one_by_one.tokens
        assert at_once._prev == one_by_one._prev
        assert at_once._last == one_by_one._last
    fresh = NgramIndex(one_by_one.tokens.tolist())
    assert (fresh._prev, fresh._last) == (at_once._prev, at_once._last)
