"""Turning per-completion runs into the bench report: JSON object, text table, PNG plot.

Ratios are ``speedup_vs[peer] = peer median ms / method median ms``: above 1 the method is
faster than that peer. ``paired_speedup_vs`` is the geometric mean over completions of
``peer ms / method ms`` for the same completion, which cancels slow stretches of a busy machine
that hit every method of one completion alike. ``decode_speedup_vs`` is the same ratio of
median decode times (the time after the first token), the part drafting can shorten.
``vs_ablations`` (``specd`` only) is the paired ratio the other way round, per ablation:
``ablation ms / specd ms``, geometric mean (above 1: specd is faster).

At simulated costs (``--costs``, ``simulated.py``) a method's ``projected_ms`` is its decode
forwards priced at those costs, summed over the workload, and ``projected_speedup_vs[peer]`` the
peer's over it (above 1: fewer simulated ms); ``target_forwards_by_width`` shows how wide
specd's planner verified.

The reference every output is compared with is the report's ``reference``: ``hf_greedy`` on a
transformers target, ``llamacpp`` on a GGUF one (``reference.py``).
A completion whose reference output is empty proves nothing about identity:
every method that also writes nothing "matches" it. Such completions are counted per workload
(``empty_references``); ``matched_nonempty`` counts the matches that are evidence, and the
goals are met only with some.
"""

from __future__ import annotations

import difflib
import math
import statistics
from typing import Any, Iterable

from specd.bench.costs import format_forward_costs
from specd.bench.near_ties import NEAR_TIE
from specd.bench.peers import ABLATIONS, HF_PEERS, LLAMACPP_PEERS, PEERS, Run
from specd.bench.reference import REFERENCE_MEANING, TORCH_REFERENCE
from specd.engine.speculation.agreement import Agreement

SPECULATIVE_PEERS = ("hf_assisted", "hf_lookup")
# The engine's speed goals, on the CPU where the bench runs: against HF's peers on edit replay.
GOAL_WORKLOAD = "edit_replay"
GOAL_TOKENS_PER_FORWARD = 2.5
GOAL_VS_GREEDY = 2.0
GOAL_VS_BEST_SPECULATIVE_PEER = 1.3
# Against llama.cpp on the same weights (greedy, prompt cache on).
LLAMACPP_GOAL_PEER = "llamacpp"
GOAL_VS_LLAMACPP_EDIT = 1.5
GOAL_VS_LLAMACPP = 1.0
# specd within 5% of, or faster than, each of its ablations (paired: see vs_ablations).
GOAL_VS_ABLATION = 0.95


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _round(value: float, digits: int = 3) -> float:
    return round(float(value), digits)


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return _round(statistics.median(values)) if values else 0.0


def _ratio_of(numerator: float, denominator: float) -> float:
    return _round(numerator / denominator) if denominator > 0 else 0.0


