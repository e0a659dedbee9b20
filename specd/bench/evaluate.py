"""``specd eval``: what a user would see, scored, on real source files.

Speed is ``specd bench``'s; this is completion quality, which lossless decoding fixes to the
model's except for what specd controls: the prompt (layout, windows, the token boundary at the
cursor) and what reaches the editor (the LSP front end's post-processing). Each case is a real
file with some text deleted at a cursor; every variant completes every case with the same
engine and model; the completion goes through ``specd_lsp.completion.postprocess``, exactly as
the editor would get it, and is scored against the deleted text.

Cursor kinds (reported apart; each a common place to ask):

- ``fresh_line``: a body line's text deleted, the cursor after its indentation: the line
  after Enter with auto-indent;
- ``line_end``: a body line cut at a word boundary, the rest of the line deleted: the end of a
  partly typed line;
- ``mid_line``: the arguments of a call deleted between its brackets, the closers still after
  the cursor (as editors auto-insert them);
- ``body_first``: a function's whole body deleted, the cursor after the first body line's
  indentation: writing a body top to bottom;
- ``multi_file``: the same, while a near-twin of the function sits in a workspace file that is
  not open (the bench's ``multi_file`` workload): what repo-level context can bring.

Metrics per case: ``exact`` (the suggestion's first line equals the deleted text's first line,
stripped), ``edit_similarity`` (difflib's ratio of those lines, as CrossCodeEval reports it),
``parses`` (the file with the suggestion inserted parses as Python: ``ast``; a suggestion cut
mid-line by the token limit is judged on its whole lines), ``stray_whitespace`` (the suggestion
starts with whitespace the deleted text did not: a doubled indentation or a space inside a
word), ``retyped_suffix`` (the suggestion ends with the closers already after the cursor:
accepting it doubles them), ``repeated_line`` (a line of the suggestion repeats one of its last
few lines, or loops within itself), ``retyped_next_line`` (a line of it equals the suffix's next non-empty line),
``empty`` (nothing shown); and, for speed's side of the same cases, ``tokens_per_forward``
(tokens over target forwards: what drafting from the prompt buys).

Suggestion boundaries (``specd.engine.front.boundaries``): each case is completed once with every
boundary off, to the token limit; the text each rule alone would return, and all of them
together (the engine's defaults), is that text cut where the rule says, since the boundaries
only decide where to stop (lossless: the tokens up to there are the same). The variants' scores
are those of the text with all boundaries, as the daemon returns it; ``boundaries`` reports per
cursor kind and rule how many suggestions the rule cut and the edit similarity and parse rate
with the rule against without any. On the first variant every case is also completed with the
boundaries on, as the daemon does, which checks that the engine returns the same text
(``mismatched``) and measures the tokens the early stop saves.

Variants, side by side in one run on the same cases: ``healing`` / ``no_healing`` (token
healing on/off), the FIM layouts the family serves (``psm``, ``anchored``, ``spm``), and
``context`` / ``no_context`` (the workspace's chunks most like the code at the cursor in the
prompt, as the daemon puts them, or none; only ``multi_file`` cases have a workspace).
"""

from __future__ import annotations

import ast
import difflib
import logging
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from specd.bench.workloads import SourceFile, _functions, function_body_lines, load_corpus

log = logging.getLogger(__name__)

KINDS = ("fresh_line", "line_end", "mid_line", "body_first", "multi_file")
# window_N: the narrow window of N tokens a cold document's first suggestions answer from while
# its full prompt prefills (``specd.engine.cold_start``), against the full prompt of the others.
WINDOWS = ("window_128", "window_256", "window_512")
VARIANTS = ("healing", "no_healing", "psm", "anchored", "spm", "context", "no_context", "plain_window", *WINDOWS)
# What an editor plugin that sends a plain window gets from the same model (llama.vim's request):
# the prefix and suffix in the family's standard order, or the prefix alone for a model without
# FIM tokens (no file header), no token healing, no suggestion boundaries.
PLAIN_WINDOW = "plain_window"
METRICS = ("exact", "edit_similarity", "parses", "stray_whitespace", "retyped_suffix", "repeated_line",
           "retyped_next_line", "empty")
BOUNDARY_ROWS = ("none", "repeated_line", "suffix_line", "block_end", "current_line", "all")
CALL = re.compile(r"\w\(")  # a call's opening bracket (after a name)
NO_TIME_BUDGET_MS = 10**9


