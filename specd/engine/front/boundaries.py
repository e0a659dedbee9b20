"""Suggestion boundaries as the engine applies them: the rules are ``specd.suggestion_rules``
(one copy, shared with specd-lsp), named here for the engine's code; what is the engine's own is
how a request's settings and the engine's options choose them.
"""

from __future__ import annotations

from specd.engine.options import resolve_request
from specd.suggestion_rules import (BLOCK_OPENERS, CLOSERS, MULTILINE_MODES, REPEAT_WINDOW, RULE_FUNCTIONS, RULES,
                                    TAB_WIDTH, BoundaryRules, Line, Surroundings, apply, block_end, boundary,
                                    current_line, expects_block, indent_width, lines_of, opens_block, repeated_line,
                                    suffix_line, surroundings)

__all__ = ["BLOCK_OPENERS", "CLOSERS", "MULTILINE_MODES", "NO_BOUNDARIES", "REPEAT_WINDOW", "RULE_FUNCTIONS", "RULES",
           "TAB_WIDTH", "BoundaryRules", "Line", "Surroundings", "apply", "block_end", "boundary", "current_line",
           "expects_block", "indent_width", "lines_of", "opens_block", "repeated_line", "rules_for", "suffix_line",
           "surroundings"]

# CompletionRequest settings with every boundary off: the model's text up to max_tokens (the
# bench compares that with other engines' output).
NO_BOUNDARIES = {"stop_at_block_end": False, "stop_at_repeated_line": False, "stop_at_suffix_line": False,
                 "multiline": "always"}


def rules_for(request, options) -> BoundaryRules:
    """A request's boundaries: its own settings, the engine's options (``engine.stop_at_*``,
    ``engine.multiline``) where it has none (``options.resolve_request``)."""
    return resolve_request(request, options).rules
