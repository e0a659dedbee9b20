"""Greedy speculative output equals the target alone (HF generate), token for token, in fp32,
over random prompts and edit sequences, for Llama, Qwen2 and GPT-2, with every drafter mix."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import assert_lossless, make_engine, make_near_draft
from specd.engine import CompletionRequest

MAX_TOKENS = 24
MODES = {
    "none": dict(use_draft_model=False, use_lookup=False),
    "draft": dict(use_draft_model=True, use_lookup=False),
    "lookup": dict(use_draft_model=False, use_lookup=True),
    "both": dict(use_draft_model=True, use_lookup=True),
}
EDIT_TEXT = st.text(alphabet=st.sampled_from(list("abcdefxyz_ ()[]:=.,'\"\n    \t0123456789") + ["é", "你", "🎉"]),
                    max_size=12)


@pytest.fixture(scope="module")
def engines(tiny_pairs, tiny_root):
    """Per arch: one engine whose draft is the tiny random model (rejections) and one whose
    draft is the target plus noise (partial acceptance); the first runs every product on
    torch, the second every product of 1-16 rows through numpy's BLAS (engine.numpy_products)
    and its decode and verify steps through the static-shape forward that CUDA graphs record
    (engine.cuda_graphs; "eager": run, not recorded, on a CPU)."""
    out = {}
    for arch, (target, draft) in tiny_pairs.items():
        near = make_near_draft(target, tiny_root / arch / "near-draft")
        out[arch] = {
            "random": make_engine(target, draft, prefix_tokens=384, suffix_tokens=128, numpy_products="off"),
            "near": make_engine(target, near, prefix_tokens=384, suffix_tokens=128, numpy_products="on",
                                cuda_graphs="eager"),
        }
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "qwen3", "gemma", "granite", "gpt_neox", "phi3", "stablelm",
                                  "phi", "opt", "gemma2", "gemma3_text", "olmo2"])
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_greedy_equals_target_alone(arch, engines, sample_source, data):
    text = sample_source
    uri = f"file:///lossless-{arch}.py"
    for engine in engines[arch].values():
        # Two open buffers that match the text but continue it differently in places: lookup
        # then has rival drafts, and the planner verifies them as token trees.
        engine.open_document("file:///twin-a.py", sample_source.replace("self", "this"))
        engine.open_document("file:///twin-b.py", sample_source.replace("(", "( "))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        # An edit somewhere (insert and/or delete), then a completion somewhere near it.
        at = data.draw(st.integers(0, len(text)), label="edit at")
        cut = data.draw(st.integers(0, 8), label="delete")
        text = text[:at] + data.draw(EDIT_TEXT, label="insert") + text[at + cut:]
        offset = data.draw(st.integers(max(0, at - 40), min(len(text), at + 40)), label="cursor")
        engine = engines[arch][data.draw(st.sampled_from(["random", "near"]), label="draft")]
        mode = data.draw(st.sampled_from(sorted(MODES)), label="mode")
        request = CompletionRequest(uri=uri, text=text, offset=offset, max_tokens=MAX_TOKENS,
                                    stop_at_block_end=False, kv_reuse=data.draw(st.booleans(), label="reuse"),
                                    **MODES[mode])
        result = engine.complete(request)
        assert_lossless(engine, result, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "qwen3", "gemma", "granite", "gpt_neox", "phi3", "stablelm",
                                  "phi", "opt", "gemma2", "gemma3_text", "olmo2"])
def test_near_draft_is_accepted_and_still_lossless(arch, engines, sample_source):
    """With a draft close to the target, drafts are accepted (fewer target forwards than
    tokens), and the output is still exactly the target's."""
    engine = engines[arch]["near"]
    assert all(path.host_rows == frozenset(range(1, 17)) for path, _ in engine.paths.values())  # numpy's BLAS
    assert all(path.graphs is not None for path, _ in engine.paths.values())  # replayed steps
    # A cursor where each architecture's random target writes on for a while before its
    # end-of-text (at some cursors one ends at once, and nothing is left to draft).
    offset = sample_source.index("    def remove")
    result = engine.complete(CompletionRequest(uri=f"file:///near-{arch}.py", text=sample_source, offset=offset,
                                               max_tokens=MAX_TOKENS, stop_at_block_end=False,
                                               use_lookup=False))
    assert_lossless(engine, result, MAX_TOKENS)
    assert len(result.token_ids) >= 4, f"the target ended at once ({result.stop_reason}): choose another cursor"
    assert result.sources["draft"].accepted > 0
    assert result.target_forwards < len(result.token_ids), result.stop_reason
    # the target's verifies and the draft's steps replayed recordings of their document's caches
    state = engine.caches.get(f"file:///near-{arch}.py")
    assert any(width > 1 and not last_only for width, last_only in state.target.cache.graphs)
    assert (1, True) in state.draft.cache.graphs