@dataclass(frozen=True)
class Case:
    kind: str
    name: str  # file:line
    text: str  # the document with the deletion
    offset: int  # the cursor
    expected: str  # what was deleted (from the cursor)
    workspace: tuple[tuple[str, str], ...] = ()  # (path, text) of workspace files not open


# -- cases --------------------------------------------------------------------------------

def _mid_line(file: SourceFile, line) -> Case | None:
    """The arguments of the last call on a line that ends with its closing bracket(s)."""
    content = file.text[line.cursor:line.line_end]
    stripped = content.rstrip(" :")
    if not stripped.endswith(")"):
        return None
    depth, close = 0, len(stripped) - 1
    for i in range(close, -1, -1):
        depth += {")": 1, "(": -1}.get(stripped[i], 0)
        if depth == 0:
            if i == 0 or not CALL.match(stripped, i - 1) or close - i < 2:
                return None
            start = line.cursor + i + 1
            end = line.cursor + close
            return Case("mid_line", "", file.text[:start] + file.text[end:], start, file.text[start:end])
    return None


def build_cases(files: list[SourceFile], limit: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[Case]:
    """``limit`` cases per kind (corpus permitting), drawn from ``random.Random(seed:kind)``."""
    lines = [line for file in files for line in function_body_lines(file)]
    body_starts = set()  # (file, offset) of each function's first body line
    for file in files:
        starts = [0] + [m.end() for m in re.finditer("\n", file.text)]
        body_starts.update((file.name, starts[body - 1]) for _, _, body, _ in _functions(file))
    out: list[Case] = []
    for kind in kinds:
        if kind == "multi_file":
            from specd.bench.workloads import multi_file_workload

            out += [Case(kind, item.label.split("/", 1)[-1], item.text, item.offset, item.expected, item.workspace)
                    for item in multi_file_workload(files, limit, seed) if item.expected.strip()]
            continue
        rng = random.Random(f"{seed}:eval:{kind}")
        made: list[Case] = []
        for line in rng.sample(lines, len(lines)):
            if len(made) >= limit:
                break
            text, file = line.file.text, line.file
            case = None
            if kind == "fresh_line":
                case = Case(kind, "", text[:line.cursor] + text[line.line_end:], line.cursor,
                            text[line.cursor:line.line_end])
            elif kind == "line_end":
                words = [m.end() for m in re.finditer(r"\w+|[^\w\s]+", text[line.cursor:line.line_end])][:-1]
                if words:
                    cut = line.cursor + rng.choice(words)
                    case = Case(kind, "", text[:cut] + text[line.line_end:], cut, text[cut:line.line_end])
            elif kind == "mid_line":
                case = _mid_line(file, line)
            elif kind == "body_first" and (line.file.name, line.line_start) in body_starts:
                case = Case(kind, "", text[:line.cursor] + "\n" + text[line.body_end:], line.cursor,
                            text[line.cursor:line.body_end])
            if case is not None and case.expected.strip():
                number = text.count("\n", 0, line.line_start) + 1
                made.append(replace(case, name=f"{file.name}:{number}"))
        out += made
    return out


# -- scoring ------------------------------------------------------------------------------

def _first_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def _retypes_next_line(shown: str, around) -> bool:
    lines = shown.split("\n")
    firsts = [(around.line_prefix + lines[0]).strip()] if not around.line_suffix.strip() else []
    return bool(around.next_line) and around.next_line in firsts + [line.strip() for line in lines[1:]]


def score(case: Case, raw: str, suggestion) -> dict[str, Any]:
    """Metrics of one case: ``raw`` is the engine's text, ``suggestion`` the LSP's Suggestion
    (None when the editor would show nothing)."""
    from specd.engine.front.boundaries import repeated_line, surroundings

    shown = suggestion.insert_text if suggestion is not None else ""
    around = surroundings(case.text, case.offset)
    replaced = suggestion.replace_chars if suggestion is not None else 0
    line_end = case.text.find("\n", case.offset)
    line_suffix = case.text[case.offset:line_end if line_end >= 0 else len(case.text)]
    got, want = _first_line(shown), _first_line(case.expected)
    after = case.text[case.offset + replaced:]
    whole = shown[:shown.rfind("\n")] if "\n" in shown else shown
    parses = bool(shown) and (_parses(case.text[:case.offset] + shown + after)
                              or _parses(case.text[:case.offset] + whole + after))
    closers = line_suffix.strip()
    return {
        "exact": bool(shown) and got == want,
        "edit_similarity": difflib.SequenceMatcher(None, got, want).ratio() if shown else 0.0,
        "parses": parses,
        "stray_whitespace": shown[:1] in (" ", "\t") and case.expected[:1] not in (" ", "\t"),
        "retyped_suffix": bool(closers) and replaced == 0 and shown.split("\n", 1)[0].rstrip().endswith(closers),
        "repeated_line": repeated_line(shown, around, finished=True) is not None,
        "retyped_next_line": _retypes_next_line(shown, around),
        "empty": not shown.strip(),
        "raw": raw,
        "shown": shown,
    }


def summarize(scores: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(scores)
    out: dict[str, Any] = {"cases": n}
    for metric in METRICS:
        values = [float(s[metric]) for s in scores]
        out[metric] = round(statistics.fmean(values), 3) if values else 0.0
    forwards = sum(s.get("target_forwards", 0) for s in scores)
    # Speed's side of the same cases: tokens per target forward (what drafting from the prompt buys).
    out["tokens_per_forward"] = round(sum(s.get("tokens", 0) for s in scores) / forwards, 3) if forwards else 0.0
    out["prompt_tokens"] = round(statistics.fmean(s.get("prompt_tokens", 0) for s in scores), 1) if scores else 0.0
    return out


# -- running --------------------------------------------------------------------------------

def variant_engines(engine, names: list[str]) -> dict[str, tuple[Any, bool]]:
    """{variant: (engine, token healing)}: layouts on sibling engines over the same loaded pair;
    a layout the family cannot serve is left out (with a log line)."""
    from specd.engine.engine import Engine
    from specd.engine.types import EngineError

    out: dict[str, tuple[Any, bool]] = {}
    for name in names:
        if name in ("healing", "no_healing"):
            out[name] = (engine, name == "healing")
            continue
        if name in ("context", "no_context"):
            out[name] = (engine, engine.options.token_healing)
            continue
        if name in WINDOWS:
            sibling = Engine(engine.options, pair=engine.pair)
            sibling.front.prompts = sibling.prompts.narrowed(int(name.split("_")[1]))
            out[name] = (sibling, engine.options.token_healing)
            continue
        if name == PLAIN_WINDOW:
            family = "plain" if engine.template.name.startswith("plain") else engine.template.name
            out[name] = (Engine(replace(engine.options, fim_layout="psm", fim_family=family), pair=engine.pair), False)
            continue
        try:
            sibling = Engine(replace(engine.options, fim_layout=name), pair=engine.pair)
        except EngineError as err:
            log.warning("eval: variant %s left out: %s", name, err)
            continue
        if sibling.prompts.layout != name:
            log.warning("eval: variant %s left out: the %s family serves %s instead", name,
                        sibling.template.name, sibling.prompts.layout)
            continue
        out[name] = (sibling, engine.options.token_healing)
    return out


def context_for(engine, case: Case) -> tuple[list, str | None]:
    """The case's workspace chunks most like the code at the cursor, within the prompt's
    context budget (the daemon's choice, ``ContextSelector.choose``), and the case's path."""
    if not case.workspace:
        return [], None
    from specd.bench.run import workspace_chunks

    path = case.name.split(":", 1)[0]
    return workspace_chunks(engine, case.text, case.offset, path, case.workspace), path


def run_cases(engines: dict[str, tuple[Any, bool]], cases: list[Case], max_tokens: int,
              progress=None) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every case on every variant: the scores of what the daemon returns (all boundaries), and
    the boundaries' figures on the first variant (the module's docstring)."""
    from specd.engine.front.boundaries import NO_BOUNDARIES, BoundaryRules, apply, rules_for, surroundings
    from specd.engine.types import CompletionRequest
    from specd_lsp.completion import context_at, postprocess

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    rows: list[dict[str, Any]] = []  # per case of the first variant: each boundary row's scores
    checks = {"checked": 0, "mismatched": 0, "tokens_without": 0, "tokens_with": 0}
    first = next(iter(engines), None)
    for i, case in enumerate(cases):
        around = surroundings(case.text, case.offset)
        ctx = context_at(case.text, case.offset)
        for name, (engine, healing) in engines.items():
            uri = f"eval/{name}/{i}"
            chunks, path = context_for(engine, case) if name == "context" else ([], None)
            request = CompletionRequest(uri=uri, text=case.text, offset=case.offset, max_tokens=max_tokens,
                                        time_budget_ms=NO_TIME_BUDGET_MS, token_healing=healing,
                                        extra_context=chunks, path=path)
            result = engine.complete(replace(request, **NO_BOUNDARIES))
            engine.close_document(uri)
            rules = BoundaryRules.none() if name == PLAIN_WINDOW else rules_for(request, engine.options)
            cut, _ = apply(result.text, around, rules)
            suggestion = postprocess(cut, ctx)
            results[name].append({"kind": case.kind, "case": case.name, "tokens": len(result.token_ids),
                                  "target_forwards": result.target_forwards, "prompt_tokens": len(result.prompt_ids),
                                  **score(case, cut, suggestion)})
            if name != first:
                continue
            bounded = engine.complete(request)  # as the daemon asks: the boundaries stop generation
            engine.close_document(uri)
            checks["checked"] += 1
            checks["mismatched"] += bounded.text != cut
            checks["tokens_without"] += len(result.token_ids)
            checks["tokens_with"] += len(bounded.token_ids)
            row: dict[str, Any] = {"kind": case.kind}
            for rule in BOUNDARY_ROWS:
                only = BoundaryRules.none() if rule == "none" else rules if rule == "all" else rules.only(rule)
                text, fired = apply(result.text, around, only)
                row[rule] = {"cut": fired is not None and text != result.text,
                             **score(case, text, postprocess(text, ctx))}
            rows.append(row)
        if progress is not None:
            progress.update()
    return results, {"variant": first, **checks, "rows": rows}


def boundary_report(boundaries: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """Per cursor kind (and all): per boundary row, suggestions cut, edit similarity, parse rate
    and the two new defects' rates."""
    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"cases": len(rows)}
        for rule in BOUNDARY_ROWS:
            scores = [row[rule] for row in rows]
            out[rule] = {"cut": sum(s["cut"] for s in scores),
                         **{metric: round(statistics.fmean(float(s[metric]) for s in scores), 3) if scores else 0.0
                            for metric in ("edit_similarity", "parses", "repeated_line", "retyped_next_line")}}
        return out

    rows = boundaries["rows"]
    return {"variant": boundaries["variant"],
            **{key: boundaries[key] for key in ("checked", "mismatched", "tokens_without", "tokens_with")},
            "all": summary(rows), "by_kind": {kind: summary([r for r in rows if r["kind"] == kind]) for kind in kinds}}


