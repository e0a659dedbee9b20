"""The local engine's idle work: what the daemon's worker runs between jobs, each call for about
a budget of seconds, so the next request finds it done. The edited document's KV caches are
prefilled where its cursor is, edited open buffers and workspace files are indexed for lookup,
and a new set of context chunks is warmed into a fresh cache before it is swapped in."""

from __future__ import annotations

import time
from typing import Protocol

from specd.engine.caches import CacheStore, DocumentState, cold_window, common_prefix
from specd.engine.cold_start import ColdStart, narrow_key
from specd.engine.front.corpus import OpenBuffers
from specd.engine.front.prompt import Prompt
from specd.engine.resident import Resident, new_state, settle_heap, widest_verify


# After an edit to a document that answers from a narrow window, idle prefill of its full prompt
# waits this long (the window itself is brought to the cursor at once): the keystroke's request,
# sent after the editor's debounce, then finds the worker free instead of inside a prefill piece
# that no request can cut short. While the user types on, the full prompt waits; a pause resumes it.
TYPING_GRACE_S = 0.2


class IdleHost(Resident, Protocol):
    """What idle work reads of its engine."""

    caches: CacheStore
    cold: ColdStart

    def build_prompt(self, uri: str | None, text: str, offset: int, chunks=None, path: str | None = None,
                     heal: bool | None = None, window: int | None = None) -> Prompt: ...


class IdleWork:
    """The idle jobs of one engine. Each returns True while more of its work remains."""

    def __init__(self, engine: IdleHost, buffers: OpenBuffers):
        self.engine = engine
        self.buffers = buffers  # the open buffers' lookup indexes, the engine's

    def index_pending_corpus(self, budget_s: float) -> bool:
        """Tokenize and index workspace files for about ``budget_s``."""
        engine = self.engine
        if engine.pair is None:
            return False
        corpus = engine.front.corpus
        had_work = corpus.pending()
        more = corpus.index_pending(engine.front.prompts.encode, budget_s)
        if had_work and not more:
            settle_heap()  # the workspace's indexes live as long as the engine, like the models
        return more

    def index_pending_buffers(self, budget_s: float) -> bool:
        """Tokenize and index edited open buffers for about ``budget_s``. A request only finishes
        small ones (``OpenBuffers.indexes``)."""
        engine = self.engine
        if engine.pair is None:
            return False
        return self.buffers.index_pending(engine.front.prompts.encode, budget_s)

    def prefill_pending(self, budget_s: float) -> bool:
        """Prefill the KV caches (target and draft) of the most recently edited document for a
        completion where its last edit ended, in pieces a new request waits for at most
        (``ColdStart.piece_tokens``), so the next keystroke's request reuses them."""
        engine = self.engine
        if engine.pair is None or not engine.options.kv_reuse:
            return False
        documents = engine.front.documents
        edited = documents.pop_edited()
        if edited is None:
            return False
        uri, offset, text = edited
        if text is None or offset > len(text):
            return documents.edits_waiting()
        chunks = engine.front.context.active(uri) if engine.options.auto_context else []
        ids = engine.build_prompt(uri, text, offset, chunks, uri).ids
        prompt = ids[:-1]  # the last token rides with the request's first step
        caches = engine.caches
        if self._narrow_first(uri, text, offset, ids):
            documents.resume_edited(uri, offset)  # the full prompt next
            return True
        since = documents.edited_ago(uri)
        if since is not None and since < TYPING_GRACE_S and caches.peek(narrow_key(uri)) is not None:
            documents.resume_edited(uri, offset)  # the full prompt once the typing pauses
            time.sleep(min(budget_s, TYPING_GRACE_S - since))
            return True
        state = caches.get(uri)
        if state is None:
            state = new_state(engine.pair, engine.paths)
            caches.put(uri, state)
        before, started = common_prefix(state.target.ids, prompt), time.monotonic()
        done = state.prefill(prompt, deadline=started + budget_s, piece=engine.cold.piece_tokens())
        engine.cold.observe(len(state.target.ids) - before, time.monotonic() - started)
        if done:  # on a GPU with CUDA graphs: record what the next request would (else nothing)
            ahead = engine.options.max_tokens + widest_verify(engine.options, engine.paths)
            for kv in (state.target, state.draft):
                if kv is not None:
                    kv.prepare(ahead)
        else:
            documents.resume_edited(uri, offset)  # not done: resume here next slice
        caches.enforce_budget(keep=uri)
        return not done or documents.edits_waiting()

    def _narrow_first(self, uri: str, text: str, offset: int, prompt: list[int]) -> bool:
        """Where a request at ``offset`` would answer from a narrow window (``caches.cold_window``:
        the full ``prompt`` needs more prefill than the first suggestion's budget affords),
        prefill that window's prompt first, into the window's own cache: the keystroke there then
        finds it ready. False once it is (or where no window would serve): the full prompt's turn."""
        engine = self.engine
        caches = engine.caches
        window = cold_window(engine.cold, caches, uri, prompt)
        if window is None:
            return False
        key = narrow_key(uri)
        narrow = caches.peek(key)
        ids = engine.build_prompt(uri, text, offset, None, uri, window=window.tokens).ids[:-1]
        if narrow is not None and narrow.window == window.tokens and common_prefix(narrow.target.ids, ids) == len(ids):
            return False  # ready
        if narrow is None:
            narrow = new_state(engine.pair, engine.paths)
            caches.put(key, narrow)
        narrow.window = window.tokens
        before, started = common_prefix(narrow.target.ids, ids), time.monotonic()
        # In one forward, not in idle pieces: the window is what the budget affords, a request
        # at this cursor would prefill the same tokens itself, and one wide forward costs less
        # per token than several narrow ones.
        narrow.prefill(ids)
        engine.cold.observe(len(narrow.target.ids) - before, time.monotonic() - started)
        engine.cold.prefilled_ahead(window.tokens, uri)
        caches.enforce_budget(keep=key)
        return True

    def warm_context(self, budget_s: float) -> bool:
        """Choose the latest document's context chunks; when they changed, prefill a fresh KV
        state with them (in slices, ``CacheWarmer``) and swap it in."""
        engine = self.engine
        if engine.pair is None:
            return False
        return engine.front.warm_context(budget_s, CacheWarmer(engine))


class CacheWarmer:
    """``context.Warmer`` for the local engine: a new chunk set's prompt is prefilled into a fresh
    ``DocumentState`` in pieces a request waits for at most (``ColdStart.piece_tokens``, as the
    document's own idle prefill), then swapped in for the document."""

    def __init__(self, engine: IdleHost):
        self.engine = engine

    def begin(self, key: str, text: str, offset: int, chunks, path: str | None) -> tuple[list[int], DocumentState]:
        engine = self.engine
        anchor = engine.front.documents.anchor(key)  # the document's, left as it is
        prompt = engine.front.prompts.build(text, offset, chunks, path, anchor, heal=engine.options.token_healing)
        return prompt.ids[:-1], new_state(engine.pair, engine.paths)

    def advance(self, job: tuple[list[int], DocumentState], deadline: float) -> tuple[bool, int]:
        ids, state = job
        before = len(state.target.ids)
        done = state.prefill(ids, deadline=deadline, piece=self.engine.cold.piece_tokens())
        return done, len(state.target.ids) - before

    def adopt(self, key: str, job: tuple[list[int], DocumentState]) -> None:
        _, state = job
        caches = self.engine.caches
        old = caches.get(key)
        if old is not None:  # keep what the typing-through continuation needs
            state.carry_memory(old)
        caches.put(key, state)
        caches.enforce_budget(keep=key)
