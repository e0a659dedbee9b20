"""Stop rules seen token by token: end-of-text / FIM tokens, single line, a line break of another
style than the document's, and the suggestion boundaries of ``boundaries`` (a repeated line, the
suffix's next line, the end of the block, one line where no block is expected), so generation
stops as soon as a boundary is known.

The completion's text is its tokens decoded in context (after a lead token, whose text is
dropped again), so a SentencePiece tokenizer's leading ``▁`` reads as the space it is instead of
being stripped as a text's implicit first space.
"""

from __future__ import annotations

import weakref

from specd.engine.front.boundaries import BoundaryRules, Surroundings, boundary
from specd.suggestion_rules import foreign_break

# Per tokenizer, whether each token's own text holds a line break, as decoded once: a decode
# call costs tens of microseconds, and the rules ask it of every token of every completion.
_BREAKS: "weakref.WeakKeyDictionary[object, dict[int, bool]]" = weakref.WeakKeyDictionary()


class StopRules:
    """Callable per new token; returns a stop reason or None. ``text()`` is the completion cut
    at the stop point (text rules can cut inside a token: the token stays in token_ids)."""

    def __init__(self, tokenizer, stop_ids: set[int], single_line: bool, block_indent: str | None,
                 healed: str = "", newline: str | None = "\n", *, rules: BoundaryRules | None = None,
                 around: Surroundings | None = None):
        """``rules`` and ``around`` (the cursor's surroundings) give the suggestion boundaries;
        without them only the end of the block applies, at ``block_indent`` (None: not at all)."""
        self.tokenizer = tokenizer
        # The document's line break: a break of another style ends the completion (None: none does).
        self.newline = newline
        if tokenizer is not None:
            lead = tokenizer.encode("x", add_special_tokens=False)
            self._lead = lead[-1:]  # decoded before the completion's tokens (see the module's docstring)
            self._lead_text = tokenizer.decode(self._lead, skip_special_tokens=False)
        self.healed = healed  # the tokens re-type this first (token healing): not part of the completion
        self.stop_ids = stop_ids
        self.single_line = single_line
        if rules is None:
            rules = BoundaryRules(repeated_line=False, suffix_line=False, block_end=bool(block_indent),
                                  multiline="always")
        self.rules = rules
        self.around = around if around is not None else Surroundings(line_prefix=block_indent or "")
        self._any_boundary = any(rules.enabled(rule) for rule in ("repeated_line", "suffix_line", "block_end",
                                                                   "current_line"))
        self.ids: list[int] = []
        self._cut: int | None = None

    def __call__(self, token: int) -> str | None:
        if token in self.stop_ids:
            return "eos"
        self.ids.append(token)
        text = None
        if self.newline is not None and self._breaks(token):
            text = self._after_cursor()
            cut = foreign_break(text, self.newline)
            if cut >= 0:
                self._cut = cut
                return "line_ending"
        if not self.single_line and not self._any_boundary:
            return None
        text = self._after_cursor() if text is None else text
        if self.single_line:
            content = len(text) - len(text.lstrip())
            newline = text.find("\n", content) if content < len(text) else -1
            if newline >= 0:
                self._cut = newline
                return "single_line"
        found = boundary(text, self.around, self.rules) if self._any_boundary else None
        if found is not None:
            self._cut, reason = found
            return reason
        return None

    def finish(self, reason: str) -> str:
        """The stop reason once generation has ended for ``reason``: a boundary that only the
        finished text shows (its last line, now complete) takes its place."""
        if self._cut is not None or not self._any_boundary or reason == "cancelled":
            return reason
        found = boundary(self._after_cursor(), self.around, self.rules, finished=True)
        if found is None:
            return reason
        self._cut, rule = found
        return rule

    def _breaks(self, token: int) -> bool:
        """Whether the token's own text holds a line break."""
        try:
            known = _BREAKS.setdefault(self.tokenizer, {})
        except TypeError:  # a tokenizer that takes no weak reference: decode every time
            known = {}
        found = known.get(token)
        if found is None:
            piece = self.tokenizer.decode([token], skip_special_tokens=False)
            found = known[token] = "\r" in piece or "\n" in piece
        return found

    def _after_cursor(self) -> str:
        text = self.tokenizer.decode(self._lead + self.ids, skip_special_tokens=False)
        text = text[len(self._lead_text):] if text.startswith(self._lead_text) else \
            self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if not self.healed:
            return text
        return text[len(self.healed):] if text.startswith(self.healed) else ""

    def text(self) -> str:
        text = self._after_cursor()
        return text if self._cut is None else text[: self._cut]
