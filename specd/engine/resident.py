"""Loading the local engine's model pair: what ``model.target`` / ``model.draft`` resolve to, the
forward path each model runs on, the healing table and prompts fitted to the tokenizer, and the
load's calibration (forward costs, the draft model's agreement) that the planner starts from.
Also what a load sets for the whole process: torch's CPU threads and a settled heap.

``install`` writes what it makes onto the engine (``Installed`` names those attributes) in the
order it makes them, so the engine's ``stats`` shows a load's progress as it goes."""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from typing import Protocol

import torch

from specd.engine.caches import DocumentState, KVState
from specd.engine.cold_start import ColdStart
from specd.engine.forward.auto import choose_auto
from specd.engine.forward.choose import choose_forward_path, llamacpp_forward
from specd.engine.head_state import HEAD_PATH, HeadState
from specd.engine.front.engine_front import EngineFront
from specd.engine.models import ModelPair, StartupTimes, is_head, load_pair, stderr_is_terminal
from specd.engine.options import FORWARD_OPTIONS, EngineOptions
from specd.engine.speculation import drafters
from specd.engine.speculation.agreement import NO_SAMPLE_CONFIDENCE, Agreement, choose_confidence, code_sample
from specd.engine.speculation.calibration_cache import cached_calibration, model_stamp
from specd.engine.speculation.costs import calibrate
from specd.engine.speculation.healing import HealingVocabulary
from specd.engine.speculation.healing_cache import healing_vocabulary
from specd.engine.speculation.planner import TREE_BRANCHES, PlannerMemory
from specd.engine.types import ModelLoadError, UnsupportedModel
from specd.llamacpp.gguf import is_gguf_name

log = logging.getLogger("specd.engine.engine")  # what a load says, the engine says: one logger for both


class Resident(Protocol):
    """What each part of the engine reads of it: its options and front, the prefill speed, and
    the loaded pair (None once released) on its forward paths."""

    options: EngineOptions
    front: EngineFront
    cold: ColdStart
    pair: ModelPair | None
    paths: dict  # role -> (forward path, why not lean / why this one)


class Installed(Resident, Protocol):
    """What ``install`` also writes: everything an engine holds from a load until ``release``."""

    startup: StartupTimes
    import_s: float | None
    vocab_size: int
    healing: HealingVocabulary
    healing_source: str
    stop_ids: set[int]
    auto_choices: dict
    costs_cached: bool
    draft_confidence: float
    agreement: Agreement | None
    planning: PlannerMemory | None


def install(engine: Installed, pair: ModelPair, paths: dict | None = None) -> None:
    """Fit ``engine`` to ``pair``: the healing table, the prompts, the forward paths (``paths``
    where another engine on the same pair built them, ``share_paths``), the calibration, the
    planner's memory; then settle the heap and log the start-up by step."""
    engine.pair = pair
    times = engine.startup = StartupTimes()  # imports, the load's steps, then this engine's own
    if engine.import_s is not None:
        times.add("imports", engine.import_s)
        engine.import_s = None  # a reload after ``release`` imports nothing
    times.seconds.update(pair.startup.seconds)
    engine.vocab_size = pair.vocab_size()
    with times.step("healing table"):
        engine.healing, engine.healing_source = healing_vocabulary(
            pair.tokenizer, engine.vocab_size, pair.tokenizer_hash)
    front = engine.front
    with times.step("prompts"):
        front.install(pair.tokenizer, pair.target_name, pair.window(), healing=engine.healing)
        engine.stop_ids = front.prompts.stop_ids()
    sources = {"target": pair.target_name, "draft": pair.draft_name}
    engine.auto_choices = {}
    with times.step("forward paths"):
        engine.paths = paths if paths is not None else {
            role: forward_path(model, sources[role], pair, role, engine.options, engine.auto_choices)
            for role, model in (("target", pair.target), ("draft", pair.draft)) if model is not None}
    for role, (path, why) in engine.paths.items():
        detail = why or path.description
        log.info("%s forward: %s%s", role, path.name, f" ({detail})" if detail else "")
    target_path, why = engine.paths["target"]
    if is_head(pair.draft) and not target_path.gives_hidden:
        raise ModelLoadError(f"draft {pair.draft_name} is a feature head, which reads the target's final hidden "
                             f"states; the target's {target_path.name} forward does not give them"
                             f"{f' ({why})' if why else ''}")
    _calibrate(engine, pair, times)
    for path, _ in engine.paths.values():  # which forwards to record is learnt from requests
        path.forget_uses()
    with times.step("heap settling"):
        settle_heap()
    log.info("engine ready: target %s, draft %s, FIM family %s (%s layout), device %s",
             pair.target_name, pair.draft_name, front.template.name, front.prompts.layout, pair.device)
    log.info("start-up: %s (%.2f s; healing table %s)", times.describe(), times.total(), engine.healing_source)