def test_transformers_forward_rolls_back_past_a_window_that_binds(tiny_pairs, tiny_root, sample_source):
    """transformers' own forward (the fallback path) on a model whose sliding window (64 tokens)
    is far shorter than its prompts (~500): rejected drafts roll the cache back by a crop, which
    a cache of sliding layers refuses once the window is full; specd's caches keep every
    position (the mask still slides) and the output is the target's."""
    target, _ = tiny_pairs["gemma3_text"]
    # a draft further off than the other tests' near drafts: this one must be rejected somewhere
    engine = make_engine(target, make_near_draft(target, tiny_root / "gemma3_text" / "far-draft", noise=0.3),
                         prefix_tokens=384, suffix_tokens=128, fast_forward=False)
    assert {path.name for path, _ in engine.paths.values()} == {"hf"}
    uri = "file:///window-hf.py"
    for marker in ("    def sell", "    def to_dict"):
        result = engine.complete(CompletionRequest(uri=uri, text=sample_source, offset=sample_source.index(marker),
                                                   max_tokens=MAX_TOKENS, stop_at_block_end=False))
        assert_lossless(engine, result, MAX_TOKENS)
        assert len(result.prompt_ids) > 300
    assert result.sources["draft"].proposed > result.sources["draft"].accepted  # rejections: rollbacks


def test_lookup_drafts_from_other_open_buffers(engines, sample_source):
    """A buffer that holds the continuation makes lookup propose it (source lookup:open)."""
    engine = engines["llama"]["random"]
    reference = engine.complete(CompletionRequest(text=sample_source[:3000], offset=3000, max_tokens=MAX_TOKENS,
                                                  stop_at_block_end=False, use_lookup=False,
                                                  use_draft_model=False))
    # Another open buffer contains exactly what the target will produce after this context.
    engine.open_document("file:///other.py", sample_source[2800:3000] + reference.text)
    try:
        result = engine.complete(CompletionRequest(uri="file:///lookup-open.py", text=sample_source[:3000],
                                                   offset=3000, max_tokens=MAX_TOKENS, stop_at_block_end=False,
                                                   use_draft_model=False))
    finally:
        engine.close_document("file:///other.py")
    assert_lossless(engine, result, MAX_TOKENS)
    assert result.token_ids == reference.token_ids
    assert result.sources["lookup:open"].accepted > 0


def test_token_trees_run_in_the_engine_and_stay_lossless(engines, sample_source):
    """The current document holds the cursor's last lines twice, the earlier copy followed by
    text the target will not write; another buffer holds them followed by what it will write.
    The planner verifies both sources' drafts in one forward (a token tree) and the output is the
    target's. (Which branch stands, token by token: tests/test_token_tree.py.)"""
    engine = engines["llama"]["random"]
    tail = sample_source[2900:3000]
    text = sample_source[:2700] + tail + "\n@@~~ decoy ~~@@\n" + sample_source[2700:3000]
    plain = dict(max_tokens=MAX_TOKENS, stop_at_block_end=False, use_draft_model=False)
    reference = engine.complete(CompletionRequest(text=text, offset=len(text), use_lookup=False, **plain))
    engine.open_document("file:///holds-the-answer.py", sample_source[2800:3000] + reference.text)
    try:
        result = engine.complete(CompletionRequest(uri="file:///tree.py", text=text, offset=len(text), **plain))
    finally:
        engine.close_document("file:///holds-the-answer.py")
    assert_lossless(engine, result, MAX_TOKENS)
    assert result.token_ids == reference.token_ids
    assert result.sources["tree"].steps > 0, result.sources
    assert result.sources["lookup:open"].accepted > 0


@pytest.mark.parametrize("mode", ["none", "lookup", "both"])
def test_a_keystrokes_new_tokens_ride_with_the_first_step(engines, sample_source, mode):
    """Where rows of logits are computed on demand (the lean forward on a CPU), a request whose
    prompt adds a few tokens to what the document's cache holds runs them with the first step's
    draft: one forward to the first token, no prefill forward. A prompt too long for that
    (a document's first) prefills first. Either way the output is the target's."""
    engine = engines["llama"]["random"]
    assert engine.caches is not None and engine.paths["target"][0].lazy_head
    uri, text = f"file:///keystroke-{mode}.py", sample_source[:3000]
    forwards_before = 0
    for typed in ("", "    def ", "    def total"):  # the first request: cold; then two keystrokes' worth
        request = CompletionRequest(uri=uri, text=text + typed, offset=len(text + typed), max_tokens=MAX_TOKENS,
                                    stop_at_block_end=False, **MODES[mode])
        result = engine.complete(request)
        assert_lossless(engine, result, MAX_TOKENS)
        state = engine.caches.get(uri)
        ran = state.target.forwards - forwards_before
        forwards_before = state.target.forwards
        if typed:
            assert 0 < result.prefill_computed <= 64
            assert ran == result.target_forwards, (ran, result.target_forwards)
        else:
            assert result.prefill_computed > 64 and ran == result.target_forwards + 1


def test_the_setting_off_verifies_chains_only(engines, sample_source):
    engine = engines["llama"]["random"]
    text = sample_source[:3000]
    request = dict(text=text, offset=len(text), max_tokens=MAX_TOKENS, stop_at_block_end=False, use_draft_model=False)
    engine.options.token_tree = False
    try:
        greedy = engine.complete(CompletionRequest(uri="file:///no-tree.py", **request))
    finally:
        engine.options.token_tree = True
    assert "tree" not in greedy.sources
    assert_lossless(engine, greedy, MAX_TOKENS)
    with_trees = engine.complete(CompletionRequest(uri="file:///trees.py", **request))
    assert with_trees.token_ids == greedy.token_ids
