"""``specd bench``: every method on every completion, interleaved, on one loaded model pair.

Order of work: load the pair once, measure what one forward costs on each forward path
(``costs``; ``--no-forward-costs`` skips it, ``--forward-costs-only`` stops after it), cut the
workloads, warm every method up once (first-call overheads stay out of the numbers), then
for each completion run all methods back to back, rotating which goes first, so a slow stretch
of a shared machine hits every method alike.
What "identical" is measured against follows the target (``reference.py``): ``hf_greedy`` on
a transformers model, ``llamacpp`` (llama.cpp's greedy of the same file) on a GGUF file.
With ``--costs gpu`` specd's planner prices forwards as a GPU would (``simulated.py``) while they
run here, and the report adds each method's decode forwards priced so.
Results go to stdout (table, or JSON with ``--json``); logs and the progress bar to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import sys
import time
from typing import Any

from specd.bench import near_ties
from specd.bench import report as reporting
from specd.bench import simulated
from specd.bench.costs import measure_forward_costs
from specd.bench.peers import (ALL_METHODS, NEEDS_DRAFT, NEEDS_LLAMACPP, PROMPT_LOOKUP_MAX_NGRAM,
                               PROMPT_LOOKUP_TOKENS, Method, PromptIds, Run, make_method)
from specd.bench.reference import REFERENCE_MEANING, baseline
from specd.bench.workloads import WORKLOADS, Completion, build_workloads, edit_replay_requests, load_corpus

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_MODEL = 1
WARMUP_DOC = "warmup"
PROMPT_KEY = "bench/prompts/{doc}"  # the engine document key the HF peers' prompts are built under
WORKLOAD_METADATA = ("settings", "hf_settings", "costs", "reference", "reference_is")  # left out of a --forward-costs-only report


def names_of(value: str | None, known: tuple[str, ...], what: str) -> list[str]:
    """The comma-separated names in ``value`` (all of ``known`` when none); ValueError for others."""
    if not value:
        return list(known)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


def command_line(args: argparse.Namespace) -> str:
    """The ``specd bench`` invocation that reproduces this run (flags that were given)."""
    parts = ["specd", "bench"]
    for flag, name in (("--model", "model"), ("--draft-model", "draft_model"), ("--device", "device"),
                       ("--dtype", "dtype"), ("--fim-layout", "fim_layout"),
                       ("--token-healing", "token_healing"), ("--corpus", "corpus"),
                       ("--methods", "methods")):
        value = getattr(args, name, None)
        if value:
            parts += [flag, str(value)]
    defaults = {"workloads": ",".join(WORKLOADS), "limit": 12, "max_tokens": 48, "seed": 0, "threads": None,
                "idle_ms": 0}
    for flag, name in (("--workloads", "workloads"), ("--limit", "limit"), ("--max-tokens", "max_tokens"),
                       ("--seed", "seed"), ("--threads", "threads"), ("--idle-ms", "idle_ms")):
        value = getattr(args, name, None)
        if value is not None and value != defaults[name]:
            parts += [flag, str(value)]
    if getattr(args, "costs", None) not in (None, simulated.MEASURED):
        parts += ["--costs", args.costs]
    if getattr(args, "json", False):
        parts.append("--json")
    for flag, name in (("--no-forward-costs", "no_forward_costs"), ("--forward-costs-only", "forward_costs_only")):
        if getattr(args, name, False):
            parts.append(flag)
    if getattr(args, "plot", None):
        parts += ["--plot", args.plot]
    return shlex.join(parts)


def _load_engine(cfg, target: str, draft: str):
    """The engine on ``target`` / ``draft`` as ``resolve_models`` named them."""
    from dataclasses import replace

    from specd.engine.engine import Engine
    from specd.engine.options import EngineOptions

    # Every method answers from the same full prompts: a cold document's narrow window
    # (engine.first_suggestion_ms) is for editors; specd eval scores what it costs in quality.
    engine = Engine(replace(EngineOptions.from_config(cfg), target=target, draft=draft, first_suggestion_ms=0))
    engine.ensure_loaded()
    return engine


def llamacpp_target(engine, names: list[str], skipped: dict[str, str]) -> str | None:
    """The target's GGUF file for the llama.cpp peers among ``names`` (written once into the
    cache), or None, with each such peer's reason put in ``skipped``."""
    wanted = [n for n in names if n in NEEDS_LLAMACPP]
    if not wanted:
        return None
    from specd.llamacpp.export import ExportError, cached_gguf
    from specd.llamacpp.runtime import LlamaCppUnavailable, available

    if engine.pair.gguf:  # the target is a GGUF file: the peers run on that file itself
        return str(engine.pair.target.path)
    reason = None
    gguf_types = _gguf_dtypes()
    if engine.pair.dtype not in gguf_types:
        reason = f"weights in {engine.pair.dtype} (the llama.cpp peers run f32/f16)"
    elif not available():
        reason = "llama-cpp-python is not installed (pip install 'specd[llamacpp]')"
    if reason is None:
        try:
            _announce("llama.cpp peers: writing/checking the target's GGUF file (cached)")
            return str(cached_gguf(engine.pair.target_name, gguf_types[engine.pair.dtype], progress=True))
        except (ExportError, LlamaCppUnavailable) as err:
            reason = str(err)
    for name in wanted:
        skipped[name] = reason
    log.warning("skipping %s: %s", ", ".join(wanted), reason)
    return None


