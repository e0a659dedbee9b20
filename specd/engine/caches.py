"""KV state of one model for one token sequence, and the per-document LRU that holds them.

``KVState`` is the small explicit cache object the decode loop works with: it knows which token
ids its cache holds (``ids``), extends by running new tokens, and rolls back by cropping.
Invariant: ``len(state.ids) == cache length`` of every layer, also after a forward failed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np
import torch

from specd.engine.cold_start import ColdStart, Window, narrow_key
from specd.engine.forward.path import ForwardPath
from specd.engine.forward.transformers import HFForward
from specd.engine.lookup import NgramIndex

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences (lists, tuples, arrays, in any mix) share.
    Slices are compared at C speed; where they differ, the stretch holding the first difference
    is halved until it is short (a rejected draft leaves it near the end of thousands of tokens,
    where a token-by-token walk cost tens of µs a call: docs/engine.md)."""
    n = min(len(a), len(b))
    if _tokens(a, 0, n) == _tokens(b, 0, n):  # the usual case
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference is before hi
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if _tokens(a, lo, mid) == _tokens(b, lo, mid):
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _tokens(seq: Sequence[int], start: int, end: int) -> list[int]:
    """``seq[start:end]`` as a list (a list's own slice is one already)."""
    return seq[start:end] if isinstance(seq, list) else list(seq[start:end])


class Rows(Protocol):
    """A forward's next-token logits, one row per input position, read row by row."""

    head_ms: float  # time spent computing rows on demand (0 when they came with the forward)
    computed: int  # rows computed on demand so far

    def __len__(self) -> int: ...
    def row(self, i: int) -> torch.Tensor: ...  # float32 [V]
    def argmax(self, i: int) -> int: ...  # of row i, the lowest index among equals
    def dense(self) -> torch.Tensor: ...  # float32 [T, V]


def row_argmax(row: torch.Tensor) -> int:
    """The index of a row's largest value, the lowest among equals (NaN counting as largest, as
    in torch). A float32 row on the CPU goes through numpy: torch's CPU argmax costs several times
    numpy's a call (docs/engine.md), over a large vocabulary or a small one alike, and a verify
    reads a row per accepted token, every step."""
    if row.device.type == "cpu" and row.dtype == torch.float32 and not row.requires_grad:
        return int(row.numpy().argmax())
    return int(row.argmax())


class DenseRows:
    """Rows that came with the forward (every path on GPU, transformers', llama.cpp's)."""

    head_ms = 0.0
    computed = 0

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self._argmax: list[int] | None = None

    def __len__(self) -> int:
        return self.logits.shape[0]

    def row(self, i: int) -> torch.Tensor:
        return self.logits[i]

    def argmax(self, i: int) -> int:
        """On a GPU every row's argmax at the first call, in one kernel and one read (each row's
        own read would be a device sync); on a CPU the row's own (a verify typically reads a few
        of its rows, and reading them all costs several times more: docs/engine.md)."""
        if self.logits.device.type == "cpu":
            return row_argmax(self.logits[i])
        if self._argmax is None:
            self._argmax = self.logits.argmax(-1).tolist()
        return self._argmax[i]

    def dense(self) -> torch.Tensor:
        return self.logits


class HostRows:
    """Rows that came with a forward as a float32 numpy array [T, V] (``ForwardPath.host_ids``:
    llama.cpp's path), read without torch; a row or all of them as a tensor on demand (sampling,
    the healing constraint)."""

    head_ms = 0.0
    computed = 0

    def __init__(self, logits: np.ndarray):
        self.logits = logits

    def __len__(self) -> int:
        return self.logits.shape[0]

    def row(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.logits[i])

    def argmax(self, i: int) -> int:
        return int(self.logits[i].argmax())

    def dense(self) -> torch.Tensor:
        return torch.from_numpy(self.logits)


