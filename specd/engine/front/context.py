"""Extra context for the prompt: chunks of other files, chosen per document, kept stable.

Repo-level FIM prompts (Qwen2.5-Coder's ``<|repo_name|>``/``<|file_sep|>``) begin with other
files of the project. This module chooses them:

- candidates are the other open buffers and workspace files near the current one (same
  directory first, then the parent's subtree), never the current file itself, and a workspace
  file that is also open only once (the buffer, which is newer);
- each candidate is cut into overlapping windows of ``WINDOW_LINES`` lines; a window scores the
  similarity (cosine, on sets) of its words (identifiers and their snake/camel-case parts) with
  those around the cursor, the few lines nearest it counting ``NEAR_WEIGHT`` times more, times
  its source's weight (open buffers over workspace files);
- the best windows are taken until the token budget is full (a window longer than what is left
  keeps its first lines), skipping windows that overlap one already taken from the same file
  and texts already taken or already in the current document; they are emitted least relevant
  first, so the most relevant sits nearest the current file.

Stability. The chunks sit at the head of the prompt: changing them costs a prefill of the whole
prompt. So a document keeps its *active* chunk set across keystrokes, and a new set is computed
only when the cursor's coarse region (``REGION_LINES`` lines) moves or the candidate pool
changes (a buffer edited, opened or closed, a workspace file changed). When the new set differs,
``warm_step`` (the engine's idle work) hands it to a ``Warmer`` (the local engine prefills a
fresh KV state with it, in slices) and only then swaps it in: requests meanwhile use the old set
and its still-valid cache, so no keystroke waits for a new context. Without a warmer (the remote
engine: the server caches prefixes) a new set is swapped in at once. Choosing itself is sliced too: the candidates' windows are computed a
few files per idle slice (and cached) before a proposal is made.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol
from urllib.parse import unquote, urlparse

from specd.engine.types import ContextChunk

REGION_LINES = 24  # the cursor moving within this many lines keeps the chunk set
QUERY_CHARS_BEFORE = 3000  # text around the cursor that relevance is measured against
QUERY_CHARS_AFTER = 800
NEAR_LINES_BEFORE = 4  # the lines nearest the cursor (the signature being filled in, usually) ...
NEAR_LINES_AFTER = 2
NEAR_WEIGHT = 2.0  # ... count this much more than the wider surroundings
MIN_CHUNK_LINES = 4  # a window cut to fit the budget keeps at least this many lines
WINDOW_LINES = 40  # a chunk is at most this many lines ...
WINDOW_STEP = 20  # ... and windows start every this many lines (they overlap)
MIN_SCORE = 0.08  # weighted similarity below this is noise, not context (measured on the bench's
# multi_file workload: it keeps every right twin that 0.05 keeps and drops unrelated files)
OPEN_WEIGHT = 1.0
WORKSPACE_WEIGHT = 0.8
SAME_DIRECTORY_BONUS = 1.15
NEARBY_FILES = 48  # workspace files considered per proposal, nearest first
MAX_FILE_CHARS = 200_000  # bigger candidates are only searched in their first part
PROMPT_OVERHEAD_TOKENS = 32  # repo header and the current file's separator line
MAX_DOCUMENTS = 64  # documents whose chunk sets are remembered (LRU)
MAX_WINDOW_CACHE = 512  # files whose windows are remembered (LRU)

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
WORD_PART = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
COMMON_WORDS = frozenset(
    "and are assert async await break class const continue def del elif else except false finally "
    "for from function global import lambda let none nonlocal not pass raise return self static "
    "the this true try var void while with yield int str bool float list dict none null new "
    "public private protected package interface struct impl pub use mut match".split())


def identifiers(text: str) -> frozenset[str]:
    """Identifiers and their parts (``parse_csv_line`` also gives parse, csv, line), so that
    ``handle_user_create`` and ``handle_user_delete`` are related."""
    words = set()
    for identifier in IDENTIFIER.findall(text):
        if identifier.lower() in COMMON_WORDS:
            continue
        words.add(identifier)
        for part in WORD_PART.findall(identifier):
            part = part.lower()
            if len(part) >= 3 and part not in COMMON_WORDS:
                words.add(part)
    return frozenset(words)


def similarity(a: frozenset[str], b: frozenset[str]) -> float:
    """Cosine similarity of two word sets: unlike Jaccard, a short window is not punished for
    being compared with a long stretch of the document."""
    return len(a & b) / math.sqrt(len(a) * len(b)) if a and b else 0.0


def near_cursor(text: str, offset: int) -> str:
    start = offset
    for _ in range(NEAR_LINES_BEFORE):
        start = text.rfind("\n", 0, max(0, start - 1)) + 1
    end = offset
    for _ in range(NEAR_LINES_AFTER):
        newline = text.find("\n", end + 1)
        end = len(text) if newline < 0 else newline
    return text[start:end]


def uri_path(name: str) -> str:
    """A file URI's path; anything else as it is."""
    if name.startswith("file://"):
        return unquote(urlparse(name).path)
    return name


