"""The engine: a resident model pair, open documents, per-document KV caches, completions.

Thread model: ``complete``, ``release`` and ``ensure_loaded`` run on one thread (the daemon's
model worker). Document methods (``open_document`` ...) may be called from any thread; they
only swap texts under a lock, and the token indexes are rebuilt lazily by the worker.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from specd.engine import compat
from specd.engine.cold_start import ColdStart, Window, narrow_key
from specd.engine.front.corpus import OpenBuffers
from specd.engine.front.engine_front import EngineFront, Fronted
from specd.engine.speculation.agreement import NO_SAMPLE_CONFIDENCE, Agreement, choose_confidence, code_sample
from specd.engine.speculation.calibration_cache import cached_calibration, model_stamp
from specd.engine.speculation.costs import calibrate
from specd.engine.speculation import drafters
from specd.engine.speculation.loop import MERGED_PREFILL, decode_steps
from specd.engine.speculation.planner import TREE_BRANCHES, DraftPlanner, PlannerMemory
from specd.engine.speculation.healing import HealingConstraint
from specd.engine.speculation.healing_cache import healing_vocabulary
from specd.engine.caches import CacheStore, DocumentState, KVState, common_prefix
from specd.engine.lookup import NgramIndex
from specd.engine.forward.auto import choose_auto
from specd.engine.forward.choose import choose_forward_path, llamacpp_forward
from specd.engine.models import ModelPair, StartupTimes, stderr_is_terminal, load_pair
from specd.engine.options import FORWARD_OPTIONS, EngineOptions, resolve_request
from specd.engine.front.prompt import Prompt
from specd.engine.speculation.sampling import SamplingParams
from specd.engine.front.boundaries import surroundings
from specd.engine.front.stops import StopRules
from specd.suggestion_rules import BoundaryRules
from specd.engine.types import (Cancelled, CompletionRequest, CompletionResult, EngineError, ModelLoadError, Progress,
                                SourceStats, UnsupportedModel, run_to_end)
from specd.llamacpp.gguf import is_gguf_name

log = logging.getLogger(__name__)

WARM_PIECE_TOKENS = 256  # tokens prefilled per idle step while warming a new context chunk set
MAX_OTHER_BUFFERS = 8  # open buffers searched by lookup, most recently edited first
BUFFER_QUIET_S = 2.0  # an edited buffer is re-indexed for lookup once unchanged this long (OpenBuffers)
ANONYMOUS = "<anonymous>"
SUGGESTION_LEAD = 8  # prompt tokens indexed before each remembered completion, so its start matches too


class Engine(Fronted):
    # stats() reads counters and sizes under short locks, never waiting on a completion: the
    # daemon's status may call it on its event loop (engine_api.StatsOnLoop).
    stats_on_loop = True

    def __init__(self, options: EngineOptions, pair: ModelPair | None = None,
                 loader: Callable[[EngineOptions], ModelPair] | None = None, paths: dict | None = None):
        """``paths``: forward paths to run ``pair`` on, built by another engine on the same pair
        (``share_paths``); None builds them here."""
        self.options = options
        self._loader = loader or _load_from_options
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
        if pair is not None:
            self._install(pair, paths)

    # -- lifecycle -------------------------------------------------------------------------

    def _install(self, pair: ModelPair, paths: dict | None = None) -> None:
        self.pair = pair
        times = self.startup = StartupTimes()  # imports, the load's steps, then this engine's own
        if self.import_s is not None:
            times.add("imports", self.import_s)
            self.import_s = None  # a reload after ``release`` imports nothing
        times.seconds.update(pair.startup.seconds)
        self.vocab_size = pair.vocab_size()
        with times.step("healing table"):
            self.healing, self.healing_source = healing_vocabulary(pair.tokenizer, self.vocab_size, pair.tokenizer_hash)
        with times.step("prompts"):
            self.front.install(pair.tokenizer, pair.target_name, pair.window(), healing=self.healing)
            self.stop_ids = self.prompts.stop_ids()
        sources = {"target": pair.target_name, "draft": pair.draft_name}
        self.auto_choices = {}
        with times.step("forward paths"):
            self.paths = paths if paths is not None else {
                role: self._forward_path(model, sources[role], pair, role)
                for role, model in (("target", pair.target), ("draft", pair.draft)) if model is not None}
        for role, (path, why) in self.paths.items():
            detail = why or path.description
            log.info("%s forward: %s%s", role, path.name, f" ({detail})" if detail else "")
        with times.step("forward costs"):
            # On a sample of code, so the draft model's agreement with the target is measured too;
            # kept for the next load of the same models on the same paths (``calibration_cache``).
            calibration, self.costs_cached = cached_calibration(self._calibration_key(), lambda: calibrate(
                lambda: self._kv("target"), (lambda: self._kv("draft")) if pair.draft is not None else None,
                pair.input_vocab(), self._widest_verify(), pair.device,
                context=code_sample(self.prompts.encode, pair.input_vocab()), target_rows=self.vocab_size))
        costs, sample = calibration.costs, calibration.sample
        self.draft_confidence = self.options.draft_confidence
        if self.draft_confidence == "auto":
            self.draft_confidence = (NO_SAMPLE_CONFIDENCE if sample is None
                                     else choose_confidence(sample, costs.break_even_agreement()))
        self.agreement = Agreement.of(sample, self.draft_confidence) if sample is not None else None
        # The draft model's prior acceptance is what was measured (``agreement``), not a guess.
        priors = {drafters.ModelDrafter.source: self.agreement.prior} if self.agreement else {}
        self.planning = PlannerMemory(costs, priors=priors)
        if costs.target:  # until a prefill is timed, the widest calibrated forward's cost per token
            widest = max(costs.target)
            self.cold.seed(costs.target[widest] / widest)
        log.info("forward costs%s: %s", " (kept from an earlier load)" if self.costs_cached else "", costs.describe())
        if self.agreement is not None:
            log.info("draft model %s: its prior acceptance", self.agreement_line())
        for path, _ in self.paths.values():  # which forwards to record is learnt from requests
            path.forget_uses()
        with times.step("heap settling"):
            settle_heap()
        log.info("engine ready: target %s, draft %s, FIM family %s (%s layout), device %s",
                 pair.target_name, pair.draft_name, self.template.name, self.prompts.layout, pair.device)
        log.info("start-up: %s (%.2f s; healing table %s)", times.describe(), times.total(), self.healing_source)

    def _calibration_key(self) -> list | None:
        """What a kept calibration must match: both models' files, the forward paths that run
        them and the options that choose those, the precision, the device, the threads and the
        widths calibrated; None where a model is not a file on this disk."""
        pair = self.pair
        stamps = [model_stamp(pair.target_name), model_stamp(pair.draft_name)]
        if None in stamps:
            return None
        paths = [(role, path.name) for role, (path, _) in sorted(self.paths.items())]
        settings = [getattr(self.options, name) for name in FORWARD_OPTIONS]
        return [*stamps, paths, settings, pair.dtype, pair.device, torch.get_num_threads(), self.options.threads,
                torch.__version__, self._widest_verify(), self.vocab_size]

    def _widest_verify(self) -> int:
        """The widest target forward the planner may run: a chain, or a token tree of
        ``TREE_BRANCHES`` drafts where the target's path runs trees."""
        chain = max(self.options.lookup_max, self.options.draft_max) + 1
        target = self.paths.get("target")
        trees = self.options.token_tree and (target is None or target[0].trees)
        return chain + (TREE_BRANCHES - 1) * self.options.lookup_max if trees else chain

    def _forward_path(self, model, source: str, pair: ModelPair, role: str):
        """(path, why): as engine.forward_backend says: torch (``choose_forward_path``: the
        lean path, else transformers' with why), llamacpp (llama.cpp's forward where it can
        serve this model, else torch's with why), or auto (whichever a few forwards timed here
        say is faster, ``auto.choose_auto``; why holds the figures)."""
        backend = self.options.forward_backend
        if backend == "auto":
            choice = choose_auto(model, source, pair, self.options, role)
            self.auto_choices[role] = choice.figures
            return choice.path, choice.why
        if backend != "llamacpp":
            return choose_forward_path(model, self.options)
        try:
            return llamacpp_forward(model, source, pair, self.options), None
        except Exception as err:  # not installed, not exportable, not on a CPU: say so, serve on torch
            path, why = choose_forward_path(model, self.options)
            reason = f"engine.forward_backend llamacpp unavailable: {str(err).splitlines()[0]}"
            log.warning("%s; using the %s forward", reason, path.name)
            return path, reason + (f"; {why}" if why else "")

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

    def close_document(self, uri: str) -> None:
        self.front.close_document(uri)
        self._buffers.remove(uri)
        self.caches.drop(uri)
        self.caches.drop(narrow_key(uri))

    def set_corpus_file(self, name: str, text: str | None) -> None:
        """Extra lookup corpus (workspace files); ``None`` removes one. Tokenized later, by
        ``index_pending_corpus``, never on a request's path."""
        self.corpus.set(name, text)

    def index_pending_corpus(self, budget_s: float) -> bool:
        """Idle work: tokenize and index workspace files for about ``budget_s``; True while more remains."""
        if self.pair is None:
            return False
        had_work = self.corpus.pending()
        more = self.corpus.index_pending(self.prompts.encode, budget_s)
        if had_work and not more:
            settle_heap()  # the workspace's indexes live as long as the engine, like the models
        return more

    def index_pending_buffers(self, budget_s: float) -> bool:
        """Idle work: tokenize and index edited open buffers for about ``budget_s``; True while
        more remains. A request only finishes small ones (``OpenBuffers.indexes``)."""
        if self.pair is None:
            return False
        return self._buffers.index_pending(self.prompts.encode, budget_s)

    def prefill_pending(self, budget_s: float) -> bool:
        """Idle work: prefill the KV caches (target and draft) of the most recently edited
        document for a completion where its last edit ended, in pieces a new request waits for
        at most (``ColdStart.piece_tokens``), so the next keystroke's request reuses them. True
        while more remains."""
        if self.pair is None or not self.options.kv_reuse:
            return False
        documents = self.front.documents
        edited = documents.pop_edited()
        if edited is None:
            return False
        uri, offset, text = edited
        if text is None or offset > len(text):
            return documents.edits_waiting()
        chunks = self.context.active(uri) if self.options.auto_context else []
        prompt = self.build_prompt(uri, text, offset, chunks, uri).ids[:-1]
        state = self.caches.get(uri)
        if state is None:
            state = self._new_state()
            self.caches.put(uri, state)
        before, started = common_prefix(state.target.ids, prompt), time.monotonic()
        done = state.prefill(prompt, deadline=started + budget_s, piece=self.cold.piece_tokens())
        self.cold.observe(len(state.target.ids) - before, time.monotonic() - started)
        if done:  # on a GPU with CUDA graphs: record what the next request would (else nothing)
            ahead = self.options.max_tokens + self._widest_verify()
            for kv in (state.target, state.draft):
                if kv is not None:
                    kv.prepare(ahead)
        else:
            documents.resume_edited(uri, offset)  # not done: resume here next slice
        self.caches.enforce_budget(keep=uri)
        return not done or documents.edits_waiting()

    def warm_context(self, budget_s: float) -> bool:
        """Idle work: choose the latest document's context chunks; when they changed, prefill a
        fresh KV state with them (in slices, ``_CacheWarmer``) and swap it in. True while more
        remains."""
        if self.pair is None:
            return False
        return self.front.warm_context(budget_s, _CacheWarmer(self))

    def _kv(self, role: str) -> KVState:
        path, _ = self.paths[role]
        return KVState(self.pair.target if role == "target" else self.pair.draft, path)

    def _new_state(self) -> DocumentState:
        return DocumentState(self._kv("target"), self._kv("draft") if self.pair.draft is not None else None)

    def _lookup_sources(self, current: str | None) -> list[tuple[str, NgramIndex]]:
        sources = [("lookup:open", index) for index in self._buffers.indexes(current, self.prompts.encode)]
        return sources + [("lookup:workspace", index) for index in self.corpus.indexes()]

    # -- prompts ---------------------------------------------------------------------------

    def build_prompt(self, uri: str | None, text: str, offset: int, chunks=None, path: str | None = None,
                     heal: bool | None = None) -> Prompt:
        """The document's prompt for a cursor at ``offset`` (``EngineFront.build_prompt``),
        healed as ``engine.token_healing`` says unless ``heal`` says otherwise."""
        heal = self.options.token_healing if heal is None else heal
        return self.front.build_prompt(uri, text, offset, chunks, path, heal=heal)

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

    def _settings(self, req: CompletionRequest) -> "_RequestSettings":
        """The request's settings (``options.resolve_request``: each one it leaves unset is the
        engine's option), with what is this engine's own: whether a draft model is loaded, the sampler."""
        asked = resolve_request(req, self.options)
        sampling = SamplingParams(max(0.0, req.temperature), req.top_p)
        generator = None
        if not sampling.greedy:
            seed = req.seed if req.seed is not None else int(time.time_ns() % 2**31)
            generator = torch.Generator().manual_seed(seed)
        return _RequestSettings(
            use_draft=asked.use_draft_model and self.pair.draft is not None,
            use_lookup=asked.use_lookup,
            kv_reuse=asked.kv_reuse,
            max_tokens=asked.max_tokens,
            budget_s=asked.budget_s,
            heal=asked.token_healing,
            rules=asked.rules,
            sampling=sampling, generator=generator)

    def agreement_line(self) -> str:
        """The draft model's measured agreement (``Agreement.summary``), where its cut-off came from
        and what a chain token must reach to pay; "" without a measurement."""
        if self.agreement is None or self.planning is None:
            return ""
        how = "engine.draft_confidence = auto" if self.options.draft_confidence == "auto" else "engine.draft_confidence"
        return self.agreement.summary(f"{how}; a chain token pays above "
                                      f"{self.planning.costs.break_even_agreement():.0%}")

    def _planner(self, state: DocumentState, settings: "_RequestSettings", req: CompletionRequest,
                 text: str, offset: int, prompt: Prompt, constraint: HealingConstraint | None = None) -> DraftPlanner:
        """A planner over the drafters of ``drafters.REGISTRY`` that have something to draft here;
        ``constraint``: the healed prompt's, for drafters that draft under it."""
        inputs = drafters.DrafterInputs(
            state=state, options=self.options, draft_confidence=self.draft_confidence,
            sampling=settings.sampling, generator=settings.generator,
            vocab_size=self.vocab_size, use_lookup=settings.use_lookup, use_draft=settings.use_draft,
            lookup_sources=lambda: self._lookup_sources(req.uri),
            previous=lambda: self._continuation(state, text, offset, prompt),
            constraint=constraint, prompt_length=len(prompt.ids))
        return DraftPlanner(self.planning, drafters.build(inputs), trees=self.options.token_tree and state.target.trees)

    def _complete(self, req: CompletionRequest, text: str, offset: int,
                  cancel: threading.Event | None) -> Generator[Progress, None, CompletionResult]:
        started = time.monotonic()
        settings = self._settings(req)
        heal = settings.heal
        prompt = self.front.request_prompt(req, text, offset, heal)
        key = req.uri or ANONYMOUS
        cached = self.caches.get(key) if settings.kv_reuse else None
        window = self._narrow_window(settings, cached, prompt, key)
        if window is not None:  # the full prompt keeps prefilling in idle time, in the document's cache
            self.front.documents.resume_edited(req.uri, offset)
            prompt = self.front.request_prompt(req, text, offset, heal, window=window.tokens)
            key = narrow_key(key)
            state = self.caches.get(key) or self._new_state()
            state.window = window.tokens
        else:
            state = cached or self._new_state()
            if settings.kv_reuse:  # warm again: the narrow window's cache has served its turn
                self._retire_narrow(key, state)

        # Prefill: the target holds prompt[:-1] (the last token rides with the first step),
        # reusing the longest common prefix; or, where prompt tokens cost no logits (computed on
        # demand, or only those asked for), a keystroke's few new tokens ride with the first step
        # too: one forward to the first token, as llama.cpp's server runs a prompt's new tail. The
        # draft model catches up only if the planner runs it.
        # The prefill runs in one go (a forward path may hand the whole prompt's K/V over at
        # once); other requests' steps wait for it.
        reused = min(common_prefix(state.target.ids, prompt.ids), len(prompt.ids) - 1)
        suspended_s = 0.0
        if state.target.merges_prompt and len(prompt.ids) - reused <= MERGED_PREFILL:
            state.target.rollback(reused)
        else:
            prefill_started = time.monotonic()
            state.target.prefill(prompt.ids[:-1])
            self.cold.observe(len(prompt.ids) - 1 - reused, time.monotonic() - prefill_started)
        prefill_s = time.monotonic() - started
        away = time.monotonic()
        try:
            yield Progress(0, str)
        except GeneratorExit:
            self._keep_prefill(settings, key, state)
            raise
        suspended_s += time.monotonic() - away
        if cancel is not None and cancel.is_set():
            self._keep_prefill(settings, key, state)
            raise Cancelled("completion cancelled")

        constraint = HealingConstraint(self.healing, prompt.healed, prompt.newline) if prompt.healed else None
        planner = self._planner(state, settings, req, text, offset, prompt, constraint)
        stop = StopRules(self.pair.tokenizer, self.stop_ids, req.single_line, prompt.indent, healed=prompt.healed,
                         newline=prompt.newline if req.stop_at_line_ending else None,
                         rules=settings.rules, around=surroundings(text, offset))
        draft_forwards_before = state.draft.forwards if state.draft else 0
        steps = decode_steps(state.target, list(prompt.ids), planner, settings.sampling, settings.max_tokens, stop,
                             deadline=started + suspended_s + settings.budget_s, cancel=cancel,
                             generator=settings.generator, constraint=constraint)
        while True:
            try:
                tokens = next(steps)
            except StopIteration as done:
                outcome = done.value
                break
            try:
                yield Progress(tokens, stop.text)
            except GeneratorExit:
                self._keep_prefill(settings, key, state)
                raise
        suspended_s += outcome.suspended_s
        stop_reason = stop.finish(outcome.stop_reason)  # a boundary the finished text shows
        completion = stop.text()
        if settings.kv_reuse:  # what the document's next request drafts from
            state.last_prefix, state.last_completion = text[:offset], completion
            state.remember(prompt.ids[-SUGGESTION_LEAD:], outcome.tokens)
            self.caches.put(key, state)
            self.caches.enforce_budget(keep=key)
        self._count(planner.stats)
        if window is not None:
            self.cold.answered(window, req.uri)
        total_s = time.monotonic() - started
        return CompletionResult(
            text=completion,
            token_ids=outcome.tokens,
            prompt_ids=list(prompt.ids),
            stop_reason=stop_reason,
            healed=prompt.healed,
            target_forwards=outcome.target_forwards,
            draft_forwards=(state.draft.forwards - draft_forwards_before) if state.draft else 0,
            prefill_computed=len(prompt.ids) - 1 - reused,
            prefill_reused=reused,
            sources=planner.stats,
            prefill_ms=prefill_s * 1000,
            first_token_ms=(prefill_s + outcome.first_token_s) * 1000,
            total_ms=total_s * 1000,
            suspended_ms=suspended_s * 1000,
            window_tokens=window.tokens if window is not None else None,
        )

    def _keep_prefill(self, settings: "_RequestSettings", key: str, state: DocumentState) -> None:
        """A request cancelled or dropped after its prefill leaves that KV to the next request on
        its document (superseded by a keystroke, given up by the client), unless the document has
        a cache already (another request's, or idle prefill's)."""
        if settings.kv_reuse and self.caches.peek(key) is None:
            self.caches.put(key, state)
            self.caches.enforce_budget(keep=key)

    def _narrow_window(self, settings: "_RequestSettings", state: DocumentState | None, prompt: Prompt,
                       key: str) -> Window | None:
        """The narrow window a request answers from where its document's full prompt needs more
        prefill than ``engine.first_suggestion_ms`` affords (``cold_start``); None otherwise.
        Only for a document an editor holds open (the daemon mirrors those here): a one-shot
        request, its text sent with it, waits for its full prompt."""
        if not settings.kv_reuse or self.front.documents.text(key) is None:
            return None
        pending = len(prompt.ids) - 1 - (common_prefix(state.target.ids, prompt.ids) if state is not None else 0)
        narrow = self.caches.peek(narrow_key(key))
        return self.cold.window(pending, len(prompt.ids), narrow.window if narrow is not None else None)

    def _retire_narrow(self, key: str, state: DocumentState) -> None:
        """Drop a document's narrow-window cache once its full prompt serves; what the narrow
        requests remembered of their suggestions carries over."""
        narrow = self.caches.get(narrow_key(key))
        if narrow is not None:
            state.carry_memory(narrow)
            self.caches.drop(narrow_key(key))

    def _count(self, sources: dict[str, SourceStats]) -> None:
        with self._lock:  # stats() may read these from another thread
            self.requests += 1
            for name, s in sources.items():
                total = self.totals.setdefault(name, SourceStats())
                total.proposed += s.proposed
                total.accepted += s.accepted
                total.steps += s.steps

    def _continuation(self, state: DocumentState, text: str, offset: int,
                      prompt: Prompt) -> tuple[int, list[int]] | None:
        """If the user typed (part of) the last suggestion, its rest drafts this completion:
        (the prompt's length in tokens, the rest's tokens)."""
        old_prefix, old_completion = state.last_prefix, state.last_completion
        if not old_completion or offset < len(old_prefix) or not text.startswith(old_prefix):
            return None
        typed = text[len(old_prefix):offset]
        if len(typed) >= len(old_completion) or not old_completion.startswith(typed):
            return None
        # The output re-types the healed text first, then the suggestion's rest.
        return len(prompt.ids), self.prompts.encode_continuation(prompt.healed + old_completion[len(typed):])

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
                "acceptance": {kind: {"first": round(a.first, 3), "then": round(a.then, 3)}
                               for kind, a in sorted(memory.acceptance.items())}}