def _gguf_dtypes() -> dict:
    import torch

    return {torch.float32: "f32", torch.float16: "f16"}


def _methods(names: list[str], engine, max_tokens: int, skipped: dict[str, str] | None = None,
             idle_ms: float = 0) -> list[Method]:
    """The methods ``names`` (the reference among them, ``Baseline.methods``) on ``engine``; those that
    cannot run here go into ``skipped`` with the reason."""
    from specd.engine.models import is_head

    skipped = {} if skipped is None else skipped
    if engine.pair.draft is None:
        needs_draft = [n for n in names if n in NEEDS_DRAFT]
        if needs_draft:
            log.warning("no draft model: skipping %s", ", ".join(needs_draft))
        skipped.update({name: "no draft model" for name in needs_draft})
    elif "hf_assisted" in names and is_head(engine.pair.draft):  # transformers' assistant is a model
        log.warning("the draft is a feature head, which transformers cannot run as an assistant: skipping hf_assisted")
        skipped["hf_assisted"] = "the draft is a feature head, not a model transformers can run"
    gguf = llamacpp_target(engine, [n for n in names if n not in skipped], skipped)
    import torch

    methods = []
    for name in names:
        if name in skipped:
            continue
        try:
            methods.append(make_method(name, engine, max_tokens, gguf=gguf, threads=torch.get_num_threads(),
                                       idle_ms=idle_ms))
        except ValueError as err:  # e.g. specd_llamacpp where llama.cpp cannot serve the model
            skipped[name] = str(err)
            log.warning("skipping %s: %s", name, err)
    return methods


def _progress(total: int):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in pipes and CI logs.
    return tqdm(total=total, desc="bench", unit="completion", file=sys.stderr, disable=None, dynamic_ncols=True)


def _prompt_ids(engine, item: Completion) -> PromptIds:
    """The prompt ids the engine builds for ``item``: what the HF peers are given, with the text
    token healing cut before the cursor (which every method's output re-types first). Under the
    anchored layout a prompt also depends on the document's previous request (where its anchor
    sits): the engine answers under a key of the bench's own, which sees the same sequence of
    requests as each specd method's document."""
    chunks, path = context_chunks(engine, item)
    key = PROMPT_KEY.format(doc=item.doc)
    # Without a path the engine names the file by its document key, as it does a request's URI.
    prompt = engine.build_prompt(key, item.text, item.offset, chunks, path or key)
    return PromptIds(prompt.ids, healed=prompt.healed, chunks=chunks, path=path, newline=prompt.newline)


def context_chunks(engine, item: Completion) -> tuple[list, str | None]:
    """Repo-level context for ``item`` as the daemon gives it: chunks of the workspace's files
    most like the code around the cursor (``ContextSelector.choose`` over the workspace files,
    within the prompt's context budget), and the file's path for the prompt; none without a
    workspace. Every method's prompt holds them, so outputs stay comparable."""
    if not item.workspace:
        return [], None
    path = item.doc.split("/", 1)[-1].split(":", 1)[0]
    return workspace_chunks(engine, item.text, item.offset, path, item.workspace), path


