"""The methods a benchmark compares: Hugging Face ``generate()`` peers and specd variants.

Every method answers ``run(completion, prompt_ids) -> Run`` on the same loaded models. The HF
peers get specd's own prompt ids (so all methods see identical inputs); specd variants go
through ``Engine.complete`` with the document text and cursor, so their wall time includes
building the prompt.

- ``hf_greedy``: ``generate(do_sample=False)`` of the target alone, cold every time. The reference
  on a transformers target (``reference.py``; on a GGUF target ``llamacpp`` is).
- ``hf_prefix_cache``: the same, but each document keeps its last ``DynamicCache`` and the ids it
  holds; the next request of that document crops it to the common token prefix and hands it to
  ``generate()``, which prefills only the rest (what llama.cpp's server does with
  ``cache_prompt``). Plain greedy decoding with prompt reuse: specd's KV reuse without drafting.
- ``hf_assisted``: ``generate(assistant_model=draft)`` with transformers' assistant defaults
  (5.x: ``num_assistant_tokens=20``, schedule ``"constant"``, ``assistant_confidence_threshold=0.4``):
  the draft proposes up to 20 tokens per step and stops early once its probability for its own
  token falls below 0.4. The threshold re-fits itself during a call only when scikit-learn is
  installed; the values in effect are in the report's ``hf_settings``.
- ``hf_lookup``: ``generate(prompt_lookup_num_tokens=10)``: HF's prompt-lookup decoding (n-grams
  of up to ``max_matching_ngram_size=2`` tokens matched in the prompt and output so far).
- ``llamacpp``: llama.cpp (llama-cpp-python) on a GGUF file written from the same weights
  (f32 weights and K/V on CPU; :mod:`specd.llamacpp.export`), or on the GGUF target itself (its
  own tensor types, K/V in f32), greedy, with one slot whose KV cache persists
  between requests and is re-used up to the longest common token prefix, as llama-server's
  ``cache_prompt`` does for a client: what a llama.vim / llama.vscode user runs.
- ``llamacpp_lookup``: the same with llama-cpp-python's prompt-lookup drafter
  (``LlamaPromptLookupDecoding``: n-grams of up to 2 tokens, 10 tokens per draft), verified in
  one batch. Both are skipped, with the reason in the report, when llama-cpp-python is not
  installed or the model cannot be written as GGUF.
- ``specd_llamacpp``: specd with ``engine.forward_backend = llamacpp`` (its decoding on llama.cpp's
  forward, same weights; a document's first prompt prefilled on torch and handed over, as
  ``engine.llamacpp_prefill`` says), a second engine on the same loaded pair; ``specd`` runs as
  configured (``engine.forward_backend = auto`` by default: per model, whichever forward
  measured faster at load; the report's ``forward`` says which).
- ``specd`` and its ablations (``specd_no_draft``, ``specd_no_lookup``, ``specd_no_reuse``,
  ``specd_no_workspace``, ``specd_no_tree``): the engine with parts switched off
  (``specd_no_tree``: a second engine on the same loaded pair with ``engine.token_tree`` off,
  its own calibration and planner memory).

All methods generate greedily with the same token limit and the same stop set (end-of-text and
FIM tokens); the indentation block-end rule is off, since HF peers cannot apply it, so the
token lists are directly comparable. A token list never includes the stop token.

Workspace files (the ``multi_file`` workload) reach the engine's lookup corpus before a specd
method runs, and are indexed then, outside the timed call: the daemon does that in idle time,
long before the keystroke. ``specd_no_workspace`` runs with an empty corpus.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specd.bench.workloads import Completion
from specd.engine import compat
from specd.engine.engine import Engine
from specd.engine.options import context_window
from specd.engine.caches import common_prefix
from specd.engine.front.boundaries import NO_BOUNDARIES
from specd.engine.speculation.costs import ForwardTally
from specd.engine.types import CompletionRequest, SourceStats

HF_PEERS = ("hf_greedy", "hf_prefix_cache", "hf_assisted", "hf_lookup")
LLAMACPP_PEERS = ("llamacpp", "llamacpp_lookup")
PEERS = HF_PEERS + LLAMACPP_PEERS  # what every method's speed is stated against
SPECD_METHODS = ("specd", "specd_llamacpp", "specd_no_draft", "specd_no_lookup", "specd_no_reuse",
                 "specd_no_workspace", "specd_no_tree")
ABLATIONS = tuple(m for m in SPECD_METHODS if m.startswith("specd_no_"))  # specd with one thing off
NEEDS_LLAMACPP = frozenset({*LLAMACPP_PEERS, "specd_llamacpp"})
ALL_METHODS = PEERS + SPECD_METHODS
NEEDS_DRAFT = frozenset({"hf_assisted", "specd_no_lookup"})
# Peers whose every target forward makes one token: at simulated costs each is one step.
ONE_TOKEN_PEERS = frozenset({"hf_greedy", "hf_prefix_cache", "llamacpp"})
PROMPT_LOOKUP_TOKENS = 10  # HF's documented example value for prompt_lookup_num_tokens
PROMPT_LOOKUP_MAX_NGRAM = 2  # transformers' default max_matching_ngram_size (left unset)
DEFAULT_WINDOW = 4096  # a target whose files state no window
PROMPT_MARKUP_TOKENS = 64  # a prompt's tokens beyond its text budgets: FIM and file-separator tokens
NO_TIME_BUDGET_MS = 10**9  # the bench compares full outputs; the engine's wall-clock stop stays out


@dataclass
class Run:
    """One method's answer to one completion."""

    tokens: list[int]
    ms: float  # wall time of the whole call, as the caller sees it
    target_forwards: int  # target forward passes that produced tokens (prefill excluded for specd)
    first_token_ms: float
    prefill_computed: int  # prompt tokens run through the target
    prefill_reused: int  # prompt tokens served from a cache
    sources: dict[str, SourceStats] = field(default_factory=dict)  # proposals/acceptances per drafter
    forwards: ForwardTally | None = None  # specd's: the forwards its steps ran, by width
    projected_ms: float | None = None  # those forwards at simulated costs (``--costs``), decode only

    @property
    def decode_ms(self) -> float:
        """Time after the first token: what drafting can shorten (prefill is the rest)."""
        return max(0.0, self.ms - self.first_token_ms)