@dataclass(frozen=True)
class _RequestSettings:
    use_draft: bool
    use_lookup: bool
    kv_reuse: bool  # and the request names a document
    max_tokens: int
    budget_s: float
    heal: bool  # token healing
    rules: BoundaryRules  # suggestion boundaries
    sampling: SamplingParams
    generator: torch.Generator | None


class _CacheWarmer:
    """``context.Warmer`` for the local engine: a new chunk set's prompt is prefilled into a fresh
    ``DocumentState`` in slices of ``WARM_PIECE_TOKENS``, then swapped in for the document."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def begin(self, key: str, text: str, offset: int, chunks, path: str | None) -> tuple[list[int], DocumentState]:
        engine = self.engine
        anchor = engine.front.documents.anchor(key)  # the document's, left as it is
        prompt = engine.prompts.build(text, offset, chunks, path, anchor, heal=engine.options.token_healing)
        return prompt.ids[:-1], engine._new_state()

    def advance(self, job: tuple[list[int], DocumentState], deadline: float) -> tuple[bool, int]:
        ids, state = job
        before = len(state.target.ids)
        done = state.prefill(ids, deadline=deadline, piece=WARM_PIECE_TOKENS)
        return done, len(state.target.ids) - before

    def adopt(self, key: str, job: tuple[list[int], DocumentState]) -> None:
        _, state = job
        caches = self.engine.caches
        old = caches.get(key)
        if old is not None:  # keep what the typing-through continuation needs
            state.carry_memory(old)
        caches.put(key, state)
        caches.enforce_budget(keep=key)


def settle_heap() -> None:
    """Collect garbage, then take every object alive now out of the cyclic garbage collector's
    sight (``gc.freeze``). The loaded models, tokenizer, imported modules and lookup indexes live
    as long as the engine: hundreds of thousands of objects once torch and transformers are
    imported, and a full collection walks them all. CPython runs one whenever enough new objects
    have survived since the last, so now and then a cold completion would wait for it (the cost
    measured: docs/engine.md). Frozen, they are skipped: later full collections walk only what
    came after (``release`` unfreezes them before the models are dropped)."""
    gc.collect()
    gc.freeze()


@contextmanager
def gc_paused():
    """The cyclic garbage collector off for a load, then back as it was. A load allocates
    millions of objects (a tokenizer's vocabulary and merges, the healing table) on top of the
    heap torch and transformers left, and each full collection CPython starts on the way walks
    that whole heap again: a 152k-token tokenizer loaded measurably slower with it on. The load
    ends in ``settle_heap``, one collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def set_cpu_threads(threads: int) -> None:
    """torch's CPU thread count. Small models gain little from threads, and a daemon that takes
    every core slows the editor beside it (and itself, when oversubscribed): auto = half the
    cores, at most 4."""
    import os

    if threads <= 0:
        threads = max(1, min(4, (os.cpu_count() or 2) // 2))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _load_from_options(options: EngineOptions) -> ModelPair:
    target, draft = resolve_models(options)
    return load_pair(target, draft or None, options.device, options.dtype, options.trust_remote_code)


def resolve_models(options: EngineOptions) -> tuple[str, str]:
    """What ``model.target`` / ``model.draft`` load as: the default model's file (fetched on
    first use) for an empty target, the demo pair's folders for ``demo``, and a GGUF file's
    dequantized folder where it runs on torch (``gguf_on_torch``). The bench resolves with this
    too, so its reference follows the weights the engine really runs."""
    from specd.engine.builtin import DEFAULT, FetchError, resolve_names

    if not options.target:
        log.info("no model configured (model.target): serving the default, %s", DEFAULT.describe())
    try:
        target, draft = resolve_names(options.target, options.draft, say=log.info)
    except FetchError as err:
        raise ModelLoadError(str(err)) from None
    if is_gguf_name(target) and gguf_on_torch(options):
        target, draft = dequantized(target, "target"), dequantized(draft, "draft") if draft else draft
    return target, draft


def gguf_on_torch(options: EngineOptions) -> bool:
    """Whether a GGUF target runs on torch's forward, its weights dequantized: where the options
    pin torch, name a device llama.cpp's CPU backend does not serve, find a GPU, or where
    llama-cpp-python is not installed."""
    from specd.llamacpp.runtime import available

    if options.forward_backend == "torch" or options.device not in ("auto", "cpu"):
        return True
    if options.device == "auto" and torch.cuda.is_available():
        return True
    return not available()


def dequantized(name: str, role: str) -> str:
    """The transformers folder of GGUF file ``name``, converted once (``specd.llamacpp.dequantize``)."""
    from specd.llamacpp.dequantize import DequantizeError, dequantized_folder

    try:
        return str(dequantized_folder(name, progress=stderr_is_terminal()))
    except DequantizeError as err:
        raise UnsupportedModel(f"{role} model {err}") from None
