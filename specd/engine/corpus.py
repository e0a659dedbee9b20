"""The workspace corpus: files that are not open, tokenized in idle time into a few lookup indexes.

Prompt lookup searches the current document, then open buffers, then this corpus. A workspace
holds thousands of files, so it is neither tokenized on a keystroke's critical path nor searched
file by file:

- ``set(name, text)`` (any thread) only stores the text and marks the file pending.
- ``index_pending(encode, budget_s)`` (the model worker, when idle) tokenizes pending files in
  slices of ``SLICE_CHARS`` characters and (re)builds lookup segments in slices of
  ``SLICE_TOKENS`` tokens, so a request arriving meanwhile waits one slice at most.
- Files are packed into *segments* of about ``SEGMENT_TOKENS`` tokens, one ``NgramIndex`` each:
  a lookup step searches a few segments, not every file, and a changed or deleted file costs a
  rebuild of its segment only. A segment keeps answering from its previous index until the new
  one is complete, so lookups never see a half-built index.
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable

from specd.engine.lookup import NgramIndex

SEGMENT_TOKENS = 32_768  # a segment is rebuilt whole when one of its files changes
SLICE_CHARS = 16_384  # characters tokenized per idle step (cut at a line end)
SLICE_TOKENS = 16_384  # tokens added to a segment's index per idle step

Encode = Callable[[str], list[int]]


@dataclass(eq=False)
class _File:
    text: str
    tokens: array | None = None  # array("i"): the whole file, once tokenized
    partial: list[int] = field(default_factory=list)  # tokens of text[:done] while tokenizing
    done: int = 0  # characters tokenized so far
    segment: "_Segment | None" = None


@dataclass(eq=False)
class _Segment:
    names: set[str] = field(default_factory=set)
    tokens: int = 0  # tokens of its files (the index may still hold an older set)
    index: NgramIndex | None = None  # what lookups search; None until first built
    dirty: bool = True
    # The rebuild in progress: files still to add, and how far into the first of them.
    building: NgramIndex | None = None
    queue: list[array] = field(default_factory=list)
    position: int = 0


class Corpus:
    """Workspace files by name (their absolute path), and their lookup segments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, _File] = {}
        self._pending: dict[str, None] = {}  # names to tokenize, oldest first (an ordered set)
        self._segments: list[_Segment] = []
        self.chars = 0
        self.generation = 0  # bumped on every change: context selection notices new files by it

    def __len__(self) -> int:
        return len(self._files)

    # -- any thread ------------------------------------------------------------------------

    def set(self, name: str, text: str | None) -> None:
        """Add, replace (``text``) or remove (``None``) one file. Cheap: tokenizing comes later."""
        with self._lock:
            old = self._files.pop(name, None)
            if old is not None:
                self.chars -= len(old.text)
                self._unplace(name, old)
            self._pending.pop(name, None)
            if text is not None:
                self._files[name] = _File(text)
                self._pending[name] = None
                self.chars += len(text)
            if old is not None or text is not None:
                self.generation += 1

    def texts(self) -> dict[str, str]:
        """A snapshot: name -> text."""
        with self._lock:
            return {name: file.text for name, file in self._files.items()}

    def indexes(self) -> list[NgramIndex]:
        """The segments' lookup indexes, as built so far."""
        with self._lock:
            return [s.index for s in self._segments if s.index is not None and len(s.index)]

    def forget_indexes(self) -> None:
        """Drop every token (the engine released its models); ``index_pending`` redoes them."""
        with self._lock:
            self._segments = []
            self._pending = dict.fromkeys(self._files)
            for name, file in self._files.items():
                self._files[name] = _File(file.text)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._pending) or any(s.dirty for s in self._segments)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "files": len(self._files),
                "chars": self.chars,
                "pending_files": len(self._pending),
                "indexed_tokens": sum(len(s.index) for s in self._segments if s.index is not None),
                "segments": len(self._segments),
                "dirty_segments": sum(1 for s in self._segments if s.dirty),
            }

    # -- the model worker, when idle -------------------------------------------------------

    def index_pending(self, encode: Encode, budget_s: float) -> bool:
        """Tokenize and index for about ``budget_s`` seconds; True while work remains."""
        deadline = time.monotonic() + budget_s
        while True:
            if not (self._tokenize_step(encode) or self._build_step()):
                return False
            if time.monotonic() >= deadline:
                return self.pending()

    def _tokenize_step(self, encode: Encode) -> bool:
        with self._lock:
            name = next(iter(self._pending), None)
            if name is None:
                return False
            file = self._files[name]
        text, start = file.text, file.done
        end = len(text)
        if end - start > SLICE_CHARS:  # cut after a newline, so tokens match a whole-file encode
            newline = text.rfind("\n", start, start + SLICE_CHARS)
            end = newline + 1 if newline >= start else start + SLICE_CHARS
        ids = encode(text[start:end])
        with self._lock:
            if self._files.get(name) is not file:
                return True  # replaced or removed meanwhile: its new version is pending anew
            file.partial.extend(ids)
            file.done = end
            if end >= len(text):
                file.tokens, file.partial = array("i", file.partial), []
                del self._pending[name]
                self._place(name, file)
        return True

    def _build_step(self) -> bool:
        with self._lock:
            segment = next((s for s in self._segments if s.dirty), None)
            if segment is None:
                return False
            if segment.building is None:
                if not segment.names:  # emptied: drop it
                    self._segments.remove(segment)
                    return True
                segment.building = NgramIndex()
                segment.queue = [self._files[n].tokens for n in sorted(segment.names)]
                segment.position = 0
            building, queue = segment.building, segment.queue
        budget = SLICE_TOKENS
        while queue and budget > 0:
            tokens = queue[0]
            piece = tokens[segment.position:segment.position + budget]
            building.extend(piece.tolist())
            budget -= len(piece)
            segment.position += len(piece)
            if segment.position >= len(tokens):
                queue.pop(0)
                segment.position = 0
        with self._lock:
            if segment.building is not building:  # restarted by a change meanwhile
                return True
            if not queue:
                segment.index, segment.building, segment.dirty = building, None, False
        return True

    # -- placement (under the lock) --------------------------------------------------------

    def _place(self, name: str, file: _File) -> None:
        size = len(file.tokens)
        segment = next((s for s in self._segments if s.tokens + size <= SEGMENT_TOKENS), None)
        if segment is None:
            segment = _Segment()
            self._segments.append(segment)
        segment.names.add(name)
        segment.tokens += size
        file.segment = segment
        self._dirty(segment)

    def _unplace(self, name: str, file: _File) -> None:
        segment = file.segment
        if segment is None:
            return
        segment.names.discard(name)
        segment.tokens -= len(file.tokens) if file.tokens is not None else 0
        file.segment = None
        self._dirty(segment)

    @staticmethod
    def _dirty(segment: _Segment) -> None:
        segment.dirty = True
        segment.building, segment.queue, segment.position = None, [], 0  # restart any rebuild