class PromptIds(list):
    """Prompt token ids, and the text before the cursor that token healing cut from them: every
    method's output re-types it first (HF peers under ``prefix_allowed_tokens_fn``). ``chunks``
    and ``path``: the repo-level context the prompt holds (specd methods ask with the same).
    ``newline``: the document's line break, which the healing constraint keeps to."""

    def __init__(self, ids=(), healed: str = "", chunks=(), path: str | None = None, newline: str = "\n"):
        super().__init__(ids)
        self.healed = healed
        self.newline = newline
        self.chunks = list(chunks)
        self.path = path


class Method(Protocol):
    name: str

    def run(self, item: Completion, prompt_ids: list[int]) -> Run: ...

    def close_document(self, doc: str) -> None: ...


class ForwardWatch:
    """Counts a model's forward calls and notes when the first one ended (a forward hook)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.calls = 0
        self.first_end: float | None = None

    def _hook(self, module, inputs, output) -> None:
        self.calls += 1
        if self.first_end is None:
            self.first_end = time.perf_counter()

    def __enter__(self) -> "ForwardWatch":
        self._handle = self.model.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


class HfMethod:
    """``model.generate(do_sample=False)`` on the full prompt, with optional HF speculation."""

    def __init__(self, name: str, engine: Engine, max_tokens: int, **generate_kwargs):
        self.name = name
        self.engine = engine
        self.pair = engine.pair
        self.stop_ids = sorted(engine.stop_ids)
        self.max_tokens = max_tokens
        self.generate_kwargs = generate_kwargs
        tokenizer = self.pair.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def run(self, item: Completion, prompt_ids: list[int]) -> Run:
        target = self.pair.target
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.pair.device)
        with ForwardWatch(target) as watch:
            started = time.perf_counter()
            reused, cache_kwargs = self._prepare(item.doc, prompt_ids)  # part of the request's time
            # Token healing: the same constraint on the first tokens as specd's engine applies.
            allowed = self.engine.healing_constraint(getattr(prompt_ids, "healed", ""), len(prompt_ids),
                                                     getattr(prompt_ids, "newline", "\n"))
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                  do_sample=False, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                                  prefix_allowed_tokens_fn=allowed, **self.generate_kwargs, **cache_kwargs)
            sequence = out[0].tolist()  # .tolist() waits for the device
            ms = (time.perf_counter() - started) * 1000
        self._keep(item.doc, sequence, cache_kwargs)
        tokens = sequence[len(prompt_ids):]
        if tokens and tokens[-1] in self.stop_ids:  # generate() keeps the stop token; specd doesn't
            tokens.pop()
        first = ((watch.first_end or started) - started) * 1000
        return Run(tokens, ms, watch.calls, first, len(prompt_ids) - reused, reused)

    def _prepare(self, doc: str, prompt_ids: list[int]) -> tuple[int, dict]:
        """(prompt tokens served from a cache, extra ``generate()`` keywords): none, cold."""
        return 0, {}

    def _keep(self, doc: str, sequence: list[int], cache_kwargs: dict) -> None:
        pass

    def close_document(self, doc: str) -> None:
        pass


class HfPrefixCacheMethod(HfMethod):
    """Greedy ``generate()`` that reuses each document's KV cache for the common token prefix of
    its previous request, like llama.cpp's ``cache_prompt``: no drafting, only prompt reuse."""

    def __init__(self, name: str, engine: Engine, max_tokens: int):
        super().__init__(name, engine, max_tokens)
        # doc -> (cache, the token ids it holds: the last prompt and all but the last generated token)
        self._caches: dict[str, tuple[object, list[int]]] = {}

    def _prepare(self, doc: str, prompt_ids: list[int]) -> tuple[int, dict]:
        target = self.pair.target
        # Popped: if generate() fails the cache is gone rather than holding ids we no longer know.
        cache, held = self._caches.pop(doc, (None, []))
        # At least one prompt token must run: it yields the first generated token's logits.
        reused = min(common_prefix(held, prompt_ids), len(prompt_ids) - 1)
        if cache is None or reused <= 0:
            cache, reused = compat.new_cache(target), 0
        else:
            compat.crop_cache(cache, reused)
        # generate() takes a prefilled cache and runs only the ids after it.
        return reused, {compat.cache_keyword(target): cache}

    def _keep(self, doc: str, sequence: list[int], cache_kwargs: dict) -> None:
        (cache,) = cache_kwargs.values()
        # The cache now holds the prompt and every generated token but the last (never run).
        self._caches[doc] = (cache, sequence[:compat.cache_length(cache)])

    def close_document(self, doc: str) -> None:
        self._caches.pop(doc, None)


