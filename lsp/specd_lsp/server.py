"""specd-lsp: the per-editor LSP front end (pygls 2.x on stdio).

Handlers are thin: they take the document, call the completer (completer.py), the document
store (documents.py) or the daemon link (daemon_link.py), and convert to ``types.*``.
Positions are converted here, at the edge, in the negotiated encoding (positions.py).

Logs go to stderr (and a file when configured), never to stdout: stdout is the protocol.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from lsprotocol import types
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from specd import __version__
from specd.config import unknown_environment
from specd.protocol.methods import (
    LSP_ACCEPTED_COMMAND,
    LSP_FOCUS_NOTIFICATION,
    LSP_STATUS_METHOD,
    LSP_SUGGESTION_GREW_METHOD,
)

from specd_lsp.completer import Completer
from specd_lsp.daemon_link import READY, UNAVAILABLE, DaemonLink, LinkEvent
from specd_lsp.documents import Document, DocumentStore
from specd_lsp.options import Settings, parse_settings, problems_message, to_dict
from specd_lsp.positions import DEFAULT_ENCODING, TextIndex
from specd_lsp.proposals import AUTOMATIC, INVOKED, CompletionQuery, Proposal, Selected
from specd_lsp.stdio import READ_TIMEOUT_S, run_stdio

log = logging.getLogger("specd_lsp")

# Custom protocol names, defined once; clients and plugins use the same strings.
STATUS_METHOD = LSP_STATUS_METHOD  # request (full status) and notification (on changes)
ACCEPTED_COMMAND = LSP_ACCEPTED_COMMAND  # each item's command: the editor inserted proposal <id>
GREW_METHOD = LSP_SUGGESTION_GREW_METHOD  # notification: the last item shown there grew; ask again
FOCUS_METHOD = LSP_FOCUS_NOTIFICATION  # from the editor plugins: the cursor came to rest there
STATUS_NOTIFY_INTERVAL_S = 0.5  # at most this often after completions; state changes go at once
LABEL_CHARS = 80


class SpecdProtocol(LanguageServerProtocol):
    """pygls's protocol without its own copy of each document's text.

    specd-lsp keeps the documents itself (``documents.py``: one pass over a didChange's changes,
    the line index carried through), and nothing reads pygls's copy. pygls applies each content
    change by rebuilding the whole text, so a "replace all" of 1,000 changes on a large file
    cost 1,000 times its size before any handler ran. These three replace pygls's built-in
    handlers (found by their ``lsp_method`` name) and only hand the notification on.
    """

    def _hand_on(self, method: str, params: Any) -> Any:
        if (user_handler := self.fm.features.get(method)) is not None:
            yield user_handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams) -> Any:
        yield from self._hand_on(types.TEXT_DOCUMENT_DID_OPEN, params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams) -> Any:
        yield from self._hand_on(types.TEXT_DOCUMENT_DID_CHANGE, params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams) -> Any:
        yield from self._hand_on(types.TEXT_DOCUMENT_DID_CLOSE, params)


class SpecdLanguageServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("specd-lsp", __version__, text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
                         protocol_cls=SpecdProtocol)
        self.settings = Settings()
        self.init_settings = Settings()
        self.encoding = DEFAULT_ENCODING
        self.documents = DocumentStore()
        self.link = DaemonLink(self.documents, lambda: self.settings.daemon, self._link_changed)
        self.completer = Completer(self.documents, self.link, lambda: self.settings, self._completed,
                                   self._completion_failed, self._suggestion_grew)
        self._pending_problems: list[str] = []
        self._told_unavailable = False
        self._last_status_sent = 0.0

    # -- settings --------------------------------------------------------------------------

    def apply_settings(self, raw: Any, base: Settings) -> None:
        self.settings, problems = parse_settings(raw, base)
        self.completer.cache.size = self.settings.cache.size
        if self.settings.log != base.log:  # the editor asked for other logging than the command line's
            configure_logging(self.settings.log.level, self.settings.log.file)
        if problems:
            log.warning("%s", problems_message(problems))
            self._pending_problems = problems

    def tell_problems(self) -> None:
        if self._pending_problems:
            self.window_show_message(types.ShowMessageParams(types.MessageType.Warning,
                                                             problems_message(self._pending_problems)))
            self._pending_problems = []

    def tell_environment(self) -> None:
        """SPECD_* variables that name no config key: specd's config skips them (the daemon this
        server starts too); say so once, so a typo does not pass unnoticed."""
        unknown = unknown_environment()
        for line in unknown:
            log.warning("%s", line)
        if unknown:
            self.window_show_message(types.ShowMessageParams(types.MessageType.Warning, "specd: " + "; ".join(unknown)))

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        link = self.link
        daemon = {**link.hello, **link.daemon_status}
        return {
            "state": link.state,
            "message": link.reason,
            "enabled": self.settings.enable,
            "positionEncoding": self.encoding,
            "documents": len(self.documents),
            "daemon": {
                "pid": daemon.get("pid"),
                "version": daemon.get("version"),
                "state": daemon.get("state"),
                "models": daemon.get("models"),
                "latencyMs": daemon.get("latency_ms"),
                "acceptance": daemon.get("acceptance"),
                "connects": link.connects,
            },
            **self.completer.stats.to_dict(),
        }

    def notify_status(self) -> None:
        self._last_status_sent = time.monotonic()
        self.protocol.notify(STATUS_METHOD, self.status())

    def _link_changed(self, event: LinkEvent) -> None:
        if event.state == READY:
            self._told_unavailable = False
        elif event.state == UNAVAILABLE and not self._told_unavailable:
            self._told_unavailable = True  # once per outage; the status notification carries updates
            self.window_show_message(types.ShowMessageParams(
                types.MessageType.Warning, f"specd: completions unavailable: {event.reason}"))
        self.notify_status()

    def _completed(self) -> None:
        if time.monotonic() - self._last_status_sent >= STATUS_NOTIFY_INTERVAL_S:
            self.notify_status()

    def _suggestion_grew(self, uri: str, version: int, offset: int) -> None:
        doc = self.documents.get(uri)
        if doc is None:
            return
        line, character = doc.index.position(offset, self.encoding)
        self.protocol.notify(GREW_METHOD, {"uri": uri, "version": version,
                                           "position": {"line": line, "character": character}})

    def _completion_failed(self, message: str) -> None:
        """A completion failed in a way the user should hear of (the completer says when: once
        per distinct message until a completion works again)."""
        self.window_show_message(types.ShowMessageParams(types.MessageType.Error, f"specd: completion failed: {message}"))
        self.notify_status()  # carries lastError

    # -- conversions -----------------------------------------------------------------------

    def lsp_range(self, index: TextIndex, start: int, end: int) -> types.Range:
        return types.Range(types.Position(*index.position(start, self.encoding)),
                           types.Position(*index.position(end, self.encoding)))

    def offset(self, doc: Document, position: types.Position) -> int:
        return doc.offset(position.line, position.character, self.encoding)

    def query(self, doc: Document, position: types.Position, trigger: str,
              selected: types.SelectedCompletionInfo | None = None) -> CompletionQuery:
        chosen = None
        if selected is not None:
            chosen = Selected(self.offset(doc, selected.range.start), self.offset(doc, selected.range.end), selected.text)
        return CompletionQuery(doc.uri, self.offset(doc, position), trigger, chosen)

    def accept_command(self, proposal: Proposal) -> types.Command:
        return types.Command(title="specd: accepted", command=ACCEPTED_COMMAND, arguments=[proposal.id])

    def inline_items(self, proposals: list[Proposal]) -> list[types.InlineCompletionItem]:
        index = _index_for(self.documents, proposals)
        return [
            types.InlineCompletionItem(insert_text=p.insert_text, range=self.lsp_range(index, p.start, p.end),
                                       command=self.accept_command(p))
            for p in proposals
        ]

    def completion_items(self, proposals: list[Proposal]) -> list[types.CompletionItem]:
        index = _index_for(self.documents, proposals)
        return [
            types.CompletionItem(
                label=_label(p.insert_text),
                kind=types.CompletionItemKind.Text,
                detail="specd completion",
                label_details=types.CompletionItemLabelDetails(description="specd"),
                text_edit=types.TextEdit(self.lsp_range(index, p.start, p.end), p.insert_text),
                insert_text_format=types.InsertTextFormat.PlainText,
                filter_text=_line_before(index, p.start) + p.insert_text,
                sort_text="0",
                preselect=True,
                command=self.accept_command(p),
            )
            for p in proposals
        ]


def _index_for(documents: DocumentStore, proposals: list[Proposal]) -> TextIndex:
    if not proposals:
        return TextIndex("")
    doc = documents.get(proposals[0].uri)
    return doc.index if doc is not None and doc.text is proposals[0].text else TextIndex(proposals[0].text)


def _line_before(index: TextIndex, offset: int) -> str:
    line, _ = index.position(offset, "utf-32")
    return index.text[index.line_start(line):offset]


def _label(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    label = lines[0] if lines else text.strip()
    if len(lines) > 1:
        label += " …"
    return label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "…"


server = SpecdLanguageServer()


# -- lifecycle ---------------------------------------------------------------------------------


@server.feature(types.INITIALIZE)
def initialize(ls: SpecdLanguageServer, params: types.InitializeParams) -> None:
    ls.apply_settings(params.initialization_options, Settings())
    ls.init_settings = ls.settings
    encoding = ls.workspace.position_encoding
    ls.encoding = getattr(encoding, "value", encoding) or DEFAULT_ENCODING
    has_inline = params.capabilities.text_document is not None and \
        params.capabilities.text_document.inline_completion is not None
    fallback = ls.settings.completion_fallback
    if fallback == "always" or (fallback == "auto" and not has_inline):
        ls.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(resolve_provider=False))(completion)
    ls.link.set_folders(workspace_folders(ls))  # sent once the link connects
    log.info("initialized: encoding %s, inline completion %s, completion fallback %s",
             ls.encoding, has_inline, fallback)


@server.feature(types.INITIALIZED)
def initialized(ls: SpecdLanguageServer, params: types.InitializedParams) -> None:
    ls.tell_problems()
    ls.tell_environment()
    ls.link.start()


@server.feature(types.SHUTDOWN)
async def shutdown(ls: SpecdLanguageServer, params: None) -> None:
    await ls.link.close()


@server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
async def did_change_configuration(ls: SpecdLanguageServer, params: types.DidChangeConfigurationParams) -> None:
    raw = params.settings
    if not raw and _can_pull_configuration(ls):
        answer = await ls.workspace_configuration_async(
            types.ConfigurationParams(items=[types.ConfigurationItem(section="specd")]))
        raw = answer[0] if answer else None
    if raw:
        ls.apply_settings(raw, ls.init_settings)
        ls.tell_problems()
        ls.notify_status()


@server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)
def did_change_workspace_folders(ls: SpecdLanguageServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
    ls.link.set_folders(workspace_folders(ls))  # pygls has applied the change to ls.workspace


def workspace_folders(ls: SpecdLanguageServer) -> list[str]:
    """The workspace's folders (``rootUri`` when the client sent no folders), local files only."""
    workspace = ls.workspace
    uris = [folder.uri for folder in workspace.folders.values()] or [workspace.root_uri or ""]
    return [uri for uri in uris if uri.startswith("file://")]