def report(results: dict[str, list[dict[str, Any]]], kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, scores in results.items():
        out[name] = {"all": summarize(scores),
                     "by_kind": {kind: summarize([s for s in scores if s["kind"] == kind]) for kind in kinds}}
    return out


def format_table(data: dict[str, Any]) -> str:
    header = f"specd eval: {data['models']['target']}, FIM family {data['fim_family']}, {data['cases']} cases, " \
             f"up to {data['settings']['max_tokens']} tokens, corpus {data['settings']['corpus']}"
    lines = [header, "what the editor shows (after specd-lsp's post-processing) vs the deleted text; "
                     "fractions of cases (edit similarity: mean ratio)"]
    columns = ("exact", "edit_similarity", "parses", "stray_whitespace", "retyped_suffix", "repeated_line",
               "retyped_next_line", "empty", "tokens_per_forward", "prompt_tokens")
    titles = ("exact", "edit sim", "parses", "stray ws", "re-typed", "repeated", "next line", "empty", "tok/fwd",
              "prompt")
    for kind in ["all", *data["kinds"]]:
        lines += ["", f"{kind}:" if kind != "all" else "all kinds:",
                  f"  {'variant':<12}{'cases':>6}" + "".join(f"{t:>10}" for t in titles)]
        for name, variant in data["variants"].items():
            s = variant["all"] if kind == "all" else variant["by_kind"][kind]
            lines.append(f"  {name:<12}{s['cases']:>6}" + "".join(
                f"{s[c]:>10.2f}" if c in ("edit_similarity", "tokens_per_forward") else
                f"{s[c]:>10.0f}" if c == "prompt_tokens" else f"{s[c] * 100:>9.0f}%"
                for c in columns))
    lines += format_boundaries(data["boundaries"], data["kinds"])
    lines += ["", f"command: {data['command']}  ({data['wall_s']:.0f} s)"]
    return "\n".join(lines)


def format_boundaries(boundaries: dict[str, Any], kinds: list[str]) -> list[str]:
    """Per cursor kind: each boundary rule alone, all of them, and none: suggestions cut, edit
    similarity, parse rate, repeated lines and re-typed next lines."""
    if not boundaries.get("checked"):
        return []
    saved = boundaries["tokens_without"] - boundaries["tokens_with"]
    lines = ["", f"suggestion boundaries (variant {boundaries['variant']}): each rule alone vs none; the engine "
                 f"with them returned the same text in {boundaries['checked'] - boundaries['mismatched']} of "
                 f"{boundaries['checked']} cases and generated {boundaries['tokens_with']} tokens instead of "
                 f"{boundaries['tokens_without']} ({saved} fewer)"]
    for kind in ["all", *kinds]:
        summary = boundaries["all"] if kind == "all" else boundaries["by_kind"][kind]
        lines += ["", f"{kind}:" if kind != "all" else "all kinds:",
                  f"  {'rule':<15}{'cut':>6}{'edit sim':>10}{'parses':>10}{'repeated':>10}{'next line':>10}"]
        for rule in BOUNDARY_ROWS:
            s = summary[rule]
            lines.append(f"  {rule:<15}{s['cut']:>6}{s['edit_similarity']:>10.2f}{s['parses'] * 100:>9.0f}%"
                         f"{s['repeated_line'] * 100:>9.0f}%{s['retyped_next_line'] * 100:>9.0f}%")
    return lines


def write_plot(data: dict[str, Any], path: str) -> None:
    """One panel per metric: bars per cursor kind, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("exact", "edit_similarity", "parses", "stray_whitespace", "retyped_suffix", "empty")
    kinds = data["kinds"]
    variants = list(data["variants"])
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), squeeze=False)
    width = 0.8 / max(1, len(variants))
    for ax, metric in zip(axes.flat, metrics):
        for j, name in enumerate(variants):
            values = [data["variants"][name]["by_kind"][k][metric] for k in kinds]
            ax.bar([i + j * width for i in range(len(kinds))], values, width, label=name)
        ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(kinds))])
        ax.set_xticklabels(kinds, fontsize=8)
        ax.set_title(metric)
        ax.set_ylim(0, 1)
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"specd eval: {data['models']['target']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_eval(args, cfg) -> int:
    """The ``specd eval`` command."""
    import json
    import shlex

    from specd.bench.run import names_of
    from specd.engine.engine import Engine
    from specd.engine.options import EngineOptions
    from specd.engine.types import EngineError, ModelLoadError

    started = time.monotonic()
    try:
        kinds = names_of(args.kinds, KINDS, "cursor kind")
        names = names_of(args.variants, VARIANTS, "variant")
        if args.limit < 1 or args.max_tokens < 1:
            raise ValueError("--limit and --max-tokens must be at least 1")
        files = load_corpus(args.corpus)
    except ValueError as err:
        print(f"specd eval: {err}", file=sys.stderr)
        return 2
    cases = build_cases(files, args.limit, args.seed, tuple(kinds))
    if not cases:
        print(f"specd eval: no cases in {args.corpus or 'the held-out stdlib modules'}", file=sys.stderr)
        return 2
    try:
        engine = Engine(EngineOptions.from_config(cfg))
        engine.ensure_loaded()
    except (ModelLoadError, EngineError) as err:
        print(f"specd eval: {err}", file=sys.stderr)
        return 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engines = variant_engines(engine, names)
    from tqdm import tqdm

    with tqdm(total=len(cases), desc="eval", unit="case", file=sys.stderr, disable=None) as bar:
        results, boundaries = run_cases(engines, cases, args.max_tokens, bar)
    data = {
        "command": shlex.join(["specd", "eval", *sys.argv[2:]]) if sys.argv[1:2] == ["eval"] else "specd eval",
        "models": engine.pair.describe(),
        "fim_family": engine.template.name,
        "fim_layout": engine.prompts.layout,
        "token_healing": engine.options.token_healing,
        "settings": {"limit": args.limit, "max_tokens": args.max_tokens, "seed": args.seed,
                     "corpus": args.corpus or "held-out stdlib modules"},
        "kinds": kinds,
        "cases": len(cases),
        "variants": report(results, kinds),
        "boundaries": boundary_report(boundaries, kinds),
        "completions": results,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.plot:
        write_plot(data, args.plot)
    print(json.dumps(data, indent=2) if args.json else format_table(data))
    return 0