def summarize_method(runs: list[Run], reference: list[list[int]], documents: list[str] | None = None) -> dict[str, Any]:
    """``documents[i]``: the document run i belongs to (its first request has nothing to reuse)."""
    times = [r.ms for r in runs]
    tokens = sum(len(r.tokens) for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    computed = sum(r.prefill_computed for r in runs)
    reused = sum(r.prefill_reused for r in runs)
    mismatches = [i for i, (r, ref) in enumerate(zip(runs, reference)) if r.tokens != ref]
    matched_nonempty = sum(1 for r, ref in zip(runs, reference) if ref and r.tokens == ref)
    acceptance: dict[str, dict[str, Any]] = {}
    for run in runs:
        for source, stats in run.sources.items():
            entry = acceptance.setdefault(source, {"proposed": 0, "accepted": 0, "steps": 0})
            entry["proposed"] += stats.proposed
            entry["accepted"] += stats.accepted
            entry["steps"] += stats.steps
    for entry in acceptance.values():
        entry["rate"] = _round(entry["accepted"] / entry["proposed"] if entry["proposed"] else 0.0, 4)
    projected = [r.projected_ms for r in runs]
    widths: dict[int, int] = {}  # specd's target forwards by width (its draft plus the pending token)
    for run in runs:
        for width, count in (run.forwards.target.items() if run.forwards is not None else ()):
            widths[width] = widths.get(width, 0) + count
    return {
        "median_ms": _round(statistics.median(times)) if times else 0.0,
        "p95_ms": _round(percentile(times, 95)),
        "mean_ms": _round(statistics.fmean(times)) if times else 0.0,
        # Tokens over target forwards, summed over the workload (a token-weighted mean).
        "mean_tokens_per_forward": _round(tokens / forwards if forwards else 0.0),
        "identical": not mismatches,
        "mismatches": len(mismatches),
        "mismatched_at": mismatches,  # indices into the workload's "labels"
        "matched_nonempty": matched_nonempty,  # matches of a non-empty reference: the evidence
        "tokens": tokens,
        "target_forwards": forwards,
        "first_token_median_ms": _median(r.first_token_ms for r in runs),
        "first_token_p95_ms": _round(percentile([r.first_token_ms for r in runs], 95)),
        "decode_median_ms": _median(r.decode_ms for r in runs),  # whole call minus first token
        "prefill_tokens": {"computed": computed, "reused": reused},
        "prefill_reused_fraction": _round(reused / (computed + reused) if computed + reused else 0.0, 4),
        # The same over the requests that follow another on their document: what a keystroke reuses.
        "prefill_reused_fraction_warm": _warm_reuse(runs, documents),
        "acceptance": acceptance,
        "ms": [_round(t, 2) for t in times],
        # At simulated costs (``--costs``): the workload's decode forwards priced so, summed; None
        # where they are not known (measured costs, or a peer whose forward widths are not).
        "projected_ms": _round(sum(projected)) if runs and None not in projected else None,
        "target_forwards_by_width": {str(w): n for w, n in sorted(widths.items())} or None,
    }


def _warm_reuse(runs: list[Run], documents: list[str] | None) -> float | None:
    if documents is None:
        return None
    seen: set[str] = set()
    computed = reused = 0
    for run, document in zip(runs, documents):
        if document in seen:
            computed, reused = computed + run.prefill_computed, reused + run.prefill_reused
        seen.add(document)
    return _round(reused / (computed + reused), 4) if computed + reused else None


def _geomean(values: Iterable[float]) -> float:
    logs = [math.log(v) for v in values if v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else 0.0


def summarize_workload(runs: dict[str, list[Run]], prompt_lengths: list[int],
                       labels: list[str], reference_method: str = TORCH_REFERENCE) -> dict[str, Any]:
    """``runs[method][i]`` answers completion i; every method ran every completion; outputs are
    compared with ``reference_method``'s."""
    reference = [r.tokens for r in runs[reference_method]]
    empty = [i for i, tokens in enumerate(reference) if not tokens]
    documents = [label.rsplit(":", 1)[0] for label in labels]
    methods = {name: summarize_method(method_runs, reference, documents) for name, method_runs in runs.items()}
    peers = [p for p in PEERS if p in runs]
    for name, summary in methods.items():
        summary["speedup_vs"] = {peer: _ratio_of(methods[peer]["median_ms"], summary["median_ms"])
                                 for peer in peers if peer != name}
        summary["decode_speedup_vs"] = {peer: _ratio_of(methods[peer]["decode_median_ms"], summary["decode_median_ms"])
                                        for peer in peers if peer != name}
        summary["paired_speedup_vs"] = {
            peer: _round(_geomean(p.ms / m.ms for p, m in zip(runs[peer], runs[name]) if m.ms > 0))
            for peer in peers if peer != name
        }
    projected = [p for p in peers if methods[p]["projected_ms"] is not None]
    for name, summary in methods.items():
        if summary["projected_ms"] is not None:
            # The same forwards-at-simulated-costs ratio: above 1, fewer simulated ms than that peer.
            summary["projected_speedup_vs"] = {peer: _ratio_of(methods[peer]["projected_ms"], summary["projected_ms"])
                                               for peer in projected if peer != name}
    if "specd" in methods:
        # Each ablation's time over specd's for the same completion, geometric mean (above 1: specd
        # is faster): the ablations do the same work as specd wherever what they turn off is not
        # used, and a median over a dozen completions on a shared machine moves by more than 5%.
        methods["specd"]["vs_ablations"] = {
            name: _round(_geomean(a.ms / s.ms for a, s in zip(runs[name], runs["specd"]) if s.ms > 0))
            for name in ABLATIONS if name in runs
        }
    return {
        "completions": len(prompt_lengths),
        "prompt_tokens_median": int(statistics.median(prompt_lengths)) if prompt_lengths else 0,
        "documents": len({label.rsplit(":", 1)[0] for label in labels}),
        # the reference wrote nothing here: identity on these completions is vacuous.
        "empty_references": len(empty),
        "empty_reference_at": empty,
        "labels": labels,  # document:line of each completion, in run order
        "methods": methods,
    }


def next_line(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def quality(completions: list[str], expected: list[str]) -> dict[str, Any]:
    """How close the reference's output (every identical method's) is to the deleted text, on
    the cursor's line: exact match of the stripped line, and edit similarity (difflib's ratio,
    what fuzzywuzzy's pure-Python ratio computes, as CrossCodeEval reports it). A property of
    the prompt (layout, windows), not of the drafting: compare runs with ``--fim-layout``."""
    scored = [(c, e) for c, e in zip(completions, expected) if next_line(e)]
    if not scored:
        return {"scored": 0, "next_line_exact": 0.0, "edit_similarity": 0.0, "stray_whitespace": 0.0}
    pairs = [(next_line(c), next_line(e)) for c, e in scored]
    exact = sum(a == b for a, b in pairs)
    similarity = sum(difflib.SequenceMatcher(None, a, b).ratio() for a, b in pairs)
    # Whitespace the deleted text did not start with: a re-indented line (the cursor already
    # had its indentation) or a space inside a half-typed word.
    stray = sum(c[:1] in (" ", "\t") and e[:1] not in (" ", "\t") for c, e in scored)
    return {"scored": len(pairs), "next_line_exact": _round(exact / len(pairs)),
            "edit_similarity": _round(similarity / len(pairs)), "stray_whitespace": _round(stray / len(pairs))}


def goals(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    """The speed goals for ``specd``. On the edit-replay workload (completing lines of a file that already holds similar code), tokens per
    forward and speed against HF peers that start cold. Against ``llamacpp`` (what
    users would pick instead; greedy, prompt cache on), at least 1.5x on edit replay and 1.0x on
    every other workload. Within 5% of each ablation, paired (``vs_ablations``). A goal
    is met only when specd's outputs there are the reference's and at least one of them is
    non-empty (``evidence``: completions with a non-empty reference that specd matched). Against
    llama.cpp's greedy on a quantized file an output that parts from it at a near-tie counts as
    the reference's (``near_ties``: its kernels round a wide verify otherwise than a step); one
    flip that is not a near-tie (a defect) and no goal there is met."""
    out: list[dict[str, Any]] = []
    for name, workload in workloads.items():
        methods = workload["methods"]
        if "specd" not in methods:
            continue
        specd = methods["specd"]
        # Speed counts only for output that is provably the reference's: identical everywhere (or
        # parting from llama.cpp's greedy at near-ties alone), with at least one non-empty
        # reference matched (empty-vs-empty pairs prove nothing).
        evidence = specd["matched_nonempty"]
        flips = specd.get("near_ties")
        lossless = evidence > 0 and (specd["identical"] or (flips is not None and flips["defects"] == 0))

        def goal(text: str, measured: float, target: float) -> dict[str, Any]:
            return {"workload": name, "goal": text, "measured": measured, "target": target,
                    "evidence": evidence, "met": lossless and measured >= target}

        if name == GOAL_WORKLOAD:
            out.append(goal("specd tokens per target forward", specd["mean_tokens_per_forward"],
                            GOAL_TOKENS_PER_FORWARD))
            if TORCH_REFERENCE in specd["speedup_vs"]:
                out.append(goal(f"specd speedup vs {TORCH_REFERENCE}", specd["speedup_vs"][TORCH_REFERENCE],
                                GOAL_VS_GREEDY))
            speculative = [p for p in SPECULATIVE_PEERS if p in specd["speedup_vs"]]
            if speculative:
                best = min(speculative, key=lambda p: methods[p]["median_ms"])
                out.append(goal(f"specd speedup vs the faster HF speculative peer ({best})",
                                specd["speedup_vs"][best], GOAL_VS_BEST_SPECULATIVE_PEER))
        if LLAMACPP_GOAL_PEER in specd["speedup_vs"]:
            target = GOAL_VS_LLAMACPP_EDIT if name == GOAL_WORKLOAD else GOAL_VS_LLAMACPP
            out.append(goal(f"specd speedup vs {LLAMACPP_GOAL_PEER}", specd["speedup_vs"][LLAMACPP_GOAL_PEER], target))
        for ablation, ratio in specd.get("vs_ablations", {}).items():
            out.append(goal(f"specd vs {ablation} (paired)", ratio, GOAL_VS_ABLATION))
    return out


# -- text ----------------------------------------------------------------------------------

def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def all_references_empty(report: dict[str, Any]) -> bool:
    completions = sum(w["completions"] for w in report["workloads"].values())
    return completions > 0 and report.get("empty_references", 0) == completions


def _identical_cell(method: str, s: dict[str, Any], reference: str) -> str:
    if method == reference:
        return "ref"
    if not s["identical"]:
        ties = s.get("near_ties")
        if ties:  # flips against llama.cpp's greedy: near-ties apart from defects
            return f"NO ({s['mismatches']}: {ties['near_ties']} tie)"
        return f"NO ({s['mismatches']})"
    return "yes" if s["matched_nonempty"] else "vacuous"  # only empty references were matched


def format_table(report: dict[str, Any]) -> str:
    settings = report["settings"]
    reference = report.get("reference", TORCH_REFERENCE)
    lines = [
        f"specd bench: {_header(report)}",
        f"up to {settings['max_tokens']} tokens per completion, seed {settings['seed']}, corpus "
        f"{settings['corpus']}, FIM layout {report.get('fim_layout', '?')}; ratios are peer median / method "
        "median (>1 = faster than that peer); decode = the time after the first token",
        f"identical = token for token the output of the reference, {reference} "
        f"({REFERENCE_MEANING.get(reference, '?')})"
        + (f"; NO (n: k tie): of n outputs that part from it, k at a near-tie (the two tokens within "
           f"{NEAR_TIE} logits in llama.cpp's one-row decode: batch-width rounding)" if reference == "llamacpp" else ""),
    ]
    agreement = report.get("draft_agreement")
    if agreement:
        lines.append(f"draft model at load: {Agreement(**agreement).summary()}")
    costs = report.get("costs") or {}
    if costs.get("simulated"):
        lines.append(f"forward costs SIMULATED ({costs['mode']}: {costs['profile']['basis']}): specd's planner chose "
                     "its drafts at those costs while the forwards ran here; the wall times are this machine's; "
                     f"projected = {costs['projection']}")
    if settings.get("idle_ms"):
        lines.append(f"specd methods hear each edit and get {settings['idle_ms']:g} ms of untimed idle time before "
                     "the request it triggers (the daemon's idle prefill during specd-lsp's debounce); peers do not")
    for name, workload in report["workloads"].items():
        methods = workload["methods"]
        peers = [p for p in PEERS if p in methods]
        documents = workload.get("documents")
        lines += ["", f"{name}: {workload['completions']} completions"
                      + (f" in {documents} documents" if documents is not None else "")
                      + f", prompts ~{workload['prompt_tokens_median']} tokens"]
        empty = workload.get("empty_references", 0)
        if empty:
            lines.append(f"  ({empty} of {workload['completions']} {reference} outputs are empty: "
                         "'identical' there compares nothing)")
        lines.append(f"  {'method':<20}{'median ms':>10}{'p95 ms':>9}{'1st tok ms':>12}{'decode ms':>11}"
                     f"{'tok/fwd':>9}{'prompt reused':>15}{'identical':>11}")
        for method, s in methods.items():
            lines.append(f"  {method:<20}{s['median_ms']:>10.1f}{s['p95_ms']:>9.1f}{s['first_token_median_ms']:>12.1f}"
                         f"{s['decode_median_ms']:>11.1f}{s['mean_tokens_per_forward']:>9.2f}"
                         f"{_pct(s['prefill_reused_fraction']):>15}{_identical_cell(method, s, reference):>11}")
        # Ratios: end to end vs every peer, and the decode-time ratio vs the reference beside it.
        columns = [(f"vs {p}", "speedup_vs", p) for p in peers]
        if reference in peers:
            columns.insert(peers.index(reference) + 1, (f"decode vs {reference}", "decode_speedup_vs", reference))
        widths = [len(title) + 2 for title, _, _ in columns]
        lines.append(f"  {'speedup':<20}" + "".join(f"{title:>{w}}" for (title, _, _), w in zip(columns, widths)))
        for method, s in methods.items():
            cells = "".join(f"{_ratio(s[key].get(peer)):>{w}}" for (_, key, peer), w in zip(columns, widths))
            lines.append(f"  {method:<20}{cells}")
        if costs.get("simulated"):
            lines += _projected_lines(methods, costs["mode"], reference)
        ablations = methods.get("specd", {}).get("vs_ablations")
        if ablations:
            lines.append("  specd vs its ablations, paired (ablation ms / specd ms per completion, geometric mean; "
                         ">1 = specd faster): " + ", ".join(f"{m} {_ratio(r)}" for m, r in ablations.items()))
        if workload.get("quality", {}).get("scored"):
            q = workload["quality"]
            lines.append(f"  quality of the cursor's line vs the deleted text ({q['scored']} scored): exact match "
                         f"{_pct(q['next_line_exact'])}, edit similarity {q['edit_similarity']:.2f}, "
                         f"stray leading whitespace {_pct(q.get('stray_whitespace', 0.0))}")
        if reference in methods and methods[reference]["median_ms"]:
            ref = methods[reference]
            lines.append(f"  ({reference} spends {_pct(ref['first_token_median_ms'] / ref['median_ms'])} of its median "
                         "time before the first token: prompt prefill, which drafting cannot shorten)")
        accepted = []
        for method, s in methods.items():
            if s["acceptance"]:
                parts = ", ".join(f"{src} {a['accepted']}/{a['proposed']} ({_pct(a['rate'])})"
                                  for src, a in sorted(s["acceptance"].items()))
                accepted.append(f"    {method}: {parts}")
        if accepted:
            lines += ["  drafts accepted/proposed:", *accepted]
    for method, why in (report.get("skipped_methods") or {}).items():
        lines.append(f"(not run: {method}: {why})")
    if report["goals"]:
        lines += ["", "speed goals (specd, this machine):"]
        for g in report["goals"]:
            mark = "met " if g["met"] else "MISS"
            note = "" if g.get("evidence", 1) else " (no non-empty reference output matched: nothing proven)"
            lines.append(f"  [{mark}] {g['workload']}: {g['goal']} {g['measured']:.2f} (goal >= {g['target']}){note}")
    if not report["identical"]:
        lines += ["", f"WARNING: some outputs differ from {reference} (see 'identical' above)"]
    elif all_references_empty(report):
        lines += ["", f"WARNING: every {reference} output was empty: 'identical' proves nothing"]
    if report.get("forward_costs"):
        lines += ["", format_forward_costs(report["forward_costs"])]
    lines += ["", f"command: {report['command']}  ({report['wall_s']:.0f} s)"]
    return "\n".join(lines)


def _projected_lines(methods: dict[str, Any], mode: str, reference: str) -> list[str]:
    """Tokens per target forward and the decode forwards priced at the simulated costs, per method
    that has a projection, with its ratio to the reference's."""
    lines = [f"  {'projected at ' + mode + ' costs':<28}{'tok/fwd':>9}{'decode ms':>11}{'vs ' + reference:>16}"]
    for method, s in methods.items():
        if s.get("projected_ms") is None:
            continue
        ratio = "-" if method == reference else _ratio(s.get("projected_speedup_vs", {}).get(reference))
        lines.append(f"  {method:<28}{s['mean_tokens_per_forward']:>9.2f}{s['projected_ms']:>11.1f}{ratio:>16}")
    return lines


def _header(report: dict[str, Any]) -> str:
    models = report["models"]
    draft = f"draft {models['draft']} ({models['draft_params'] / 1e6:.1f}M)" if models.get("draft") else "no draft"
    return (f"target {models['target']} ({models['target_params'] / 1e6:.1f}M params), {draft}, "
            f"{report['device']} {report['dtype']}, torch {report['torch']}, transformers {report['transformers']}, "
            f"{report['threads']} threads")


def format_forward_costs_report(report: dict[str, Any]) -> str:
    """``specd bench --forward-costs-only``: what ran, and the forward-costs block."""
    return "\n".join([f"specd bench --forward-costs-only: {_header(report)}", "",
                      format_forward_costs(report["forward_costs"]), "",
                      f"command: {report['command']}  ({report['wall_s']:.0f} s)"])


# -- plot ----------------------------------------------------------------------------------

def write_plot(report: dict[str, Any], path: str) -> None:
    """Per workload: latency CDF per method (left), speedup vs the reference per method (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    reference = report.get("reference", TORCH_REFERENCE)
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.6 * len(workloads)), squeeze=False)
    for row, (name, workload) in enumerate(workloads.items()):
        cdf, bars = axes[row]
        methods = workload["methods"]
        for method, s in methods.items():
            times = sorted(s["ms"])
            fractions = [(i + 1) / len(times) for i in range(len(times))]
            cdf.step(times, fractions, where="post", label=method,
                     linestyle="--" if method in PEERS else "-")
        cdf.set_xscale("log")
        cdf.set_xlabel("latency per completion (ms, log scale)")
        cdf.set_ylabel("fraction of completions")
        cdf.set_title(f"{name}: latency CDF")
        cdf.grid(True, which="both", alpha=0.3)
        cdf.legend(fontsize=7, loc="lower right")
        names = [m for m in methods if m != reference]
        ratios = [methods[m]["speedup_vs"].get(reference, 0.0) for m in names]
        colors = ["tab:gray" if m in HF_PEERS else "tab:orange" if m in LLAMACPP_PEERS else "tab:blue"
                  for m in names]
        bars.barh(names, ratios, color=colors)
        for y, value in enumerate(ratios):
            bars.text(value, y, f" {value:.2f}x", va="center", fontsize=8)
        bars.axvline(1.0, color="black", linewidth=0.8)
        bars.invert_yaxis()
        bars.set_xlabel(f"speedup vs {reference} (median ms ratio)")
        bars.set_title(f"{name}: speedup")
    fig.suptitle(f"specd bench: {report['models']['target']} on {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