def _can_pull_configuration(ls: SpecdLanguageServer) -> bool:
    workspace = ls.client_capabilities.workspace
    return bool(workspace is not None and workspace.configuration)


# -- documents ---------------------------------------------------------------------------------


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: SpecdLanguageServer, params: types.DidOpenTextDocumentParams) -> None:
    item = params.text_document
    ls.link.open(ls.documents.open(item.uri, item.text, item.version, item.language_id))


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: SpecdLanguageServer, params: types.DidChangeTextDocumentParams) -> None:
    doc = ls.documents.get(params.text_document.uri)
    if doc is None:
        log.warning("change for %s, which was never opened", params.text_document.uri)
        return
    edits = [doc.apply(change, ls.encoding) for change in params.content_changes]
    doc.version = params.text_document.version
    ls.link.change(doc, edits)


@server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: SpecdLanguageServer, params: types.DidCloseTextDocumentParams) -> None:
    if ls.documents.close(params.text_document.uri) is not None:
        ls.link.close_document(params.text_document.uri)
        ls.completer.forget(params.text_document.uri)


@server.feature(FOCUS_METHOD)
def did_focus(ls: SpecdLanguageServer, params: Any) -> None:
    """The editor plugins' cursor hint: the daemon prefills the prompt a completion there would
    need while the user reads, so the first suggestion in a file just opened does not wait for it."""
    hint = _focus_hint(params)
    doc = ls.documents.get(hint[0]) if hint is not None else None
    if doc is None:
        log.debug("focus ignored: %r", params)
        return
    offset = doc.offset(hint[1], hint[2], ls.encoding)
    ls.link.focus(doc.uri, *doc.index.position(offset, "utf-32"))