def workspace_chunks(engine, text: str, offset: int, path: str, workspace) -> list:
    """The ``workspace`` files' (path, text) chunks most like the code at ``offset``, within the
    prompt's context budget: the daemon's choice (``ContextSelector.choose``)."""
    from specd.engine.front.context import WORKSPACE_WEIGHT, Candidate, ContextSelector

    candidates = [Candidate(name, body, WORKSPACE_WEIGHT) for name, body in workspace]
    return ContextSelector(engine.prompts.extra_tokens).choose(text, offset, path, candidates, engine.prompts.encode)


def _close(engine, methods: list[Method], doc: str) -> None:
    for method in methods:
        method.close_document(doc)
    engine.close_document(PROMPT_KEY.format(doc=doc))  # the prompt key's anchor, if any


def measure(engine, methods: list[Method], workloads: dict[str, list[Completion]],
            profile: simulated.CostProfile | None = None) -> dict[str, Any]:
    """Run every method on every completion; per workload: ({method: [Run]}, prompt lengths, labels).
    With a cost ``profile``, each run's decode forwards are also priced at its costs (``projected_ms``)."""
    first = next((items[0] for items in workloads.values() if items), None)
    if first is not None:
        warm = Completion(first.workload, WARMUP_DOC, first.text, first.offset)
        prompt = _prompt_ids(engine, warm)
        for method in methods:
            method.run(warm, prompt)
        _close(engine, methods, WARMUP_DOC)
    results: dict[str, Any] = {}
    total = sum(len(items) for items in workloads.values())
    turn = 0
    with _progress(total) as bar:
        for name, items in workloads.items():
            runs: dict[str, list[Run]] = {m.name: [] for m in methods}
            lengths: list[int] = []
            healed: list[str] = []
            prompts: list[list[int]] = []
            last_use = {item.doc: i for i, item in enumerate(items)}
            for i, item in enumerate(items):
                prompt = _prompt_ids(engine, item)
                lengths.append(len(prompt))
                healed.append(prompt.healed)
                prompts.append(list(prompt))
                shift = turn % len(methods)
                for method in methods[shift:] + methods[:shift]:
                    run = method.run(item, prompt)
                    if profile is not None:
                        run.projected_ms = simulated.project(method, run, profile)
                    runs[method.name].append(run)
                if last_use[item.doc] == i:
                    _close(engine, methods, item.doc)
                turn += 1
                bar.update()
            results[name] = (runs, lengths, [item.label for item in items], [item.expected for item in items], healed,
                             prompts)
    return results


def _count_near_ties(summary: dict[str, Any], slot, runs: dict[str, list[Run]], prompts: list[list[int]],
                     reference: str) -> None:
    """Each method's flips against llama.cpp's greedy, near-ties apart (``near_ties``)."""
    expected = [run.tokens for run in runs[reference]]
    for method, stats in summary["methods"].items():
        if method == reference:
            continue
        outputs = [run.tokens for run in runs[method]]
        stats["near_ties"] = near_ties.summarize(
            near_ties.flip_margins(slot, prompts, outputs, expected, stats["mismatched_at"]))


def prompt_layout(engine) -> str:
    """The FIM prompt layout the engine uses (psm, spm, anchored), or the requested option when
    the engine does not say which it resolved to."""
    layout = getattr(getattr(engine, "prompts", None), "layout", None)
    if isinstance(layout, str):
        return layout
    return getattr(engine.options, "fim_layout", "auto")


def hf_settings(engine) -> dict[str, Any] | None:
    """What HF's speculative peers run with: transformers' assistant defaults as the installed
    version fills them in (the draft's generation config first), and the prompt-lookup settings;
    None on a GGUF pair (no HF peer runs)."""
    if engine.pair.gguf:
        return None
    from transformers import GenerationConfig
    from transformers.utils import is_sklearn_available

    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    from specd.engine.models import is_head

    draft = engine.pair.draft
    config = draft.generation_config if draft is not None and not is_head(draft) else GenerationConfig()
    values = {name: getattr(config, name, None) for name in names}
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)  # 5.x keeps them here
    if callable(defaults):
        values = {name: defaults().get(name) if value is None else value for name, value in values.items()}
    return {
        "hf_assisted": {**values,
                        # Without scikit-learn the confidence threshold stays fixed during a call.
                        "confidence_threshold_adapts": bool(is_sklearn_available())},
        "hf_lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "max_matching_ngram_size": PROMPT_LOOKUP_MAX_NGRAM},
    }


