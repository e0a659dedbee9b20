"""The feature head's network and file: drafting step by step after a cache computes what the
whole-window forward (training's) computes, and a saved head loads as it was."""

import pytest
import torch

from specd.engine.feature_head import FeatureHead, HeadCache, HeadConfig, is_feature_head


def _head(seed: int = 0) -> FeatureHead:
    torch.manual_seed(seed)
    config = HeadConfig(hidden=32, heads=4, intermediate=48, vocab_size=50, rope_theta=100.0)
    vocab = torch.tensor([3, 7, 11, 20, 42])
    lm_head = torch.randn(50, 32)  # the target's LM head, untied from its embeddings
    head = FeatureHead(config, vocab, lm_head[vocab], torch.randn(50, 32))
    head.lm_head = lm_head  # kept here for the tests that load a saved head
    with torch.no_grad():  # away from the identity start, so the layer's every part shows
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return head


def test_steps_after_a_cache_match_the_window_forward():
    head = _head()
    features, tokens = torch.randn(1, 9, 32), torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        whole = head(features, tokens)[0]
        cache = HeadCache()
        parts = [head.step(features[0, :4], tokens[0, :4], cache),  # a prompt's positions at once
                 head.step(features[0, 4:5], tokens[0, 4:5], cache),  # then one at a time
                 head.step(features[0, 5:9], tokens[0, 5:9], cache)]
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_moving_a_head_moves_the_targets_embedding_table_with_it():
    """``to``/``double``/``cpu`` reach the embedding table, a plain tensor of the head's (train-draft
    moves a head to its device and back; the rotary tables follow the states' device)."""
    head = _head()
    features, tokens = torch.randn(1, 5, 32), torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        expected = head(features, tokens).double()
        moved = head.double()
        assert moved is head and head.embedding.dtype == head.rows.dtype == torch.float64
        torch.testing.assert_close(head(features.double(), tokens), expected, atol=1e-5, rtol=1e-5)
        head.float().cpu()
    assert head.embedding.dtype == torch.float32 and head.embedding.device.type == "cpu"


def test_a_cropped_cache_drafts_as_if_the_rest_never_ran():
    head = _head()
    features, tokens = torch.randn(6, 32), torch.randint(0, 50, (6,))
    other = torch.randn(2, 32)
    with torch.no_grad():
        cache = HeadCache()
        head.step(features[:4], tokens[:4], cache)
        head.step(other, tokens[4:6], cache)  # a rejected chain
        cache.crop(4)
        again = head.step(features[4:6], tokens[4:6], cache)
        fresh = head.step(features, tokens, HeadCache())[4:]
    torch.testing.assert_close(again, fresh, atol=1e-5, rtol=1e-5)


def test_a_saved_head_loads_as_it_was_from_its_file_and_the_targets_tables(tmp_path):
    from safetensors.torch import load_file

    head = _head(1)
    head.save(tmp_path / "h")
    assert is_feature_head(tmp_path / "h") and not is_feature_head(tmp_path)
    # the file holds what the head trained; the target's rows come from the target at load
    assert "rows" not in load_file(str(tmp_path / "h" / "head.safetensors"))
    loaded = FeatureHead.load(tmp_path / "h", head.embedding, head.lm_head)
    features, tokens = torch.randn(1, 5, 32), torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(features, tokens), head(features, tokens))
        torch.testing.assert_close(loaded.scores(head(features, tokens)), head.scores(head(features, tokens)))
    assert loaded.vocab.tolist() == [3, 7, 11, 20, 42]
    with pytest.raises(ValueError, match="vocabulary 50 and width 32, not an embedding of"):
        FeatureHead.load(tmp_path / "h", torch.randn(60, 32), head.lm_head)
    with pytest.raises(ValueError, match="vocabulary 50 and width 32, not an LM head of"):
        FeatureHead.load(tmp_path / "h", head.embedding, torch.randn(50, 16))


def test_a_file_that_carries_rows_loads_scoring_with_the_targets_own(tmp_path):
    from safetensors.torch import save_file

    head = _head(2)
    head.save(tmp_path / "h")
    tensors = {name: t.contiguous() for name, t in head.state_dict().items()}
    tensors["rows"] = torch.zeros_like(tensors["rows"])  # a stale copy, unlike the target's
    save_file(tensors, str(tmp_path / "h" / "head.safetensors"))
    loaded = FeatureHead.load(tmp_path / "h", head.embedding, head.lm_head)
    assert torch.equal(loaded.rows, head.lm_head[head.vocab])


