"""Lookup indexes of other files, tokenized in idle time: the workspace corpus and open buffers.

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

Open buffers (``OpenBuffers``) are few but large and edited while the user types, so a
completion must not re-tokenize them either: see that class.
"""

from __future__ import annotations

import bisect
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specd.engine.lookup import NgramIndex

SEGMENT_TOKENS = 32_768  # a segment is rebuilt whole when one of its files changes
SLICE_CHARS = 16_384  # characters tokenized per idle step (cut at a line end)
SLICE_TOKENS = 16_384  # tokens added to a segment's index per idle step

Encode = Callable[[str], list[int]]


@dataclass(eq=False)
class _File:
    text: str
    tokens: array | None = None  # array("i"): the whole file, once tokenized
    partial: array = field(default_factory=lambda: array("i"))  # tokens of text[:done] while tokenizing
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
                file.tokens, file.partial = file.partial, array("i")
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


# -- open buffers ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Piece:
    start: int  # offsets in the buffer's current text; a piece starts at 0 or after a newline
    end: int
    tokens: array  # array("i")


@dataclass(eq=False)
class _Buffer:
    text: str
    stamp: int  # recency: higher was opened or edited later
    version: int = 0  # bumped by every edit
    pieces: list[_Piece] = field(default_factory=list)  # sorted, disjoint; gaps are untokenized
    index: NgramIndex | None = None
    indexed_version: int = -1  # the version whose tokens the index holds entirely
    target: array | None = None  # the tokens the index is being brought to, while syncing
    target_version: int = -1
    keep: int = 0  # tokens the index shares with ``target`` (found once per sync)
    touched: bool = False  # edited since it was opened, or wanted by a request: worth tokens
    changed_at: float = float("-inf")  # when it was opened or an edit last changed it (time.monotonic)


