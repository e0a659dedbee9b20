"""Method names and the protocol version, defined once for the daemon, the client and the LSP."""

from __future__ import annotations

from enum import Enum

# Bumped when a method changes incompatibly; adding methods or optional fields does not bump it.
PROTOCOL_VERSION = 1


class Method(str, Enum):
    HELLO = "hello"
    OPEN = "open"
    CHANGE = "change"
    CLOSE = "close"
    COMPLETE = "complete"
    CANCEL = "cancel"
    STATUS = "status"
    SHUTDOWN = "shutdown"
    WORKSPACE = "workspace"
    FOCUS = "focus"


# Notification the daemon sends when it cannot tie an error to a request (undecodable bytes,
# a message with no readable msgid, a refused connection): params [{"code", "message"}].
ERROR_NOTIFICATION = "specd/error"

# Notification the daemon sends while a ``complete`` asked with ``stream`` runs, each time a line
# of it is settled: params [{"msgid", "text", "tail", "tokens"}]: ``text`` is the completion's
# settled lines (up to its last line break, which is left out), ``tail`` what follows so far
# (it may still change), ``tokens`` the tokens generated. The result comes as usual after the
# last one; each ``text`` is a prefix of the result's text.
PROGRESS_NOTIFICATION = "progress"

# specd-lsp's custom LSP names, shared with the editor plugins' code and docs: the status
# request/notification, and the command each inline item carries to report an accept.
LSP_STATUS_METHOD = "specd/status"
LSP_ACCEPTED_COMMAND = "specd.accepted"
# specd-lsp's notification that the item it last answered for a document grew (more of a
# streamed completion arrived after the first line was shown): params {"uri", "version",
# "position"} (the request's; position in the negotiated encoding). A plugin asks again there
# and gets the longer item from specd-lsp's cache, with no model work.
LSP_SUGGESTION_GREW_METHOD = "specd/suggestionGrew"
# The editor plugins' notification to specd-lsp that the cursor came to rest in an open document
# (it was opened, or the cursor jumped there): params {"textDocument": {"uri"}, "position"}
# (position in the negotiated encoding). specd-lsp passes it on as the socket's ``focus``; the
# daemon prefills, in idle time, the prompt a completion there would need, so the first
# keystroke's suggestion does not wait for it.
LSP_FOCUS_NOTIFICATION = "specd/didFocus"

# Position encodings a cursor or edit range may use for its ``character`` field, named as in
# LSP's positionEncoding: utf-32 counts code points, utf-16 counts UTF-16 code units (LSP's
# default), utf-8 counts bytes (Neovim's column).
POSITION_ENCODINGS = ("utf-32", "utf-16", "utf-8")

# Shapes of the error slot a client may ask for in hello ("errors"): "map" is {code, message,
# data?} (the default); "string" is "code: message", because Neovim's rpcrequest shows a string
# error but reports any map as "unknown error".
ERROR_FORMATS = ("map", "string")

CAPABILITIES = (
    "buffers",  # open/change/close with versions
    "ranged_edits",
    "cancel",
    "supersede",  # a new complete for a document cancels its in-flight one
    "stateless_complete",  # complete with text= and no open document
    "extra_context",
    "workspace",  # watched folders feed lookup drafting and repo-level context
)