class LazyRows:
    """Rows computed when first read, from the final hidden states and the LM head.

    Why: greedy verification of a k-token draft reads rows 0 .. n (n = accepted tokens), and on
    a CPU the LM head over a whole vocabulary is a large share of a narrow forward (the demo
    target: a quarter of its weights). MKL's few-row matrix products also cost several times a
    one-row product per row, so k + 1 rows at once cost far more than the 1 + n rows read one at
    a time. A row is the one-row product a plain decode step computes."""

    def __init__(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]):
        self.hidden = hidden  # [T, D], after the final norm
        self.head = head  # [1, D] -> float32 [1, V]
        self.rows: dict[int, torch.Tensor] = {}
        self.head_ms = 0.0

    def __len__(self) -> int:
        return self.hidden.shape[0]

    @property
    def computed(self) -> int:
        return len(self.rows)

    def row(self, i: int) -> torch.Tensor:
        row = self.rows.get(i)
        if row is None:
            started = time.perf_counter()
            row = self.rows[i] = self.head(self.hidden[i:i + 1])[0]
            self.head_ms += (time.perf_counter() - started) * 1000
        return row

    def argmax(self, i: int) -> int:
        return row_argmax(self.row(i))

    def dense(self) -> torch.Tensor:
        return torch.stack([self.row(i) for i in range(len(self))])


# Final hidden states a target's state keeps for a feature head: at least the last this many
# positions, more than the head reads back when it starts again (``head_state.READ_BACK``).
FEATURE_WINDOW = 128


class FeatureTrail:
    """The final hidden states of a state's last positions, contiguous up to its end: positions
    ``first`` .. ``first + length - 1``. In a buffer that grows by doubling and, past twice
    ``FEATURE_WINDOW``, keeps the last window (rarely: a decode step appends one row, and a copy
    of every row each step would cost what the rows do)."""

    def __init__(self) -> None:
        self.first = 0
        self.length = 0
        self._rows: torch.Tensor | None = None  # [capacity, D]

    @property
    def end(self) -> int:
        return self.first + self.length

    def get(self, start: int, end: int) -> torch.Tensor | None:
        if self._rows is None or start < self.first or end > self.end or start > end:
            return None
        return self._rows[start - self.first:end - self.first]

    def note(self, hidden: torch.Tensor, start: int) -> None:
        """``hidden`` [n, D]: the states of positions ``start`` .. ``start + n - 1``, which follow
        the last kept (else the trail starts again there)."""
        if self._rows is None or start != self.end or self.length == 0:
            self.first, self.length, self._rows = start, 0, None
        n = hidden.shape[0]
        if self.length + n > 2 * FEATURE_WINDOW:  # keep the last window of what there will be
            keep = max(0, FEATURE_WINDOW - n)
            if keep:
                self._rows[:keep] = self._rows[self.length - keep:self.length].clone()
            self.first, self.length = self.end - keep, keep
            hidden = hidden[-FEATURE_WINDOW:]
            self.first += n - hidden.shape[0]
            n = hidden.shape[0]
        if self._rows is None or self.length + n > self._rows.shape[0]:
            grown = hidden.new_empty(max(64, 2 * (self.length + n)), hidden.shape[1])
            if self.length:
                grown[:self.length] = self._rows[:self.length]
            self._rows = grown
        self._rows[self.length:self.length + n] = hidden
        self.length += n

    def crop(self, length: int) -> None:
        """Keep the positions before ``length``."""
        self.length = max(0, min(self.length, length - self.first))

    def keep(self, start: int, slots: Sequence[int]) -> bool:
        """After a token tree from ``start``: positions start.. become ``slots``' rows, in order;
        False where the trail does not reach back to ``start`` (then it is of no use)."""
        if self._rows is None or start < self.first or any(s >= self.end for s in slots):
            return False
        rows = self._rows[[s - self.first for s in slots]]  # a gather: a copy
        self._rows[start - self.first:start - self.first + len(slots)] = rows
        self.length = start - self.first + len(slots)
        return True

    def nbytes(self) -> int:
        rows = self._rows
        return rows.numel() * rows.element_size() if rows is not None else 0