class OpenBuffers:
    """Lookup indexes of the open buffers, kept current in idle time and incrementally.

    Lookup searches the ``searched`` most recently edited buffers other than the one being
    completed, so only the ``searched + 1`` most recent hold tokens, and of those only as many
    as fit in ``max_indexed_chars`` characters together (the most recent first; a larger one is
    passed over for older ones that fit): the others are dropped and redone if they come back.
    A buffer holding tokens costs its pieces' tokens and its index's (4 + 8 bytes a token).

    - Tokens are built lazily: a buffer only opened holds none until a request touches it (an
      edit, a completion in it, or a completion that would search it); opening a few hundred
      files costs their texts, not their tokens.
    - ``set(uri, text)`` (any thread) only stores the text. Tokens are kept in *pieces* of about
      ``SLICE_CHARS`` characters, cut after a newline; an edit keeps every piece that lies in the
      text the edit left alone (the common prefix, or the common suffix, shifted), so a keystroke
      in a 1 MiB buffer re-tokenizes one piece, not the buffer.
    - ``index_pending(encode, budget_s)`` (the model worker, when idle) tokenizes the gaps a slice
      at a time, then brings the buffer's ``NgramIndex`` to the new tokens: truncate at the first
      token that differs, extend with the rest, ``SLICE_TOKENS`` at a time. A buffer waits until
      it has been open, and unchanged by edits, for ``quiet_s``: the buffer a person types in is
      the one being completed (searched through its own prompt, not this index), and a client
      that rewrites a large buffer every few hundred ms (a formatter, a script), or opens and
      closes many large ones, would otherwise keep the model thread tokenizing and indexing
      (pure Python, holding the GIL the event loop needs) text that is gone before its index
      is done.
    - ``indexes(exclude, encode)`` (a request) returns what is built. It finishes inline only
      buffers small enough to cost at most ``INLINE_CHARS`` characters of tokenizing in all, so a
      completion never waits on another buffer's re-tokenization beyond that.

    An index may lag its buffer (or hold a prefix of its new tokens) until idle time catches up:
    that only changes what lookup proposes; the target verifies every draft, so never the output.
    """

    INLINE_CHARS = SLICE_CHARS  # per request, for buffers that can be finished at once
    MAX_INDEXED_CHARS = 8 * 1024 * 1024  # buffers holding tokens, together (one larger one alone is kept)

    def __init__(self, searched: int, max_indexed_chars: int = MAX_INDEXED_CHARS, quiet_s: float = 0.0):
        self.searched = searched
        self.max_indexed_chars = max_indexed_chars
        self.quiet_s = quiet_s
        self._lock = threading.Lock()
        self._buffers: dict[str, _Buffer] = {}
        self._stamp = 0

    # -- any thread ------------------------------------------------------------------------

    def set(self, uri: str, text: str) -> None:
        """Open or update one buffer. Cheap: pieces the edit did not touch keep their tokens."""
        with self._lock:
            buffer = self._buffers.get(uri)
            old = buffer.text if buffer is not None else None
        # Compared outside the lock (milliseconds a MiB: docs/workspace.md): requests and idle
        # work go on meanwhile.
        affixes = common_affixes(old, text) if old is not None and old != text else None
        with self._lock:
            buffer = self._buffers.get(uri)
            if buffer is not None and buffer.text == text:
                return
            self._stamp += 1
            if buffer is None:
                self._buffers[uri] = _Buffer(text, self._stamp, changed_at=time.monotonic())
                return
            if buffer.text is not old:  # another set() came in between (callers are one thread: rare)
                old, affixes = buffer.text, common_affixes(buffer.text, text)
            prefix, suffix = affixes
            delta = len(text) - len(old)
            kept = []
            for piece in buffer.pieces:
                if piece.end <= prefix:
                    kept.append(piece)
                elif piece.start > len(old) - suffix:  # strictly: the newline before it is unchanged too
                    kept.append(_Piece(piece.start + delta, piece.end + delta, piece.tokens))
            buffer.text, buffer.stamp, buffer.pieces = text, self._stamp, kept
            buffer.version += 1
            buffer.touched = True
            buffer.changed_at = time.monotonic()

    def remove(self, uri: str) -> None:
        with self._lock:
            self._buffers.pop(uri, None)

    def forget_indexes(self) -> None:
        """Drop every token (the engine released its models); idle work redoes them."""
        with self._lock:
            for uri, buffer in self._buffers.items():
                self._buffers[uri] = _Buffer(buffer.text, buffer.stamp, buffer.version, touched=buffer.touched)

    def stats(self) -> dict[str, int]:
        with self._lock:
            kept = [buffer for _uri, buffer in self._kept()]
            return {
                "buffers": len(self._buffers),
                "indexed": sum(1 for b in kept if b.indexed_version == b.version),
                "stale": sum(1 for b in kept if b.touched and b.indexed_version != b.version),
                "indexed_tokens": sum(len(b.index) for b in kept if b.index is not None),
            }

    # -- the model worker ------------------------------------------------------------------

    def indexes(self, exclude: str | None, encode: Encode) -> list[NgramIndex]:
        """The indexes of the ``searched`` most recently edited buffers but ``exclude``, most
        recent first, as built so far (buffers never indexed yet are left out)."""
        with self._lock:
            if exclude in self._buffers:
                self._buffers[exclude].touched = True
            chosen = [b for uri, b in self._kept() if uri != exclude][:self.searched]
            for buffer in chosen:
                buffer.touched = True
        allowance = self.INLINE_CHARS
        out = []
        for buffer in chosen:
            small = len(buffer.text) <= allowance and (buffer.index is None or len(buffer.index) <= allowance)
            if buffer.indexed_version != buffer.version and small:
                allowance -= len(buffer.text)
                while self._step(buffer, encode):  # small: finish it now, a few steps at most
                    pass
            if buffer.index is not None and len(buffer.index):
                out.append(buffer.index)
        return out

    def index_pending(self, encode: Encode, budget_s: float) -> bool:
        """Tokenize and index the most recently edited buffers for about ``budget_s`` seconds;
        True while work remains (False too while the only stale buffers are not quiet yet: the
        worker's next idle poll comes back for them)."""
        deadline = time.monotonic() + budget_s
        while True:
            with self._lock:
                kept = [buffer for _uri, buffer in self._kept()]
                for buffer in self._buffers.values():
                    if buffer in kept:
                        continue
                    if buffer.pieces or buffer.index is not None or buffer.indexed_version >= 0:  # no longer searched: free its tokens
                        buffer.pieces, buffer.index, buffer.target = [], None, None
                        buffer.indexed_version = buffer.target_version = -1
                settled = time.monotonic() - self.quiet_s
                stale = [b for b in kept if b.touched and b.indexed_version != b.version and b.changed_at <= settled]
            if not stale:
                return False
            self._step(stale[0], encode)
            if time.monotonic() >= deadline:
                return True

    def _step(self, buffer: _Buffer, encode: Encode) -> bool:
        """One slice of work on ``buffer``: tokenize part of its first gap, or move its index a
        slice toward its tokens. False once the index holds the current text (or it was closed)."""
        with self._lock:
            if buffer.indexed_version == buffer.version:
                return False
            version, text = buffer.version, buffer.text
            gap = _first_gap(buffer.pieces, len(text))
            if gap is None and (buffer.target is None or buffer.target_version != version):
                buffer.target = array("i")
                for piece in buffer.pieces:
                    buffer.target.extend(piece.tokens)
                buffer.target_version = version
                buffer.keep = -1
            target = buffer.target
        if gap is not None:
            start, stop = gap
            end = stop
            if stop - start > SLICE_CHARS:  # cut after a newline, as the corpus does
                newline = text.rfind("\n", start, start + SLICE_CHARS)
                end = newline + 1 if newline >= start else start + SLICE_CHARS
            tokens = array("i", encode(text[start:end]))
            with self._lock:
                if buffer.version == version or _still_uncovered(buffer, text[start:end], start, end):
                    bisect.insort(buffer.pieces, _Piece(start, end, tokens), key=lambda p: p.start)
            return True
        # Bring the index to ``target``: only this thread touches indexes, so no lock. Lookups
        # in between see a consistent index of a prefix of the old or the new tokens.
        if buffer.index is None:
            buffer.index = NgramIndex()
        index = buffer.index
        if buffer.keep < 0:
            buffer.keep = common_prefix_length(index.tokens, target)
        held = len(index)
        if held > buffer.keep:
            index.truncate(max(buffer.keep, held - SLICE_TOKENS))
        elif held < len(target):
            index.extend(target[held:held + SLICE_TOKENS].tolist())
            buffer.keep = len(index)  # what it holds now agrees with the target
        else:
            with self._lock:
                if buffer.version == version:
                    buffer.indexed_version, buffer.target = version, None
        return True

    # -- under the lock ------------------------------------------------------------------

    def _ranked_items(self) -> list[tuple[str, _Buffer]]:
        return sorted(self._buffers.items(), key=lambda item: -item[1].stamp)

    def _kept(self) -> list[tuple[str, _Buffer]]:
        """The buffers that may hold tokens, most recent first: the ``searched + 1`` most recent,
        as many as fit in ``max_indexed_chars`` (the first always)."""
        kept, chars = [], 0
        for uri, buffer in self._ranked_items()[:self.searched + 1]:
            if kept and chars + len(buffer.text) > self.max_indexed_chars:
                continue
            chars += len(buffer.text)
            kept.append((uri, buffer))
        return kept


