"""The engine: a resident model pair, open documents, per-document KV caches, completions.

``Engine`` is the facade the daemon, the CLI, the bench and the tests hold; its parts, one
concern each, read and write the state it keeps: ``resident`` loads the pair (forward paths,
healing table, calibration), ``idle`` is the work between requests (prefill, lookup indexes,
context warming), ``completion`` runs one request from its prompt to its result.

Thread model: ``complete``, ``release`` and ``ensure_loaded`` run on one thread (the daemon's
model worker). Document methods (``open_document`` ...) may be called from any thread; they
only swap texts under a lock, and the token indexes are rebuilt lazily by the worker.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any, Callable, Generator

import torch

from specd.engine import compat
from specd.engine.caches import CacheStore, DocumentState
from specd.engine.cold_start import ColdStart, narrow_key
from specd.engine.completion import Completions
from specd.engine.front.corpus import OpenBuffers
from specd.engine.front.engine_front import EngineFront, Fronted
from specd.engine.front.prompt import Prompt
from specd.engine.idle import IdleWork
from specd.engine.models import ModelPair, StartupTimes
from specd.engine.options import FORWARD_OPTIONS, EngineOptions
from specd.engine.resident import (agreement_line, gc_paused, install, load_from_options, new_state,
                                   resolve_models, set_cpu_threads, widest_verify)
from specd.engine.speculation.agreement import Agreement
from specd.engine.speculation.costs import depth_ranges
from specd.engine.speculation.planner import PlannerMemory
from specd.engine.types import (CompletionRequest, CompletionResult, EngineError, Progress, SourceStats,
                                run_to_end)

__all__ = ["Engine", "resolve_models"]  # resolve_models: the bench resolves the models as the engine does

log = logging.getLogger(__name__)

MAX_OTHER_BUFFERS = 8  # open buffers searched by lookup, most recently edited first
BUFFER_QUIET_S = 2.0  # an edited buffer is re-indexed for lookup once unchanged this long (OpenBuffers)


class Engine(Fronted):
    """The local engine: one resident model pair serving completions on open documents. It holds
    the state (the pair and what its load measured, the caches, the counters); ``IdleWork`` and
    ``Completions`` work on it."""

    # stats() reads counters and sizes under short locks, never waiting on a completion: the
    # daemon's status may call it on its event loop (engine_api.StatsOnLoop).
    stats_on_loop = True

    def __init__(self, options: EngineOptions, pair: ModelPair | None = None,
                 loader: Callable[[EngineOptions], ModelPair] | None = None, paths: dict | None = None):
        """``paths``: forward paths to run ``pair`` on, built by another engine on the same pair
        (``share_paths``); None builds them here."""
        self.options = options
        self._loader = loader or load_from_options
        self.front = EngineFront(options)  # documents, workspace files, context chunks, prompts
        self._buffers = OpenBuffers(MAX_OTHER_BUFFERS, quiet_s=BUFFER_QUIET_S)  # open buffers' lookup indexes: idle time too
        self._lock = threading.Lock()  # the counters: stats() reads them from other threads
        self.caches = CacheStore(options.cache_budget_mb * 1024 * 1024)
        self.cold = ColdStart(options.first_suggestion_ms)  # prefill speed, and narrow windows for cold requests
        self.totals: dict[str, SourceStats] = {}
        self.requests = 0
        self.oom_retries = 0
        self.pair: ModelPair | None = None
        self.planning: PlannerMemory | None = None  # forward costs and acceptance of the loaded pair
        self.agreement: Agreement | None = None  # the draft model's with the target, measured at load
        self.draft_confidence = 0.0  # where the draft model stops a chain: the option, or measured (auto)
        self.paths: dict = {}  # role -> (forward path, why not lean / why this one)
        self.auto_choices: dict = {}  # role -> what forward_backend = auto measured and chose
        self.startup = StartupTimes()  # what the last load spent where (``_install``)
        self.import_s: float | None = None  # importing the engine's modules, when the loader measured it
        self.healing_source = ""  # where the healing table's texts came from (``healing_vocabulary``)
        self.costs_cached = False  # whether the last load's forward costs came from the cache
        self.idle = IdleWork(self, self._buffers)
        self.completions = Completions(self, self._buffers, self._count)
        if pair is not None:
            self._install(pair, paths)

    # -- lifecycle -------------------------------------------------------------------------

    def _install(self, pair: ModelPair, paths: dict | None = None) -> None:
        install(self, pair, paths)

    def _widest_verify(self) -> int:
        return widest_verify(self.options, self.paths)

    def _new_state(self) -> DocumentState:
        return new_state(self.pair, self.paths)

    def share_paths(self, options: EngineOptions) -> dict | None:
        """This engine's forward paths, for a second engine on the same pair with ``options``,
        when those would build the same ones: torch's paths hold no per-engine state (each
        document's cache is its own), and sharing them keeps one copy of the transposed weights
        and one measured choice of routes (``numpy_products``), so the two engines differ only
        in what their options change. llama.cpp's path holds its KV sequences: never shared."""
        same = all(getattr(options, name) == getattr(self.options, name) for name in FORWARD_OPTIONS)
        torch_only = all(path.name != "llamacpp" for path, _ in self.paths.values())
        return self.paths if same and self.paths and torch_only else None

    @property
    def loaded(self) -> bool:
        return self.pair is not None

    def ensure_loaded(self) -> None:
        if self.pair is None:
            set_cpu_threads(self.options.threads)
            with gc_paused():  # _install ends in settle_heap, which collects once
                self._install(self._loader(self.options))

    def release(self) -> None:
        """Drop models and caches (idle policy); documents stay. ``ensure_loaded`` reloads."""
        self.caches.clear()
        self.pair = None
        self.paths = {}  # they hold the models (and the lean path its transposed weight copies)
        self._buffers.forget_indexes()
        self.corpus.forget_indexes()
        # What settle_heap froze (the models among it) is collectable again: a model held in a
        # reference cycle would otherwise never be freed.
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- documents -------------------------------------------------------------------------

    def open_document(self, uri: str, text: str) -> None:
        self.front.documents.open(uri, text)
        self._buffers.set(uri, text)

    def update_document(self, uri: str, text: str, cursor: int | None = None) -> None:
        """The document's new text; ``cursor``, where the edit left the cursor, when known
        (``Documents.update``): idle time prefills the cache for a completion there."""
        self.front.documents.update(uri, text, cursor)
        self._buffers.set(uri, text)

    def focus_document(self, uri: str, offset: int) -> bool:
        """The editor's cursor came to rest at ``offset`` (``Documents.focus``): idle time
        prefills for a completion there, a narrow window first where the full prompt would keep
        the first suggestion waiting (``IdleWork.prefill_pending``)."""
        return self.front.documents.focus(uri, offset)

    def close_document(self, uri: str) -> None:
        self.front.close_document(uri)
        self._buffers.remove(uri)
        self.caches.drop(uri)
        self.caches.drop(narrow_key(uri))

    def set_corpus_file(self, name: str, text: str | None) -> None:
        """Extra lookup corpus (workspace files); ``None`` removes one. Tokenized later, by
        ``index_pending_corpus``, never on a request's path."""
        self.corpus.set(name, text)

    # -- idle work (``IdleWork``): each True while more of it remains ---------------------------

    def index_pending_corpus(self, budget_s: float) -> bool:
        """Tokenize and index workspace files for about ``budget_s``."""
        return self.idle.index_pending_corpus(budget_s)

    def index_pending_buffers(self, budget_s: float) -> bool:
        """Tokenize and index edited open buffers for about ``budget_s``."""
        return self.idle.index_pending_buffers(budget_s)

    def prefill_pending(self, budget_s: float) -> bool:
        """Prefill the most recently edited document's caches where its last edit ended."""
        return self.idle.prefill_pending(budget_s)

    def warm_context(self, budget_s: float) -> bool:
        """Choose the latest document's context chunks and warm a cache with a changed set."""
        return self.idle.warm_context(budget_s)

    # -- prompts ---------------------------------------------------------------------------

    def build_prompt(self, uri: str | None, text: str, offset: int, chunks=None, path: str | None = None,
                     heal: bool | None = None, window: int | None = None) -> Prompt:
        """The document's prompt for a cursor at ``offset`` (``EngineFront.build_prompt``; with
        ``window``, the narrow one), healed as ``engine.token_healing`` says unless ``heal`` says
        otherwise."""
        heal = self.options.token_healing if heal is None else heal
        return self.front.build_prompt(uri, text, offset, chunks, path, heal=heal, window=window)

    def healing_constraint(self, healed: str, prompt_length: int, newline: str = "\n"):
        """The token-healing constraint as ``generate(prefix_allowed_tokens_fn=...)`` takes it
        (None when nothing was healed): how anyone reproduces specd's output with plain HF."""
        return self.healing.prefix_allowed_fn(healed, prompt_length, newline) if healed else None

    # -- completion ------------------------------------------------------------------------

    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult:
        return run_to_end(self.complete_steps(req, cancel))

    def complete_steps(self, req: CompletionRequest,
                       cancel: threading.Event | None = None) -> Generator[Progress, None, CompletionResult]:
        """``complete`` step by step: yields a ``Progress`` after its prefill and each
        decode step, returns the result. Between steps the caller may run other requests' steps
        (each request works on its own document's state) or read the text so far."""
        self.ensure_loaded()
        text, offset = self.front.resolve(req)
        try:
            return (yield from self._complete(req, text, offset, cancel))
        except Exception as err:
            if not compat.is_oom(err):
                raise
            # Out of memory: drop every other document's cache and this one's, retry once.
            self.oom_retries += 1
            log.warning("out of memory during completion; evicting caches and retrying once")
            self.caches.evict_except(None)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            try:
                return (yield from self._complete(req, text, offset, cancel))
            except Exception as again:
                if compat.is_oom(again):
                    self.caches.clear()
                    raise EngineError("out of memory even after evicting all caches; "
                                      "lower engine.prefix_tokens or use a smaller model") from None
                raise

    def _complete(self, req: CompletionRequest, text: str, offset: int,
                  cancel: threading.Event | None) -> Generator[Progress, None, CompletionResult]:
        return self.completions.steps(req, text, offset, cancel)

    def _count(self, sources: dict[str, SourceStats]) -> None:
        with self._lock:  # stats() may read these from another thread
            self.requests += 1
            for name, s in sources.items():
                total = self.totals.setdefault(name, SourceStats())
                total.proposed += s.proposed
                total.accepted += s.accepted
                total.steps += s.steps

    def agreement_line(self) -> str:
        """The draft model's measured agreement, where its cut-off came from and what a chain
        token must reach to pay (``resident.agreement_line``); "" without a measurement."""
        return agreement_line(self.agreement, self.planning, self.options)

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        pair = self.pair
        info = pair.describe() if pair else {"target": self.options.target or "default", "draft": self.options.draft}
        if pair is not None:  # which forward runs each model, where only "models" is passed on (daemon status)
            info["forward"] = {role: path.name for role, (path, _) in self.paths.items()}
        with self._lock:
            acceptance = {name: {"proposed": s.proposed, "accepted": s.accepted, "rate": round(s.rate, 4)}
                          for name, s in self.totals.items()}
        return {
            "loaded": self.loaded,
            "models": info,
            **self.front.stats(),
            "workspace": self.corpus.stats(),
            "open_buffers": self._buffers.stats(),
            "cache": self.caches.stats(),
            "requests": self.requests,
            "oom_retries": self.oom_retries,
            "first_suggestion": self.cold.stats(),
            "acceptance": acceptance,
            "planner": self._planner_stats(),
            "forward": {role: {"path": path.name, "why": why, "detail": path.description or None,
                               **({"auto": self.auto_choices[role]} if role in self.auto_choices else {})}
                        for role, (path, why) in self.paths.items()}
            if self.pair is not None else None,
            "threads": torch.get_num_threads(),
            "startup_s": {step: round(seconds, 3) for step, seconds in self.startup.seconds.items()},
        }

    def _planner_stats(self) -> dict[str, Any] | None:
        memory = self.planning
        if memory is None or self.pair is None:
            return None
        return {**memory.costs.describe(),
                "draft_agreement": self.agreement.describe() if self.agreement else None,
                "draft_confidence": self.draft_confidence,
                "break_even_agreement": round(memory.costs.break_even_agreement(), 4) if self.pair.draft is not None
                else None,
                "acceptance": {kind: {"first": round(a.first, 3), "then": round(a.then, 3),
                                      "then_by_depth": {name: round(a.then_at(depth), 3) for name, depth in depth_ranges()}}
                               for kind, a in sorted(memory.acceptance.items())}}
