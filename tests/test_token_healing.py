"""Token healing: the prompt ends a token before the cursor and the output re-types it first,
under a constraint that binds drafts and verification alike (so output stays lossless)."""

from __future__ import annotations

import pytest

from engine_helpers import assert_lossless, make_engine
from specd.engine import CompletionRequest
from specd.engine.front.boundaries import NO_BOUNDARIES
from specd.engine.speculation.healing import HealingVocabulary
from specd.engine.front.prompt import TEMPLATES, PromptBuilder
from tiny import make_tokenizer

FRESH_LINE = "class Stack:\n    def pop(self):\n        "  # the cursor after Enter + auto-indent


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return HealingVocabulary(tokenizer, len(tokenizer))


def token_id(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_allowed_tokens_retype_the_cut_text(tokenizer, vocabulary):
    rest = "\n        "
    allowed = set(vocabulary.allowed(rest).tolist())
    assert allowed
    for i in allowed:
        text = vocabulary.texts[i]
        assert text.startswith(rest) or rest.startswith(text)
    assert token_id(tokenizer, "\n       ") in allowed  # 7 spaces: a prefix, one space still to type
    assert token_id(tokenizer, " self") not in allowed
    assert not set(tokenizer.all_special_ids) & allowed  # no end-of-text before the cut text is back


@pytest.fixture(scope="module")
def demo_vocabulary():
    from transformers import AutoTokenizer

    from specd.demo import DEMO_DIR

    demo = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    return HealingVocabulary(demo, len(demo))


@pytest.mark.parametrize("which, rest", [("tiny", "\n        "), ("tiny", "    "), ("tiny", " "),
                                         ("demo", "        "), ("demo", "    "), ("demo", " ")])
def test_cut_whitespace_is_retyped_exactly_never_deepened(vocabulary, demo_vocabulary, which, rest):
    """A fresh line's indentation (or the space after a word) is the user's: no allowed token
    re-types it and goes on with more spaces or tabs, so a suggestion cannot start deeper than
    the cursor (the README's first completion did: 12 spaces where the editor put 8)."""
    vocabulary = vocabulary if which == "tiny" else demo_vocabulary
    deeper = [i for i, text in enumerate(vocabulary.texts)
              if text.startswith(rest) and len(text) > len(rest) and text[len(rest)] in " \t"]
    assert deeper, "the tokenizer has whitespace tokens longer than the cut text"  # so the check bites
    allowed = set(vocabulary.allowed(rest).tolist())
    assert allowed and not allowed & set(deeper)
    # The cut text itself and its pieces (7 spaces, then " return": how these tokenizers go on
    # to code) stay allowed.
    pieces = {i for i, text in enumerate(vocabulary.texts) if text and rest.startswith(text)}
    assert pieces and pieces <= allowed


def test_remaining_walks_the_constraint(tokenizer, vocabulary):
    seven, self_ = token_id(tokenizer, "\n       "), token_id(tokenizer, " self")
    assert vocabulary.remaining("\n        ", [seven]) == " "
    assert vocabulary.remaining("\n        ", [seven, self_]) == ""
    assert vocabulary.remaining("\n        ", [self_]) is None  # broke it


def test_allows_counts_the_draft_tokens_a_verify_could_accept(tokenizer, vocabulary):
    """A draft token the constraint masks can only be rejected: the decode loop cuts a point-mass
    or greedy draft before it (a narrower verify, the same output)."""
    from specd.engine.speculation.healing import HealingConstraint

    seven, self_ = token_id(tokenizer, "\n       "), token_id(tokenizer, " self")
    constraint = HealingConstraint(vocabulary, "\n        ")
    assert constraint.allows([], [seven, self_, self_]) == 3  # re-typed by the second: free after
    assert constraint.allows([], [self_, seven]) == 0
    assert constraint.allows([seven], [self_]) == 1
    assert constraint.allows([seven, self_], [seven]) == 1  # settled: nothing masked
    assert constraint.allows([], []) == 0


def test_mask_leaves_only_allowed_tokens_on_constrained_rows(tokenizer, vocabulary):
    import torch

    seven, self_ = token_id(tokenizer, "\n       "), token_id(tokenizer, " self")
    logits = torch.zeros(3, len(tokenizer))
    masked = vocabulary.mask(logits, "\n        ", [], [seven, self_])
    assert torch.isfinite(masked[0]).sum() == len(vocabulary.allowed("\n        "))
    assert torch.isfinite(masked[1]).sum() == len(vocabulary.allowed(" "))  # one space left after row 0's token
    assert torch.isfinite(masked[2]).all()  # re-typed: free
    assert torch.isfinite(logits).all()  # the forward's logits are never changed in place


def test_prompt_ends_a_token_before_the_cursor(tokenizer, vocabulary):
    psm = PromptBuilder(tokenizer, TEMPLATES["qwen"], 200, 100, layout="psm")
    psm.healing = vocabulary
    prompt = psm.build(FRESH_LINE, len(FRESH_LINE))
    full = tokenizer.encode(FRESH_LINE, add_special_tokens=False)
    assert prompt.healed == tokenizer.decode(full[-1:]) and FRESH_LINE.endswith(prompt.healed)
    middle = tokenizer.convert_tokens_to_ids("<|fim_suffix|>")
    assert prompt.ids[1:prompt.ids.index(middle)] == full[:-1]
    assert psm.build(FRESH_LINE, len(FRESH_LINE), heal=False).healed == ""

    anchored = PromptBuilder(tokenizer, TEMPLATES["qwen"], 200, 100)
    anchored.healing = vocabulary
    prompt = anchored.build(FRESH_LINE, len(FRESH_LINE))
    assert prompt.anchor == FRESH_LINE.rindex("\n") + 1
    assert prompt.healed == "        " and prompt.forced == 0  # the forced middle was only the indentation
    half_word = FRESH_LINE + "return self.ite"
    prompt = anchored.build(half_word, len(half_word))
    assert half_word.endswith(prompt.healed) and prompt.healed.strip()  # part of the half-typed word


@pytest.mark.parametrize("layout", ["anchored", "psm"])
def test_healed_completion_is_lossless_and_returns_what_follows_the_cursor(llama_pair, sample_source, layout):
    target, draft = llama_pair
    engine = make_engine(target, draft, fim_layout=layout)
    cursor = sample_source.index("    def low_stock")
    text = sample_source[:cursor] + "    def size(self):\n        " + sample_source[cursor:]
    offset = cursor + len("    def size(self):\n        ")
    result = engine.complete(CompletionRequest(uri="file:///heal.py", text=text, offset=offset, max_tokens=16,
                                               **NO_BOUNDARIES))
    assert result.healed and text[:offset].endswith(result.healed)
    generated = engine.pair.tokenizer.decode(result.token_ids)
    assert generated.startswith(result.healed)
    assert result.text == generated[len(result.healed):]
    assert_lossless(engine, result, 16)  # against generate() under the same constraint
    plain = engine.complete(CompletionRequest(uri="file:///heal.py", text=text, offset=offset, max_tokens=16,
                                              token_healing=False, **NO_BOUNDARIES))
    assert plain.healed == "" and len(plain.prompt_ids) == len(result.prompt_ids) + 1
    assert_lossless(engine, plain, 16)


def test_stop_rules_see_only_what_follows_the_cursor(tokenizer):
    """At column 0 the cut token is the newline itself: re-typing it is not a line break of the
    completion, and the re-typed text is not part of it."""
    from specd.engine.front.stops import StopRules

    ids = tokenizer.encode("\nfoo = 1\nbar = 2\n", add_special_tokens=False)
    def first_stop(rules):
        for n, token in enumerate(ids):
            if rules(token):
                return n
        return None

    stop = StopRules(tokenizer, set(), single_line=True, block_indent=None, healed="\n")
    at = first_stop(stop)
    assert at is not None and "bar" not in tokenizer.decode(ids[:at + 1])  # the second newline, not the first
    assert stop.text() == "foo = 1"
    unhealed = StopRules(tokenizer, set(), single_line=True, block_indent=None)
    assert first_stop(unhealed) == at
    assert unhealed.text() == "\nfoo = 1"  # without healing the newline would be part of the completion