def _metadata(args: argparse.Namespace, engine, wall_s: float, reference: str,
              profile: simulated.CostProfile | None = None) -> dict[str, Any]:
    import torch
    import transformers

    from specd import __version__

    opts = engine.options
    models = engine.pair.describe()
    return {
        "specd": __version__,
        "command": command_line(args),
        "models": models,
        "device": str(engine.pair.device),
        "dtype": models["dtype"],  # torch's dtype, or "gguf Q8_0" (the file's type) on a GGUF pair
        "fim_family": engine.template.name,
        "fim_layout": prompt_layout(engine),
        "forward": engine.stats()["forward"],  # the specd engine's paths, and what the lean one measured
        # the draft model's agreement with the target measured at load: its prior and chain cut-off
        "draft_agreement": engine.agreement.describe() if getattr(engine, "agreement", None) else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "settings": {
            "limit": args.limit, "max_tokens": args.max_tokens, "seed": args.seed,
            "idle_ms": getattr(args, "idle_ms", 0) or 0,
            "corpus": args.corpus or "held-out stdlib modules",
            "prefix_tokens": opts.prefix_tokens, "suffix_tokens": opts.suffix_tokens,
            "draft_max": opts.draft_max, "lookup_max": opts.lookup_max,
            "draft_confidence": getattr(engine, "draft_confidence", opts.draft_confidence), "stop_at_block_end": False,
            "fim_layout": getattr(opts, "fim_layout", "auto"),  # as asked; the top-level one is in effect
            "token_healing": opts.token_healing,
            "edit_replay_requests": edit_replay_requests(args.limit),
        },
        "hf_settings": hf_settings(engine),
        # what the planner priced forwards at: this machine's measurements, or a simulated machine's
        "costs": simulated.describe(profile, engine),
        "reference": reference,  # the method every output is compared with
        "reference_is": REFERENCE_MEANING[reference],
        "wall_s": round(wall_s, 1),
    }


def _announce(line: str) -> None:
    print(f"specd bench: {line}", file=sys.stderr, flush=True)


def _report_forward_costs(args: argparse.Namespace, engine, costs: dict[str, Any], started: float,
                          reference: str) -> int:
    """``--forward-costs-only``: the forward costs and what they ran on; no workloads."""
    report = {key: value for key, value in _metadata(args, engine, time.monotonic() - started, reference).items()
              if key not in WORKLOAD_METADATA}
    report["forward_costs"] = costs
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print(reporting.format_forward_costs_report(report))
    return 0