class LlamaCppMethod:
    """Greedy llama.cpp on the same weights (GGUF), one slot keeping its prompt cache between
    requests (llama-server's ``cache_prompt``), optionally with prompt-lookup drafting."""

    def __init__(self, name: str, engine: Engine, max_tokens: int, gguf_path, threads: int, lookup: bool):
        from specd.llamacpp.runtime import LOOKUP_TOKENS, LlamaSlot

        self.name = name
        self.engine = engine
        self.max_tokens = max_tokens
        self.stop_ids = set(engine.stop_ids)
        # K/V in the weights' precision, as specd_llamacpp keeps them (f32 on a GGUF target, as
        # the engine keeps them there): llama-server's f16 K/V moves logits enough to flip
        # near-ties, and the bench compares outputs token for token.
        self.slot = LlamaSlot(gguf_path, n_ctx=slot_window(engine) + max_tokens + LOOKUP_TOKENS + 64,
                              threads=threads, lookup=lookup, kv_f32=engine.pair.dtype == torch.float32)
        self._held_doc: str | None = None  # the document whose prompt the slot's cache holds

    def _constraint(self, healed: str, newline: str):
        """Token healing's constraint on the first tokens, as every other method gets it."""
        if not healed:
            return None
        healing = self.engine.healing

        def allowed(generated: list[int]):
            rest = healing.remaining(healed, generated) if len(generated) <= len(healed) else ""
            return healing.allowed(rest, newline).numpy() if rest else None

        return allowed

    def run(self, item: Completion, prompt_ids: list[int]) -> Run:
        self._held_doc = item.doc
        text = self.engine.pair.tokenizer.decode(list(prompt_ids), skip_special_tokens=False).encode()
        started = time.perf_counter()
        # llama-server receives text (llama.vim's input_prefix/input_suffix/input_extra) and
        # tokenizes it on every request: that is part of its time, as building the prompt is
        # part of specd's. Generation then runs on the given ids, so outputs stay comparable.
        self.slot.llama.tokenize(text, add_bos=False, special=True)
        tokenize_ms = (time.perf_counter() - started) * 1000
        gen = self.slot.generate(list(prompt_ids), self.max_tokens, self.stop_ids,
                                 self._constraint(getattr(prompt_ids, "healed", ""),
                                                  getattr(prompt_ids, "newline", "\n")))
        ms = (time.perf_counter() - started) * 1000
        sources = {}
        if self.slot.lookup is not None:
            sources["llamacpp_lookup"] = SourceStats(proposed=gen.drafted, accepted=gen.accepted,
                                                     steps=gen.forwards - 1)
        return Run(gen.tokens, ms, gen.forwards, tokenize_ms + gen.first_token_ms, gen.prefill_computed,
                   gen.prefill_reused, sources)

    def close_document(self, doc: str) -> None:
        # One slot for every document, as one llama-server slot per client; a closed document's
        # prompt goes with it, as every other method's cache does. (Else the warm-up, which runs
        # the first completion's own text, would leave that completion a warm cache here alone.)
        if doc == self._held_doc:
            self.slot.forget()
            self._held_doc = None