def _still_uncovered(buffer: _Buffer, piece_text: str, start: int, end: int) -> bool:
    """Whether a piece tokenized from an older version still fits the buffer as it is now (an
    edit elsewhere came meanwhile): same text at the same place, after a newline, in a gap."""
    text, pieces = buffer.text, buffer.pieces
    if text[start:end] != piece_text or (start > 0 and text[start - 1] != "\n"):
        return False
    at = bisect.bisect_left(pieces, start, key=lambda p: p.start)
    return (at == 0 or pieces[at - 1].end <= start) and (at == len(pieces) or pieces[at].start >= end)


def _first_gap(pieces: list[_Piece], length: int) -> tuple[int, int] | None:
    """The first stretch of ``[0, length)`` no piece covers, as (start, stop)."""
    position = 0
    for piece in pieces:
        if piece.start > position:
            return position, piece.start
        position = piece.end
    return (position, length) if position < length else None


def common_affixes(old: str, new: str) -> tuple[int, int]:
    """(prefix, suffix): the lengths of the common prefix and of the common suffix after it,
    found by binary search over slice comparisons (C speed)."""
    prefix = common_prefix_length(old, new)
    limit = min(len(old), len(new)) - prefix
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old[len(old) - mid:] == new[len(new) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return prefix, lo


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items two strings (or two arrays of one type) share: binary search over
    slice comparisons, which run at C speed (memcmp for arrays)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
