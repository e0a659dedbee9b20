"""Stop rules seen token by token: end-of-text / FIM tokens, single line, end of block, and a line
break of another style than the document's.

The completion's text is its tokens decoded in context (after an anchor token, whose text is
dropped again), so a SentencePiece tokenizer's leading ``▁`` reads as the space it is instead of
being stripped as a text's implicit first space.
"""

from __future__ import annotations

from specd.engine.speculation.healing import foreign_break

TAB_WIDTH = 8


def indent_width(whitespace: str) -> int:
    return len(whitespace.expandtabs(TAB_WIDTH))


class StopRules:
    """Callable per new token; returns a stop reason or None. ``text()`` is the completion cut
    at the stop point (text rules can cut inside a token: the token stays in token_ids)."""

    def __init__(self, tokenizer, stop_ids: set[int], single_line: bool, block_indent: str | None,
                 healed: str = "", newline: str = "\n"):
        self.tokenizer = tokenizer
        self.newline = newline  # the document's line break: a break of another style ends the completion
        anchor = tokenizer.encode("x", add_special_tokens=False)
        self._anchor = anchor[-1:]  # decoded before the completion's tokens (see the module's docstring)
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)
        self.healed = healed  # the tokens re-type this first (token healing): not part of the completion
        self.stop_ids = stop_ids
        self.single_line = single_line
        # Block end: the first new line indented less than the cursor's line ends the block.
        self.block_width = indent_width(block_indent) if block_indent else None
        self.ids: list[int] = []
        self._cut: int | None = None

    def __call__(self, token: int) -> str | None:
        if token in self.stop_ids:
            return "eos"
        self.ids.append(token)
        text = None
        piece = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\r" in piece or "\n" in piece:
            text = self._after_cursor()
            cut = foreign_break(text, self.newline)
            if cut >= 0:
                self._cut = cut
                return "line_ending"
        if not self.single_line and self.block_width is None:
            return None
        text = self._after_cursor() if text is None else text
        if self.single_line:
            content = len(text) - len(text.lstrip())
            newline = text.find("\n", content) if content < len(text) else -1
            if newline >= 0:
                self._cut = newline
                return "single_line"
        if self.block_width is not None:
            cut = self._block_end(text)
            if cut is not None:
                self._cut = len(text[:cut].rstrip(" \t\n"))  # blank lines before the dedent go too
                return "block_end"
        return None

    def _block_end(self, text: str) -> int | None:
        newline = text.find("\n")
        while newline >= 0:
            line_start = newline + 1
            next_newline = text.find("\n", line_start)
            line = text[line_start: next_newline if next_newline >= 0 else len(text)]
            stripped = line.lstrip(" \t")
            if stripped:  # indentation known once the line has content
                if indent_width(line[: len(line) - len(stripped)]) < self.block_width:
                    return newline
            newline = next_newline
        return None

    def _after_cursor(self) -> str:
        text = self.tokenizer.decode(self._anchor + self.ids, skip_special_tokens=False)
        text = text[len(self._anchor_text):] if text.startswith(self._anchor_text) else \
            self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if not self.healed:
            return text
        return text[len(self.healed):] if text.startswith(self.healed) else ""

    def text(self) -> str:
        text = self._after_cursor()
        return text if self._cut is None else text[: self._cut]