class KVState:
    def __init__(self, model: PreTrainedModel, path: ForwardPath | None = None):
        self.model = model
        self.device = model.device
        self.path = path if path is not None else HFForward(model)
        self.cache = self.path.new_cache()
        self.ids: list[int] = []
        self.forwards = 0
        # Final hidden states of the last positions run, for a feature head to read
        # (``features``): kept where ``keeps_features`` is set and the path gives them.
        self.keeps_features = False
        self._trail: FeatureTrail | None = None  # None: no states kept (none given, or a gap since)

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (a crop, not a recompute). Should
        the crop fail, the state starts empty (ids and cache still agree) and the error is raised."""
        if length < len(self.ids):
            try:
                self.path.crop(self.cache, length)
            except BaseException:
                self.reset()
                raise
            del self.ids[length:]
            self._crop_features(length)

    def extend(self, new_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Run ``new_ids`` after the held tokens; logits [len(new_ids), V] (or [1, V] when last_only).

        A forward that fails part-way (out of memory, or any other error) has grown
        the layers it reached and not the rest: every layer is cropped back to the tokens held
        before the call, and the error is raised. The cache is never left inconsistent."""
        if self.gives_features:  # the same products a forward with its head runs, row by row
            hidden = self._forward(new_ids, head=False)
            return self.path.head(hidden[-1:] if last_only else hidden)
        return self._forward(new_ids, last_only=last_only)

    @property
    def gives_features(self) -> bool:
        """Whether this state keeps the final hidden states of what it runs (``features``)."""
        return self.keeps_features and self.path.gives_hidden

    @property
    def features_from(self) -> int | None:
        """The first position whose final hidden state this state keeps (None: none)."""
        trail = self._trail
        return trail.first if trail is not None and trail.length else None

    def chained_next(self, ids: Sequence[int]) -> None:
        """A draft model's chain reads its own cache, as reading ``ids`` did: the teacher-forced
        agreement on them is its chains' (``HeadState.chained_next`` answers otherwise)."""
        return None

    def features(self, start: int, end: int) -> torch.Tensor | None:
        """The final hidden states [end - start, D] of positions start .. end - 1, where this
        state still keeps them (at least its last ``FEATURE_WINDOW`` positions), else None."""
        trail = self._trail
        return trail.get(start, end) if trail is not None and end <= len(self.ids) else None

    def _note_features(self, hidden: torch.Tensor | None, added: int) -> None:
        """The forward that added the last ``added`` positions gave ``hidden`` (None: none)."""
        if hidden is None or hidden.shape[0] != added:
            self._trail = None  # a gap: states start again with the next forward that gives them
            return
        if self._trail is None:
            self._trail = FeatureTrail()
        self._trail.note(hidden, len(self.ids) - added)

    def _crop_features(self, length: int) -> None:
        if self._trail is not None:
            self._trail.crop(length)

    @property
    def lazy_head(self) -> bool:
        """Whether this state's forward path computes rows of logits on demand (``LazyRows``)."""
        return self.path.lazy_head

    @property
    def merges_prompt(self) -> bool:
        """Whether prompt tokens can ride with a decode step at no cost in logits: their rows
        are never computed (a lazy head, or a path that computes only the rows asked for)."""
        return self.path.lazy_head or self.path.rows_from

    def extend_rows(self, new_ids: Sequence[int], skip: int = 0) -> Rows:
        """``extend`` for verification: the logits as ``Rows``, computed on demand where the
        forward path can (``lazy_head``: the lean path on CPU), else all at once. ``skip``: the
        first new tokens' rows are not wanted (prompt tokens run with a step): row 0 is then the
        one after ``new_ids[skip]``."""
        if self.lazy_head:
            return LazyRows(self._forward(new_ids, head=False)[skip:], self.path.head)
        if self.path.host_ids:
            return HostRows(self._forward_ids(list(new_ids), skip))
        if self.path.rows_from:
            return DenseRows(self._forward(new_ids, rows_from=skip))
        return DenseRows(self.extend(new_ids)[skip:])

    @property
    def recordings(self) -> int:
        """CUDA graphs this state's forward path has recorded so far (``LeanForward.use_graphs``;
        0 on every other path): a forward that recorded one first is no measure of its width."""
        return self.path.recordings

    def prepare(self, ahead: int) -> int:
        """Idle work for a forward path that replays recorded graphs (``LeanForward.prepare``):
        room for ``ahead`` more tokens and the recordings the next request will want. Returns
        how many were recorded (0 on every other path)."""
        return self.path.prepare(self.cache, ahead)

    @property
    def trees(self) -> bool:
        """Whether this state's forward path runs token trees (``extend_tree``)."""
        return self.path.trees

    def extend_tree(self, new_ids: Sequence[int], parents: Sequence[int], skip: int = 0) -> Rows:
        """``extend_rows`` for a token tree (``parents[i]``: index of token i's parent among
        ``new_ids``, -1 for the first): row i is the next-token distribution after the cache and
        token i's root path (``skip`` as for ``extend_rows``). The cache then holds the whole tree
        in slot order; ``keep`` keeps one path of it. Only where ``trees``."""
        if not self.trees:
            raise ValueError(f"the {self.path.name} forward runs no token trees")
        if not self.lazy_head:
            if self.gives_features:
                return DenseRows(self.path.head(self._forward(new_ids, head=False, parents=parents))[skip:])
            return DenseRows(self._forward(new_ids, parents=parents)[skip:])
        return LazyRows(self._forward(new_ids, head=False, parents=parents)[skip:], self.path.head)

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """After ``extend_tree`` from ``start`` held tokens: keep those and the tree's ``nodes``
        (indexes of a root-to-leaf path, in order), which move into place after them. Should the
        move fail, the state starts empty and the error is raised."""
        slots = [start + node for node in nodes]
        try:
            self.path.keep(self.cache, start, slots)
        except BaseException:
            self.reset()
            raise
        self.ids[start:] = [self.ids[slot] for slot in slots]
        if self._trail is not None and not self._trail.keep(start, slots):  # the kept path's states move with its K/V
            self._trail = None

    def _forward(self, new_ids: Sequence[int], **kwargs: Any) -> torch.Tensor:
        input_ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)
        hidden = kwargs.get("head") is False and not kwargs.get("last_only")
        return self._run(new_ids, lambda: self.path.forward(input_ids, self.cache, **kwargs), hidden)

    def _forward_ids(self, new_ids: list[int], rows_from: int) -> np.ndarray:
        """``_forward`` on a path that takes a list and gives numpy logits (``host_ids``)."""
        return self._run(new_ids, lambda: self.path.forward_ids(new_ids, self.cache, rows_from=rows_from))

    def _run(self, new_ids: Sequence[int], forward: Callable[[], Any], hidden: bool = False) -> Any:
        """``forward()`` over ``new_ids`` into the cache: the ids are held once it returns; if it
        fails, every layer goes back to the tokens held before and the error is raised.
        ``hidden``: it returns the final hidden states of every new position."""
        try:
            out = forward()
        except BaseException:
            self._restore(len(self.ids))
            raise
        self.ids.extend(new_ids)
        self.forwards += 1
        if self.keeps_features:
            self._note_features(out if hidden else None, len(new_ids))
        return out

    def _restore(self, length: int) -> None:
        """Every layer back to ``length`` positions after a failed forward; an empty state if
        that cannot be done (a layer that cannot be cropped, one shorter than ``length``)."""
        try:
            self.path.crop(self.cache, length)
            if self.path.consistent(self.cache, length):
                return
        except Exception:
            log.debug("cropping the cache after a failed forward failed", exc_info=True)
        log.warning("KV cache of %d tokens could not be restored after a failed forward; starting "
                    "it empty", length)
        self.reset()

    def logits_after(self, seq: Sequence[int]) -> torch.Tensor:
        """Logits [1, V] for the token after ``seq``, reusing whatever prefix the cache holds."""
        self.rollback(min(common_prefix(self.ids, seq), len(seq) - 1))
        return self.extend(seq[len(self.ids):], last_only=True)

    def prefill(self, ids: Sequence[int], deadline: float | None = None, piece: int | None = None) -> bool:
        """Make the cache hold exactly ``ids``: keep the common prefix, run the rest, in pieces of
        ``piece`` tokens (all at once when None) until ``deadline`` (time.monotonic; at least one
        piece runs, so repeated calls always progress). True when it holds all of ``ids``; False
        when the deadline stopped it (call again to resume). The one prefill of the engine:
        requests, idle prefill and context warming use it."""
        self.rollback(common_prefix(self.ids, ids))
        while len(self.ids) < len(ids):
            end = len(ids) if piece is None else min(len(ids), len(self.ids) + piece)
            self.extend(ids[len(self.ids):end], last_only=True)
            if deadline is not None and len(self.ids) < len(ids) and time.monotonic() > deadline:
                return False
        return True

    def nbytes(self) -> int:
        """The cache's bytes, and the final hidden states kept for a feature head."""
        cache, trail = self.cache, self._trail  # None for a moment in ``reset``, which another thread's stats may see
        kept = trail.nbytes() if trail is not None else 0
        return (self.path.nbytes(cache) if cache is not None else 0) + kept

    def reset(self) -> None:
        self.ids = []
        self._trail = None
        self.cache = None  # its memory goes back first: a path with a pool of caches may need it
        self.cache = self.path.new_cache()


