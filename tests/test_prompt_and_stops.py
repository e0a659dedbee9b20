"""FIM prompt building (families as data, token windows on a coarse grid) and stop rules."""

from __future__ import annotations

import pytest

from specd.engine.front.prompt import (ANCHOR_MAX_LINES, TEMPLATES, PromptBuilder, choose_anchor, detect_family,
                                 resolve_layout)
from specd.engine.caches import common_prefix
from specd.engine.front.stops import StopRules
from specd.engine.types import ContextChunk, EngineError
from tiny import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def special(tokenizer, name):
    return tokenizer.convert_tokens_to_ids(name)


def test_family_detection_from_vocabulary_and_override(tokenizer, tmp_path):
    assert detect_family(tokenizer).name == "qwen"
    assert detect_family(tokenizer, override="starcoder").name == "starcoder"
    (tmp_path / "specd.json").write_text('{"fim_family": "demo"}')
    assert detect_family(tokenizer, str(tmp_path)).name == "demo"
    with pytest.raises(EngineError, match="unknown FIM family"):
        detect_family(tokenizer, override="nope")


def test_codegemma_is_told_from_qwen_by_its_file_separator():
    """CodeGemma's vocabulary holds Qwen's FIM token strings too; its own separator decides, so
    its completions stop at "<|file_separator|>" instead of writing it out."""
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|file_separator|>"]})
    family = detect_family(tokenizer)
    assert family.name == "codegemma" and "<|file_separator|>" in family.stop_tokens
    assert resolve_layout(family) == "anchored" and family.bos


def test_every_family_has_prefix_and_suffix_slots():
    for template in TEMPLATES.values():
        assert "{prefix}" in template.psm
        if not template.name.startswith("plain"):  # no FIM: the prefix alone
            assert "{suffix}" in template.psm and template.stop_tokens