def slot_window(engine: Engine) -> int:
    """Prompt positions the llama.cpp peers' slot holds: the target's window; on a GGUF target
    at most the engine's prompt budgets (a real file declares 32k-128k trained positions, and a
    slot allocates its cells up front), with room for the FIM and file-separator tokens."""
    pair = engine.pair
    if not pair.gguf:
        return context_window(pair.target_name, pair.target.config) or DEFAULT_WINDOW
    opts = engine.options
    budget = opts.prefix_tokens + opts.suffix_tokens + opts.context_tokens + PROMPT_MARKUP_TOKENS
    return min(pair.window() or budget, budget)


class SpecdMethod:
    """``Engine.complete`` with a chosen set of drafters and KV reuse on or off. With reuse on,
    successive completions of one document share its cache, as in the daemon. With ``idle_ms``,
    each request on a document seen before is preceded, untimed, by what the daemon does between
    a keystroke and the request it triggers (specd-lsp's debounce): the edit reaches the engine
    (``update_document``) and idle prefill (``prefill_pending``) runs for up to ``idle_ms``."""

    idle_ms: float = 0.0

    def __init__(self, name: str, engine: Engine, max_tokens: int, use_draft: bool, use_lookup: bool,
                 kv_reuse: bool, use_workspace: bool = True):
        self.name = name
        self.engine = engine
        self.max_tokens = max_tokens
        self.use_draft, self.use_lookup, self.kv_reuse = use_draft, use_lookup, kv_reuse
        self.use_workspace = use_workspace

    def _uri(self, doc: str) -> str:
        return f"bench/{self.name}/{doc}"  # each method keeps its own caches

    def run(self, item: Completion, prompt_ids: list[int]) -> Run:
        request = CompletionRequest(
            uri=self._uri(item.doc), text=item.text, offset=item.offset, max_tokens=self.max_tokens,
            **NO_BOUNDARIES, stop_at_line_ending=False,  # generate() has neither: same tokens to the limit
            time_budget_ms=NO_TIME_BUDGET_MS, use_draft_model=self.use_draft,
            use_lookup=self.use_lookup, kv_reuse=self.kv_reuse,
            extra_context=list(getattr(prompt_ids, "chunks", [])), path=getattr(prompt_ids, "path", None),
        )
        sync_workspace(self.engine, dict(item.workspace) if self.use_workspace else {})
        if self.idle_ms > 0 and self.kv_reuse:
            self._idle(request.uri, item.text)
        before = self.engine.planning.ran.copy()
        started = time.perf_counter()
        result = self.engine.complete(request)
        ms = (time.perf_counter() - started) * 1000
        if result.prompt_ids != prompt_ids:
            raise RuntimeError(f"{self.name}: the engine built a different prompt for {item.label} "
                               "than the one the HF peers were given")
        return Run(list(result.token_ids), ms, result.target_forwards, result.first_token_ms,
                   result.prefill_computed, result.prefill_reused, dict(result.sources),
                   forwards=self.engine.planning.ran.since(before))

    def _idle(self, uri: str, text: str) -> None:
        """The edit, then idle prefill until it is done or ``idle_ms`` have passed (untimed)."""
        self.engine.update_document(uri, text)  # a document's first request opens it: nothing to prefill
        deadline = time.perf_counter() + self.idle_ms / 1000
        while (left := deadline - time.perf_counter()) > 0 and self.engine.prefill_pending(left):
            pass

    def close_document(self, doc: str) -> None:
        self.engine.close_document(self._uri(doc))  # its KV caches, and its prompt anchor if any