SUGGESTIONS_KEPT = 4  # completions per document indexed for lookup


@dataclass
class DocumentState:
    """What the engine keeps per document between requests: both models' KV states."""

    target: KVState
    draft: KVState | None
    context_index: NgramIndex = field(default_factory=NgramIndex)  # lookup index of the last context
    last_prefix: str = ""  # text before the cursor at the last request ...
    last_completion: str = ""  # ... and what was completed there
    suggestions: list[NgramIndex] = field(default_factory=list)  # recent completions, newest first
    window: int | None = None  # the narrow window's size in tokens where it holds one (``cold_start``)
    last_used: float = field(default_factory=time.monotonic)

    def remember(self, lead: Sequence[int], tokens: Sequence[int]) -> None:
        """Index a completion (``tokens``, after the prompt's last ``lead`` tokens) for lookup:
        the next request on this document, one keystroke later, mostly rewrites it."""
        if tokens:
            self.suggestions.insert(0, NgramIndex([*lead, *tokens]))
            del self.suggestions[SUGGESTIONS_KEPT:]

    def carry_memory(self, old: "DocumentState") -> None:
        """Take over what ``old`` remembered of this document's suggestions (a re-warmed state)."""
        self.last_prefix, self.last_completion = old.last_prefix, old.last_completion
        self.suggestions = old.suggestions

    def nbytes(self) -> int:
        return self.target.nbytes() + (self.draft.nbytes() if self.draft else 0)

    def prefill(self, ids: Sequence[int], deadline: float | None = None, piece: int | None = None) -> bool:
        """Both models' caches to ``ids`` (see ``KVState.prefill``); True when both hold it."""
        return all(kv.prefill(ids, deadline, piece) for kv in (self.target, self.draft) if kv is not None)