def test_psm_and_spm_layouts(tokenizer):
    text = "def f(x):\n    return x\n"
    cursor = text.index("return")
    psm = PromptBuilder(tokenizer, TEMPLATES["qwen"], 100, 100, layout="psm").build(text, cursor)
    spm = PromptBuilder(tokenizer, TEMPLATES["demo"], 100, 100).build(text, cursor)
    pre, suf, mid = (special(tokenizer, t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    assert psm.ids[0] == pre and psm.ids[-1] == mid and suf in psm.ids
    assert spm.ids[0] == suf and spm.ids[-1] == mid
    assert tokenizer.decode(spm.ids[1:spm.ids.index(pre)]) == text[cursor:]
    assert tokenizer.decode(spm.ids[spm.ids.index(pre) + 1:-1]) == text[:cursor]
    assert psm.indent == "    "


def test_layout_defaults_per_family():
    assert resolve_layout(TEMPLATES["demo"]) == "spm"  # trained suffix-first
    for name in ("qwen", "starcoder", "deepseek", "codellama"):
        assert resolve_layout(TEMPLATES[name]) == "anchored"
    # Prefix-last templates: typing only changes the prompt's tail already.
    assert resolve_layout(TEMPLATES["codestral"]) == "psm"
    assert resolve_layout(TEMPLATES["plain"], "anchored") == "psm"
    assert resolve_layout(TEMPLATES["demo"], "psm") == "psm"
    with pytest.raises(EngineError, match="no suffix-first"):
        resolve_layout(TEMPLATES["qwen"], "spm")
    with pytest.raises(EngineError, match="unknown FIM layout"):
        resolve_layout(TEMPLATES["qwen"], "middle-out")


def test_anchored_prompt_carries_the_typed_span_after_the_middle_token(tokenizer):
    text = "def f(x):\n    y = x + 1\n    return y\n"
    cursor = text.index("+ 1")
    builder = PromptBuilder(tokenizer, TEMPLATES["qwen"], 100, 100)
    assert builder.layout == "anchored"
    prompt = builder.build(text, cursor)
    mid = special(tokenizer, "<|fim_middle|>")
    line_start = text.index("    y")
    assert prompt.anchor == line_start
    after_middle = prompt.ids[prompt.ids.index(mid) + 1:]
    assert len(after_middle) == prompt.forced and tokenizer.decode(after_middle) == text[line_start:cursor]
    pre, suf = special(tokenizer, "<|fim_prefix|>"), special(tokenizer, "<|fim_suffix|>")
    assert tokenizer.decode(prompt.ids[1:prompt.ids.index(suf)]) == text[:line_start]
    assert tokenizer.decode(prompt.ids[prompt.ids.index(suf) + 1:prompt.ids.index(mid)]) == text[cursor:]
    assert prompt.ids[0] == pre


def test_anchor_stays_while_typing_and_moves_past_its_bound():
    text = "class A:\n    def f(self):\n        "
    first = choose_anchor(text, len(text), None)
    assert first == text.rindex("\n") + 1
    typed = text + "x = 1\n        y = 2\n        z"
    assert choose_anchor(typed, len(typed), first) == first  # two lines on: same anchor
    long = typed + "".join(f"\n        v{i} = {i}" for i in range(ANCHOR_MAX_LINES))
    assert choose_anchor(long, len(long), first) == long.rindex("\n") + 1
    assert choose_anchor(typed, first - 3, first) == typed.rindex("\n", 0, first - 3) + 1  # cursor went above
    assert choose_anchor(typed, len(typed), first + 2) == typed.rindex("\n") + 1  # not a line start


def test_typing_in_the_anchored_layout_only_changes_the_prompt_tail(tokenizer):
    """The point of the layout: each keystroke re-prefills only the typed span, where psm
    re-prefills the whole suffix window."""
    body = "".join(f"    total += values[{i}] * {i}\n" for i in range(60))
    before, after = "def f(values):\n    total = 0\n", body + "    return total\n"
    line = "    result = compute(total, values)"
    anchored = PromptBuilder(tokenizer, TEMPLATES["qwen"], 400, 300)
    psm = PromptBuilder(tokenizer, TEMPLATES["qwen"], 400, 300, layout="psm")
    anchor, previous = None, {"anchored": None, "psm": None}
    recomputed = {"anchored": 0, "psm": 0}
    for typed in range(1, len(line) + 1):
        text = before + line[:typed] + "\n" + after
        cursor = len(before) + typed
        for name, builder in (("anchored", anchored), ("psm", psm)):
            prompt = builder.build(text, cursor, previous_anchor=anchor if name == "anchored" else None)
            if name == "anchored":
                anchor = prompt.anchor
            if previous[name] is not None:
                recomputed[name] += len(prompt.ids) - common_prefix(previous[name], prompt.ids)
            previous[name] = prompt.ids
    assert anchor == len(before)
    assert recomputed["anchored"] * 10 < recomputed["psm"]
    assert recomputed["anchored"] <= 3 * len(line)


TYPED_BEFORE = "".join(f"def f{i}(values):\n    return values[{i}] * {i}\n\n" for i in range(80))
TYPED_AFTER = "\n\ndef tail():\n    pass\n"
TYPED_LINE = "    result = compute(total, values)"


def typing_line(tokenizer, build):
    """Types ``TYPED_LINE`` between ``TYPED_BEFORE`` and ``TYPED_AFTER`` one character at a time:
    yields (characters typed, text, cursor, the prompt ``build(text, cursor)`` gave, the lengths
    of the texts the tokenizer's offsets pass (``__call__``) read while building it)."""
    real_call = type(tokenizer).__call__
    for typed in range(1, len(TYPED_LINE) + 1):
        text = TYPED_BEFORE + TYPED_LINE[:typed] + TYPED_AFTER
        cursor = len(TYPED_BEFORE) + typed
        calls: list[int] = []

        def counting(self, text, *args, **kwargs):
            calls.append(len(text))
            return real_call(self, text, *args, **kwargs)

        type(tokenizer).__call__ = counting
        try:
            prompt = build(text, cursor)
        finally:
            type(tokenizer).__call__ = real_call
        yield typed, text, cursor, prompt, calls


def test_typing_at_a_fixed_anchor_reuses_the_prefix_window_and_builds_the_same_prompt(tokenizer):
    """Keystrokes after a fixed anchor find their prefix window in the builder's memo (no
    tokenization of the prefix) and get exactly the prompt a fresh builder builds."""
    builder = PromptBuilder(tokenizer, TEMPLATES["qwen"], 300, 100)
    anchor = None
    for typed, text, cursor, prompt, calls in typing_line(
            tokenizer, lambda text, cursor: builder.build(text, cursor, previous_anchor=anchor)):
        fresh = PromptBuilder(tokenizer, TEMPLATES["qwen"], 300, 100).build(text, cursor, previous_anchor=anchor)
        assert prompt.ids == fresh.ids and prompt.anchor == fresh.anchor == len(TYPED_BEFORE)
        assert (len(calls) == 0) == (typed > 1), (typed, calls)  # the window is tokenized once, at the first keystroke
        anchor = prompt.anchor


def test_typing_where_the_prefix_ends_at_the_cursor_keeps_the_window_start_and_builds_the_same_prompt(tokenizer):
    """Prefix-last prompts (psm, the prefix-only families) change with every keystroke; typing on
    the cursor's line reuses the window's start chosen for the text above it (no pass with
    offsets), and each prompt is exactly the one a fresh builder builds."""
    builder = PromptBuilder(tokenizer, TEMPLATES["plain"], 300, 0)
    passes = 0
    for _, text, cursor, prompt, calls in typing_line(tokenizer, builder.build):
        fresh = PromptBuilder(tokenizer, TEMPLATES["plain"], 300, 0).build(text, cursor)
        assert prompt.ids == fresh.ids and prompt.prefix_start == fresh.prefix_start
        # A pass with offsets only where the window outgrew the budget (the start moves on, or
        # the last grid stretch alone is over it and the tokens nearest the cursor are taken).
        passes += bool(calls)
    assert 1 <= passes <= 3, passes  # of 35 keystrokes


def test_windows_are_fitted_in_tokens(tokenizer):
    text = "".join(f"line_{i} = {i} * 2\n" for i in range(400))
    cursor = len(text) // 2
    builder = PromptBuilder(tokenizer, TEMPLATES["demo"], prefix_tokens=300, suffix_tokens=80)
    prompt = builder.build(text, cursor)
    prefix_ids = builder.encode(text[prompt.prefix_start:cursor])
    suffix_ids = builder.encode(text[cursor:prompt.suffix_end])
    assert len(prefix_ids) <= 300 and len(suffix_ids) <= 80
    assert len(prompt.ids) == len(prefix_ids) + len(suffix_ids) + 3
    assert prompt.prefix_start == 0 or text[prompt.prefix_start - 1] == "\n"


def test_window_start_moves_in_coarse_steps(tokenizer):
    text = "".join(f"value_{i} = compute({i})\n" for i in range(300))
    builder = PromptBuilder(tokenizer, TEMPLATES["demo"], prefix_tokens=600, suffix_tokens=50)
    starts = {builder.build(text, cursor).prefix_start for cursor in range(len(text) // 2, len(text) // 2 + 200, 3)}
    assert len(starts) <= 2  # typing 200 characters moves the window start at most once


def test_a_window_cut_inside_its_last_lines_keeps_its_start_while_typing(tokenizer):
    """A narrow window's budget is often less than its last few lines: its start still moves in
    steps of a quarter of the budget, not a token per keystroke, so a keystroke reuses the
    window's cache; every window fits the budget and is the one a fresh builder picks."""
    before = "".join(f"def f{i}(values):\n    return values[{i}] * {i}\n\n" for i in range(40))
    line = "    result = compute_the_total(values, weights, offsets, scale=2.0, shift=-1.5)"
    builder = PromptBuilder(tokenizer, TEMPLATES["plain"], 48, 0).narrowed(48)
    starts, ids_before = [], None
    recomputed = 0
    for typed in range(1, len(line) + 1):
        text = before + line[:typed] + "\n"
        prompt = builder.build(text, len(before) + typed)
        fresh = PromptBuilder(tokenizer, TEMPLATES["plain"], 48, 0).narrowed(48).build(text, len(before) + typed)
        assert prompt.ids == fresh.ids and prompt.prefix_start == fresh.prefix_start
        assert len(prompt.ids) <= 48
        assert text.startswith(tokenizer.decode(prompt.ids), prompt.prefix_start)
        starts.append(prompt.prefix_start)
        if ids_before is not None:
            recomputed += len(prompt.ids) - common_prefix(ids_before, prompt.ids)
        ids_before = prompt.ids
    typed_tokens = len(tokenizer.encode(line))
    assert len(set(starts)) <= typed_tokens // (48 // 4) + 2, starts  # a move per quarter budget typed, not per key
    assert recomputed < 4 * typed_tokens  # a token per key, and the window again at each move: not the window per key


def test_cursor_out_of_range_is_an_engine_error(tokenizer):
    builder = PromptBuilder(tokenizer, TEMPLATES["qwen"], 100, 100)
    with pytest.raises(EngineError, match="out of range"):
        builder.build("abc", 4)


def test_repo_level_context_chunks_come_first(tokenizer):
    builder = PromptBuilder(tokenizer, TEMPLATES["qwen"], 100, 100)
    prompt = builder.build("x = 1\n", 6, [ContextChunk("util.py", "def helper():\n    pass\n")], path="main.py")
    assert prompt.ids[0] == special(tokenizer, "<|repo_name|>")
    assert prompt.ids.count(special(tokenizer, "<|file_sep|>")) == 2
    assert prompt.chunks_used == ["util.py"]


def stop_on(tokenizer, text, **kw):
    rules = StopRules(tokenizer, {special(tokenizer, "<|endoftext|>")}, kw.get("single_line", False),
                      kw.get("indent"))
    for token in tokenizer.encode(text):
        reason = rules(token)
        if reason:
            return reason, rules.text()
    return None, rules.text()


def test_single_line_stops_at_the_first_newline_after_content(tokenizer):
    assert stop_on(tokenizer, "return x\n    y = 2", single_line=True) == ("single_line", "return x")
    assert stop_on(tokenizer, "\n    return x\nz", single_line=True) == ("single_line", "\n    return x")


def test_block_end_stops_at_a_less_indented_line(tokenizer):
    body = "total = 0\n        for v in values:\n            total += v\n        return total\n\ndef other():"
    reason, text = stop_on(tokenizer, body, indent="        ")
    assert reason == "block_end"
    assert text == "total = 0\n        for v in values:\n            total += v\n        return total\n"[:-1]


def test_eos_stops_without_adding_text(tokenizer):
    rules = StopRules(tokenizer, {special(tokenizer, "<|endoftext|>")}, False, None)
    for token in tokenizer.encode("abc"):
        assert rules(token) is None
    assert rules(special(tokenizer, "<|endoftext|>")) == "eos"
    assert rules.text() == "abc"