def test_a_cache_that_dropped_its_oldest_positions_keeps_the_rest_in_place():
    head = _head()
    features, tokens = torch.randn(8, 32), torch.randint(0, 50, (8,))
    with torch.no_grad():
        cache = HeadCache()
        head.step(features[:6], tokens[:6], cache)
        cache.drop_front(2)
        last = head.step(features[6:], tokens[6:], cache)
        # the same as a head that read positions 2.. at their own positions: rotary angles are
        # relative, so it matches a fresh read of positions 2..7 from position 0
        fresh = head.step(features[2:], tokens[2:], HeadCache())[4:]
    assert cache.length == 6 and cache.dropped == 2
    torch.testing.assert_close(last, fresh, atol=1e-4, rtol=1e-4)


def test_the_feature_trail_keeps_the_last_positions_in_order(monkeypatch):
    from specd.engine import caches

    monkeypatch.setattr(caches, "FEATURE_WINDOW", 4)
    trail = caches.FeatureTrail()
    rows = torch.arange(40, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i
    at = 0
    for n in (3, 1, 1, 2, 1, 6, 1, 1, 9, 1):  # prompt pieces and steps, past twice the window
        trail.note(rows[at:at + n], at)
        at += n
        assert trail.end == at and trail.length >= min(at, 4)
        assert at < 4 or torch.equal(trail.get(at - 4, at), rows[at - 4:at])
    trail.crop(at - 2)
    assert trail.end == at - 2 and trail.get(at - 2, at) is None
    assert torch.equal(trail.get(at - 4, at - 2), rows[at - 4:at - 2])
    trail.note(rows[:1] * 0 - 1, at + 5)  # not after its end: it starts again there
    assert trail.first == at + 5 and trail.length == 1


def test_lookups_guess_is_the_token_after_the_last_pair_else_the_last_token_seen_before():
    import numpy as np

    from specd.engine.feature_head import NO_GUESS, lookup_guess, lookup_guesses

    def guess(history, last):
        return lookup_guess(np.asarray(history), last)

    assert guess([5, 1, 7, 2, 1, 8, 9], 1) == 8  # 1 alone: the token after its latest occurrence
    assert guess([5, 1, 7, 2, 1, 8, 5], 1) == 7  # the pair (5, 1) wins over 1's latest occurrence
    assert guess([4, 1], 1) == NO_GUESS  # 1 never had a token after it
    assert guess([], 3) == guess([3], 3) == NO_GUESS
    assert guess([3, 3], 3) == 3
    ids = [2, 6, 2, 7, 2, 6, 2]
    # each position reads only the tokens before it
    assert lookup_guesses(ids) == [NO_GUESS, NO_GUESS, 6, NO_GUESS, 7, 2, 7]
    assert lookup_guesses(ids, 4, 6) == [7, 2]


def test_a_head_reading_lookups_guess_steps_as_its_window_forward_and_saves_so(tmp_path):
    torch.manual_seed(2)
    config = HeadConfig(hidden=32, heads=4, intermediate=48, vocab_size=50, rope_theta=100.0, guess=True)
    vocab = torch.tensor([3, 7, 11, 20, 42])
    lm_head, embedding = torch.randn(50, 32), torch.randn(50, 32)
    head = FeatureHead(config, vocab, lm_head[vocab], embedding)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    features, tokens = torch.randn(1, 9, 32), torch.randint(0, 6, (1, 9))
    guesses = torch.tensor([[-1, 4, 2, -1, 0, 5, 5, 1, -1]])
    with torch.no_grad():
        whole = head(features, tokens, guesses)[0]
        cache = HeadCache()
        parts = [head.step(features[0, :4], tokens[0, :4], cache, guesses[0, :4]),
                 head.step(features[0, 4:], tokens[0, 4:], cache, guesses[0, 4:])]
        # the guess is read: another guess, another prediction
        assert not torch.allclose(head(features, tokens, guesses.flip(-1))[0], whole)
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="guess"):
        head(features, tokens)
    head.save(tmp_path / "h")
    loaded = FeatureHead.load(tmp_path / "h", embedding, lm_head)
    assert loaded.config.guess
    with torch.no_grad():
        torch.testing.assert_close(loaded(features, tokens, guesses)[0], whole)
