"""The one front the local and the remote engine share: open documents, the workspace files
that context chunks come from, the FIM template and prompt builder fitted to the model's
window, request checks, and the choice of each document's context chunks in idle time.

What differs between the two engines stays with them: the local one adds token healing, lookup
indexes and KV caches (and warms a fresh cache before a new chunk set is swapped in, through a
``context.Warmer``); the remote one sends the prompt to a server.
"""

from __future__ import annotations

from typing import Any

from specd.engine.front.context import ContextSelector, Warmer
from specd.engine.front.corpus import Corpus
from specd.engine.front.documents import Documents
from specd.engine.front.prompt import FimTemplate, Prompt, PromptBuilder, detect_family
from specd.engine.options import EngineOptions, fit_prompt_budget
from specd.engine.types import CompletionRequest, EngineError


class EngineFront:
    """Documents, context and prompts for one engine. Document and corpus methods may be called
    from any thread; prompt building runs on the engine's (the model worker's)."""

    def __init__(self, options: EngineOptions, track_edits: bool = True):
        self.options = options
        self.documents = Documents(track_edits)
        self.corpus = Corpus()  # workspace files (the local engine also indexes them for lookup)
        self.context = ContextSelector(options.context_tokens)
        self.template: FimTemplate | None = None
        self.prompts: PromptBuilder | None = None

    def install(self, tokenizer: Any, source: str, window: int | None, healing: Any = None) -> None:
        """Fit the prompt to a model: its FIM template (from the tokenizer, or as configured),
        its window, and a healing vocabulary where the engine heals the cursor's token."""
        options = self.options
        self.template = detect_family(tokenizer, source, options.fim_family)
        prefix, suffix, context = fit_prompt_budget(options.prefix_tokens, options.suffix_tokens,
                                                    options.context_tokens, window, options.max_tokens)
        self.prompts = PromptBuilder(tokenizer, self.template, prefix, suffix, context, layout=options.fim_layout)
        self.prompts.healing = healing

    # -- documents -------------------------------------------------------------------------

    def close_document(self, uri: str) -> None:
        self.documents.close(uri)
        self.context.forget(uri)

    # -- requests --------------------------------------------------------------------------

    def resolve(self, req: CompletionRequest) -> tuple[str, int]:
        """The request's text (its own, or the open document's) and cursor offset, checked."""
        text = req.text if req.text is not None else (self.documents.text(req.uri) if req.uri else None)
        if text is None:
            raise EngineError(f"document {req.uri!r} is not open and no text was given")
        offset = len(text) if req.offset is None else req.offset
        if not 0 <= offset <= len(text):
            raise EngineError(f"cursor offset {offset} is out of range 0..{len(text)}")
        return text, offset

    def build_prompt(self, uri: str | None, text: str, offset: int, chunks=None, path: str | None = None,
                     heal: bool = False, window: int | None = None) -> Prompt:
        """The document's prompt for a cursor at ``offset``; with ``window``, a narrow one about
        that many tokens long (``PromptBuilder.narrowed``: no chunks). In the anchored layout the
        anchor carries over from the document's previous prompt (``prompt.choose_anchor``), so
        the same sequence of requests gives the same ids whoever asks."""
        builder = self.prompts if window is None else self.prompts.narrowed(window)
        previous = self.documents.anchor(uri) if uri else None
        prompt = builder.build(text, offset, None if window else chunks, path, previous, heal=heal)
        if uri and builder.anchored:
            self.documents.set_anchor(uri, prompt.anchor)
        return prompt

    def request_prompt(self, req: CompletionRequest, text: str, offset: int, heal: bool,
                       window: int | None = None) -> Prompt:
        """The request's prompt, with its own context chunks or the document's active set (a
        changed set is warmed in idle time, never chosen on the request's path); with
        ``window``, the narrow one (``build_prompt``)."""
        chunks = req.extra_context
        if not chunks and req.uri and self.options.auto_context and window is None:
            chunks = self.context.chunks_for(req.uri, text, offset, req.path or req.uri)
        prompt = self.build_prompt(req.uri, text, offset, chunks, req.path or req.uri, heal=heal, window=window)
        if not prompt.ids:
            raise EngineError("empty prompt: nothing before the cursor and no FIM template to frame it")
        return prompt

    # -- idle work -------------------------------------------------------------------------

    def warm_context(self, budget_s: float, warmer: Warmer | None = None) -> bool:
        """One slice of choosing the latest document's context chunks (only for templates with
        a file separator); a changed set is swapped in once ``warmer`` made it ready, at once
        without one. True while more remains."""
        if self.prompts is None or not self.options.auto_context or not self.template.file_sep:
            return False
        self.context.budget_tokens = self.prompts.extra_tokens  # as fitted to the model's window
        return self.context.warm_step(open_docs=self.documents.texts(), corpus=self.corpus,
                                      encode=self.prompts.encode, budget_s=budget_s, warmer=warmer)

    def stats(self) -> dict[str, Any]:
        return {"fim_family": self.template.name if self.template else None, "documents": len(self.documents),
                "corpus_files": len(self.corpus), "context": self.context.stats()}


class Fronted:
    """What an engine with an ``EngineFront`` shows of it: the prompt builder, the FIM template,
    the context selector and the workspace corpus, read by the bench, ``specd eval`` and tests."""

    front: EngineFront

    @property
    def prompts(self) -> PromptBuilder | None:
        return self.front.prompts

    @property
    def template(self) -> FimTemplate | None:
        return self.front.template

    @property
    def context(self) -> ContextSelector:
        return self.front.context

    @property
    def corpus(self) -> Corpus:
        return self.front.corpus

    def document_text(self, uri: str) -> str | None:
        return self.front.documents.text(uri)