_HELD: "weakref.WeakKeyDictionary[Engine, dict[str, str]]" = weakref.WeakKeyDictionary()


def sync_workspace(engine: Engine, files: dict[str, str]) -> None:
    """Make the engine's workspace corpus hold exactly ``files``, indexed (untimed idle work)."""
    held = _HELD.setdefault(engine, {})
    if held == files:
        return
    for name in held.keys() - files.keys():
        engine.set_corpus_file(name, None)
    for name, text in files.items():
        if held.get(name) != text:
            engine.set_corpus_file(name, text)
    _HELD[engine] = dict(files)
    while engine.index_pending_corpus(1.0):
        pass


def sibling(engine: Engine, **options) -> Engine:
    """``engine`` itself where its options already say so, else a second engine on the same
    loaded pair with those options changed (its own calibration and planner; the same forward
    paths where the options leave them alike, ``Engine.share_paths``, so an ablation differs
    from ``specd`` only in what it turns off)."""
    from dataclasses import replace

    if all(getattr(engine.options, name) == value for name, value in options.items()):
        return engine
    changed = replace(engine.options, **options)
    return Engine(changed, pair=engine.pair, paths=engine.share_paths(changed))


def llamacpp_sibling(engine: Engine) -> Engine:
    """An engine on the same loaded pair whose forwards run on llama.cpp (ValueError with the
    reason when they cannot)."""
    sibling_engine = sibling(engine, forward_backend="llamacpp")
    path, why = sibling_engine.paths["target"]
    if path.name != "llamacpp":
        raise ValueError(why or f"the target runs on the {path.name} path")
    return sibling_engine


def make_method(name: str, engine: Engine, max_tokens: int, gguf: str | None = None, threads: int = 1,
                idle_ms: float = 0) -> Method:
    """``gguf``: the target's GGUF file, for the llama.cpp peers (``threads`` CPU threads);
    ``idle_ms``: the idle time specd methods get after each edit (``SpecdMethod``)."""
    method = _make_method(name, engine, max_tokens, gguf, threads)
    if isinstance(method, SpecdMethod):
        method.idle_ms = idle_ms
    return method


def _make_method(name: str, engine: Engine, max_tokens: int, gguf: str | None, threads: int) -> Method:
    draft = engine.pair.draft
    if name in LLAMACPP_PEERS:
        if gguf is None:
            raise ValueError(f"{name} needs the target as a GGUF file")
        return LlamaCppMethod(name, engine, max_tokens, gguf, threads, lookup=name == "llamacpp_lookup")
    if name == "hf_greedy":
        return HfMethod(name, engine, max_tokens)
    if name == "hf_prefix_cache":
        return HfPrefixCacheMethod(name, engine, max_tokens)
    if name == "hf_assisted":
        return HfMethod(name, engine, max_tokens, assistant_model=draft)
    if name == "hf_lookup":
        return HfMethod(name, engine, max_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
    has_draft = draft is not None
    if name == "specd_llamacpp":
        return SpecdMethod(name, llamacpp_sibling(engine), max_tokens, has_draft, True, True)
    if name == "specd":
        return SpecdMethod(name, engine, max_tokens, has_draft, True, True)
    if name == "specd_no_draft":
        return SpecdMethod(name, engine, max_tokens, False, True, True)
    if name == "specd_no_lookup":
        return SpecdMethod(name, engine, max_tokens, True, False, True)
    if name == "specd_no_reuse":
        return SpecdMethod(name, engine, max_tokens, has_draft, True, False)
    if name == "specd_no_workspace":
        return SpecdMethod(name, engine, max_tokens, has_draft, True, True, use_workspace=False)
    if name == "specd_no_tree":
        return SpecdMethod(name, sibling(engine, token_tree=False), max_tokens, has_draft, True, True)
    raise ValueError(f"unknown method {name!r} (known: {', '.join(ALL_METHODS)})")