def _focus_hint(params: Any) -> tuple[str, int, int] | None:
    """(uri, line, character) of ``{"textDocument": {"uri"}, "position": {"line", "character"}}``;
    None for any other shape (the notification is the plugins' own, never worth an error)."""
    uri = _field(_field(params, "textDocument"), "uri")
    position = _field(params, "position")
    line, character = _field(position, "line"), _field(position, "character")
    if not isinstance(uri, str) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                           for n in (line, character)):
        return None
    return uri, line, character


def _field(obj: Any, name: str) -> Any:
    """A custom message's field: pygls hands its params on as attribute objects."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


# -- completions -------------------------------------------------------------------------------


@server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
async def inline_completion(ls: SpecdLanguageServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
    doc = ls.documents.get(params.text_document.uri)
    if doc is None:
        return types.InlineCompletionList(items=[])
    invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
    query = ls.query(doc, params.position, INVOKED if invoked else AUTOMATIC, params.context.selected_completion_info)
    return types.InlineCompletionList(items=ls.inline_items(await ls.completer.propose(query)))


async def completion(ls: SpecdLanguageServer, params: types.CompletionParams) -> types.CompletionList:
    """The fallback for clients without inline completion: one item carrying the suggestion."""
    doc = ls.documents.get(params.text_document.uri)
    if doc is None:
        return types.CompletionList(is_incomplete=True, items=[])
    invoked = params.context is not None and params.context.trigger_kind == types.CompletionTriggerKind.Invoked
    proposals = await ls.completer.propose(ls.query(doc, params.position, INVOKED if invoked else AUTOMATIC))
    return types.CompletionList(is_incomplete=True, items=ls.completion_items(proposals[:1]))


@server.command(ACCEPTED_COMMAND)
def accepted(ls: SpecdLanguageServer, *args: Any) -> None:
    """The item's command: [id] after the whole item went in; [id, {"partialChars": n}] after a
    word or line of it (editor plugins send that themselves; LSP has no partial-accept message)."""
    proposal_id = args[0] if args else None
    if isinstance(proposal_id, dict):
        proposal_id = proposal_id.get("id")
    extra = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
    partial = extra.get("partialChars")
    if isinstance(partial, int) and not isinstance(partial, bool):
        found = ls.completer.partially_accepted(str(proposal_id), partial)
    else:
        found = ls.completer.accepted(str(proposal_id))
    if found is None:
        log.debug("accept of an unknown or already accepted proposal %r", proposal_id)
    ls.notify_status()


@server.feature(STATUS_METHOD)
async def status(ls: SpecdLanguageServer, params: Any) -> dict[str, Any]:
    if ls.link.state == READY:
        try:
            await ls.link.status()
        except Exception as err:  # the cached figures still answer
            log.debug("daemon status failed: %s", err)
    return {**ls.status(), "settings": to_dict(ls.settings)}


# -- entry point -------------------------------------------------------------------------------


def configure_logging(level: str = "info", log_file: str = "") -> None:
    from specd.logs import setup_logging

    setup_logging(level, Path(log_file).expanduser() if log_file else None, stderr=True)
    # pygls logs every message it sends at info, whole; its warnings are what matter here.
    logging.getLogger("pygls").setLevel(logging.WARNING)
    logging.getLogger("asyncio").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specd-lsp", description="specd's language server (LSP on stdio)")
    parser.add_argument("--stdio", action="store_true", help="talk LSP on stdin/stdout (the default and only transport)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--log-file", default="", help="also log to this file (logs never go to stdout)")
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, metavar="SECONDS",
                        help="a message that stops arriving for this long is a framing error: specd-lsp exits "
                             "(status 1) so that the editor restarts it (default %(default)g)")
    parser.add_argument("--version", action="version", version=f"specd-lsp {__version__}")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_file)
    return run_stdio(server, read_timeout=args.read_timeout)


if __name__ == "__main__":
    sys.exit(main())