def display_path(path: str, current: str | None) -> str:
    """``path`` relative to the directory it shares with the current file (repo-relative, usually)."""
    if current and os.path.isabs(path) and os.path.isabs(current):
        try:
            common = os.path.commonpath([os.path.dirname(current), path])
        except ValueError:
            return path
        if common != os.sep:
            return os.path.relpath(path, common)
    return path


@dataclass(frozen=True)
class Candidate:
    path: str  # file path (URIs converted), what the prompt shows and dedup keys on
    text: str
    weight: float


@dataclass(frozen=True)
class _Window:
    start_line: int
    text: str
    words: frozenset[str]


@dataclass
class _Doc:
    active: list[ContextChunk] = field(default_factory=list)
    snapshot: tuple[str, int, str | None] | None = None  # (text, offset, path) of the last request
    region: int = -1  # region of the last request
    chosen_region: int = -2  # region the active set was chosen for
    chosen_pool: Any = None  # pool signature the active set was chosen from


@dataclass
class _Warming:
    key: str
    chunks: list[ContextChunk]
    job: Any  # the warmer's work in progress (None without a warmer)
    region: int


class Warmer(Protocol):
    """Makes a new chunk set ready before it is swapped in: the local engine prefills a fresh KV
    state with the document's prompt in slices, so the next request finds it warm."""

    def begin(self, key: str, text: str, offset: int, chunks: list[ContextChunk], path: str | None) -> Any:
        """Start warming the prompt for ``chunks``; the job ``advance`` and ``adopt`` take."""

    def advance(self, job: Any, deadline: float) -> tuple[bool, int]:
        """Warm until ``deadline``: (done, tokens warmed in this slice)."""

    def adopt(self, key: str, job: Any) -> None:
        """Swap the warmed job in for document ``key``."""