def run_bench(args: argparse.Namespace, cfg) -> int:
    from specd.engine.options import EngineOptions
    from specd.engine.types import EngineError

    started = time.monotonic()
    costs_only = getattr(args, "forward_costs_only", False)
    try:
        if costs_only and getattr(args, "no_forward_costs", False):
            raise ValueError("--forward-costs-only and --no-forward-costs exclude each other")
        workload_names = names_of(args.workloads, WORKLOADS, "workload")
        requested = names_of(args.methods, ALL_METHODS, "method") if args.methods else None
        if args.limit < 1 or args.max_tokens < 1:
            raise ValueError("--limit and --max-tokens must be at least 1")
        profile = simulated.profile_named(getattr(args, "costs", None))
        files = [] if costs_only else load_corpus(args.corpus)
        # The files the models load as (the default model, the demo pair, a GGUF file dequantized
        # for torch), so the baseline is chosen for what really runs. (torch loads here, after
        # the cheap checks: a usage error answers at once.)
        from specd.engine.engine import resolve_models

        target, draft = resolve_models(EngineOptions.from_config(cfg))
        chosen = baseline(target, draft)
        method_names = chosen.methods(requested, target or draft)
        if requested and chosen.reference not in requested:
            log.info("also running %s: every method's output is compared with it", chosen.reference)
    except ValueError as err:
        print(f"specd bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    except EngineError as err:  # the default model could not be fetched, a file not converted
        print(f"specd bench: {err}", file=sys.stderr)
        return EXIT_MODEL
    if not files and not costs_only:
        print(f"specd bench: no usable source files in {args.corpus or 'the held-out stdlib modules'}",
              file=sys.stderr)
        return EXIT_USAGE

    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        print("specd bench: --threads must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    import torch

    previous_threads = torch.get_num_threads()
    try:
        return _bench(args, cfg, (target, draft), files, workload_names, method_names, chosen.reference, started,
                      profile)
    finally:
        torch.set_num_threads(previous_threads)  # in-process callers (tests) get theirs back


def _bench(args: argparse.Namespace, cfg, models: tuple[str, str], files, workload_names: list[str], method_names: list[str],
           reference: str, started: float, profile: simulated.CostProfile | None = None) -> int:
    from specd.engine.types import EngineError, ModelLoadError

    try:
        engine = _load_engine(cfg, *models)
    except ModelLoadError as err:
        print(f"specd bench: {err}", file=sys.stderr)
        return EXIT_MODEL
    except EngineError as err:  # settings the model cannot serve, e.g. --fim-layout spm on a PSM-only family
        print(f"specd bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    threads = getattr(args, "threads", None)
    if threads is not None:  # after loading: the engine applies engine.threads when it loads
        import torch

        torch.set_num_threads(threads)
    forward_costs = None
    if not getattr(args, "no_forward_costs", False):
        forward_costs = measure_forward_costs(engine, announce=_announce)
    if getattr(args, "forward_costs_only", False):
        return _report_forward_costs(args, engine, forward_costs, started, reference)
    workloads = build_workloads(workload_names, files, args.limit, args.seed)
    skipped: dict[str, str] = {}
    methods = _methods(method_names, engine, args.max_tokens, skipped, idle_ms=getattr(args, "idle_ms", 0) or 0)
    if reference in skipped:  # nothing to compare outputs with: no report worth printing
        print(f"specd bench: the reference {reference} cannot run: {skipped[reference]}", file=sys.stderr)
        return EXIT_MODEL
    log.info("bench: %s; methods %s; %d source files",
             ", ".join(f"{n} {len(c)}" for n, c in workloads.items()), ", ".join(m.name for m in methods), len(files))
    if profile is not None:  # before the warm-up: every step the planner plans is priced so
        simulated.install(methods, profile)
        log.info("forward costs simulated (%s): %s", profile.name, profile.basis)

    results = measure(engine, methods, workloads, profile)
    report = _metadata(args, engine, time.monotonic() - started, reference, profile)
    decode = engine.pair.tokenizer.decode
    report["workloads"] = {}
    slot = next((getattr(m, "slot", None) for m in methods if m.name == reference), None)
    for name, (runs, lengths, labels, expected, healed, prompts) in results.items():
        if lengths:
            summary = reporting.summarize_workload(runs, lengths, labels, reference)
            if slot is not None:  # llama.cpp's greedy is the reference: flips measured at its one-row decode
                _count_near_ties(summary, slot, runs, prompts, reference)
            # What the editor would show: the output after the re-typed (healed) text.
            shown = [decode(r.tokens)[len(cut):] for r, cut in zip(runs[reference], healed)]
            summary["quality"] = reporting.quality(shown, expected)
            report["workloads"][name] = summary
    report["goals"] = reporting.goals(report["workloads"])
    report["identical"] = all(s["identical"] for w in report["workloads"].values() for s in w["methods"].values())
    # Evidence behind "identical": matches of a non-empty reference (empty-vs-empty proves nothing).
    report["identical_evidence"] = sum(s["matched_nonempty"] for w in report["workloads"].values()
                                       for name, s in w["methods"].items() if name != reference)
    report["empty_references"] = sum(w["empty_references"] for w in report["workloads"].values())
    report["forward_costs"] = forward_costs  # None with --no-forward-costs
    report["skipped_methods"] = skipped  # {method: why it did not run}
    if args.plot:
        reporting.write_plot(report, args.plot)
        log.info("plot written to %s", args.plot)
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print(reporting.format_table(report))
    if not report["identical"]:
        log.warning("some methods' outputs differ from %s; see 'identical' / 'mismatches'", reference)
    elif reporting.all_references_empty(report):
        log.warning("every %s output was empty: 'identical' proves nothing", reference)
    elif report["empty_references"]:
        log.info("%d %s outputs were empty; 'identical' is vacuous on those", report["empty_references"], reference)
    return 0