def cold_window(cold: ColdStart, caches: "CacheStore", key: str, prompt: Sequence[int]) -> Window | None:
    """The narrow window a request on document ``key`` with the full prompt ``prompt`` answers
    from (``ColdStart.window``), from what the document's cache still lacks of that prompt and the
    size of the window its narrow cache holds; None where the full prompt serves. Read alike by a
    request and by idle prefill, so both fill the window a keystroke there will ask for."""
    full, narrow = caches.peek(key), caches.peek(narrow_key(key))
    pending = len(prompt) - 1 - (common_prefix(full.target.ids, prompt) if full is not None else 0)
    return cold.window(pending, len(prompt), narrow.window if narrow is not None else None)


STATS_LARGEST = 8  # documents ``CacheStore.stats`` lists by their caches' bytes
# Closed documents' cache bytes freed before the C heap is trimmed. A torch cache's tensors of a
# few MiB come from glibc's heap, which keeps what is freed: gigabytes of freed K/V tensors stayed
# resident until ``malloc_trim`` gave nearly all of it back (docs/reliability.md).
TRIM_AFTER_DROPPED_BYTES = 64 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None elsewhere (musl, macOS: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


class CacheStore:
    """LRU of DocumentState under a byte budget. ``enforce_budget`` never evicts the state in use;
    a forward path whose caches live in a pool of its own (llama.cpp's contexts) calls
    ``reclaim`` when the pool is full, one least recently used document at a time.

    The worker thread puts, gets and evicts; documents close (``drop``) and ``stats`` read from
    other threads, hence the lock around the order."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._docs: OrderedDict[str, DocumentState] = OrderedDict()
        self._lock = threading.RLock()
        self.evictions = 0
        self.reclaimed = 0  # of the evictions, those a forward path asked for to free a cache
        self.dropped = 0  # bytes of dropped documents' caches since the heap was last trimmed
        self.trims = 0

    def get(self, key: str) -> DocumentState | None:
        with self._lock:
            state = self._docs.get(key)
            if state is not None:
                self._docs.move_to_end(key)
                state.last_used = time.monotonic()
        return state

    def peek(self, key: str) -> DocumentState | None:
        """The state under ``key``, its place in the LRU order left as it is."""
        return self._docs.get(key)

    def put(self, key: str, state: DocumentState) -> None:
        with self._lock:
            self._docs[key] = state
            self._docs.move_to_end(key)
        for kv in (state.target, state.draft):
            if kv is not None:
                kv.path.add_reclaimer(self.reclaim)

    def drop(self, key: str) -> None:
        """Forget a closed document's state; its caches go as it does (outside the lock: a
        path's finalizer may take a lock of its own), and the heap is trimmed once enough went."""
        with self._lock:
            states = [self._docs.pop(key)] if key in self._docs else []
        self._dropped(states)

    def clear(self) -> None:
        with self._lock:
            states = list(self._docs.values())
            self._docs.clear()
        self._dropped(states)

    def _dropped(self, states: list[DocumentState]) -> None:
        """Count the bytes of ``states`` (the caller's last references) and free them; trim the
        C heap once ``TRIM_AFTER_DROPPED_BYTES`` went since the last trim. Evicted documents
        count too: caches grow to their prompts' sizes, so a new document's seldom fits the
        blocks an evicted one left, and the heap kept them resident."""
        self.dropped += sum(state.nbytes() for state in states)
        states.clear()
        if self.dropped >= TRIM_AFTER_DROPPED_BYTES and _TRIM is not None:
            self.dropped = 0
            self.trims += 1
            _TRIM(0)

    def evict_except(self, keep: str | None) -> int:
        """Evict every document but ``keep``; returns how many went (the OOM path)."""
        with self._lock:
            victims = [self._docs.pop(k) for k in list(self._docs) if k != keep]
            self.evictions += len(victims)
        count = len(victims)
        del victims
        return count

    def reclaim(self) -> bool:
        """Evict the least recently used document (a forward path's pool is full); False when
        none is left. Its caches free as the state goes, unless a request in flight holds it."""
        with self._lock:
            if not self._docs:
                return False
            key, state = self._docs.popitem(last=False)
            self.evictions += 1
            self.reclaimed += 1
        log.debug("evicted KV cache of %s to free a cache for another document", key)
        del state
        return True

    def enforce_budget(self, keep: str | None = None) -> None:
        with self._lock:
            total = self.nbytes()
            victims = []
            for key in list(self._docs):
                if total <= self.budget_bytes:
                    break
                if key == keep:
                    continue
                victims.append(self._docs.pop(key))
                total -= victims[-1].nbytes()
                self.evictions += 1
                log.debug("evicted KV cache of %s (budget %d bytes)", key, self.budget_bytes)
        self._dropped(victims)

    def nbytes(self) -> int:
        with self._lock:
            return sum(state.nbytes() for state in self._docs.values())

    def stats(self, largest: int = STATS_LARGEST) -> dict[str, Any]:
        """Documents, bytes (what each forward path's caches hold in memory: a static cache's
        slots, a llama.cpp sequence's cells), the budget, evictions, and the ``largest``
        documents by bytes with the tokens their target cache holds."""
        with self._lock:
            sizes = [(key, state.nbytes(), len(state.target.ids)) for key, state in self._docs.items()]
            evictions, reclaimed = self.evictions, self.reclaimed
        sizes.sort(key=lambda item: -item[1])
        return {"documents": len(sizes), "bytes": sum(size for _, size, _ in sizes), "budget_bytes": self.budget_bytes,
                "evictions": evictions, "reclaimed": reclaimed, "heap_trims": self.trims,
                "largest": [{"document": key, "bytes": size, "tokens": tokens} for key, size, tokens in sizes[:largest]]}

    def __len__(self) -> int:
        return len(self._docs)