class ContextSelector:
    """Chunk sets per document (keyed like the KV caches), proposals, and background warming."""

    def __init__(self, budget_tokens: int):
        self.budget_tokens = budget_tokens
        self._lock = threading.Lock()
        self._docs: OrderedDict[str, _Doc] = OrderedDict()  # most recently requested last
        self._windows: OrderedDict[tuple[str, int], list[_Window]] = OrderedDict()
        self._warming: _Warming | None = None
        self.switches = 0  # chunk sets swapped in after warming
        self.proposals = 0
        self.warm_tokens = 0

    # -- the request path: O(1) apart from counting lines ----------------------------------

    def chunks_for(self, key: str, text: str, offset: int, path: str | None) -> list[ContextChunk]:
        """The document's active chunk set (empty until one has been warmed)."""
        with self._lock:
            doc = self._docs.pop(key, None) or _Doc()
            self._docs[key] = doc
            while len(self._docs) > MAX_DOCUMENTS:
                self._docs.popitem(last=False)
            doc.snapshot = (text, offset, path)
            doc.region = text.count("\n", 0, offset) // REGION_LINES
            return list(doc.active)

    def forget(self, key: str) -> None:
        with self._lock:
            self._docs.pop(key, None)
            if self._warming is not None and self._warming.key == key:
                self._warming = None

    def active(self, key: str) -> list[ContextChunk]:
        with self._lock:
            doc = self._docs.get(key)
            return list(doc.active) if doc else []

    def stats(self) -> dict[str, Any]:
        with self._lock:
            recent = next(reversed(self._docs.values()), None)
            return {"budget_tokens": self.budget_tokens, "proposals": self.proposals, "switches": self.switches,
                    "warm_tokens": self.warm_tokens, "warming": self._warming is not None,
                    "recent_chunks": [c.path for c in recent.active] if recent else []}

    # -- idle work -------------------------------------------------------------------------

    def warm_step(self, *, open_docs: dict[str, str], corpus: Any, encode: Callable[[str], list[int]],
                  budget_s: float, warmer: Warmer | None = None) -> bool:
        """One slice of background work; True while more remains.

        ``open_docs``: uri -> text of the open buffers; ``corpus``: the workspace ``Corpus``;
        ``warmer``: makes a changed chunk set ready before it is swapped in (None: swapped in at
        once).
        """
        deadline = time.monotonic() + budget_s
        with self._lock:
            if self._warming is not None:
                doc = self._docs.get(self._warming.key)
                if doc is None or doc.region != self._warming.region:
                    self._warming = None  # the cursor moved on: that set is no longer wanted
        if self._warming is None:
            found = self._stale(open_docs, corpus.generation)
            if found is None:
                return False
            key, doc, pool = found
            text, offset, path = doc.snapshot
            candidates = self._candidates(key, path, open_docs, corpus.texts)
            # cut into windows a few files per slice (large buffers cost tens of ms each)
            for candidate in candidates:
                self._windows_of(candidate)
                if time.monotonic() >= deadline:
                    return True  # the same proposal resumes next slice, its files' windows cached
            chunks = self.choose(text, offset, path, candidates, encode)
            with self._lock:
                self.proposals += 1
                doc.chosen_region, doc.chosen_pool = doc.region, pool
                if chunks == doc.active:
                    return True
            job = warmer.begin(key, text, offset, chunks, path) if warmer is not None else None
            self._warming = _Warming(key, chunks, job, doc.region)
        warming = self._warming
        if warmer is not None:
            done, warmed = warmer.advance(warming.job, deadline)
            self.warm_tokens += warmed
            if not done:
                return True
        with self._lock:
            self._warming = None
            doc = self._docs.get(warming.key)
            if doc is None or doc.region != warming.region:
                return True  # the cursor moved on meanwhile: a new proposal follows
            if warmer is not None:
                warmer.adopt(warming.key, warming.job)
            doc.active = warming.chunks
            self.switches += 1
        return True

    def _stale(self, open_docs: dict[str, str], corpus_generation: int):
        """The most recently requested document whose chunk set may be out of date."""
        with self._lock:
            for key, doc in reversed(self._docs.items()):
                if doc.snapshot is None:
                    continue
                pool = (corpus_generation, frozenset((u, hash(t)) for u, t in open_docs.items() if u != key))
                if doc.region != doc.chosen_region or pool != doc.chosen_pool:
                    return key, doc, pool
                return None  # only the most recent document is worth warming
        return None

    def _candidates(self, key: str, path: str | None, open_docs: dict[str, str],
                    corpus_texts: Callable[[], dict[str, str]]) -> list[Candidate]:
        current = uri_path(path or key)
        out: list[Candidate] = []
        seen = {current}
        for uri, text in open_docs.items():
            doc_path = uri_path(uri)
            if uri == key or doc_path in seen:
                continue
            seen.add(doc_path)
            out.append(Candidate(doc_path, text, OPEN_WEIGHT))
        texts = corpus_texts()
        for name in nearby(current, [n for n in texts if n not in seen], NEARBY_FILES):
            weight = WORKSPACE_WEIGHT * (SAME_DIRECTORY_BONUS if os.path.dirname(name) == os.path.dirname(current) else 1.0)
            out.append(Candidate(name, texts[name], weight))
        return out

    # -- choosing --------------------------------------------------------------------------

    def choose(self, text: str, offset: int, path: str | None, candidates: list[Candidate],
               encode: Callable[[str], list[int]]) -> list[ContextChunk]:
        """The chunk set for a cursor: best windows first within the budget, emitted least
        relevant first. Deterministic for the same inputs."""
        query = identifiers(text[max(0, offset - QUERY_CHARS_BEFORE):offset + QUERY_CHARS_AFTER])
        near = identifiers(near_cursor(text, offset))
        if not query:
            return []
        scored: list[tuple[float, int, Candidate, _Window]] = []
        for number, candidate in enumerate(candidates):
            for window in self._windows_of(candidate):
                closeness = similarity(query, window.words) + NEAR_WEIGHT * similarity(near, window.words)
                score = candidate.weight * closeness / (1 + NEAR_WEIGHT)
                if score >= MIN_SCORE:
                    scored.append((score, number, candidate, window))
        scored.sort(key=lambda item: (-item[0], item[1], item[3].start_line))
        budget = self.budget_tokens - PROMPT_OVERHEAD_TOKENS
        current = uri_path(path) if path else None
        taken: list[tuple[float, ContextChunk]] = []
        lines_taken: dict[str, list[int]] = {}
        texts_taken: set[str] = set()
        for score, _number, candidate, window in scored:
            body = window.text.strip("\n")
            if any(abs(window.start_line - s) < WINDOW_LINES for s in lines_taken.get(candidate.path, [])):
                continue
            if body in texts_taken or body in text:
                continue
            chunk = self._fit(ContextChunk(display_path(candidate.path, current), window.text), budget, encode)
            if chunk is None:
                continue
            cost = len(encode(f"{chunk.path}\n{chunk.text}\n")) + 1  # + the file separator
            budget -= cost
            taken.append((score, chunk))
            lines_taken.setdefault(candidate.path, []).append(window.start_line)
            texts_taken.add(body)
        taken.sort(key=lambda item: item[0])
        return [chunk for _score, chunk in taken]

    @staticmethod
    def _fit(chunk: ContextChunk, budget: int, encode: Callable[[str], list[int]]) -> ContextChunk | None:
        """The chunk, or its first lines that fit ``budget`` tokens; None when too few do."""
        lines = chunk.text.splitlines(keepends=True)
        while True:
            cost = len(encode(f"{chunk.path}\n{''.join(lines)}\n")) + 1
            if cost <= budget:
                return ContextChunk(chunk.path, "".join(lines))
            if len(lines) <= MIN_CHUNK_LINES:
                return None
            lines = lines[:max(MIN_CHUNK_LINES, min(len(lines) - 1, int(len(lines) * budget / cost)))]

    def _windows_of(self, candidate: Candidate) -> list[_Window]:
        key = (candidate.path, hash(candidate.text))
        with self._lock:
            windows = self._windows.get(key)
            if windows is not None:
                self._windows.move_to_end(key)
                return windows
        lines = candidate.text[:MAX_FILE_CHARS].splitlines(keepends=True)
        windows = []
        for start in range(0, max(1, len(lines) - WINDOW_LINES + WINDOW_STEP), WINDOW_STEP):
            body = "".join(lines[start:start + WINDOW_LINES])
            if body.strip():
                windows.append(_Window(start, body, identifiers(body)))
        with self._lock:
            self._windows[key] = windows
            while len(self._windows) > MAX_WINDOW_CACHE:
                self._windows.popitem(last=False)
        return windows


def nearby(current: str, names: list[str], limit: int) -> list[str]:
    """Up to ``limit`` of ``names`` nearest ``current`` in the directory tree: same directory,
    then the parent's subtree, then the grandparent's; same extension first at equal distance."""
    if not os.path.isabs(current):
        return []  # an unsaved buffer has no place in the tree
    here = os.path.dirname(current)
    parent = os.path.dirname(here)
    # Never the filesystem root: "near /x.py" would be every file.
    scopes = tuple(scope for scope in (parent, os.path.dirname(parent)) if os.path.dirname(scope) != scope)
    extension = os.path.splitext(current)[1]
    ranked = []
    for name in names:
        if os.path.dirname(name) == here:
            distance = 0
        else:
            distance = next((d for d, scope in enumerate(scopes, 1) if _under(name, scope)), None)
            if distance is None:
                continue
        ranked.append((distance, os.path.splitext(name)[1] != extension, name))
    ranked.sort()
    return [name for *_rank, name in ranked[:limit]]


def _under(name: str, directory: str) -> bool:
    return name.startswith(directory.rstrip(os.sep) + os.sep)
