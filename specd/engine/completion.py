"""One completion on the local engine, from a request to its result: the request's settings, its
prompt and the KV state it prefills (the document's cache, or a narrow window's on a cold
document, ``cold_start``), the planner over the drafters, the speculative loop's steps and the
stop rules; then what it leaves for the document's next request (its cache, its suggestion)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator, Protocol

import torch

from specd.engine.caches import CacheStore, DocumentState, cold_window, common_prefix
from specd.engine.cold_start import Window, narrow_key
from specd.engine.front.boundaries import surroundings
from specd.engine.front.corpus import OpenBuffers
from specd.engine.front.prompt import Prompt
from specd.engine.front.stops import StopRules
from specd.engine.lookup import NgramIndex
from specd.engine.options import RequestSettings, resolve_request
from specd.engine.resident import Resident, new_state
from specd.engine.speculation import drafters
from specd.engine.speculation.healing import HealingConstraint, HealingVocabulary
from specd.engine.speculation.loop import MERGED_PREFILL, decode_steps
from specd.engine.speculation.planner import DraftPlanner, PlannerMemory
from specd.engine.speculation.sampling import SamplingParams
from specd.engine.types import Cancelled, CompletionRequest, CompletionResult, Progress, SourceStats

ANONYMOUS = "<anonymous>"
SUGGESTION_LEAD = 8  # prompt tokens indexed before each remembered completion, so its start matches too


class CompletionHost(Resident, Protocol):
    """What a completion reads of its engine: with the caches, what the load made."""

    caches: CacheStore
    healing: HealingVocabulary
    stop_ids: set[int]
    vocab_size: int
    planning: PlannerMemory | None
    draft_confidence: float


@dataclass(frozen=True)
class LocalSettings:
    """A request's settings (``options.resolve_request``) with what is this engine's own."""

    asked: RequestSettings
    use_draft: bool  # asked for, and a draft model is loaded
    sampling: SamplingParams
    generator: torch.Generator | None


class Completions:
    """The local engine's completions. ``count`` takes each finished request's drafting stats."""

    def __init__(self, engine: CompletionHost, buffers: OpenBuffers,
                 count: Callable[[dict[str, SourceStats]], None]):
        self.engine = engine
        self.buffers = buffers  # other open buffers, searched by lookup
        self.count = count

    def settings(self, req: CompletionRequest) -> LocalSettings:
        """The request's settings (``options.resolve_request``: each one it leaves unset is the
        engine's option), with whether a draft model runs for it and the sampler."""
        asked = resolve_request(req, self.engine.options)
        sampling = SamplingParams(max(0.0, req.temperature), req.top_p)
        generator = None
        if not sampling.greedy:
            seed = req.seed if req.seed is not None else int(time.time_ns() % 2**31)
            generator = torch.Generator().manual_seed(seed)
        use_draft = asked.use_draft_model and self.engine.pair.draft is not None
        return LocalSettings(asked, use_draft, sampling, generator)

    def steps(self, req: CompletionRequest, text: str, offset: int,
              cancel: threading.Event | None) -> Generator[Progress, None, CompletionResult]:
        """The request on ``text`` at ``offset``, step by step (``Engine.complete_steps``)."""
        engine = self.engine
        started = time.monotonic()
        settings = self.settings(req)
        asked = settings.asked
        heal = asked.token_healing
        prompt = engine.front.request_prompt(req, text, offset, heal)
        key = req.uri or ANONYMOUS
        cached = engine.caches.get(key) if asked.kv_reuse else None
        window = self._narrow_window(asked, prompt, key)
        if window is not None:  # the full prompt keeps prefilling in idle time, in the document's cache
            engine.front.documents.resume_edited(req.uri, offset)
            prompt = engine.front.request_prompt(req, text, offset, heal, window=window.tokens)
            key = narrow_key(key)
            state = engine.caches.get(key) or new_state(engine.pair, engine.paths)
            state.window = window.tokens
        else:
            state = cached or new_state(engine.pair, engine.paths)
            if asked.kv_reuse:  # warm again: the narrow window's cache has served its turn
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
            engine.cold.observe(len(prompt.ids) - 1 - reused, time.monotonic() - prefill_started)
        prefill_s = time.monotonic() - started
        away = time.monotonic()
        try:
            yield Progress(0, str)
        except GeneratorExit:
            self._keep_prefill(asked, key, state)
            raise
        suspended_s += time.monotonic() - away
        if cancel is not None and cancel.is_set():
            self._keep_prefill(asked, key, state)
            raise Cancelled("completion cancelled")

        constraint = HealingConstraint(engine.healing, prompt.healed, prompt.newline) if prompt.healed else None
        planner = self._planner(state, settings, req, text, offset, prompt, constraint)
        stop = StopRules(engine.pair.tokenizer, engine.stop_ids, req.single_line, prompt.indent, healed=prompt.healed,
                         newline=prompt.newline if req.stop_at_line_ending else None,
                         rules=asked.rules, around=surroundings(text, offset))
        draft_forwards_before = state.draft.forwards if state.draft else 0
        steps = decode_steps(state.target, list(prompt.ids), planner, settings.sampling, asked.max_tokens, stop,
                             deadline=started + suspended_s + asked.budget_s, cancel=cancel,
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
                self._keep_prefill(asked, key, state)
                raise
        suspended_s += outcome.suspended_s
        stop_reason = stop.finish(outcome.stop_reason)  # a boundary the finished text shows
        completion = stop.text()
        if asked.kv_reuse:  # what the document's next request drafts from
            state.last_prefix, state.last_completion = text[:offset], completion
            state.remember(prompt.ids[-SUGGESTION_LEAD:], outcome.tokens)
            engine.caches.put(key, state)
            engine.caches.enforce_budget(keep=key)
        self.count(planner.stats)
        if window is not None:
            engine.cold.answered(window, req.uri)
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

    def _planner(self, state: DocumentState, settings: LocalSettings, req: CompletionRequest,
                 text: str, offset: int, prompt: Prompt, constraint: HealingConstraint | None = None) -> DraftPlanner:
        """A planner over the drafters of ``drafters.REGISTRY`` that have something to draft here;
        ``constraint``: the healed prompt's, for drafters that draft under it."""
        engine = self.engine
        inputs = drafters.DrafterInputs(
            state=state, options=engine.options, draft_confidence=engine.draft_confidence,
            sampling=settings.sampling, generator=settings.generator,
            vocab_size=engine.vocab_size, use_lookup=settings.asked.use_lookup, use_draft=settings.use_draft,
            lookup_sources=lambda: self._lookup_sources(req.uri),
            previous=lambda: self._continuation(state, text, offset, prompt),
            constraint=constraint, prompt_length=len(prompt.ids))
        return DraftPlanner(engine.planning, drafters.build(inputs),
                            trees=engine.options.token_tree and state.target.trees)

    def _lookup_sources(self, current: str | None) -> list[tuple[str, NgramIndex]]:
        encode = self.engine.front.prompts.encode
        sources = [("lookup:open", index) for index in self.buffers.indexes(current, encode)]
        return sources + [("lookup:workspace", index) for index in self.engine.front.corpus.indexes()]

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
        rest = prompt.healed + old_completion[len(typed):]
        return len(prompt.ids), self.engine.front.prompts.encode_continuation(rest)

    def _keep_prefill(self, asked: RequestSettings, key: str, state: DocumentState) -> None:
        """A request cancelled or dropped after its prefill leaves that KV to the next request on
        its document (superseded by a keystroke, given up by the client), unless the document has
        a cache already (another request's, or idle prefill's)."""
        caches = self.engine.caches
        if asked.kv_reuse and caches.peek(key) is None:
            caches.put(key, state)
            caches.enforce_budget(keep=key)

    def _narrow_window(self, asked: RequestSettings, prompt: Prompt, key: str) -> Window | None:
        """The narrow window a request answers from where its document's full prompt needs more
        prefill than ``engine.first_suggestion_ms`` affords (``cold_start``); None otherwise.
        Only for a document an editor holds open (the daemon mirrors those here): a one-shot
        request, its text sent with it, waits for its full prompt."""
        engine = self.engine
        if not asked.kv_reuse or engine.front.documents.text(key) is None:
            return None
        return cold_window(engine.cold, engine.caches, key, prompt.ids)

    def _retire_narrow(self, key: str, state: DocumentState) -> None:
        """Drop a document's narrow-window cache once its full prompt serves; what the narrow
        requests remembered of their suggestions carries over."""
        caches = self.engine.caches
        narrow = caches.get(narrow_key(key))
        if narrow is not None:
            state.carry_memory(narrow)
            caches.drop(narrow_key(key))