def _calibrate(engine: Installed, pair: ModelPair, times: StartupTimes) -> None:
    """The forward costs and the draft model's agreement, measured (or kept from an earlier load),
    and what follows from them: the draft model's confidence cut-off, the planner's memory, a
    first estimate of the prefill speed."""
    options, paths = engine.options, engine.paths
    with times.step("forward costs"):
        # On a sample of code, so the draft model's agreement with the target is measured too;
        # kept for the next load of the same models on the same paths (``calibration_cache``).
        calibration, engine.costs_cached = cached_calibration(
            calibration_key(pair, paths, options, engine.vocab_size), lambda: calibrate(
                lambda: new_kv(pair, paths, "target"),
                (lambda target: new_draft(pair, paths, target)) if pair.draft is not None else None,
                pair.input_vocab(), widest_verify(options, paths), pair.device,
                context=code_sample(engine.front.prompts.encode, pair.input_vocab()), target_rows=engine.vocab_size))
    costs, sample = calibration.costs, calibration.sample
    engine.draft_confidence = options.draft_confidence
    if engine.draft_confidence == "auto":
        engine.draft_confidence = (NO_SAMPLE_CONFIDENCE if sample is None
                                   else choose_confidence(sample, costs.break_even_agreement()))
    engine.agreement = Agreement.of(sample, engine.draft_confidence) if sample is not None else None
    # The draft model's prior acceptance is what was measured (``agreement``), not a guess.
    priors = {drafters.ModelDrafter.source: engine.agreement.prior} if engine.agreement else {}
    engine.planning = PlannerMemory(costs, priors=priors)
    if costs.target:  # until a prefill is timed, the widest calibrated forward's cost per token
        widest = max(costs.target)
        engine.cold.seed(costs.target[widest] / widest)
    log.info("forward costs%s: %s", " (kept from an earlier load)" if engine.costs_cached else "", costs.describe())
    if engine.agreement is not None:
        log.info("draft model %s: its prior acceptance", agreement_line(engine.agreement, engine.planning, options))


def agreement_line(agreement: Agreement | None, planning: PlannerMemory | None, options: EngineOptions) -> str:
    """The draft model's measured agreement (``Agreement.summary``), where its cut-off came from
    and what a chain token must reach to pay; "" without a measurement."""
    if agreement is None or planning is None:
        return ""
    how = "engine.draft_confidence = auto" if options.draft_confidence == "auto" else "engine.draft_confidence"
    return agreement.summary(f"{how}; a chain token pays above {planning.costs.break_even_agreement():.0%}")


def calibration_key(pair: ModelPair, paths: dict, options: EngineOptions, vocab_size: int) -> list | None:
    """What a kept calibration must match: both models' files, the forward paths that run
    them and the options that choose those, the precision, the device, the threads and the
    widths calibrated; None where a model is not a file on this disk."""
    stamps = [model_stamp(pair.target_name), model_stamp(pair.draft_name)]
    if None in stamps:
        return None
    roles = [(role, path.name) for role, (path, _) in sorted(paths.items())]
    settings = [getattr(options, name) for name in FORWARD_OPTIONS]
    return [*stamps, roles, settings, pair.dtype, pair.device, torch.get_num_threads(), options.threads,
            torch.__version__, widest_verify(options, paths), vocab_size]


def widest_verify(options: EngineOptions, paths: dict) -> int:
    """The widest target forward the planner may run: a chain, or a token tree of
    ``TREE_BRANCHES`` drafts where the target's path runs trees."""
    chain = max(options.lookup_max, options.draft_max) + 1
    target = paths.get("target")
    trees = options.token_tree and (target is None or target[0].trees)
    return chain + (TREE_BRANCHES - 1) * options.lookup_max if trees else chain


