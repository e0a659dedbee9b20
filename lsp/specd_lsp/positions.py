"""LSP positions: the shared conversions (``specd.protocol.positions``) plus encoding
negotiation. Out-of-range input is clamped, never an error (see the shared module)."""

from __future__ import annotations

from specd.protocol.positions import (  # noqa: F401  (re-exported for the LSP modules)
    DEFAULT_ENCODING,
    ENCODINGS,
    LINE_BREAK,
    Encoding,
    TextIndex,
    chars_for_units,
    offset_at,
    position_at,
    units,
)


def negotiate(offered: list[str] | None) -> Encoding:
    """The client's most preferred encoding we support; UTF-16 when it offers none we know."""
    for encoding in offered or ():
        if encoding in ENCODINGS:
            return encoding  # type: ignore[return-value]
    return DEFAULT_ENCODING
