"""A first line shown while it is being written (``completion.partial_line``): cut back to its
last whole word part, held back while the line could still become one the suggestion rules cut the
whole suggestion at (the suffix's next line, the cursor's line repeated, the text after the
cursor re-typed), and, in a stream (``StreamedCompletion``), once shown only ever grown."""

from __future__ import annotations

import pytest

from specd.suggestion_rules import repeated_line
from specd_lsp.completion import context_at, partial_line, postprocess
from specd_lsp.streams import StreamedCompletion


def _partial(document: str, written: str, **kw) -> str:
    """``partial_line`` at the ``|`` in ``document``."""
    offset = document.index("|")
    return partial_line(written, context_at(document.replace("|", "", 1), offset), **kw)


BODY = "def f(a, b):\n    |\n    return a\n"


@pytest.mark.parametrize("written, shown", [
    ("total = a", "total = "),  # `a` may go on (`abs(...)`): up to the whole word parts
    ("total = a +", "total = a +"),
    ("total = compute(", "total = compute("),
    ("total", ""),  # one part still being written: nothing yet
    ("console_screen_buf", "console_screen_"),  # a long identifier, part by part
    ("self.get_consoleScr", "self.get_console"),
    ("getConsole", "get"),  # `Console` may go on (`Consoles`)
    ("XMLPar", ""),  # capitals after capitals do not split
    ("x2 = y1", "x2 = "),
    ("  ", ""),
])
def test_a_partial_line_ends_after_its_last_whole_word_part(written, shown):
    assert _partial(BODY, written) == shown


@pytest.mark.parametrize("document, written, completed", [
    # the suffix's next line, reached from the cursor's line
    ("def f(a, b):\n    ret|\n    return a\n", "urn a", "urn a"),
    ("def f(a, b):\n    |\n\n    return a + b\n", "return a +", "return a + b"),
    # the cursor's line repeated
    ("def f(a, b):\n    total = a|\n    return a\n", "\n    total = ", "\n    total = a"),
    # only the rest of the cursor's line re-typed
    ("def f(a, b):\n    g(|a, b)\n", "a, ", "a, b"),
])
def test_a_partial_the_completed_line_could_withdraw_is_held_back(document, written, completed):
    offset = document.index("|")
    ctx = context_at(document.replace("|", "", 1), offset)
    # the rules cut the completed line to nothing: specd-lsp's post-processing, or the engine's
    # repeated-line rule (the daemon's result is cut there)
    assert postprocess(completed, ctx) is None or repeated_line(completed, ctx.around, True) == 0
    assert _partial(document, written) == ""


def test_a_held_back_partial_would_otherwise_show():
    """Where post-processing alone would show the partial, and the line it completes into
    shows nothing: the hold-back is what keeps it off the screen."""
    for document, written in [("def f(a, b):\n    ret|\n    return a\n", "urn a"),
                              ("def f(a, b):\n    total = a|\n    return a\n", "\n    total = ")]:
        offset = document.index("|")
        ctx = context_at(document.replace("|", "", 1), offset)
        cut = written.rstrip("a")  # the word cut
        assert postprocess(cut, ctx) is not None, written
        assert _partial(document, written) == ""


def test_a_line_looping_within_itself_is_not_shown():
    looping = "DB_CORE" + "_DEBUG_ON" * 6 + "_DEB"
    assert _partial(BODY, looping) == ""  # the engine drops the line (repeated_line): nothing to grow from
    assert _partial(BODY, looping[:20]) == "DB_CORE_DEBUG_ON_"  # before it loops, a partial like any other


def test_a_partial_that_cannot_become_the_next_line_is_shown():
    document = "def f(a, b):\n    |\n\n    return a + b\n"
    assert _partial(document, "total = a +") == "total = a +"
    assert _partial(document, "retval = a") == "retval = "  # `retval...` can never be `return a + b`
    assert _partial("def f(a, b):\n    ret|\n    return a\n", "urn b") == "urn "


def test_a_settled_line_is_not_a_partial_and_single_line_keeps_the_first():
    assert _partial(BODY, "total = 1\n    y") == ""
    assert _partial("def f(a, b):\n    x = 1|\n", "\n    total = a +", single_line=True) == ""


def _note(text: str, tail: str) -> dict:
    return {"text": text, "tail": tail}


def test_a_streamed_partial_once_shown_only_grows_then_the_settled_lines_follow():
    document = BODY.replace("|", "")
    offset = BODY.index("|")
    ctx = context_at(document, offset)
    stream = StreamedCompletion("file:///f.py", document, offset, partial_of=lambda w: partial_line(w, ctx))
    stream.progress(_note("", "total"))
    assert stream.partial == ""  # nothing to show yet (at the time budget, what there is)
    assert stream.shown_raw == "total"
    stream.progress(_note("", "total = a"))
    assert stream.partial == "total = "
    stream.show_partial()
    assert stream.shown_raw == "total = "
    assert not stream.progress(_note("", "total = abs"))  # still inside a word: no growth
    assert stream.progress(_note("", "total = abs(a) +"))
    assert stream.shown_raw == "total = abs(a) +"
    assert stream.progress(_note("total = abs(a) + b", "\n    "))  # the line settled
    assert stream.shown_raw == "total = abs(a) + b"
    assert stream.finish("total = abs(a) + b\n    return total")
    assert stream.shown_raw == "total = abs(a) + b\n    return total"


def test_without_partials_a_stream_shows_only_settled_lines():
    stream = StreamedCompletion("file:///f.py", BODY.replace("|", ""), BODY.index("|"))
    stream.progress(_note("", "total = a +"))
    assert stream.partial == ""
    stream.show_partial()
    assert not stream.showing_partial and stream.shown_raw == "total = a +"  # the time budget's answer