def forward_path(model, source: str, pair: ModelPair, role: str, options: EngineOptions, auto_choices: dict):
    """(path, why): as engine.forward_backend says: torch (``choose_forward_path``: the
    lean path, else transformers' with why), llamacpp (llama.cpp's forward where it can
    serve this model, else torch's with why), or auto (whichever a few forwards timed here
    say is faster, ``auto.choose_auto``, its figures kept in ``auto_choices``; why holds them)."""
    if is_head(model):
        return HEAD_PATH, None
    backend = options.forward_backend
    if role == "target" and is_head(pair.draft) and backend == "auto":
        path, why = choose_forward_path(model, options)  # the head reads hidden states only torch's give
        return path, why or "torch's forward: the draft is a feature head, which reads its final hidden states"
    if backend == "auto":
        choice = choose_auto(model, source, pair, options, role)
        auto_choices[role] = choice.figures
        return choice.path, choice.why
    if backend != "llamacpp":
        return choose_forward_path(model, options)
    try:
        return llamacpp_forward(model, source, pair, options), None
    except Exception as err:  # not installed, not exportable, not on a CPU: say so, serve on torch
        path, why = choose_forward_path(model, options)
        reason = f"engine.forward_backend llamacpp unavailable: {str(err).splitlines()[0]}"
        log.warning("%s; using the %s forward", reason, path.name)
        return path, reason + (f"; {why}" if why else "")


def new_kv(pair: ModelPair, paths: dict, role: str) -> KVState:
    """An empty cache for ``role``'s model on its forward path; the target's keeps its final
    hidden states from its first forward where the draft is a feature head, which reads them."""
    path, _ = paths[role]
    state = KVState(pair.target if role == "target" else pair.draft, path)
    state.keeps_features = role == "target" and is_head(pair.draft)
    return state


def new_draft(pair: ModelPair, paths: dict, target: KVState) -> KVState | HeadState:
    """An empty draft state beside ``target`` (the same document's): a feature head reads the
    target's states, so its state is bound to that one."""
    if is_head(pair.draft):
        return HeadState(pair.draft, target)
    return new_kv(pair, paths, "draft")


def new_state(pair: ModelPair, paths: dict) -> DocumentState:
    """An empty document state: the target's cache, and the draft model's where one is loaded."""
    target = new_kv(pair, paths, "target")
    return DocumentState(target, new_draft(pair, paths, target) if pair.draft is not None else None)


# -- what a load sets for the process -----------------------------------------------------------

def settle_heap() -> None:
    """Collect garbage, then take every object alive now out of the cyclic garbage collector's
    sight (``gc.freeze``). The loaded models, tokenizer, imported modules and lookup indexes live
    as long as the engine: a great many objects once torch and transformers are imported, and a
    full collection walks them all. CPython runs one whenever enough new objects have survived
    since the last, so now and then a cold completion would wait for it (the cost measured:
    docs/engine.md). Frozen, they are skipped: later full collections walk only what came after
    (``Engine.release`` unfreezes them before the models are dropped)."""
    gc.collect()
    gc.freeze()


@contextmanager
def gc_paused():
    """The cyclic garbage collector off for a load, then back as it was. A load allocates
    millions of objects (a tokenizer's vocabulary and merges, the healing table) on top of the
    heap torch and transformers left, and each full collection CPython starts on the way walks
    that whole heap again: a large tokenizer loads measurably slower with it on. The load ends
    in ``settle_heap``, one collection."""
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


# -- what the options name ----------------------------------------------------------------------

def load_from_options(options: EngineOptions) -> ModelPair:
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
    if is_gguf_name(target) and (gguf_on_torch(options) or head_on_auto(options, draft)):
        target = dequantized(target, "target")
        draft = dequantized(draft, "draft") if draft and is_gguf_name(draft) else draft
    return target, draft


def head_on_auto(options: EngineOptions, draft: str) -> bool:
    """Whether the draft is a feature head with the forward left to ``auto``: a head reads the
    target's final hidden states, which only torch's forward gives, so a GGUF target runs there."""
    from specd.engine.feature_head import is_feature_head

    return options.forward_backend == "auto" and bool(draft) and is_feature_head(draft)


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
